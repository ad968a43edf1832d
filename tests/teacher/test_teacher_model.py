"""TeacherModel (no Ray): top-k vs a direct forward, document isolation, streamed chunks, bad rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hylo.pipeline.data.rows import PackedRowError, check_row
from hylo.pipeline.teacher.model import TeacherModel, tokenizer_fingerprint

from tests.helpers.common import assert_topk_matches
from tests.helpers.teacher import make_packed_row, save_tiny_llama

VOCAB = 96


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def teachers(tiny_dir):
    return {iso: TeacherModel(tiny_dir, isolation=iso) for iso in ("per_doc", "packed")}


def _alone_logits(model, row, s, e):
    ids = torch.as_tensor(row["input_ids"][s:e]).unsqueeze(0)
    return model(input_ids=ids).logits[0]


@pytest.mark.parametrize("iso", ["per_doc", "packed"])
@pytest.mark.parametrize("docs,pad", [([7, 13, 4], 3), ([1, 9], 0), ([31], 0)], ids=["3docs-pad3", "len1doc", "1doc"])
def test_each_document_equals_running_it_alone(teachers, iso, docs, pad):
    t = teachers[iso]
    row = make_packed_row(docs, VOCAB, seed=len(docs) + pad, pad=pad)
    full = t.logits(check_row(row))
    cu = row["cu_seqlens"].tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        torch.testing.assert_close(full[s:e], _alone_logits(t.model, row, s, e), rtol=1e-5, atol=1e-5)


def test_isolation_matters(teachers):
    # The check above could fail: without isolation the later documents' logits differ.
    t = teachers["per_doc"]
    row = make_packed_row([7, 13], VOCAB, seed=5)
    leaky = t.model(input_ids=torch.as_tensor(row["input_ids"]).unsqueeze(0)).logits[0]
    assert (t.logits(check_row(row))[7:] - leaky[7:]).abs().max() > 1e-2


@pytest.mark.parametrize("iso", ["per_doc", "packed"])
@pytest.mark.parametrize("k", [1, 8, VOCAB], ids=lambda k: f"k{k}")
def test_topk_equals_topk_of_direct_forward(teachers, iso, k):
    t = teachers[iso]
    row = make_packed_row([9, 6], VOCAB, seed=11, pad=2)
    got = t.topk(check_row(row), k)
    cu = row["cu_seqlens"].tolist()
    ref_logits = torch.cat([_alone_logits(t.model, row, s, e) for s, e in zip(cu[:-1], cu[1:])])
    assert got.logprobs.dtype == torch.float16 and got.indices.dtype == torch.int32
    assert got.tail_logmass.dtype == torch.float32 and got.logprobs.shape == (row["input_ids"].size, k)
    # The packed forward and the per-document ones are different computations: tolerances, and
    # near-ties may swap (helpers.assert_topk_matches); the tail is compared as a probability.
    assert_topk_matches(torch.log_softmax(ref_logits.float(), dim=-1), got, k, "float16")
    # The top-k mass plus the tail bucket is a distribution.
    total = torch.logaddexp(torch.logsumexp(got.logprobs.float(), -1), got.tail_logmass)
    torch.testing.assert_close(total, torch.zeros_like(total), atol=2e-3, rtol=0)


def test_topk_bf16_record(teachers):
    got = teachers["per_doc"].topk(check_row(make_packed_row([10], VOCAB, seed=2)), 4, dtype="bfloat16")
    assert got.logprobs.dtype == torch.bfloat16


@pytest.mark.parametrize("chunk", [1, 4, 7, 64], ids=lambda c: f"C{c}")
def test_stream_chunks_concatenate_to_full_logits(teachers, chunk):
    t = teachers["per_doc"]
    row = make_packed_row([11, 6], VOCAB, seed=4, pad=1)
    chunks = list(t.stream(check_row(row), chunk_tokens=chunk))
    n = row["input_ids"].size
    assert [c.shape[0] for c in chunks] == [min(chunk, n - s) for s in range(0, n, chunk)]
    cu = row["cu_seqlens"].tolist()
    ref = torch.cat([_alone_logits(t.model, row, s, e) for s, e in zip(cu[:-1], cu[1:])])
    torch.testing.assert_close(torch.cat(chunks), ref, rtol=1e-5, atol=1e-5)
    # A window [start, end) is the same slice of the full logits.
    torch.testing.assert_close(torch.cat(list(t.stream(check_row(row), chunk, start=3, end=12))), ref[3:12], rtol=1e-5, atol=1e-5)


def test_hidden_states_and_lm_head_give_the_logits(teachers):
    t = teachers["per_doc"]
    row = make_packed_row([5, 8], VOCAB, seed=6)
    h = t.hidden(check_row(row))
    assert h.shape == (13, t.hidden_size) and t.lm_head_weight.shape == (VOCAB, t.hidden_size)
    torch.testing.assert_close(h @ t.lm_head_weight.T, t.logits(check_row(row)), rtol=1e-5, atol=1e-5)


def test_batched_rows_equal_single_rows(teachers):
    t = teachers["per_doc"]
    rows = [make_packed_row([5, 5, 3], VOCAB, seed=i) for i in range(3)]
    batched = t.hidden_batch([check_row(r) for r in rows])
    for r, h in zip(rows, batched):
        torch.testing.assert_close(h, t.hidden(check_row(r)), rtol=1e-5, atol=1e-5)


def test_hylo_teacher_packed_equals_per_document():
    from hylo.config import HybridConfig
    from hylo.modeling import HyLoForCausalLM

    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, n_layer=2, mla_layers=[0],
                       num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8, gdn_num_heads=2, gdn_head_dim=16, gdn_chunk_size=8)
    m = HyLoForCausalLM(cfg)
    row = make_packed_row([5, 11, 3], VOCAB, seed=3, pad=2)
    packed = TeacherModel(m, isolation="auto")
    assert packed.isolation == "packed"
    row = check_row(row)
    torch.testing.assert_close(packed.logits(row), TeacherModel(m, isolation="per_doc").logits(row),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda r: r.pop("cu_seqlens"), "missing field"),
        (lambda r: r.__setitem__("cu_seqlens", np.array([0, 5, 99], np.int32)), "cu_seqlens"),
        (lambda r: r.__setitem__("cu_seqlens", np.array([0, 5, 5, 15], np.int32)), "strictly increasing"),
        (lambda r: r.__setitem__("position_ids", np.arange(15)), "position_ids.*restart"),
        (lambda r: r.__setitem__("input_ids", r["input_ids"].astype(np.float32)), "input_ids.*integers"),
        (lambda r: r.__setitem__("position_ids", np.arange(3)), "position_ids"),
    ],
    ids=["no-cu", "cu-end", "empty-doc", "positions-no-restart", "float-ids", "short-positions"],
)
def test_bad_rows_are_rejected_with_the_field_named(mutate, match):
    row = make_packed_row([5, 10], VOCAB, seed=0)
    mutate(row)
    with pytest.raises(PackedRowError, match=match):
        check_row(row, where="data.parquet row 7")
    with pytest.raises(PackedRowError, match="data.parquet row 7"):
        check_row(row, where="data.parquet row 7")


def test_token_outside_vocabulary_names_the_tokenizer(teachers):
    row = make_packed_row([5], VOCAB, seed=0)
    row["input_ids"][2] = VOCAB + 3
    with pytest.raises(ValueError, match="outside the teacher's vocabulary"):
        teachers["per_doc"].topk(check_row(row), 4)


def test_tokenizer_fingerprint_ignores_formatting_not_content(tmp_path, tiny_dir):
    a = tokenizer_fingerprint(tiny_dir)
    reformatted = tmp_path / "tok"
    reformatted.mkdir()
    (reformatted / "tokenizer.json").write_text(json.dumps(json.loads((tiny_dir / "tokenizer.json").read_text()), indent=4))
    assert tokenizer_fingerprint(reformatted) == a
    other = save_tiny_llama(tmp_path / "other", vocab_size=VOCAB, tokenizer_salt="x")
    assert tokenizer_fingerprint(other) != a and a.startswith("tok-")


def test_row_id_is_content_hash_unless_given():
    row = make_packed_row([4, 4], VOCAB, seed=1)
    a = check_row(row).row_id
    # other boundaries (positions derived, the loss mask left out: it was made for the old ones)
    row2 = dict(row, cu_seqlens=np.array([0, 3, 8], np.int32), position_ids=None, loss_mask=None)
    assert check_row(row2).row_id != a
    assert check_row(dict(row, row_id="r-17")).row_id == "r-17"
