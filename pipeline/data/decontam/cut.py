"""`match.mode: cut`: remove the matched spans from a record instead of dropping it."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

from hylo.pipeline.data.decontam.decide import Match
from hylo.pipeline.data.normalize import normalize_words
from hylo.pipeline.data.readers import Record


def _word_spans(text: str) -> list[tuple[int, int]] | None:
    """Char span of every normalised word of `text` (the whitespace-separated run it came from)."""
    spans: list[tuple[int, int]] = []
    words: list[str] = []
    for m in re.finditer(r"\S+", text):
        ws = normalize_words(m.group())
        words += ws
        spans += [m.span()] * len(ws)
    # Normalising run by run must give the same words as normalising the whole text.
    return spans if words == normalize_words(text) else None


def cut_record(rec: Record, matches: Sequence[Match]) -> Record | None:
    """Remove the matched spans from the record's turns; None when that is impossible or empties a turn."""
    by_turn: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for m in matches:
        by_turn[m.turn].append((m.start, m.start + m.length))
    msgs = [dict(x) for x in rec["messages"]]
    for t, ivs in by_turn.items():
        text = msgs[t]["content"]
        spans = _word_spans(text)
        if spans is None:
            return None
        cuts = []
        for a, b in sorted(ivs):
            lo, hi = spans[a][0], spans[b - 1][1]
            if cuts and lo <= cuts[-1][1]:
                cuts[-1] = (cuts[-1][0], max(cuts[-1][1], hi))
            else:
                cuts.append((lo, hi))
        pieces, last = [], 0
        for lo, hi in cuts:
            pieces.append(text[last:lo])
            last = hi
        pieces.append(text[last:])
        new = "".join(pieces)
        if not new.strip():
            return None
        msgs[t]["content"] = new
    return {"id": rec["id"], "source": rec["source"], "messages": msgs}  # type: ignore[typeddict-item]
