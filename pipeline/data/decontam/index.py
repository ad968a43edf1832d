"""The n-gram index over every benchmark item (`BenchmarkIndex`) and the hits a scan of it gives."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hylo.pipeline.data.config import BenchmarkSpec, MatchConfig
from hylo.pipeline.data.decontam.benchmarks import Item, load_benchmark
from hylo.pipeline.data.normalize import content_words

# A scan maps a batch of documents (each a list of turn texts) to hits: arrays
# (doc [H] int64 index in the batch, entry [H] int64, turn [H] int64, start [H] int64 word offset).

Hits = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def empty_hits() -> Hits:
    return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))  # type: ignore[return-value]


@dataclass
class Entry:
    words: tuple[str, ...]
    kind: str
    items: list[int]


@dataclass
class BenchmarkIndex:
    """Every indexed n-gram (entry) with the items it belongs to, and per-suite index statistics."""

    cfg: MatchConfig
    items: list[Item]
    entries: list[Entry]
    # Kept "ngram"-kind entries per item (coverage denominator).
    item_ngrams: list[int]
    suite_stats: dict[str, dict[str, int]]

    @classmethod
    def build(cls, items: Sequence[Item], cfg: MatchConfig) -> BenchmarkIndex:
        n = cfg.ngram
        by_key: dict[tuple[str, tuple[str, ...]], set[int]] = defaultdict(set)
        stats: dict[str, Counter] = defaultdict(Counter)
        for ii, it in enumerate(items):
            st = stats[it.suite]
            st["items"] += 1
            for words in it.segments:
                if len(words) >= n:
                    kind, grams = "ngram", {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}
                elif len(words) >= cfg.short_min_words:
                    kind, grams = "short", {tuple(words)}
                else:
                    kind, grams = "exact", {tuple(words)}
                for g in grams:
                    if content_words(g) < cfg.min_content_words:
                        st["low_content_dropped"] += 1
                        continue
                    # "ngram" and "short" entries both match contiguous words: one key space.
                    by_key["exact" if kind == "exact" else "contig", g].add(ii)
        entries: list[Entry] = []
        for (space, g), its in by_key.items():
            per_suite = Counter(items[i].suite for i in its)
            keep = [i for i in its if per_suite[items[i].suite] <= cfg.max_item_df]
            for s, c in per_suite.items():
                if c > cfg.max_item_df:
                    stats[s]["template_dropped"] += 1
            if keep:
                kind = "exact" if space == "exact" else ("ngram" if len(g) == n else "short")
                entries.append(Entry(g, kind, sorted(keep)))
        # Deterministic entry order whatever the set iteration order was.
        entries.sort(key=lambda e: (e.kind, len(e.words), e.words))
        item_ngrams = [0] * len(items)
        indexed: set[int] = set()
        for e in entries:
            for i in e.items:
                stats[items[i].suite][f"{e.kind}_entries"] += 1
                indexed.add(i)
                if e.kind == "ngram":
                    item_ngrams[i] += 1
        for i in indexed:
            stats[items[i].suite]["items_indexed"] += 1
        return cls(cfg, list(items), entries, item_ngrams, {s: dict(c) for s, c in stats.items()})


def build_index(benchmarks: Sequence[BenchmarkSpec], match: MatchConfig) -> tuple[BenchmarkIndex, dict]:
    """The n-gram index of every item of `benchmarks`, plus the rows skipped per suite."""
    items: list[Item] = []
    skipped: dict[str, dict[str, int]] = {}
    for b in benchmarks:
        its, sk = load_benchmark(b)
        items += its
        skipped[b.name] = sk
    return BenchmarkIndex.build(items, match), skipped
