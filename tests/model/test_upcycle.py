"""Upcycling Llama/Qwen3 into HyLo, and whole-model behaviour: packing, cached decoding, save/load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hylo.io import load_hylo, save_hylo
from hylo.modeling import HyLoForCausalLM
from hylo.upcycle import (
    UpcycleError,
    gdn_weights_from_attention,
    hybrid_config_from_base,
    load_base_model,
    mla_weights_from_attention,
    rope_dim_split,
    upcycle,
)


def tiny_llama(n_layer: int = 4, seed: int = 0, dtype=torch.float64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=n_layer, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_qwen3(seed: int = 0, kv_heads: int = 2) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, head_dim=16, vocab_size=128, max_position_embeddings=256)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return m


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def test_full_rank_svd_reproduces_projections():
    base = tiny_llama()
    attn = base.model.layers[0].self_attn
    h, g, dh = 4, 2, 16
    # 2 KV groups x 4 rope dims each -> qk_rope_head_dim 8, per-head nope 12, full kv rank 2 * (12 + 16)
    hcfg = hybrid_config_from_base(base.config, mla_layers="all", kv_lora_rank=56, q_lora_rank=64,
                                   qk_rope_head_dim=8)
    assert hcfg.rope_key_groups == 2 and hcfg.qk_nope_head_dim == 12
    w = mla_weights_from_attention(attn, hcfg)
    nope, rope = rope_dim_split(dh, 4)
    scale = ((12 + 8) / 16) ** 0.5  # MLA divides scores by sqrt(20), the base by sqrt(16)
    wq = attn.q_proj.weight.double().view(h, dh, -1)
    wk = attn.k_proj.weight.double().view(g, dh, -1)
    wv = attn.v_proj.weight.double().view(g, dh, -1)
    # queries: q_b @ q_a == per-head [nope | rope block of its group] reordering of W_q (scaled)
    q = (w["q_b_proj.weight"] @ w["q_a_proj.weight"]).view(h, 20, -1) / scale
    assert rel_err(q[:, :12], wq[:, nope]) < 1e-12
    for head in range(h):
        blk = head // 2
        # per head: 12 nope dims, then rope reals [12:16] (2 per group), imaginaries [16:20]
        assert rel_err(q[head, 12 + 2 * blk: 12 + 2 * blk + 2], wq[head, rope[:2]]) < 1e-12
        assert rel_err(q[head, 16 + 2 * blk: 16 + 2 * blk + 2], wq[head, rope[2:]]) < 1e-12
        other = 1 - blk
        assert q[head, 12 + 2 * other: 12 + 2 * other + 2].abs().max() < 1e-12
    # keys (nope part) and values: kv_b @ latent rows, each query head reads its GQA group
    r = hcfg.kv_lora_rank
    kv = (w["kv_b_proj.weight"] @ w["kv_a_proj_with_mqa.weight"][:r]).view(h, 12 + 16, -1)
    for head in range(h):
        grp = head // 2
        assert rel_err(kv[head, :12], wk[grp, nope]) < 1e-12
        assert rel_err(kv[head, 12:], wv[grp]) < 1e-12
    # shared roped key: one block per KV group holding that group's rope rows
    k_pe = w["kv_a_proj_with_mqa.weight"][r:]
    for grp in range(g):
        assert torch.equal(k_pe[2 * grp: 2 * grp + 2], wk[grp, rope[:2]])
        assert torch.equal(k_pe[4 + 2 * grp: 4 + 2 * grp + 2], wk[grp, rope[2:]])
    assert rel_err(w["o_proj.weight"], attn.o_proj.weight.double()) < 1e-12


def test_grouped_rope_key_reproduces_attention_exactly_at_full_rank():
    """With every rope pair kept (nope = 0) and full rank, an MLA layer IS the base attention."""
    base = tiny_llama()
    attn = base.model.layers[1].self_attn
    model = upcycle(base, mla_layers=[1], kv_lora_rank=32, qk_rope_head_dim=32, rope_key_groups=2)
    assert model.config.qk_nope_head_dim == 0
    mixer = model.model.layers[1].mixer
    x = torch.randn(2, 11, 64, dtype=torch.float64)
    pos = torch.arange(11).expand(2, 11)
    cos, sin = base.model.rotary_emb(x, pos)
    # causal mask: the base module needs one when called alone
    mask = torch.full((11, 11), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    ref = attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)[0]
    torch.testing.assert_close(mixer(x), ref, atol=1e-10, rtol=1e-10)


FULL_RANK = {
    # every RoPE pair kept (nope 0) and the joint SVD's full rank: kv_lora_rank = KV heads x (0 + v 16)
    "llama": (lambda: tiny_llama(dtype=torch.float32), dict(kv_lora_rank=32, qk_rope_head_dim=32, rope_key_groups=2)),
    "qwen3": (tiny_qwen3, dict(kv_lora_rank=32, qk_rope_head_dim=32, rope_key_groups=2)),
    # one KV head: one shared roped key, no rope-key groups
    "qwen3-mqa": (lambda: tiny_qwen3(kv_heads=1), dict(kv_lora_rank=16, qk_rope_head_dim=16, rope_key_groups=1)),
}


@pytest.mark.parametrize("name", list(FULL_RANK))
def test_full_rank_all_mla_conversion_reproduces_the_base_logits(name):
    """An all-MLA conversion at full rank with every RoPE pair kept is the base model, for Qwen3 as
    for Llama: Qwen3's per-head q/k RMSNorms become the MLA layers' q_norm / k_norm (folding only their
    weights, as before, left max |logit diff| 0.31 and KL 2.2e-3 here). Both attention paths: the full
    forward and the absorbed decode over the latent cache."""
    make, kw = FULL_RANK[name]
    base = make()
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (2, 24))
    model = upcycle(base, mla_layers="all", **kw).eval()
    with torch.no_grad():
        ref = base(ids).logits.double()
        full = model(ids).logits.double()
        out = model(ids[:, :9], use_cache=True)
        steps = [out.logits]
        for t in range(9, 24):
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
        cached = torch.cat(steps, dim=1).double()
    lp_ref = torch.log_softmax(ref, -1)
    for got in (full, cached):
        kl = float((lp_ref.exp() * (lp_ref - torch.log_softmax(got, -1))).sum(-1).mean())
        diff = float((got - ref).abs().max())
        assert diff < 1e-5 and kl < 1e-10, f"{name}: max |logit diff| {diff:.3g}, KL {kl:.3g}"
    qwen = name.startswith("qwen3")
    assert model.config.mla_qk_norm == qwen
    keys = model.state_dict().keys()
    assert ("model.layers.1.mixer.q_norm.weight" in keys and "model.layers.1.mixer.k_norm.weight" in keys) == qwen


def test_single_shared_rope_key_is_rank1_fit():
    base = tiny_llama()
    hcfg = hybrid_config_from_base(base.config, mla_layers="all", kv_lora_rank=48, qk_rope_head_dim=8,
                                   rope_key_groups=1)
    assert hcfg.rope_key_groups == 1 and hcfg.qk_nope_head_dim == 8
    w = mla_weights_from_attention(base.model.layers[0].self_attn, hcfg)
    assert w["kv_a_proj_with_mqa.weight"].shape == (48 + 8, 64)


def test_truncated_rank_is_best_approximation():
    base = tiny_llama()
    attn = base.model.layers[1].self_attn
    hcfg = hybrid_config_from_base(base.config, mla_layers="all", kv_lora_rank=16, qk_rope_head_dim=8)
    w = mla_weights_from_attention(attn, hcfg)
    assert w["kv_a_proj_with_mqa.weight"].shape == (16 + 8, 64)
    assert w["kv_b_proj.weight"].shape == (4 * (12 + 16), 16)
    assert "q_proj.weight" in w  # uncompressed queries by default


def test_gdn_copy_and_qwen3_norm_folding():
    base = tiny_llama()
    attn = base.model.layers[0].self_attn
    hcfg = hybrid_config_from_base(base.config, mla_layers="none")
    w = gdn_weights_from_attention(attn, hcfg)
    assert torch.equal(w["q_proj.weight"], attn.q_proj.weight.double())
    k = w["k_proj.weight"].view(4, 16, -1)
    wk = attn.k_proj.weight.double().view(2, 16, -1)
    assert torch.equal(k[0], wk[0]) and torch.equal(k[1], wk[0]) and torch.equal(k[3], wk[1])
    assert torch.equal(w["o_proj.weight"], attn.o_proj.weight.double())
    q3 = tiny_qwen3()
    a3 = q3.model.layers[0].self_attn
    w3 = gdn_weights_from_attention(a3, hybrid_config_from_base(q3.config, mla_layers="none"))
    # GDN L2-normalises q, so folding q_norm's weight is exact: l2norm(W' x) == l2norm(q_norm(W x))
    x = torch.randn(5, 64, dtype=torch.float64)
    ref = a3.q_norm(a3.q_proj(x.float()).view(5, 4, 16)).double()
    ours = (x @ w3["q_proj.weight"].T).view(5, 4, 16)
    torch.testing.assert_close(torch.nn.functional.normalize(ours, dim=-1),
                               torch.nn.functional.normalize(ref, dim=-1), atol=1e-5, rtol=1e-5)


def test_upcycle_qwen3_runs():
    q3 = tiny_qwen3()
    model = upcycle(q3, mla_layers=[1])
    ids = torch.randint(0, 128, (1, 12))
    assert torch.isfinite(model(ids).logits).all()
    # the MLA layer keeps the q/k norms, laid out per head as [nope | rope] (E = 8 + 2 groups x 8); GDN folds them
    sd = model.state_dict()
    assert model.config.mla_qk_norm and sd["model.layers.1.mixer.k_norm.weight"].shape == (24,)
    assert not any("q_norm" in k or "k_norm" in k for k in sd if k.startswith("model.layers.0."))
    from hylo.upcycle import rope_dim_split

    nope, rope = rope_dim_split(16, 8)  # 8 rope dims (4 pairs) of each base head, one block per KV group
    w_k = q3.model.layers[1].self_attn.k_norm.weight
    assert torch.equal(sd["model.layers.1.mixer.k_norm.weight"],
                       torch.cat([w_k[nope], w_k[rope[:4]].repeat(2), w_k[rope[4:]].repeat(2)]))
    with pytest.raises(UpcycleError, match="mla_qk_norm is set but the base attention has no q_norm"):
        hcfg = hybrid_config_from_base(tiny_llama().config, mla_layers=[1])
        hcfg.mla_qk_norm = True
        upcycle(tiny_llama(), hcfg)


def _hybrid(dtype=torch.float64, mla="even", n_layer=4) -> HyLoForCausalLM:
    base = tiny_llama(n_layer=n_layer, dtype=dtype)
    return upcycle(base, mla_layers=mla, kv_lora_rank=32, qk_rope_head_dim=8).eval()


def test_packed_row_equals_documents_one_by_one():
    model = _hybrid()
    torch.manual_seed(1)
    lens = [5, 17, 1, 9]
    docs = [torch.randint(0, 128, (1, n)) for n in lens]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        out = model(packed, cu_seqlens=cu, output_mixer_outputs=True).logits
        for d, s, e in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(d).logits
            torch.testing.assert_close(out[:, s:e], alone, atol=1e-9, rtol=1e-9)


@pytest.mark.slow
def test_cached_decoding_equals_full_forward_and_cache_sizes():
    model = _hybrid()
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (2, 14))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        cache = out.past_key_values
        steps = [out.logits]
        sizes = []
        for t in range(6, 14):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            sizes.append(cache.nbytes())
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-9, rtol=1e-9)
    cfg = model.config
    # MLA layers: exactly (kv_lora_rank + qk_rope_head_dim) values per token per layer, on the real tensors
    for i in cfg.mla_layers:
        layer = cache[i]
        per_token = sum(t.shape[-1] for t in layer.tensors())
        assert per_token == cfg.kv_lora_rank + cfg.qk_rope_head_dim
        assert layer.c_kv.shape == (2, 14, cfg.kv_lora_rank) and layer.k_pe.shape == (2, 14, cfg.qk_rope_head_dim)
        # no length hint here: the buffer grew from the 6-token prefill by half at a time (6 -> 9 -> 13 -> 19)
        assert layer.capacity == 19
    # linear layers: constant size as the context grows
    assert len({s["linear"] for s in sizes}) == 1 and sizes[0]["linear"] > 0
    per_step = sizes[1]["mla_used"] - sizes[0]["mla_used"]
    assert per_step == 2 * len(cfg.mla_layers) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 8
    assert all(s["mla"] >= s["mla_used"] for s in sizes)


def test_save_load_identical_logits_and_generate(tmp_path):
    model = _hybrid(dtype=torch.float32)
    save_hylo(model, tmp_path / "ckpt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "hybrid_config.json", "model.safetensors"} <= files
    back = load_hylo(tmp_path / "ckpt").eval()
    # tokenizer files of another directory travel along (copied, never loaded)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "tok" / "model.safetensors").write_text("not copied")
    save_hylo(model, tmp_path / "ckpt2", tokenizer_from=tmp_path / "tok")
    assert (tmp_path / "ckpt2" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (tmp_path / "ckpt2" / "chat_template.jinja").is_file()
    assert load_hylo(tmp_path / "ckpt2").state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)
    gen = back.generate(ids, max_new_tokens=5, eos_token_id=None)
    assert gen.shape == (1, 15) and torch.equal(gen[:, :10], ids)
    # greedy generate continues exactly what full forwards pick
    with torch.no_grad():
        nxt = back(gen[:, :-1]).logits[:, 9:].argmax(-1)
    assert torch.equal(nxt, gen[:, 10:])
    # the cache allocated once, exactly the tokens fed: prompt + 4 (the 5th new token is never fed back)
    _, cache = back.generate(ids, max_new_tokens=5, eos_token_id=None, return_cache=True)
    mla = [c for c in cache.layers if hasattr(c, "capacity")]
    assert mla and all(c.seq_len == c.capacity == 14 for c in mla) and cache.get_seq_length() == 14


def test_upcycled_mla_far_below_random_init_on_tiny_model():
    # MLA at full rank with the latent-norm calibration is nearly the base attention; random mixers are not.
    # (GDN vs softmax attention is judged on the real model by bench/upcycle_quality.py.)
    base = tiny_llama(dtype=torch.float32)
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        ref = torch.log_softmax(base(ids).logits, -1)

        def kl(m):
            lp = torch.log_softmax(m(ids).logits, -1)
            return float((ref.exp() * (ref - lp)).sum(-1).mean())

        kw = dict(mla_layers="all", kv_lora_rank=56, qk_rope_head_dim=8)
        ours = kl(upcycle(base, calibration_ids=ids, **kw))
        rand = kl(upcycle(base, init="random", **kw))
    assert ours < 0.05 * rand


def test_bad_base_inputs(tmp_path):
    with pytest.raises(UpcycleError, match="does not exist"):
        load_base_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UpcycleError, match="no config.json"):
        load_base_model(tmp_path / "empty")
    bad = tmp_path / "corrupt"
    tiny_llama(dtype=torch.float32).save_pretrained(bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(UpcycleError, match="could not load the base model weights"):
        load_base_model(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(UpcycleError, match="not valid JSON"):
        load_base_model(bad)
    gpt = tmp_path / "gpt2"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UpcycleError, match="'gpt2'.*not supported"):
        load_base_model(gpt)
    with pytest.raises(UpcycleError, match="out of range"):
        upcycle(tiny_llama(), mla_layers=[0, 7])


@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
def test_calibration_makes_linear_gates_constant_and_norms_the_attention_rms(linear_type):
    # The gate of every linear layer is ~1 on calibration inputs, and the output norm weight holds the
    # RMS of the attention heads it replaces; without calibration the gate is noise around 0.
    base = tiny_llama(dtype=torch.float32)
    torch.manual_seed(5)
    ids = torch.randint(0, 128, (1, 48))
    kw = dict(mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8, linear_type=linear_type)
    cal = upcycle(base, calibration_ids=ids, **kw)
    raw = upcycle(base, **kw)
    xs, os_ = {}, {}
    hooks = []
    for i, layer in enumerate(base.model.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda m, a, k, i=i: xs.__setitem__(i, a[0] if a else k["hidden_states"]), with_kwargs=True))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: os_.__setitem__(i, a[0])))
    with torch.no_grad():
        base(input_ids=ids)
    for h in hooks:
        h.remove()
    for i in (1, 2, 3):
        x = xs[i][0]
        rms_HK = os_[i][0].reshape(x.shape[0], 4, 16).pow(2).mean(0).sqrt()
        gates = {}
        for name, model in (("cal", cal), ("raw", raw)):
            mixer = model.model.layers[i].mixer
            with torch.no_grad():
                if linear_type == "gdn":
                    g = torch.nn.functional.silu(mixer.g_proj(x))
                else:
                    g = torch.nn.functional.silu(x @ mixer.in_proj.weight[: mixer.num_heads * mixer.head_dim].T)
            gates[name] = float((g - 1).abs().mean())
        assert gates["cal"] < 0.25 < gates["raw"], gates
        mixer = cal.model.layers[i].mixer
        if linear_type == "gdn":
            torch.testing.assert_close(mixer.o_norm.weight.float(), rms_HK.mean(0).float(), rtol=1e-4, atol=1e-5)
        else:
            want = torch.cat([rms_HK[m % 4] for m in range(mixer.num_heads)])
            torch.testing.assert_close(mixer.norm.weight.float(), want.float(), rtol=1e-4, atol=1e-5)


def test_conversion_is_reproducible_and_layer_init_independent_of_placement():
    # Parameters conversion does not set (GDN decay, step, beta rows) come from a per-layer seed: the same
    # conversion twice is identical, and a linear layer starts the same whatever the other layers are.
    base = tiny_llama(dtype=torch.float32)
    kw = dict(kv_lora_rank=32, qk_rope_head_dim=8)
    torch.manual_seed(1)
    a = upcycle(base, mla_layers=[0], **kw).state_dict()
    torch.manual_seed(2)
    b = upcycle(base, mla_layers=[0], **kw).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = upcycle(base, mla_layers=[2], **kw).state_dict()
    for i in (1, 3):  # linear in both placements
        keys = [k for k in a if k.startswith(f"model.layers.{i}.mixer.")]
        assert keys and all(torch.equal(a[k], c[k]) for k in keys)
    d = upcycle(base, mla_layers=[0], seed=7, **kw).state_dict()
    assert not torch.equal(a["model.layers.1.mixer.A_log"], d["model.layers.1.mixer.A_log"])


def test_non_finite_base_weights_are_refused_naming_the_tensor():
    base = tiny_llama(dtype=torch.float32)
    with torch.no_grad():
        base.model.layers[1].self_attn.k_proj.weight[3, 5] = float("nan")
        base.model.layers[2].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(UpcycleError, match=r"2 base tensors.*layers\.1\.self_attn\.k_proj\.weight.*1 value"):
        upcycle(base, mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8)


def test_converter_refuses_latents_wider_than_the_input_and_unknown_conversion_options():
    from hylo.config import HybridConfig, HybridConfigError

    base = tiny_llama(dtype=torch.float32)
    with pytest.raises(UpcycleError, match=r"kv_lora_rank \(--kv-lora-rank\) = 72 is larger than the hidden size 64"):
        hybrid_config_from_base(base.config, mla_layers="all", kv_lora_rank=72, qk_rope_head_dim=4,
                                rope_key_groups=1)
    with pytest.raises(UpcycleError, match=r"q_lora_rank \(--q-lora-rank\) = 128 is larger"):
        hybrid_config_from_base(base.config, q_lora_rank=128)
    with pytest.raises(HybridConfigError, match="q_lora_rank"):
        HybridConfig(q_lora_rank=0)
    with pytest.raises(UpcycleError, match="unknown conversion option.*kv_lora_rnak.*valid: .*kv_lora_rank"):
        upcycle(tiny_llama(dtype=torch.float32), kv_lora_rnak=32)


@pytest.mark.parametrize("tamper", ["missing", "unexpected", "renamed", "shape"])
def test_loading_is_strict_and_names_the_keys(tmp_path, tamper):
    """A checkpoint whose mixer weights do not match the model is an error, never a random init."""
    from safetensors.torch import load_file, save_file

    from hylo.io import CheckpointMismatchError

    model = _hybrid(dtype=torch.float32)
    save_hylo(model, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    sd = load_file(path)
    key = "model.layers.0.mixer.kv_b_proj.weight"
    if tamper == "missing":
        del sd[key]
    elif tamper == "unexpected":
        sd["model.layers.1.mixer.extra.weight"] = torch.zeros(3)
    elif tamper == "renamed":
        sd[key.replace("mixer", "mla")] = sd.pop(key)
    else:
        sd[key] = sd[key][:8].clone()
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError) as err:
        load_hylo(tmp_path / "ckpt")
    msg = str(err.value)
    assert str(tmp_path / "ckpt") in msg
    if tamper == "missing":
        assert f"missing: {key}" in msg
    elif tamper == "unexpected":
        assert "unexpected: model.layers.1.mixer.extra.weight" in msg
    elif tamper == "renamed":
        assert key in msg and key.replace("mixer", "mla") in msg
    else:
        assert key in msg and "shape" in msg


def test_gdn_with_fewer_heads_uses_every_query_head():
    """Each GDN head stands for a group of query heads (9 GDN heads for 24 query heads do not keep heads 0-8
    only)."""
    from hylo.upcycle import gdn_head_groups

    assert gdn_head_groups(24, 9) == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15],
                                      [16, 17, 18], [19, 20], [21, 22, 23]]
    assert gdn_head_groups(4, 6) == [[0], [1], [2], [3], [0], [1]]
    base = tiny_llama()
    attn = base.model.layers[0].self_attn
    wq = attn.q_proj.weight.detach().view(4, 16, -1)
    wk = attn.k_proj.weight.detach().view(2, 16, -1)
    wv = attn.v_proj.weight.detach().view(2, 16, -1)
    wo = attn.o_proj.weight.detach().view(64, 4, 16)
    x, y = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    # room for two heads per GDN head: q.k is the sum of the two heads' scores, the output map their sum
    hcfg = hybrid_config_from_base(base.config, mla_layers="none", gdn_num_heads=2, gdn_head_dim=32, gdn_expand_v=2.0)
    w = gdn_weights_from_attention(attn, hcfg)
    q, k = w["q_proj.weight"].view(2, 32, -1), w["k_proj.weight"].view(2, 32, -1)
    v, o = w["v_proj.weight"].view(2, 64, -1), w["o_proj.weight"].view(64, 2, 64)
    for j, heads in enumerate(([0, 1], [2, 3])):
        want = sum((wq[a] @ x) @ (wk[a // 2] @ y) for a in heads)
        assert float((q[j] @ x) @ (k[j] @ y)) == pytest.approx(float(want), rel=1e-12)
        out_map = o[:, j] @ v[j]
        assert rel_err(out_map, sum(wo[:, a] @ wv[a // 2] for a in heads)) < 1e-12
    # no room: projected onto a shared basis; the value rows of one KV head repeat, so that part stays exact
    hcfg = hybrid_config_from_base(base.config, mla_layers="none", gdn_num_heads=2, gdn_head_dim=16)
    w = gdn_weights_from_attention(attn, hcfg)
    v, o = w["v_proj.weight"].view(2, 16, -1), w["o_proj.weight"].view(64, 2, 16)
    for j, heads in enumerate(([0, 1], [2, 3])):
        assert rel_err(o[:, j] @ v[j], sum(wo[:, a] @ wv[a // 2] for a in heads)) < 1e-12
    assert (w["q_proj.weight"].abs().sum(1) > 0).all() and (w["k_proj.weight"].abs().sum(1) > 0).all()


def test_gdn_spare_value_dims_add_nothing_but_can_train():
    base = tiny_llama()
    model = upcycle(base, mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8, gdn_head_dim=16, gdn_expand_v=4.0)
    mixer = model.model.layers[1].mixer
    v = mixer.v_proj.weight.view(4, 64, -1)
    o = mixer.o_proj.weight.view(64, 4, 64)
    # one 16-dim value slot per head holds the base head; the other 48 rows are zero, their o_proj columns not
    assert v[:, 16:].abs().max() == 0 and (o[:, :, 16:].abs().sum(0) > 0).all()
    x = torch.randn(1, 9, 64, dtype=torch.float64)
    with torch.no_grad():
        ref = mixer(x)
        mixer.o_proj.weight.view(64, 4, 64)[:, :, 16:] = 0
        assert torch.equal(mixer(x), ref)


@pytest.mark.slow
def test_converter_modules_import_alone_without_cycles():
    """The converter is one package; the model code never imports it (no converter in a layer file that
    imports the converter back), its modules form no cycle, and its options load without torch."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def name(f: Path) -> str:
        return ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")

    imports: dict[str, set[str]] = {}
    for f in [*(root / "hylo").rglob("*.py"), *(root / "kernels").rglob("*.py")]:
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        imports[name(f)] = found
    converter = sorted(m for m in imports if m.startswith("hylo.upcycle."))
    assert {"hylo.upcycle.mamba2", "hylo.upcycle.gdn", "hylo.upcycle.mla", "hylo.upcycle.model"} <= set(converter)
    users = sorted(m for m, deps in imports.items()
                   if not m.startswith("hylo.upcycle") and any(d.startswith("hylo.upcycle") for d in deps))
    assert users == [], f"model code importing the converter: {users}"
    # no converter module imports the package itself, and their own imports form no cycle
    graph = {m: {d for d in imports[m] if d in imports and d.startswith("hylo.upcycle.")} for m in converter}
    assert not [m for m in converter if "hylo.upcycle" in imports[m]]
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            assert state.get(d) != 1, f"import cycle: {' -> '.join([*path, m, d])}"
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in converter:
        if m not in state:
            visit(m, [])
    # in a fresh interpreter: the whole converter imports, and the options alone leave torch out
    for module, torch_loaded in (("hylo.upcycle.model", "True"), ("hylo.upcycle.options", "False")):
        code = f"import sys, {module}; print('torch' in sys.modules)"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
        assert proc.returncode == 0 and proc.stdout.split()[-1] == torch_loaded, (module, proc.stdout, proc.stderr[-2000:])


def test_convert_options_are_checked_as_given():
    """ConvertConfig is every option of a conversion: values are checked on construction, names against its
    fields, and `hybrid_config_from_base` takes it with overrides."""
    from hylo.upcycle import ConvertConfig, make_options

    # the ranges are the config system's @rules (hylo/rules.py), worded with the option's flag
    with pytest.raises(UpcycleError, match=r"kv_lora_rank \(--kv-lora-rank\) = 0: must be >= 1"):
        ConvertConfig(kv_lora_rank=0)
    with pytest.raises(UpcycleError, match=r"seed \(--seed\) = -1: must be in \[0, 4294967295\]"):
        ConvertConfig(seed=-1)
    with pytest.raises(UpcycleError, match=r"kv_lora_rank \(--kv-lora-rank\) = 1.5: must be an integer"):
        ConvertConfig(kv_lora_rank=1.5)
    with pytest.raises(UpcycleError, match=r"gdn_expand_v \(--gdn-expand-v\) = 'x': must be a number"):
        ConvertConfig(gdn_expand_v="x")
    with pytest.raises(UpcycleError, match=r"init \(--init\) = 'svd': must be one of attention, random"):
        ConvertConfig(init="svd")
    with pytest.raises(UpcycleError, match="mla_layers .* must be a placement name"):
        ConvertConfig(mla_layers=[0, "two"])
    with pytest.raises(UpcycleError, match="unknown conversion option.s. kv_lora_rnak; valid: mla_layers, kv_lora_rank"):
        make_options(kv_lora_rnak=8)
    base = tiny_llama()
    # upcycle() takes the shape options only: the run options belong to convert()
    with pytest.raises(UpcycleError, match="unknown conversion option.s. calibrate"):
        upcycle(base, calibrate=False)
    opts = ConvertConfig(kv_lora_rank=16, gdn_num_heads=2)
    hcfg = hybrid_config_from_base(base.config, opts, mla_layers=3)
    assert hcfg.mla_layers == [3] and hcfg.kv_lora_rank == 16 and hcfg.gdn_num_heads == 2
    assert make_options(opts, seed=4).non_defaults() == {"kv_lora_rank": 16, "gdn_num_heads": 2, "seed": 4}
