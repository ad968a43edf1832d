"""The reference scanner: plain Python n-gram sets, what `fast.FastScanner` must equal hit for hit."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from hylo.pipeline.data.decontam.index import BenchmarkIndex, Hits
from hylo.pipeline.data.normalize import normalize_words_plain


class ReferenceScanner:
    """Plain single-process Python reference: regex normalisation (normalize_words_plain) and n-gram sets.

    mode "set" (the classic recipe, e.g. lm-eval's): per turn, the set of all its n-gram tuples of
    each indexed length, intersected with the benchmark's n-gram set; positions are then looked up
    only in turns that matched. mode "probe": a dict probed at every word position (faster Python).
    Both give exactly the hits of FastScanner.
    """

    def __init__(self, index: BenchmarkIndex, mode: str = "set"):
        if mode not in ("set", "probe"):
            raise ValueError(f"ReferenceScanner mode {mode!r} not in ('set', 'probe')")
        self.mode = mode
        self.tables: dict[int, dict[tuple[str, ...], int]] = defaultdict(dict)
        self.exact: dict[tuple[str, ...], int] = {}
        for k, e in enumerate(index.entries):
            (self.exact if e.kind == "exact" else self.tables[len(e.words)])[e.words] = k
        self.keysets = {L: set(table) for L, table in self.tables.items()}

    def scan(self, docs: Sequence[Sequence[str]]) -> Hits:
        out = []
        for d, texts in enumerate(docs):
            for t, text in enumerate(texts):
                words = normalize_words_plain(text)
                k = self.exact.get(tuple(words))
                if k is not None:
                    out.append((d, k, t, 0))
                for L, table in self.tables.items():
                    if self.mode == "set":
                        grams = {tuple(words[i:i + L]) for i in range(len(words) - L + 1)}
                        if grams.isdisjoint(self.keysets[L]):
                            continue
                    for i in range(len(words) - L + 1):
                        k = table.get(tuple(words[i:i + L]))
                        if k is not None:
                            out.append((d, k, t, i))
        a = np.array(out, dtype=np.int64).reshape(-1, 4)
        return a[:, 0], a[:, 1], a[:, 2], a[:, 3]


def reference_scan(index: BenchmarkIndex, docs: Sequence[Sequence[str]], mode: str = "set") -> Hits:
    return ReferenceScanner(index, mode).scan(docs)
