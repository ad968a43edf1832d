"""The fast scanner: a batch of documents against a BenchmarkIndex in numpy, hit for hit the reference's.

Its reference is `reference.ReferenceScanner` beside it (tests/data/test_decontam.py compares the two).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from hylo.pipeline.data.decontam.index import BenchmarkIndex, Hits, empty_hits
from hylo.pipeline.data.normalize import fold_many

_MASK = (1 << 64) - 1


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
            return empty_hits()
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
            return empty_hits()
        h = np.array(out, dtype=np.int64)
        return h[:, 0], h[:, 1], h[:, 2], h[:, 3]
