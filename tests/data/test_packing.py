"""Best-fit packing: row contract, whole documents, label boundaries, long-document policies."""

from __future__ import annotations

import numpy as np
import pytest

from hylo.pipeline.data.packing import (
    PAD_DOC_ID,
    BestFitPacker,
    Document,
    label_aligned_mask,
)
from hylo.pipeline.data.rows import PackedRowError, check_row


def _docs(n: int, lo: int, hi: int, seed: int = 0) -> list[Document]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(lo, hi + 1))
        # Token ids encode (document, position) so any mix-up shows.
        ids = (i * 10_000 + np.arange(L)).astype(np.int32)
        am = rng.random(L) < 0.5
        out.append(Document(f"d{i}", ids, am))
    return out


def _pack(docs, **kw) -> tuple[list[dict], BestFitPacker]:
    p = BestFitPacker(**kw)
    rows = list(p.add_many(docs))
    return rows, p


def _segments(rows):
    """(doc_id, ids, loss_mask) of every non-padding segment, in row order."""
    for r in rows:
        cu = r["cu_seqlens"]
        for j, did in enumerate(r["doc_ids"]):
            s, e = cu[j], cu[j + 1]
            yield did, r["input_ids"][s:e], r["loss_mask"][s:e]


@pytest.mark.parametrize("max_len,window", [(64, 1), (64, 7), (256, 50), (1000, 1000)], ids=lambda v: str(v))
def test_rows_follow_contract_and_keep_documents_whole(max_len, window):
    docs = _docs(120, 1, 60, seed=max_len + window)
    rows, p = _pack(docs, max_len=max_len, window=window, max_open_rows=4, pad_id=7)
    seen = {}
    for r in rows:
        check_row(r, max_len=max_len)
        assert r["cu_seqlens"].dtype == np.int32
        assert len(r["input_ids"]) == max_len
        assert r["cu_seqlens"][-1] == max_len
    for did, ids, mask in _segments(rows):
        if did == PAD_DOC_ID:
            assert (ids == 7).all() and not mask.any()
            continue
        assert did not in seen, f"{did} packed twice"
        seen[did] = (ids, mask)
    assert sorted(seen) == sorted(d.doc_id for d in docs)
    for d in docs:
        ids, mask = seen[d.doc_id]
        np.testing.assert_array_equal(ids, d.input_ids)
        np.testing.assert_array_equal(mask, label_aligned_mask(d.assistant_mask))
    assert p.stats.tokens_packed == sum(len(d.input_ids) for d in docs)
    assert p.stats.rows == len(rows)


def test_labels_never_cross_documents():
    docs = [Document(f"d{i}", np.arange(5, dtype=np.int32) + 100 * i, np.ones(5, bool)) for i in range(6)]
    rows, _ = _pack(docs, max_len=16, window=6)
    for r in rows:
        ids, mask, cu = r["input_ids"], r["loss_mask"], r["cu_seqlens"]
        pos = r["position_ids"]
        for s, e in zip(cu[:-1], cu[1:]):
            assert pos[s] == 0
            assert not mask[e - 1]
        # Labels = ids shifted by one; every label that counts lies in the same document.
        seg = np.searchsorted(cu, np.arange(len(ids)), side="right")
        t = np.nonzero(mask)[0]
        assert (seg[t] == seg[t + 1]).all()
        assert mask.sum() == 4 * (len(r["doc_ids"]) - (r["doc_ids"][-1] == PAD_DOC_ID))


def test_label_aligned_mask_marks_targets_that_are_assistant_tokens():
    am = np.array([0, 0, 1, 1, 0, 1], dtype=bool)
    np.testing.assert_array_equal(label_aligned_mask(am), [0, 1, 1, 0, 1, 0])


def test_best_fit_fills_rows_exactly_when_sizes_allow():
    # 3 x 70 + 3 x 30 and 2 x 50 fill four 100-token rows exactly, but arrive in an order where
    # first-fit in arrival order would leave gaps.
    sizes = [30, 70, 50, 30, 70, 30, 50, 70]
    docs = [Document(f"d{i}", np.arange(n, dtype=np.int32), np.ones(n, bool)) for i, n in enumerate(sizes)]
    rows, p = _pack(docs, max_len=100, window=len(docs))
    assert p.stats.rows == 4 and p.stats.pad_tokens == 0
    assert p.stats.efficiency == 1.0
    assert all(PAD_DOC_ID not in r["doc_ids"] for r in rows)


def test_same_input_same_rows():
    docs = _docs(200, 1, 90, seed=3)
    a, _ = _pack(docs, max_len=128, window=32, max_open_rows=3)
    b, _ = _pack(docs, max_len=128, window=32, max_open_rows=3)
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra["doc_ids"] == rb["doc_ids"]
        np.testing.assert_array_equal(ra["input_ids"], rb["input_ids"])


@pytest.mark.parametrize("policy", ["split", "truncate", "drop"])
def test_long_documents_follow_policy(policy):
    long_ = Document("long", np.arange(25, dtype=np.int32), np.ones(25, bool))
    short = Document("short", np.arange(4, dtype=np.int32) + 500, np.ones(4, bool))
    rows, p = _pack([long_, short], max_len=10, window=4, long_doc_policy=policy)
    segs = {did: (ids, m) for did, ids, m in _segments(rows) if did != PAD_DOC_ID}
    assert "short" in segs
    st = p.stats
    if policy == "split":
        assert st.docs_split == 1 and st.pieces == 4
        parts = [segs[f"long@{k}"] for k in range(3)]
        np.testing.assert_array_equal(np.concatenate([ids for ids, _ in parts]), long_.input_ids)
        # Each window ends without a label (its successor lives in another segment).
        assert all(not m[-1] and m[:-1].all() for _, m in parts)
        assert st.tokens_packed == 29
    elif policy == "truncate":
        assert st.docs_truncated == 1 and st.tokens_truncated == 15
        np.testing.assert_array_equal(segs["long"][0], np.arange(10))
        assert not segs["long"][1][-1]
    else:
        assert st.docs_dropped == 1 and st.tokens_dropped == 25
        assert set(segs) == {"short"}
    for r in rows:
        check_row(r, max_len=10)


def test_unpadded_rows_end_at_their_last_document():
    docs = _docs(30, 3, 20, seed=5)
    rows, p = _pack(docs, max_len=64, window=8, pad_to_max_len=False)
    for r in rows:
        check_row(r, max_len=64)
        assert PAD_DOC_ID not in r["doc_ids"]
    assert p.stats.pad_tokens == 0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="empty doc_id"):
        Document("", np.arange(3), np.ones(3, bool))
    with pytest.raises(ValueError, match="'x'.*same length"):
        Document("x", np.arange(3), np.ones(2, bool))
    with pytest.raises(ValueError, match="long_doc_policy"):
        BestFitPacker(16, long_doc_policy="wrap")


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("cu_seqlens", np.array([0, 3, 7], np.int32), "end at T"),
        ("position_ids", np.array([0, 1, 2, 3, 4, 5, 6, 7], np.int32), "restart"),
        ("loss_mask", np.array([0, 0, 1, 0, 0, 0, 0, 0], bool), "last token"),
    ],
    ids=["cu-short", "pos-no-restart", "label-crosses"],
)
def test_check_row_catches_broken_rows(field, value, msg):
    row = {
        "input_ids": np.arange(8, dtype=np.int32),
        "position_ids": np.array([0, 1, 2, 0, 1, 2, 3, 4], np.int32),
        "cu_seqlens": np.array([0, 3, 8], np.int32),
        "loss_mask": np.array([1, 1, 0, 1, 1, 1, 1, 0], bool),
        "doc_ids": ["a", "b"],
    }
    check_row(row)
    row[field] = value
    with pytest.raises(PackedRowError, match=msg):
        check_row(row)


def test_min_loss_tokens_drops_and_counts_pieces_without_loss():
    # d0: no assistant token at all; d1: long, its first window has none; d2: one loss token
    no_loss = Document("d0", np.arange(10, dtype=np.int32), np.zeros(10, bool))
    long_mask = np.zeros(40, bool)
    long_mask[20:30] = True
    long_doc = Document("d1", np.arange(100, 140, dtype=np.int32), long_mask)
    one = np.zeros(6, bool)
    one[3] = True  # label-aligned: position 2's label is an assistant token
    tiny = Document("d2", np.arange(200, 206, dtype=np.int32), one)
    rows, p = _pack([no_loss, long_doc, tiny], max_len=16, min_loss_tokens=1)
    kept = {did for did, _, _ in _segments(rows)} - {PAD_DOC_ID}
    # d1 splits into windows [0,16) [16,32) [32,40): only the middle one holds assistant labels
    assert kept == {"d1@1", "d2"}
    assert p.stats.pieces_without_loss == 3 and p.stats.tokens_without_loss == 10 + 16 + 8
    assert p.stats.loss_tokens == sum(int(m.sum()) for _, _, m in _segments(rows))
    # the default keeps every piece
    rows, p = _pack([no_loss, long_doc, tiny], max_len=16)
    assert p.stats.pieces_without_loss == 0 and len({d for d, _, _ in _segments(rows)} - {PAD_DOC_ID}) == 5
    with pytest.raises(ValueError, match="min_loss_tokens"):
        BestFitPacker(16, min_loss_tokens=-1)
