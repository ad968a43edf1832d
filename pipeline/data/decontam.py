"""Decontamination: find and remove mixture records that contain evaluation-benchmark items.

Pipeline (`run_decontamination`): read the inputs with `readers` (bad records -> rejects.jsonl) ->
build one n-gram index over every benchmark item -> scan every turn of every record (Ray Data
`map_batches` tasks; the index travels once through the object store and each worker process
builds its scanner once) -> decide per record ->
write clean records, removed records (with the matched suite, item id and n-gram) and a JSON +
Markdown report per suite.

Matching (all on `normalize.normalize_words`: NFKC, lowercase, punctuation/whitespace folded):
* an item field of >= n words is indexed by its n-grams (n = 13 by default, GPT-3 / lm-eval);
* a field of `short_min_words` .. n-1 words is indexed whole, as one shorter n-gram;
* a field shorter than that matches only a turn that is exactly that field (after normalisation).
A record matches an item when one of its turns contains one of the item's indexed n-grams.

Boilerplate, the usual source of false positives, is handled three ways:
1. low-content n-grams (fewer than `min_content_words` words that are not stopwords, single
   characters or numbers) are never indexed;
2. template n-grams that occur in more than `max_item_df` items of one suite (shared prompt text,
   licence headers) are dropped from the index;
3. mixture-frequent n-grams: a record that contains at least `boilerplate_coverage` of an item's
   n-grams is a leak of that item, always. Otherwise an n-gram found in >= `boilerplate_docs`
   records (counting only records that are not such leaks, so a leak duplicated many times never
   makes its own n-grams look common) is a common phrase, and a record that matches an item only
   through such phrases is kept. Every n-gram ignored this way is listed in the report with its
   count, so a human can check the call; `boilerplate_docs: 0` turns the rule off.

Speed (FastScanner): a whole batch of turns is folded into one byte array (normalize.fold_many),
words are hashed in numpy, words outside the benchmark vocabulary (which can never match) get id
0, every window's polynomial hash comes from prefix sums (uint64, wrapping), windows pass a bitmap
prefilter and a searchsorted lookup, and every hit is verified word by word, so the result equals
the plain Python n-gram-set reference (`ReferenceScanner`, kept beside it and tested against it)
exactly. Its cost barely grows with the number of n-gram lengths (short items), the reference's
grows linearly.

Limits: records are held in driver memory between read and write (a few GB per million
conversations); the scan, the expensive part, is what Ray distributes.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hylo.pipeline.config import FILE_NAME, at_least, between, one_of, renamed, rules
from hylo.pipeline.data.normalize import content_words, fold_many, normalize_words, normalize_words_plain
from hylo.pipeline.data.readers import Record, SourceError, SourceSpec, is_reject, iter_raw, iter_source
from hylo.pipeline.ray_init import RayInitSection, init_ray

from hylo.files import atomic_path, atomic_write

MODES = ("drop", "cut")
OUTPUT_FORMATS = ("jsonl", "parquet")
SCANNERS = ("ray", "local", "reference")


# ----------------------------------------------------------------------------------- config


@dataclass
@rules(name=FILE_NAME)
class BenchmarkSpec:
    """An evaluation suite to decontaminate against. `path` "" -> the built-in/registry entry."""

    name: str
    # Local JSONL/JSON/Parquet file, directory, HF save_to_disk dir, or "hub:<dataset>".
    path: str = ""
    # Fields whose text is indexed; dotted paths reach nested values ("choices.text"); a list of
    # strings gives one segment per string.
    fields: list[str] = field(default_factory=list)
    id_field: str = "id"
    split: str = "test"
    subset: str | None = None


@dataclass
@rules(ngram=at_least(2), short_min_words=at_least(1), min_content_words=at_least(0), max_item_df=at_least(1),
       boilerplate_docs=at_least(0), boilerplate_coverage=between(0, 1, lo_open=True), mode=one_of(*MODES))
class MatchConfig:
    """The matching flags; the job and the reference scan use the same ones."""

    ngram: int = 13
    short_min_words: int = 5
    min_content_words: int = 2
    max_item_df: int = 5
    # 0 disables the mixture-frequency rule.
    boilerplate_docs: int = 50
    boilerplate_coverage: float = 0.5
    mode: str = "drop"

    def __post_init__(self) -> None:
        if self.short_min_words > self.ngram:
            raise ValueError(f"match.short_min_words must be in [1, ngram={self.ngram}], "
                             f"got {self.short_min_words}")


@dataclass
@rules(output_format=one_of(*OUTPUT_FORMATS), scanner=one_of(*SCANNERS), batch_size=at_least(1))
@renamed(ray_address="ray.address", num_cpus="ray.num_cpus")
class DecontamJobConfig:
    inputs: list[SourceSpec] = field(default_factory=list)
    benchmarks: list[BenchmarkSpec] = field(default_factory=lambda: [BenchmarkSpec("humaneval")])
    match: MatchConfig = field(default_factory=MatchConfig)
    out: str = "runs/decontam"
    output_format: str = "jsonl"
    # Turns (records) per scan batch.
    batch_size: int = 256
    # ray: Ray Data tasks; local: the same fast scan in-process; reference: plain Python n-gram sets.
    scanner: str = "ray"
    # The job's Ray (pipeline/ray_init.py): a local one of 2 CPUs unless an address or $RAY_ADDRESS is given.
    ray: RayInitSection = field(default_factory=lambda: RayInitSection(num_cpus=2))
    progress: bool = True

    def __post_init__(self) -> None:
        names = [s.name for s in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"inputs: duplicate source names {names}")
        suites = [b.name for b in self.benchmarks]
        if len(set(suites)) != len(suites):
            raise ValueError(f"benchmarks: duplicate suite names {suites}")


# The evaluation suites of the HyLo papers (hub name, config, split, fields, id) and the built-in one.
# RULER is generated synthetically at evaluation time; it has no fixed items to index.
SUITES: dict[str, BenchmarkSpec] = {
    b.name: b
    for b in [
        # The prompt (signature + docstring) only: canonical solutions are short idioms (a prime
        # test loop, a running sum) that real code shares without any leak. Add
        # "canonical_solution" to the fields to catch solution-only leaks at that cost.
        BenchmarkSpec("humaneval", "asset:humaneval", ["prompt"], "task_id"),
        BenchmarkSpec("arc_easy", "hub:allenai/ai2_arc", ["question", "choices.text"], "id", "test",
                      "ARC-Easy"),
        BenchmarkSpec("arc_challenge", "hub:allenai/ai2_arc", ["question", "choices.text"], "id", "test",
                      "ARC-Challenge"),
        BenchmarkSpec("hellaswag", "hub:Rowan/hellaswag", ["ctx", "endings"], "ind", "validation"),
        BenchmarkSpec("openbookqa", "hub:allenai/openbookqa", ["question_stem", "choices.text"], "id",
                      "test", "main"),
        BenchmarkSpec("piqa", "hub:ybisk/piqa", ["goal", "sol1", "sol2"], "id", "validation"),
        BenchmarkSpec("race", "hub:ehovy/race", ["article", "question", "options"], "example_id",
                      "test", "all"),
        BenchmarkSpec("winogrande", "hub:allenai/winogrande", ["sentence", "option1", "option2"], "id",
                      "validation", "winogrande_xl"),
        BenchmarkSpec("gsm8k", "hub:openai/gsm8k", ["question", "answer"], "id", "test", "main"),
        BenchmarkSpec("mmlu", "hub:cais/mmlu", ["question", "choices"], "id", "test", "all"),
    ]
}


def export_benchmarks(out_dir: str | Path, names: Sequence[str] | None = None,
                      log: Callable[[str], None] = print) -> dict[str, int]:
    """Write each hub suite of SUITES as `<out_dir>/<name>.jsonl` (its evaluation split), for configs
    that read the suites from local files. Needs the `datasets` package and the hub, once."""
    try:
        import datasets
    except ImportError:
        raise ValueError("exporting benchmarks needs the `datasets` package (pip install datasets) and "
                         "access to the Hugging Face hub") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hub = [n for n, b in SUITES.items() if b.path.startswith("hub:")]
    unknown = sorted(set(names or []) - set(hub))
    if unknown:
        raise ValueError(f"unknown or non-hub suite(s) {unknown}; exportable: {', '.join(hub)}")
    counts = {}
    for name in names or hub:
        b = SUITES[name]
        rows = datasets.load_dataset(b.path.removeprefix("hub:"), b.subset, split=b.split)
        with atomic_path(out / f"{name}.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as f:
            n = 0
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
                n += 1
        counts[name] = n
        log(f"{name}: {n} items ({b.path.removeprefix('hub:')} {b.subset or ''} {b.split}) -> {out / name}.jsonl")
    return counts


def resolve_benchmark(spec: BenchmarkSpec) -> BenchmarkSpec:
    """Fill path/fields from the registry when not given; errors name the suite and the choices."""
    if spec.path and spec.fields:
        return spec
    known = SUITES.get(spec.name)
    if known is None:
        raise ValueError(
            f"benchmark {spec.name!r}: give `path` and `fields`, or use a known suite: {', '.join(SUITES)}"
        )
    return dataclasses.replace(
        known, name=spec.name, path=spec.path or known.path, fields=spec.fields or known.fields
    )


# ------------------------------------------------------------------------------- benchmark items


@dataclass
class Item:
    suite: str
    id: str
    # Normalised words of each indexed field value.
    segments: list[list[str]]


def _get_path(row: Any, dotted: str) -> Any:
    cur = row
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return None
    return cur


def _texts(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _texts(v)]
    if isinstance(value, int | float):
        return [str(value)]
    return []


def load_benchmark(spec: BenchmarkSpec) -> tuple[list[Item], dict[str, int]]:
    """Items of one suite plus counts of rows skipped (unparseable or without any indexed field)."""
    spec = resolve_benchmark(spec)
    from hylo.assets import expand_asset

    path = expand_asset(spec.path, progress=False)
    src = SourceSpec(name=spec.name, path=path, split=spec.split, subset=spec.subset)
    items: list[Item] = []
    skipped = Counter()
    keys_seen: set[str] = set()
    for _fname, idx, row, err in iter_raw(src):
        if err is not None:
            skipped["unparseable"] += 1
            continue
        if isinstance(row, dict):
            keys_seen.update(map(str, row))
        segs = [w for f in spec.fields for t in _texts(_get_path(row, f)) if (w := normalize_words(t))]
        if not segs:
            skipped["no_text_in_fields"] += 1
            continue
        rid = row.get(spec.id_field) if isinstance(row, dict) else None
        items.append(Item(spec.name, f"{spec.name}#{idx}" if rid is None else str(rid), segs))
    if not items:
        raise ValueError(
            f"benchmark {spec.name!r} ({path}): no item has text in fields {spec.fields}; "
            f"keys present: {sorted(keys_seen)[:20]}"
        )
    return items, dict(skipped)


# ------------------------------------------------------------------------------------- index


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


# --------------------------------------------------------------------------------------- scans
# A scan maps a batch of documents (each a list of turn texts) to hits: arrays
# (doc [H] int64 index in the batch, entry [H] int64, turn [H] int64, start [H] int64 word offset).

Hits = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_MASK = (1 << 64) - 1


def _empty_hits() -> Hits:
    return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))  # type: ignore[return-value]


class _PolyHash:
    """Polynomial hashes mod 2^64 of many spans of one array at once, from prefix sums.

    With an odd base b (invertible mod 2^64), prefix[i] = sum_{k<i} x_k b^-k and the hash of
    x[lo:hi] = (prefix[hi] - prefix[lo]) * b^(hi-1) = sum_k x_k b^(hi-1-k): position independent.
    """

    def __init__(self, base: int):
        self.base = base | 1
        self.base_inv = pow(self.base, -1, 1 << 64)
        self.pow = np.ones(1, dtype=np.uint64)
        self.pow_inv = np.ones(1, dtype=np.uint64)

    def _grow(self, m: int) -> None:
        if len(self.pow) >= m:
            return
        m = max(m, 2 * len(self.pow))
        for name, b in (("pow", self.base), ("pow_inv", self.base_inv)):
            p = np.empty(m, dtype=np.uint64)
            p[0] = 1
            np.cumprod(np.full(m - 1, b, dtype=np.uint64), out=p[1:])
            setattr(self, name, p)

    def prefix(self, x: np.ndarray) -> np.ndarray:
        self._grow(len(x) + 1)
        out = np.zeros(len(x) + 1, dtype=np.uint64)
        np.cumsum(x.astype(np.uint64) * self.pow_inv[:len(x)], out=out[1:])
        return out

    def spans(self, prefix: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        # Empty spans (hi == lo) hash to 0; pow[-1] wraps harmlessly there.
        return (prefix[hi] - prefix[lo]) * self.pow[hi - 1]

    def one(self, x: Sequence[int]) -> int:
        h = 0
        for v in x:
            h = (h * self.base + int(v)) & _MASK
        return h


_C1, _C2, _C3, _C4 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                              0xD6E8FEB86659FD93))
# LOW_BYTES[n] keeps the n low bytes of a little-endian uint64 (n = 0..8).
_LOW_BYTES = np.array([(1 << (8 * n)) - 1 for n in range(9)], dtype=np.uint64)


def _word_hashes(buf: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Word starts [W], ends [W] and 64-bit hashes [W] of a space-separated byte string.

    A word's hash mixes its length, its first 8 and its last 8 bytes (read as unaligned uint64
    words), so it costs O(words), not O(bytes); words up to 16 bytes hash without loss, longer ones
    may collide, which only adds candidates that the word-by-word check removes.
    """
    # One space before and eight after: every word has a space on each side, and the unaligned
    # 8-byte reads below stay inside the array.
    a = np.frombuffer(b" " + buf + b" " * 8, dtype=np.uint8)
    n = len(buf) + 2
    word = a[:n] != 32
    # Word edges alternate start, end, start, ... (both sides of the buffer are spaces).
    edges = np.flatnonzero(word[1:] != word[:-1]) + 1
    starts, ends = edges[0::2], edges[1::2]
    # u64[i] = the 8 bytes starting at byte i.
    u64 = np.ndarray(shape=(n,), dtype="<u8", buffer=a, strides=(1,))
    ln = (ends - starts).astype(np.uint64)
    low = _LOW_BYTES[np.minimum(ln, 8).astype(np.int64)]
    first = u64[starts] & low
    last = u64[np.maximum(ends - 8, starts)] & low
    h = (first * _C1) ^ (last * _C2) ^ (ln * _C3)
    h ^= h >> np.uint64(29)
    h *= _C4
    h ^= h >> np.uint64(32)
    # Offsets into `buf` (without the leading space).
    return starts - 1, ends - 1, h


def _bitmap(keys: np.ndarray) -> tuple[np.ndarray, np.uint64]:
    """A membership bitmap over the top bits of 64-bit hashes, ~32 slots per key (~3 % false hits)."""
    bits = max(10, int(np.ceil(np.log2(32 * max(len(keys), 1)))))
    shift = np.uint64(64 - bits)
    bitmap = np.zeros(1 << bits, dtype=bool)
    bitmap[(keys >> shift).astype(np.int64)] = True
    return bitmap, shift


class FastScanner:
    """Vectorised scan of a batch of documents against a BenchmarkIndex.

    Per batch: all turns are folded to normalised UTF-8 bytes at once (normalize.fold_many) and
    joined into one byte array, each turn preceded by a "\\n" marker word. In numpy: word
    boundaries and a hash per word, which is the word's id when a bitmap of the benchmark
    vocabulary admits it (else 0; markers are 0), then for each indexed n-gram length a polynomial
    hash per window of ids (windows holding a 0 are skipped), a bitmap prefilter and a searchsorted
    lookup. Only hits reach Python, and each is verified against the entry's actual words.
    """

    def __init__(self, index: BenchmarkIndex, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.id_hash = _PolyHash(int(rng.integers(1 << 62, 1 << 63)))
        words: dict[bytes, None] = {}
        self.entry_words: list[list[bytes]] = []
        for e in index.entries:
            ws = [w.encode("utf-8", "surrogatepass") for w in e.words]
            self.entry_words.append(ws)
            words.update(dict.fromkeys(ws))
        # A word's id is its 64-bit hash (computed by the same numpy code as the scan, so both
        # sides agree); words outside the benchmark vocabulary get id 0, decided by a bitmap
        # (~32 bits per word; its rare false members only cost a lookup that finds nothing).
        wh = _word_hashes(b" ".join(words))[2] if words else np.zeros(0, dtype=np.uint64)
        wh[wh == 0] = 1
        self.vocab_bitmap, self.vocab_shift = _bitmap(wh)
        id_of = dict(zip(words, wh.tolist()))
        self.entry_ids = [[id_of[w] for w in ws] for ws in self.entry_words]
        # key -> candidate entries (several only when hashes collide).
        tables: dict[Any, dict[int, list[int]]] = defaultdict(dict)
        for k, e in enumerate(index.entries):
            key = "exact" if e.kind == "exact" else len(e.words)
            tables[key].setdefault(self.id_hash.one(self.entry_ids[k]), []).append(k)
        self.cands: list[list[int]] = []
        self.tables: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray, np.uint64]] = {}
        for key, d in tables.items():
            keys = np.fromiter(d.keys(), dtype=np.uint64, count=len(d))
            vals = np.arange(len(self.cands), len(self.cands) + len(d), dtype=np.int64)
            self.cands += list(d.values())
            order = np.argsort(keys)
            # Bitmap prefilter: most windows are rejected by one gather.
            self.tables[key] = (keys[order], vals[order], *_bitmap(keys))

    def _lookup(self, key: Any, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys, vals, bitmap, shift = self.tables[key]
        maybe = np.flatnonzero(bitmap[(h >> shift).astype(np.int64)])
        if not len(maybe):
            return maybe, maybe
        j = np.minimum(np.searchsorted(keys, h[maybe]), len(keys) - 1)
        found = keys[j] == h[maybe]
        return maybe[found], vals[j[found]]

    def scan(self, docs: Sequence[Sequence[str]]) -> Hits:
        seg_doc: list[int] = []
        seg_turn: list[int] = []
        flat: list[str] = []
        for d, texts in enumerate(docs):
            for t, text in enumerate(texts):
                seg_doc.append(d)
                seg_turn.append(t)
                flat.append(text)
        if not flat:
            return _empty_hits()
        buf = fold_many(flat, b" \n ")
        starts, ends, word_h = _word_hashes(buf)
        is_marker = (ends - starts == 1) & (np.frombuffer(buf, dtype=np.uint8)[starts] == 10)
        marker_pos = np.flatnonzero(is_marker)
        ids = np.where(self.vocab_bitmap[(word_h >> self.vocab_shift).astype(np.int64)], word_h, 0)
        ids[is_marker] = 0
        prefix = self.id_hash.prefix(ids)
        zeros = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(ids == 0, out=zeros[1:])
        out: list[tuple[int, int, int, int]] = []

        def emit(pos: np.ndarray, cand: np.ndarray, length: np.ndarray | int) -> None:
            seg = np.searchsorted(marker_pos, pos, side="right") - 1
            for p, c, s, L in zip(pos.tolist(), cand.tolist(), seg.tolist(),
                                  np.broadcast_to(length, pos.shape).tolist()):
                got = [buf[starts[q]:ends[q]] for q in range(p, p + L)]
                for k in self.cands[c]:
                    # Verify the actual words: the result is exact, never a hash collision.
                    if got == self.entry_words[k]:
                        out.append((seg_doc[s], k, seg_turn[s], p - int(marker_pos[s]) - 1))

        for key in self.tables:
            if key == "exact":
                # A whole turn: from after its marker to the next marker.
                lo = marker_pos + 1
                hi = np.append(marker_pos[1:], len(ids))
                ok = np.flatnonzero((zeros[hi] == zeros[lo]) & (hi > lo))
                found, cs = self._lookup(key, self.id_hash.spans(prefix, lo[ok], hi[ok]))
                emit(lo[ok][found], cs, (hi - lo)[ok][found])
                continue
            L = key
            if len(ids) < L:
                continue
            pos = np.flatnonzero(zeros[L:] == zeros[:-L])
            found, cs = self._lookup(key, self.id_hash.spans(prefix, pos, pos + L))
            emit(pos[found], cs, L)
        if not out:
            return _empty_hits()
        h = np.array(out, dtype=np.int64)
        return h[:, 0], h[:, 1], h[:, 2], h[:, 3]


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


# ------------------------------------------------------------------------------------ decision


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


# ----------------------------------------------------------------------------------------- cut


def _word_spans(text: str) -> list[tuple[int, int]] | None:
    """Char span of every normalised word of `text` (the whitespace-separated run it came from)."""
    import re

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


# ------------------------------------------------------------------------------------- writing


def _write_jsonl(path: Path, rows: Iterable[dict], ensure_ascii: bool = False) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=ensure_ascii) + "\n")
            n += 1
    return n


def _write_parquet(path: Path, rows: Iterable[dict], chunk: int = 4096) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.string()), ("source", pa.string()), (
        "messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    n = 0
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema) as w:
        buf: list[dict] = []
        for r in rows:
            buf.append(r)
            if len(buf) >= chunk:
                w.write_table(pa.Table.from_pylist(buf, schema))
                n, buf = n + len(buf), []
        if buf or n == 0:
            w.write_table(pa.Table.from_pylist(buf, schema))
            n += len(buf)
    return n


# ------------------------------------------------------------------------------------------ job


# One FastScanner per worker process and index. Ray reuses worker processes across tasks, so the
# scan runs as stateless tasks (which start on Ray's pre-started workers, where an actor pool would
# spawn and import fresh processes on every run) and each worker builds its scanner once.
_WORKER_SCANNERS: dict[str, FastScanner] = {}


def _scan_batch_task(batch: Any, index_refs: list) -> dict[str, np.ndarray]:
    import ray

    key = index_refs[0].hex()
    scanner = _WORKER_SCANNERS.get(key)
    if scanner is None:
        _WORKER_SCANNERS.clear()
        scanner = _WORKER_SCANNERS[key] = FastScanner(ray.get(index_refs[0]))
    # pyarrow batches: list<string> -> Python lists directly. (The numpy format would build
    # fixed-width unicode arrays per document, padding every turn to the longest one.)
    rows = batch.column("row").to_numpy()
    d, e, t, s = scanner.scan(batch.column("texts").to_pylist())
    return {"doc": rows[d].astype(np.int64), "entry": e, "turn": t, "start": s}


def _scan_ray(index: BenchmarkIndex, texts: list[list[str]], cfg: DecontamJobConfig) -> Hits:
    import ray

    init_ray(cfg.ray.address, cfg.ray.num_cpus, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = cfg.progress
    # The index goes to the object store once; tasks receive its reference (inside a list, so Ray
    # does not resolve it per task) and fetch it once per worker.
    index_ref = ray.put(index)
    import pyarrow as pa

    n = len(texts)
    if n == 0:
        return _empty_hits()
    # One Arrow table built in the driver (much cheaper than from_items' per-row dicts), cut into
    # a few blocks per CPU so both workers stay busy; tasks iterate batches inside their block.
    table = pa.table({"row": pa.array(np.arange(n, dtype=np.int64)),
                      "texts": pa.array(texts, type=pa.list_(pa.string()))})
    cpus = cfg.ray.num_cpus or int(ray.cluster_resources().get("CPU", 1))
    blocks = max(1, min(n, max(2 * cpus, -(-n // 2048))))
    bounds = np.linspace(0, n, blocks + 1).astype(int)
    ds = ray.data.from_arrow([table.slice(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])])
    out = ds.map_batches(_scan_batch_task, fn_args=([index_ref],), batch_size=cfg.batch_size,
                         batch_format="pyarrow", num_cpus=1)
    cols: dict[str, list[np.ndarray]] = defaultdict(list)
    for b in out.iter_batches(batch_format="numpy", batch_size=None):
        for k in ("doc", "entry", "turn", "start"):
            cols[k].append(np.asarray(b[k], dtype=np.int64))
    if not cols:
        return _empty_hits()
    return tuple(np.concatenate(cols[k]) for k in ("doc", "entry", "turn", "start"))  # type: ignore


def _scan_local(texts: list[list[str]], batch_size: int, fn: Callable[[Sequence[Sequence[str]]], Hits],
                progress: bool) -> Hits:
    from tqdm import tqdm

    parts = []
    for lo in tqdm(range(0, len(texts), batch_size), desc="scan", unit="batch", disable=not progress):
        d, e, t, s = fn(texts[lo:lo + batch_size])
        parts.append((d + lo, e, t, s))
    if not parts:
        return _empty_hits()
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(4))  # type: ignore


def build_index(benchmarks: Sequence[BenchmarkSpec], match: MatchConfig) -> tuple[BenchmarkIndex, dict]:
    """The n-gram index of every item of `benchmarks`, plus the rows skipped per suite."""
    items: list[Item] = []
    skipped: dict[str, dict[str, int]] = {}
    for b in benchmarks:
        its, sk = load_benchmark(b)
        items += its
        skipped[b.name] = sk
    return BenchmarkIndex.build(items, match), skipped


def scan_and_decide(index: BenchmarkIndex, texts: list[list[str]], scanner: str = "ray", batch_size: int = 256,
                    progress: bool = True, ray_cfg: RayInitSection | None = None) -> Decision:
    """Scan documents (each a list of turn texts) and decide which are contaminated (see `decide`)."""
    if scanner == "ray":
        from types import SimpleNamespace

        hits = _scan_ray(index, texts, SimpleNamespace(batch_size=batch_size, progress=progress,
                                                       ray=ray_cfg or RayInitSection(num_cpus=2)))
    elif scanner == "local":
        hits = _scan_local(texts, batch_size, FastScanner(index).scan, progress)
    else:
        hits = _scan_local(texts, batch_size, ReferenceScanner(index, "set").scan, progress)
    return decide(index, *hits)


def run_decontamination(cfg: DecontamJobConfig, index: BenchmarkIndex | None = None) -> dict[str, Any]:
    """Run the whole job; returns the summary (also written to `<out>/summary.json`)."""
    if not cfg.inputs:
        raise ValueError("decontaminate: no inputs given")
    t0 = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_skipped: dict[str, dict[str, int]] = {}
    if index is None:
        index, bench_skipped = build_index(cfg.benchmarks, cfg.match)
    t_index = time.perf_counter()

    from tqdm import tqdm

    records: list[Record] = []
    rejects: list[dict] = []
    with tqdm(desc="read", unit="doc", disable=not cfg.progress) as bar:
        for spec in cfg.inputs:
            for it in iter_source(spec):
                (rejects if is_reject(it) else records).append(it)  # type: ignore[arg-type]
                bar.update()
    texts = [[m["content"] for m in r["messages"]] for r in records]
    t_read = time.perf_counter()

    if cfg.scanner == "ray":
        hits = _scan_ray(index, texts, cfg)
    elif cfg.scanner == "local":
        hits = _scan_local(texts, cfg.batch_size, FastScanner(index).scan, cfg.progress)
    else:
        hits = _scan_local(texts, cfg.batch_size, ReferenceScanner(index, "set").scan, cfg.progress)
    t_scan = time.perf_counter()

    dec = decide(index, *hits)
    removed: list[dict] = []
    cut_ids: set[int] = set()
    fallback_drops = 0

    def clean_rows():
        nonlocal fallback_drops
        for d, rec in enumerate(records):
            ms = dec.flagged.get(d)
            if ms is None:
                yield rec
                continue
            action = "drop"
            if cfg.match.mode == "cut":
                new = cut_record(rec, ms)
                if new is not None:
                    action = "cut"
                    cut_ids.add(d)
                    yield new
                else:
                    fallback_drops += 1
            removed.append({"id": rec["id"], "source": rec["source"], "action": action,
                            "matches": [dataclasses.asdict(m) for m in ms], "record": rec})

    clean_name = f"clean.{cfg.output_format}"
    if cfg.output_format == "jsonl":
        # \u-escaped JSON encodes about twice as fast; every JSON reader decodes it identically.
        n_clean = _write_jsonl(out / clean_name, clean_rows(), ensure_ascii=True)
    else:
        n_clean = _write_parquet(out / clean_name, clean_rows())
    _write_jsonl(out / "removed.jsonl", removed)
    _write_jsonl(out / "rejects.jsonl", rejects)
    t_end = time.perf_counter()

    summary = _reports(cfg, index, dec, records, removed, rejects, n_clean, bench_skipped, out)
    summary.update(
        fallback_drops=fallback_drops,
        files={k: str(out / v) for k, v in [("clean", clean_name), ("removed", "removed.jsonl"),
                                            ("rejects", "rejects.jsonl")]},
        seconds={"index": round(t_index - t0, 3), "read": round(t_read - t_index, 3),
                 "scan": round(t_scan - t_read, 3), "decide_write": round(t_end - t_scan, 3),
                 "total": round(t_end - t0, 3)},
        docs_per_s=round(len(records) / max(t_end - t_index, 1e-9), 1),
    )
    atomic_write(out / "summary.json", json.dumps(summary, indent=1))
    return summary


def _reports(cfg: DecontamJobConfig, index: BenchmarkIndex, dec: Decision, records: list[Record],
             removed: list[dict], rejects: list[dict], n_clean: int,
             bench_skipped: dict[str, dict[str, int]], out: Path) -> dict[str, Any]:
    flags = dataclasses.asdict(cfg.match)
    suites = sorted({it.suite for it in index.items})
    action_of = {r["id"] + "\0" + r["source"]: r["action"] for r in removed}
    (out / "reports").mkdir(exist_ok=True)
    per_suite = {}
    for s in suites:
        docs: dict[int, set[str]] = {}
        item_docs: Counter = Counter()
        example: dict[str, str] = {}
        for d, ms in dec.flagged.items():
            ids = {m.item_id for m in ms if m.suite == s}
            if ids:
                docs[d] = ids
                item_docs.update(ids)
                for m in ms:
                    if m.suite == s:
                        example.setdefault(m.item_id, m.ngram)
        actions = Counter(action_of[records[d]["id"] + "\0" + records[d]["source"]] for d in docs)
        boiler = sorted(((dec.entry_df[e], spared, " ".join(index.entries[e].words))
                         for e, spared in dec.boilerplate.items()
                         if any(index.items[i].suite == s for i in index.entries[e].items)), reverse=True)
        rep = {
            "suite": s,
            "flags": flags,
            "index": index.suite_stats.get(s, {}),
            "benchmark_rows_skipped": bench_skipped.get(s, {}),
            "documents_scanned": len(records),
            "documents_matched": len(docs),
            "documents_dropped": actions.get("drop", 0),
            "documents_cut": actions.get("cut", 0),
            "items_matched": len(item_docs),
            "matched_items": [{"item_id": i, "documents": c, "example_ngram": example[i]}
                              for i, c in item_docs.most_common()],
            "removed_documents": [records[d]["id"] for d in sorted(docs)][:1000],
            "boilerplate_ignored": [{"ngram": g, "documents": df, "documents_spared": sp}
                                    for df, sp, g in boiler[:100]],
        }
        per_suite[s] = rep
        atomic_write(out / "reports" / f"{s}.json", json.dumps(rep, indent=1))
        atomic_write(out / "reports" / f"{s}.md", _markdown(rep))
    return {
        "documents_in": len(records) + len(rejects),
        "documents_rejected": len(rejects),
        "documents_scanned": len(records),
        "documents_out": n_clean,
        "documents_dropped": sum(r["action"] == "drop" for r in removed),
        "documents_cut": sum(r["action"] == "cut" for r in removed),
        "scanner": cfg.scanner,
        "flags": flags,
        "suites": {s: {k: per_suite[s][k] for k in ("documents_matched", "items_matched")} for s in suites},
    }


def _markdown(rep: dict[str, Any]) -> str:
    lines = [
        f"# Decontamination report: {rep['suite']}", "",
        f"* documents scanned: {rep['documents_scanned']}",
        f"* documents matched: {rep['documents_matched']} (dropped {rep['documents_dropped']}, "
        f"cut {rep['documents_cut']})",
        f"* benchmark items matched: {rep['items_matched']}",
        f"* index: {', '.join(f'{k} {v}' for k, v in sorted(rep['index'].items()))}",
        f"* flags: {', '.join(f'{k}={v}' for k, v in rep['flags'].items())}", "",
    ]
    if rep["matched_items"]:
        lines += ["| item | documents | example n-gram |", "|---|---|---|"]
        lines += [f"| {m['item_id']} | {m['documents']} | `{m['example_ngram'][:120]}` |"
                  for m in rep["matched_items"][:50]]
        lines.append("")
    if rep["boilerplate_ignored"]:
        lines += ["Ignored as boilerplate (frequent in the mixture):", "",
                  "| n-gram | documents | spared |", "|---|---|---|"]
        lines += [f"| `{b['ngram'][:120]}` | {b['documents']} | {b['documents_spared']} |"
                  for b in rep["boilerplate_ignored"][:30]]
    return "\n".join(lines) + "\n"


def read_jsonl(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


__all__ = [
    "BenchmarkIndex", "BenchmarkSpec", "DecontamJobConfig", "Decision", "FastScanner", "Item", "Match",
    "MatchConfig", "ReferenceScanner", "SUITES", "SourceError", "cut_record", "decide", "load_benchmark", "read_jsonl",
    "reference_scan", "run_decontamination",
]
