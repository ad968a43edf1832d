"""Evaluation: KL/perplexity, retrieval suite, measured KV cache, lm-eval adapter, jobs/eval.py.

Tiny random Llama (vocab = a word-level test tokenizer) upcycled into a HyLo hybrid with 2 MLA and
2 GDN layers. Torch runs single-threaded here: the tensors are tiny and the CPU is shared.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from hylo.io import save_hylo
from hylo.pipeline.data.rowfile import DataFormatError
from hylo.pipeline.data.rows import PackedRowError
from hylo.pipeline.eval import kvcache
from hylo.pipeline.eval import retrieval as R
from hylo.pipeline.eval.decode import EvalError, cache_nbytes, greedy_decode
from hylo.pipeline.eval.kl import evaluate_kl, iter_eval_rows
from hylo.pipeline.eval.lm_eval_adapter import Scorer
from hylo.upcycle import kv_summary, upcycle

from tests.helpers.common import one_thread  # noqa: F401  (autouse: one intra-op thread)

REPO = Path(__file__).resolve().parents[2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer():
    """Word-level fast tokenizer over the retrieval vocabulary (digits split), ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.Punctuation()])
    rng = random.Random(0)
    texts = [R.filler_sentence(rng) for _ in range(3000)]
    texts += [R.needle(k, "0123456789") for k in R.KEYS]
    texts += [f"What is the secret code for {k}? Answer with the number only. The secret code for {k} is" for k in R.KEYS]
    texts += ["user assistant system how are you fine thanks the answer is yes no"]
    words = {p for t in texts for p, _ in pre.pre_tokenize_str(t)}
    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "\n"]
    vocab = {w: i for i, w in enumerate(special + sorted(words - set(special)))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre
    tk.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>", "\n"])
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def base(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def hybrid(base):
    return upcycle(base, mla_layers=[0, 2], kv_lora_rank=16, qk_rope_head_dim=8, gdn_num_heads=2,
                   gdn_head_dim=16).eval()


def packed_row(vocab: int, doc_lens: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = sum(doc_lens)
    ids = torch.randint(3, vocab, (t,), generator=g)
    cu = torch.tensor([0, *np.cumsum(doc_lens).tolist()], dtype=torch.int32)
    mask = torch.rand(t, generator=g) < 0.7
    mask[cu[1:].long() - 1] = False
    pos = torch.cat([torch.arange(n) for n in doc_lens])
    return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "loss_mask": mask,
            "doc_ids": [f"d{i}" for i in range(len(doc_lens))]}


def rows_of(*rows):
    return [(f"row {i}", {"input_ids": r["input_ids"], "cu_seqlens": r["cu_seqlens"], "loss_mask": r["loss_mask"]})
            for i, r in enumerate(rows)]


def reference_kl_nll(student, teacher, row) -> tuple[float, float, int]:
    """Full logits, one forward per document, F.kl_div / F.cross_entropy."""
    kl = nll = 0.0
    n = 0
    cu = row["cu_seqlens"].tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        ids = row["input_ids"][s:e][None]
        m = row["loss_mask"][s:e]
        ls = student(input_ids=ids).logits[0].double()[m]
        lt = teacher(input_ids=ids).logits[0].double()[m]
        labels = row["input_ids"][m.nonzero().squeeze(-1) + s + 1]
        kl += float(F.kl_div(F.log_softmax(ls, -1), F.log_softmax(lt, -1), log_target=True, reduction="sum"))
        nll += float(F.cross_entropy(ls, labels, reduction="sum"))
        n += int(m.sum())
    return kl, nll, n


# ---------------------------------------------------------------------------------------------- KL
@pytest.mark.parametrize("use_fused,backend", [(True, "fused_linear_kl_div"), (False, "chunked_exact")],
                         ids=["fused", "exact"])
def test_kl_and_ppl_match_full_logits_reference(hybrid, base, use_fused, backend):
    rows = [packed_row(base.config.vocab_size, [23, 41, 9], seed=1), packed_row(base.config.vocab_size, [60], seed=2)]
    with torch.no_grad():
        res = evaluate_kl(hybrid, rows_of(*rows), teacher=base, use_fused=use_fused, chunk=16)
        refs = [reference_kl_nll(hybrid, base, r) for r in rows]
        t_refs = [reference_kl_nll(base, base, r) for r in rows]
    n = sum(r[2] for r in refs)
    assert res.kl_backend == backend
    assert (res.rows, res.documents, res.tokens) == (2, 4, n)
    assert res.kl == pytest.approx(sum(r[0] for r in refs) / n, rel=1e-4)
    assert res.kl > 1e-4
    assert res.nll == pytest.approx(sum(r[1] for r in refs) / n, rel=1e-5)
    assert res.ppl == pytest.approx(math.exp(res.nll))
    assert res.teacher_nll == pytest.approx(sum(r[1] for r in t_refs) / n, rel=1e-5)


def test_kl_of_a_model_to_itself_is_zero_and_ppl_matches_hf_loss(base):
    row = packed_row(base.config.vocab_size, [50], seed=3)
    row["loss_mask"][:] = True
    res = evaluate_kl(base, rows_of(row), teacher=base)
    assert abs(res.kl) < 1e-5
    assert res.ppl == pytest.approx(res.teacher_ppl)
    with torch.no_grad():
        hf_loss = float(base(input_ids=row["input_ids"][None], labels=row["input_ids"][None]).loss)
    assert res.ppl == pytest.approx(math.exp(hf_loss), rel=1e-5)
    # without a teacher: perplexity only
    alone = evaluate_kl(base, rows_of(row))
    assert alone.kl is None and alone.kl_backend is None and alone.ppl == pytest.approx(res.ppl)


def test_eval_rows_from_parquet_packed_dir_and_chat_records(tmp_path, tok, base):
    rows = [packed_row(base.config.vocab_size, [7, 5], seed=4), packed_row(base.config.vocab_size, [12], seed=5)]
    table = pa.table({k: [r[k].tolist() for r in rows] for k in ("input_ids", "position_ids", "cu_seqlens", "loss_mask")})
    pq.write_table(table, tmp_path / "rows.parquet")
    got = list(iter_eval_rows(tmp_path / "rows.parquet"))
    assert [w for w, _ in got] == ["rows.parquet row 0", "rows.parquet row 1"]
    for (_, g), r in zip(got, rows):
        assert torch.equal(g.input_ids, r["input_ids"]) and torch.equal(g.loss_mask, r["loss_mask"])
    assert len(list(iter_eval_rows(tmp_path / "rows.parquet", max_rows=1))) == 1
    # a directory of Parquet files: its files in name order, each row named by its own file and index there
    (tmp_path / "files").mkdir()
    pq.write_table(table, tmp_path / "files" / "a.parquet")
    pq.write_table(table.slice(1), tmp_path / "files" / "b.parquet")
    got = list(iter_eval_rows(tmp_path / "files"))
    assert [w for w, _ in got] == ["a.parquet row 0", "a.parquet row 1", "b.parquet row 0"]
    assert torch.equal(got[2][1].input_ids, rows[1]["input_ids"])
    bad = table.slice(1).set_column(0, "input_ids", pa.array([[-1] * 12]))
    pq.write_table(bad, tmp_path / "files" / "c.parquet")
    with pytest.raises(PackedRowError, match=r"files/c.parquet row 0: field 'input_ids' holds a negative"):
        list(iter_eval_rows(tmp_path / "files"))

    from hylo.pipeline.data.shards import ShardWriter, write_manifest

    writer = ShardWriter(tmp_path / "packed", rows_per_shard=1, row_group_rows=1)
    for r in rows:
        writer.add({k: (v.numpy() if torch.is_tensor(v) else v) for k, v in r.items()})
    write_manifest(tmp_path / "packed", {"shards": writer.finish()})
    got = list(iter_eval_rows(tmp_path / "packed"))
    assert len(got) == 2 and torch.equal(got[1][1].input_ids, rows[1]["input_ids"])

    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    recs = [{"id": "c1", "messages": [{"role": "user", "content": "how are you"},
                                      {"role": "assistant", "content": "fine thanks"}]}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    ((where, row),) = list(iter_eval_rows(tmp_path / "chat.jsonl", tok_dir))
    ids = row.input_ids.tolist()
    assert tok.decode(ids).startswith("<|im_start|>")
    # scored positions predict exactly the assistant reply and its end marker
    predicted = [ids[t + 1] for t in row.loss_mask.nonzero().squeeze(-1).tolist()]
    assert tok.decode(predicted) == tok.decode(tok(" fine thanks<|im_end|>", add_special_tokens=False)["input_ids"])


def test_bad_eval_input_is_named(tmp_path, base, tok):
    good = packed_row(base.config.vocab_size, [8, 8], seed=6)
    pq.write_table(pa.table({"input_ids": [good["input_ids"].tolist()]}), tmp_path / "a.parquet")
    with pytest.raises(DataFormatError, match=r"a.parquet: not packed rows, missing column\(s\) \['cu_seqlens'\]"):
        list(iter_eval_rows(tmp_path / "a.parquet"))
    with pytest.raises(PackedRowError, match="row 0: missing field 'cu_seqlens'"):
        evaluate_kl(base, [("row 0", {"input_ids": good["input_ids"]})])
    bad_cu = {**good, "cu_seqlens": torch.tensor([0, 8, 15], dtype=torch.int32)}
    pq.write_table(pa.table({k: [bad_cu[k].tolist()] for k in ("input_ids", "cu_seqlens")}), tmp_path / "b.parquet")
    with pytest.raises(PackedRowError, match=r"b.parquet row 0: cu_seqlens .* end at T=16"):
        list(iter_eval_rows(tmp_path / "b.parquet"))
    big = {**good, "input_ids": good["input_ids"].clone()}
    big["input_ids"][3] = base.config.vocab_size + 5
    with pytest.raises(EvalError, match="row 0: token id .* outside the model's vocabulary"):
        evaluate_kl(base, rows_of(big))
    ok = {"id": "x", "messages": [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(ok) + "\n{broken\n")
    with pytest.raises(EvalError, match="could not load a tokenizer"):
        list(iter_eval_rows(tmp_path / "chat.jsonl", tmp_path))
    tok.save_pretrained(tmp_path / "tok")
    rows = iter_eval_rows(tmp_path / "chat.jsonl", tmp_path / "tok")
    assert next(rows)[0] == "chat.jsonl record x"
    with pytest.raises(EvalError, match="chat.jsonl record 1: "):
        next(rows)
    # or reported: the broken record is listed, the good one still evaluated
    rejects: list = []
    got = list(iter_eval_rows(tmp_path / "chat.jsonl", tmp_path / "tok", rejects=rejects))
    assert [w for w, _ in got] == ["chat.jsonl record x"]
    assert [r["record"] for r in rejects] == ["chat.jsonl record 1"] and rejects[0]["reason"]
    with pytest.raises(EvalError, match="does not exist"):
        list(iter_eval_rows(tmp_path / "nope"))


# ----------------------------------------------------------------------------------------- retrieval
def test_retrieval_samples_are_deterministic_sized_and_hold_their_needles(tok):
    lengths = [128, 512]
    a = R.make_samples(tok, lengths, 3, ["niah_single", "niah_multikey"], seed=7, prompt_format="plain")
    b = R.make_samples(tok, lengths, 3, ["niah_single", "niah_multikey"], seed=7, prompt_format="plain")
    c = R.make_samples(tok, lengths, 3, ["niah_single", "niah_multikey"], seed=8, prompt_format="plain")
    assert [s.input_ids for s in a] == [s.input_ids for s in b]
    assert [s.input_ids for s in a] != [s.input_ids for s in c]
    assert len(a) == 2 * 2 * 3
    for s in a:
        assert 0.85 * s.target_tokens <= len(s.input_ids) <= s.target_tokens
        text = tok.decode(s.input_ids)
        assert R.needle(s.key, s.value) in text
        assert text.endswith(f"The secret code for {s.key} is")
        n_needles = 1 if s.task == "niah_single" else 4
        assert text.count("The secret code for") == n_needles + 1
        assert len({k for k, _ in s.needles}) == n_needles
        if s.task == "niah_single" and s.target_tokens == 512:
            at = text.index(R.needle(s.key, s.value)) / len(text)
            assert abs(at - s.depth) < 0.1
    chat = R.make_samples(tok, [128], 1, ["niah_single"], prompt_format="auto")[0]
    assert tok.decode(chat.input_ids).rstrip().endswith("<|im_start|> assistant")


def test_retrieval_scores_by_string_match(tok, base, monkeypatch):
    samples = R.make_samples(tok, [96, 160], 2, ["niah_single"], seed=0, prompt_format="plain")
    by_prompt = {tuple(s.input_ids): s.value for s in samples}

    class Res:
        def __init__(self, tokens):
            self.tokens = tokens

    for shift, acc in [(0, 1.0), (1, 0.0)]:
        def decode(model, ids, max_new_tokens, eos=None, shift=shift, **kw):
            value = str(int(by_prompt[tuple(ids)]) + shift)
            return Res(tok(f" {value}.", add_special_tokens=False)["input_ids"])

        monkeypatch.setattr(R, "greedy_decode", decode)
        out = R.run_retrieval(base, tok, samples)
        assert {L: c["accuracy"] for L, c in out["accuracy"]["niah_single"].items()} == {"96": acc, "160": acc}
        assert all(r["correct"] == (acc == 1.0) for r in out["samples"])


def test_retrieval_runs_greedy_decoding_on_real_models(tok, base, hybrid):
    samples = R.make_samples(tok, [96], 2, ["niah_single", "niah_multikey"], seed=1, prompt_format="plain")
    for model in (base, hybrid):
        first = R.run_retrieval(model, tok, samples, max_new_tokens=4)
        again = R.run_retrieval(model, tok, samples, max_new_tokens=4)
        assert [r["completion"] for r in first["samples"]] == [r["completion"] for r in again["samples"]]
        cells = first["accuracy"]
        assert set(cells) == {"niah_single", "niah_multikey"}
        assert all(0.0 <= c["accuracy"] <= 1.0 and c["n"] == 2 for t in cells.values() for c in t.values())
        assert not cells["niah_single"]["96"]["beyond_max_positions"]


# ----------------------------------------------------------------------------------------- KV cache
def test_measured_cache_hybrid_at_kv_cache_ratio_base_linear(base, hybrid):
    lengths = [64, 128, 256]
    b = kvcache.measure(base, lengths, decode_tokens=3)
    h = kvcache.measure(hybrid, lengths, decode_tokens=3)
    ratio = kv_summary(base.config, hybrid.config)["kv_cache_ratio"]
    assert ratio == pytest.approx(2 * (16 + 8) / (4 * 2 * 2 * 16))
    cmp = kvcache.compare(b, h, kvcache.expected_ratio(base, hybrid), kvcache.hybrid_expected_bytes_per_token(hybrid))
    assert cmp["hybrid_within_tolerance"] and cmp["base_grows_linearly"]
    for row, hb, bb, L in zip(cmp["per_length"], h, b, lengths):
        assert hb["cached_tokens"] == bb["cached_tokens"] == L + 2
        assert abs(row["measured_ratio"] / ratio - 1) <= 0.05
        assert row["hybrid_vs_config"] == pytest.approx(1.0)
        # base: K and V of 4 layers, 2 heads of 16 dims, fp32, for every cached token
        assert bb["total_bytes"] == (L + 2) * 4 * 2 * 2 * 16 * 4
    # GDN state and conv windows do not grow with the context
    assert len({hb["constant_bytes"] for hb in h}) == 1 and h[0]["constant_bytes"] > 0
    assert all(r["decode_steps"] == 2 and r["decode_tokens_per_s"] > 0 for r in b + h)


def test_cache_nbytes_counts_every_cache_tensor(hybrid):
    res = greedy_decode(hybrid, torch.arange(3, 40), max_new_tokens=2, ignore_eos=True)
    cb = cache_nbytes(res.cache)
    manual = sum(t.numel() * t.element_size() for layer in res.cache.layers for t in layer.tensors())
    assert cb.total == manual and cb.tokens == 38
    assert cb.per_token_part == 38 * 2 * (16 + 8) * 4  # allocated == cached: prompt + new - 1 tokens
    assert cb.detail["mla_used"] == cb.detail["mla"]


def test_compare_flags_a_wrong_ratio_and_nonlinear_base():
    base_rows = [{"context": 100, "bytes_per_token": 1000.0, "decode_tokens_per_s": 1.0},
                 {"context": 200, "bytes_per_token": 1100.0, "decode_tokens_per_s": 1.0}]
    hyb = [{"context": 100, "bytes_per_token": 300.0, "growing_bytes_per_token": 250.0, "decode_tokens_per_s": 2.0},
           {"context": 200, "bytes_per_token": 300.0, "growing_bytes_per_token": 275.0, "decode_tokens_per_s": 2.0}]
    cmp = kvcache.compare(base_rows, hyb, ratio=0.1875)
    assert not cmp["hybrid_within_tolerance"] and not cmp["base_grows_linearly"]
    assert cmp["per_length"][0]["ratio_deviation"] == pytest.approx(0.25 / 0.1875 - 1)


# ------------------------------------------------------------------------------------ lm-eval adapter
def direct_logprob(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    target = torch.tensor(cont)
    return float(logp[pos, target].sum()), bool((logp[pos].argmax(-1) == target).all())


PAIRS = [("The farmer waited near the bridge", " in the morning."),
         ("The secret code for amber is", " 4 8 2"),
         ("", "The kitten ran along the hill."),
         ("A quiet town looked at ", "the harbour")]


@pytest.mark.parametrize("which", ["hf", "hylo"])
def test_loglikelihood_matches_direct_computation(tok, base, hybrid, which):
    model = base if which == "hf" else hybrid
    sc = Scorer(model, tok, max_length=256)
    got = sc.loglikelihood(PAIRS)
    for (ctx, cont), (lp, greedy) in zip(PAIRS, got):
        c_ids, x_ids = sc.encode_pair(ctx, cont)
        if not ctx:
            assert c_ids == [tok.bos_token_id]
        if ctx.endswith(" "):
            assert tok.decode(x_ids).startswith(" ") or x_ids[0] == tok(" the", add_special_tokens=False)["input_ids"][0]
        ref_lp, ref_greedy = direct_logprob(model, c_ids, x_ids)
        assert lp == pytest.approx(ref_lp, rel=1e-4, abs=1e-4)
        assert greedy == ref_greedy


def test_hylo_packed_scoring_equals_one_request_per_forward(tok, hybrid):
    sc = Scorer(hybrid, tok, max_length=256)
    packed = sc.loglikelihood(PAIRS)
    sc.max_batch_tokens = 1
    alone = sc.loglikelihood(PAIRS)
    for (a, ga), (b, gb) in zip(packed, alone):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5) and ga == gb


def test_is_greedy_true_only_for_the_greedy_continuation(tok, hybrid):
    sc = Scorer(hybrid, tok, max_length=256)
    ctx = tok("The library turned from a wooden fence", add_special_tokens=False)["input_ids"]
    greedy = greedy_decode(hybrid, ctx, 4, ignore_eos=True).tokens
    other = greedy[:-1] + [(greedy[-1] + 1) % len(tok)]
    (lp_g, is_g), (lp_o, is_o) = sc._continuation_logprobs([(ctx + greedy, 4), (ctx + other, 4)])
    assert is_g and not is_o and lp_g > lp_o


@pytest.mark.parametrize("n", [1, 5, 10, 11, 23])
def test_rolling_windows_predict_every_token_once(tok, base, n):
    sc = Scorer(base, tok, max_length=5)
    tokens = list(range(10, 10 + n))
    windows = sc.rolling_windows(tokens)
    predicted = [t for w, k in windows for t in w[-k:]]
    assert predicted == tokens
    assert all(len(w) - 1 <= 5 for w, _ in windows)
    assert windows[0][0][0] == tok.bos_token_id


def test_loglikelihood_rolling_equals_full_context_sum(tok, base):
    text = "The farmer waited near the bridge in the morning. The kitten ran along the hill."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ref, _ = direct_logprob(base, [tok.bos_token_id], ids)
    assert Scorer(base, tok, max_length=256).loglikelihood_rolling([text])[0] == pytest.approx(ref, rel=1e-4)
    # short windows still score every token once (less context, so a different value)
    windowed = Scorer(base, tok, max_length=6).loglikelihood_rolling([text])[0]
    assert windowed < 0 and windowed != pytest.approx(ref, rel=1e-6)


def test_generate_until_cuts_at_the_stop_string(tok, hybrid):
    sc = Scorer(hybrid, tok, max_length=256)
    ctx = "The teacher leaned on the stone wall"
    ids = tok(ctx, add_special_tokens=False)["input_ids"]
    full = tok.decode(greedy_decode(hybrid, ids, 12, ignore_eos=True).tokens, skip_special_tokens=True)
    (plain,) = sc.generate_until([(ctx, {"max_gen_toks": 12})])
    assert full.startswith(plain) and plain
    stop = plain[len(plain) // 2:len(plain) // 2 + 2]
    (cut,) = sc.generate_until([(ctx, {"until": [stop], "max_gen_toks": 12})])
    assert cut == plain[:plain.index(stop)]
    # sampling goes through generate() too (the request's own kwargs)
    torch.manual_seed(0)
    (sampled,) = sc.generate_until([(ctx, {"do_sample": True, "temperature": 0.7, "max_gen_toks": 5})])
    assert isinstance(sampled, str)


def test_generate_until_in_padded_batches_equals_one_prompt_at_a_time(tok, hybrid):
    contexts = ["The teacher leaned on the stone wall", "The river", "A quiet town looked at the harbour and the"]
    reqs = [(c, {"until": ["."], "max_gen_toks": 6}) for c in contexts] + [(contexts[0], {"max_gen_toks": 3})]
    alone = Scorer(hybrid, tok, max_length=256, batch_size=1).generate_until(reqs)
    batched = Scorer(hybrid, tok, max_length=256, batch_size=3).generate_until(reqs)
    assert batched == alone and all(alone[:3])
    # each equals the greedy continuation of that prompt alone, cut at the stop string
    ids = tok(contexts[1], add_special_tokens=False)["input_ids"]
    full = tok.decode(greedy_decode(hybrid, ids, 6, eos=Scorer(hybrid, tok).eos).tokens, skip_special_tokens=True)
    assert full.split(".")[0] == alone[1]


def test_lm_eval_model_registered_as_hylo_and_takes_instances(tok, hybrid):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from hylo.pipeline.eval.lm_eval_adapter import register

    cls = register()
    assert get_model("hylo") is cls and register() is cls
    lm = cls(model=hybrid, tokenizer_obj=tok, max_length=256)
    ll = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    assert lm.loglikelihood(ll) == Scorer(hybrid, tok, max_length=256).loglikelihood(PAIRS)
    text = "The farmer waited near the bridge."
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert rolling == pytest.approx(Scorer(hybrid, tok, max_length=256).loglikelihood_rolling([text])[0])
    (gen,) = lm.generate_until([Instance("generate_until", {}, ("The river", {"until": ["\n"], "max_gen_toks": 3}), 0)])
    assert isinstance(gen, str)


def write_local_tasks(root: Path) -> Path:
    """Local lm-eval tasks: a multiple-choice one (2-shot by default), a generation one, and one whose
    data file does not exist (a dataset that cannot be loaded)."""
    rng = random.Random(0)
    docs = []
    for i in range(6):
        key = R.KEYS[i]
        values = [str(rng.randrange(100, 1000)) for _ in range(3)]
        docs.append({"question": f"{R.needle(key, values[0])} What is the secret code for {key}?",
                     "choices": values, "label": 0, "answer": values[0]})
    root.mkdir(parents=True, exist_ok=True)
    (root / "data.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'data.jsonl'}\n"
              "test_split: test\nfewshot_split: test\n")
    (root / "hylo_local_mc.yaml").write_text(
        "task: hylo_local_mc\n" + common + "output_type: multiple_choice\nnum_fewshot: 2\n"
        "doc_to_text: \"{{question}} The secret code for is\"\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    (root / "hylo_local_gen.yaml").write_text(
        "task: hylo_local_gen\n" + common + "output_type: generate_until\nnum_fewshot: 0\n"
        "doc_to_text: \"{{question}} The secret code for is\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\".\"]\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    (root / "hylo_missing.yaml").write_text(
        "task: hylo_missing\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'not_there.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_choice: choices\ndoc_to_target: label\n")
    return root


@pytest.mark.slow
def test_lm_eval_simple_evaluate_on_a_local_task(tmp_path, tok, hybrid):
    """A local multiple-choice task through the harness; accuracy equals our own argmax scoring."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hylo.pipeline.eval.lm_eval_adapter import register

    root = write_local_tasks(tmp_path / "tasks")
    cls = register()
    lm = cls(model=hybrid, tokenizer_obj=tok, max_length=256)
    tm = TaskManager(include_path=str(root), include_defaults=False)
    res = lm_eval.simple_evaluate(model=lm, tasks=["hylo_local_mc"], task_manager=tm, num_fewshot=0,
                                  log_samples=False, bootstrap_iters=0)
    acc = res["results"]["hylo_local_mc"]["acc,none"]
    sc = Scorer(hybrid, tok, max_length=256)
    docs = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    ours = 0
    for d in docs:
        ctx = f"{d['question']} The secret code for is"
        scores = [lp for lp, _ in sc.loglikelihood([(ctx, f" {c}") for c in d["choices"]])]
        ours += int(int(np.argmax(scores)) == d["label"])
    assert acc == pytest.approx(ours / len(docs))


@pytest.mark.slow
def test_lm_eval_through_the_registered_name_and_the_hf_backend(saved, tmp_path):
    """simple_evaluate(model="hylo") by name, and lm-eval's own `hf` model loading the saved checkpoint with
    trust_remote_code (transformers' generate() on left-padded batches): the same log-likelihoods."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hylo.pipeline.eval.lm_eval_adapter import register

    register()
    root = write_local_tasks(tmp_path / "tasks")
    out = {}
    for name, args in [("hylo", f"pretrained={saved / 'hybrid'}"),
                       ("hf", f"pretrained={saved / 'hybrid'},trust_remote_code=True,dtype=float32,device=cpu")]:
        tm = TaskManager(include_path=str(root), include_defaults=False)
        out[name] = lm_eval.simple_evaluate(model=name, model_args=args, tasks=["hylo_local_mc", "hylo_local_gen"],
                                            task_manager=tm, batch_size=2, log_samples=True, bootstrap_iters=0)
    assert out["hylo"]["config"]["model"] == "hylo"
    for name, res in out.items():
        assert res["n-shot"]["hylo_local_mc"] == 2, name
        gens = [s["resps"][0][0] for s in res["samples"]["hylo_local_gen"]]
        assert len(gens) == 6 and all(isinstance(g, str) for g in gens), name
    ll = {name: [r[0] for s in res["samples"]["hylo_local_mc"] for r in (x[0] for x in s["resps"])]
          for name, res in out.items()}
    assert len(ll["hylo"]) == 18
    np.testing.assert_allclose(ll["hylo"], ll["hf"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_hylo_lm_eval_command_runs_the_harness_cli(saved, tmp_path):
    """`python -m hylo.pipeline.eval.lm_eval_adapter` (the `hylo-lm-eval` console script's code) with `--model hylo`."""
    root = write_local_tasks(tmp_path / "tasks")
    proc = subprocess.run(
        [sys.executable, "-m", "hylo.pipeline.eval.lm_eval_adapter", "--model", "hylo", "--model_args",
         f"pretrained={saved / 'hybrid'}", "--tasks", "hylo_local_mc", "--include_path", str(root),
         "--output_path", str(tmp_path / "out"), "--limit", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = list((tmp_path / "out").rglob("results_*.json"))
    data = json.loads(result.read_text())
    assert data["config"]["model"] == "hylo" and "acc,none" in data["results"]["hylo_local_mc"]


# ------------------------------------------------------------------------------------------ the job
@pytest.fixture(scope="module")
def saved(tmp_path_factory, tok, base, hybrid):
    root = tmp_path_factory.mktemp("models")
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    save_hylo(hybrid, root / "hybrid", tokenizer=tok)
    rows = [packed_row(base.config.vocab_size, [20, 30], seed=9)]
    table = pa.table({k: [r[k].tolist() for r in rows] for k in ("input_ids", "position_ids", "cu_seqlens", "loss_mask")})
    pq.write_table(table, root / "heldout.parquet")
    return root


def eval_main():
    from hylo.jobs.eval import main

    return main


def test_eval_job_writes_json_and_markdown(saved, tmp_path):
    main = eval_main()

    out = tmp_path / "eval"
    rc = main(["--model", str(saved / "hybrid"), "--teacher", str(saved / "base"), "--base", str(saved / "base"),
               "--data", str(saved / "heldout.parquet"), "--out", str(out), "--suite", "kl,retrieval,kvcache",
               "--set", "retrieval.lengths=[96]", "--set", "retrieval.samples_per_length=1",
               "--set", "retrieval.tasks=[niah_single]", "--set", "retrieval.max_new_tokens=3",
               "--set", "kvcache.lengths=[64,128]", "--set", "kvcache.decode_tokens=2", "--quiet"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["model"]["kind"] == "hylo" and res["base"]["kind"] == "LlamaForCausalLM"
    assert res["kl"]["kl"] > 0 and res["kl"]["tokens"] > 0 and res["kl"]["kl_backend"] == "fused_linear_kl_div"
    assert set(res["retrieval"]) >= {"model", "base"}
    assert res["kvcache"]["comparison"]["hybrid_within_tolerance"] is True
    md = (out / "results.md").read_text()
    for heading in ("## KL to the teacher", "## Needle-in-a-haystack", "## KV cache measured"):
        assert heading in md
    assert not list(out.glob(".*tmp*"))


def test_samples_suite_gives_the_greedy_answers_of_model_and_base(saved, tmp_path):
    from hylo.pipeline.eval.samples import greedy_answers

    main = eval_main()
    out = tmp_path / "eval"
    prompts = ["how are you", "the answer is"]
    rc = main(["--model", str(saved / "hybrid"), "--base", str(saved / "base"), "--out", str(out),
               "--suite", "samples", "--set", f"samples.prompts={json.dumps(prompts)}",
               "--set", "samples.max_new_tokens=4", "--quiet"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())["samples"]
    assert [a["prompt"] for a in res["model"]] == prompts == [a["prompt"] for a in res["base"]]
    assert all(1 <= a["new_tokens"] <= 4 for a in res["model"] + res["base"])
    # what the job wrote is the model's own greedy continuation of the chat-rendered prompt
    from transformers import AutoTokenizer

    from hylo.io import load_hylo

    tok = AutoTokenizer.from_pretrained(saved / "hybrid", trust_remote_code=True)
    again = greedy_answers(load_hylo(saved / "hybrid").eval(), tok, prompts, 4)
    assert [a["answer"] for a in again] == [a["answer"] for a in res["model"]]
    md = (out / "results.md").read_text()
    assert "## Sample answers (greedy)" in md and "| how are you |" in md


@pytest.mark.slow
def test_eval_job_runs_lm_eval_with_fewshot_samples_progress_and_card(saved, tmp_path, capsys):
    import shutil

    main = eval_main()
    model_dir = tmp_path / "model"
    shutil.copytree(saved / "hybrid", model_dir)
    root = write_local_tasks(tmp_path / "tasks")
    out = tmp_path / "eval"
    common = ["--model", str(model_dir), "--out", str(out), "--suite", "lm_eval,kvcache",
              "--lm-eval-tasks", "hylo_local_mc,hylo_local_gen", "--set", f"lm_eval.include_path={root}",
              "--set", "lm_eval.include_defaults=false", "--set", "lm_eval.bootstrap_iters=0",
              "--set", "kvcache.lengths=[32]", "--set", "kvcache.decode_tokens=2", "--quiet"]
    assert main([*common, "--batch-size", "3", "--log-samples", "--update-card"]) == 0
    err = capsys.readouterr().err
    # a line per suite and progress bars over the work
    assert "[eval] suite lm_eval (1/2)" in err and "[eval] suite kvcache (2/2)" in err
    assert "generate_until" in err and "kvcache model" in err and "loglikelihood" in err
    res = json.loads((out / "results.json").read_text())
    le = res["lm_eval"]
    # each task keeps its own few-shot default (2 for the MC task, 0 for generation)
    assert le["n-shot"] == {"hylo_local_mc": 2, "hylo_local_gen": 0}
    assert set(le["results"]) == {"hylo_local_mc", "hylo_local_gen"}
    assert list((out / "lm_eval").rglob("results_*.json"))
    samples = list((out / "lm_eval").rglob("samples_hylo_local_gen_*.jsonl"))
    assert samples and len(samples[0].read_text().splitlines()) == 6
    card = (model_dir / "README.md").read_text()
    assert "## Evaluation" in card and "| lm_eval | hylo_local_mc acc |" in card and "| kvcache | kv_cache_ratio |" in card
    # few-shot counts: one for all, then per task
    assert main([*common, "--num-fewshot", "1", "--set", "lm_eval.fewshot_per_task={hylo_local_gen: 3}"]) == 0
    le = json.loads((out / "results.json").read_text())["lm_eval"]
    assert le["n-shot"] == {"hylo_local_mc": 1, "hylo_local_gen": 3}


def test_lm_eval_tasks_that_cannot_run_fail_the_job_at_once_with_one_line(saved, tmp_path, capsys):
    main = eval_main()
    root = write_local_tasks(tmp_path / "tasks")
    rc = main(["--model", str(saved / "hybrid"), "--out", str(tmp_path / "eval"), "--suite", "kvcache,lm_eval",
               "--lm-eval-tasks", "hylo_local_mc,hylo_missing,no_such_task", "--set", f"lm_eval.include_path={root}",
               "--set", "lm_eval.include_defaults=false", "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "'hylo_missing': its dataset is not available" in lines[0]
    assert "'no_such_task' is not a known task" in lines[0] and "hylo_local_mc" not in lines[0]
    # nothing ran: the tasks are checked before the first suite
    assert "[eval] suite kvcache" not in err and not (tmp_path / "eval" / "results.json").exists()


def test_eval_job_errors_name_the_problem(saved, tmp_path, capsys):
    main = eval_main()

    assert main(["--model", str(tmp_path / "missing"), "--suite", "kvcache", "--out", str(tmp_path)]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["--model", str(saved / "hybrid"), "--suite", "kl,bogus", "--out", str(tmp_path)]) == 2
    assert "item 1 is 'bogus'" in capsys.readouterr().err
    assert main(["--model", str(saved / "hybrid"), "--suite", "kl", "--out", str(tmp_path)]) == 2
    assert "needs --data" in capsys.readouterr().err
    assert main(["--model", str(saved / "hybrid"), "--set", "kvcache.lengths=[]", "--out", str(tmp_path)]) == 2
    assert "kvcache.lengths" in capsys.readouterr().err


def test_smoke_config_loads_and_bad_values_are_named():
    from hylo.pipeline.config import ConfigError, load_config
    from hylo.pipeline.eval.config import EvalConfig

    cfg = load_config(EvalConfig, REPO / "configs" / "eval_smoke.yaml")
    assert cfg.suites == ["kl", "retrieval", "kvcache"] and max(cfg.kvcache.lengths) <= 4096
    with pytest.raises(ConfigError, match="kl.on_bad_record='skip'"):
        load_config(EvalConfig, None, ["kl.on_bad_record=skip"])
    with pytest.raises(ConfigError, match="unknown key.*retrieval.length\\b"):
        load_config(EvalConfig, None, ["retrieval.length=[1]"])


def test_eval_never_overwrites_results_it_did_not_write_and_replaces_its_own(saved, tmp_path, capsys):
    """`eval --out DIR` overwrote the user's own results.md with no check: a results file the job did not write
    (not in DIR's .hylo-output.json) is refused before any model loads, with one line naming it; the job's own
    earlier results are replaced; an --out that is the evaluated model is refused."""
    main = eval_main()
    out = tmp_path / "eval"
    out.mkdir()
    (out / "results.md").write_text("my own notes")
    (out / "other.txt").write_text("not a name eval writes: left alone")

    def args(length: int, where: Path = out) -> list[str]:
        return ["--model", str(saved / "hybrid"), "--out", str(where), "--suite", "kvcache", "--set",
                f"kvcache.lengths=[{length}]", "--set", "kvcache.decode_tokens=2", "--quiet"]

    capsys.readouterr()
    assert main(args(64)) == 2
    err = capsys.readouterr().err
    assert err == (f"error: out {out} holds results.md, which this project did not write (it has no "
                   f".hylo-output.json); it never overwrites a file it did not write: move it away, or choose "
                   f"another out\n"), err
    assert (out / "results.md").read_text() == "my own notes" and not (out / "results.json").exists()
    (out / "results.md").unlink()
    assert main(args(64)) == 0
    assert json.loads((out / ".hylo-output.json").read_text())["entries"] == ["results.json", "results.md"]
    assert [r["context"] for r in json.loads((out / "results.json").read_text())["kvcache"]["model"]] == [64]
    # its own results, from the run before, are replaced
    assert main(args(96)) == 0
    assert [r["context"] for r in json.loads((out / "results.json").read_text())["kvcache"]["model"]] == [96]
    assert (out / "other.txt").read_text() == "not a name eval writes: left alone"
    # results written into the model under test, or over it, are refused before anything is written
    before = sorted(p.name for p in (saved / "hybrid").iterdir())
    for where, how in [(saved / "hybrid", "is the input --model"), (saved / "hybrid" / "eval", "lies inside the input"),
                       (saved, "holds the input --model")]:
        capsys.readouterr()
        assert main(args(64, where)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: out {where} {how}") and err.count("\n") == 1, err
    assert sorted(p.name for p in (saved / "hybrid").iterdir()) == before and not (saved / "results.json").exists()
