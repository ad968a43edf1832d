"""From hits to contaminated records: the per-item coverage and the mixture-frequency boilerplate rule."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from hylo.pipeline.data.decontam.index import BenchmarkIndex


@dataclass
class Match:
    suite: str
    item_id: str
    kind: str
    ngram: str
    turn: int
    start: int
    length: int


@dataclass
class Decision:
    # doc index -> matches of the items it is contaminated by.
    flagged: dict[int, list[Match]]
    # entry -> number of documents it was found in outside a leak of a whole item.
    entry_df: dict[int, int]
    # entries treated as boilerplate (df >= boilerplate_docs) -> documents spared because of them.
    boilerplate: dict[int, int]


def decide(index: BenchmarkIndex, doc: np.ndarray, entry: np.ndarray, turn: np.ndarray,
           start: np.ndarray) -> Decision:
    """Turn raw hits into contaminated documents, applying the mixture-frequency boilerplate rule."""
    cfg = index.cfg
    hits_by_doc: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for d, e, t, s in zip(doc.tolist(), entry.tolist(), turn.tolist(), start.tolist()):
        hits_by_doc[d].append((e, t, s))
    # Per document: hits grouped by item, and which items it covers substantially (a leak).
    per_doc: dict[int, tuple[dict[int, list[tuple[int, int, int]]], set[int]]] = {}
    df: Counter = Counter()
    for d, raw in hits_by_doc.items():
        by_item: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for e, t, s in sorted(set(raw), key=lambda h: (h[1], h[2], h[0])):
            for i in index.entries[e].items:
                by_item[i].append((e, t, s))
        covered = set()
        for i, ih in by_item.items():
            n_ngram = len({e for e, _, _ in ih if index.entries[e].kind == "ngram"})
            if index.item_ngrams[i] and n_ngram / index.item_ngrams[i] >= cfg.boilerplate_coverage:
                covered.add(i)
        per_doc[d] = (by_item, covered)
        # Document frequency counts only occurrences outside a leak of a whole item, so duplicated
        # leaks never make the leaked item's own n-grams look like boilerplate.
        df.update({e for e, _, _ in raw if not covered.intersection(index.entries[e].items)})
    frequent = {e for e, c in df.items() if cfg.boilerplate_docs > 0 and c >= cfg.boilerplate_docs}
    flagged: dict[int, list[Match]] = {}
    spared: Counter = Counter()
    for d in sorted(per_doc):
        by_item, covered = per_doc[d]
        matches: list[Match] = []
        for i, ih in sorted(by_item.items()):
            ents = {e for e, _, _ in ih}
            if i in covered or ents - frequent:
                it = index.items[i]
                for e, t, s in ih:
                    en = index.entries[e]
                    matches.append(Match(it.suite, it.id, en.kind, " ".join(en.words), t, s, len(en.words)))
            else:
                spared.update(ents)
        if matches:
            flagged[d] = matches
    return Decision(flagged, dict(df), {e: spared[e] for e in frequent})
