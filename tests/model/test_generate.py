"""Generation: transformers' GenerationMixin over the hybrid cache, every standard option, padded batches.

An all-MLA conversion at full rank with every RoPE pair kept reproduces the base attention exactly (see
test_upcycle.py), so each generation option must give the base LlamaForCausalLM's tokens; both run in
float64 so that no near-tie flips an argmax. The same holds for a Qwen3 base, whose per-head q/k norms the
MLA layers keep (`mla_qk_norm`: the decode path then attends with cached key 1/RMS values). Hybrids with GDN or Mamba-2 layers have no reference model:
there a left-padded batch must give each prompt's tokens alone, and generation with the cache must give
what generation without it (a full forward per step) gives.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from hylo.cache import HyLoCache
from hylo.upcycle import upcycle

from tests.helpers.common import one_thread  # noqa: F401  (autouse: one intra-op thread)

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    # a large init makes the random model's greedy continuations varied instead of one repeated token
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=256,
                      initializer_range=0.4, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS,
                      pad_token_id=PAD)
    return LlamaForCausalLM(cfg).double().eval()


@pytest.fixture(scope="module")
def mla(base):
    """All MLA, full rank, every RoPE pair kept: the base attention exactly."""
    model = upcycle(base, mla_layers="all", kv_lora_rank=32, qk_rope_head_dim=32, rope_key_groups=2).eval()
    assert model.config.qk_nope_head_dim == 0
    return model


@pytest.fixture(scope="module")
def qwen3_pair() -> tuple[Qwen3ForCausalLM, torch.nn.Module]:
    """A random Qwen3 (non-trivial q/k norm weights) and its all-MLA full-rank conversion."""
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=256,
                      initializer_range=0.4, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS,
                      pad_token_id=PAD)
    base = Qwen3ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model = upcycle(base, mla_layers="all", kv_lora_rank=32, qk_rope_head_dim=32, rope_key_groups=2).eval()
    assert model.config.mla_qk_norm and model.config.qk_nope_head_dim == 0
    return base, model


@pytest.fixture(scope="module", params=["gdn", "mamba2"])
def hybrid(request, base):
    return upcycle(base, mla_layers=[0], kv_lora_rank=16, qk_rope_head_dim=8, linear_type=request.param).eval()


def prompts(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (1, length), generator=g) for length in (9, 5, 7)[:n]]


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1]:] = r[0]
        mask[i, width - r.shape[1]:] = 1
    return ids, mask


def gen(model, ids, seed: int | None = None, **kw) -> torch.Tensor:
    if seed is not None:
        torch.manual_seed(seed)
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("do_sample", False)
    return model.generate(ids, **kw)


class StopAt(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value) -> None:
        self.chunks.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


# ------------------------------------------------------------------ every option equals the base model
def options_for(base, ids) -> dict[str, dict]:
    greedy = gen(base, ids)[0, ids.shape[1]:].tolist()
    return {
        "greedy": {},
        "beams": {"num_beams": 3},
        "beams-return-2": {"num_beams": 3, "num_return_sequences": 2},
        "repetition_penalty": {"repetition_penalty": 3.0},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 1},
        "bad_words_ids": {"bad_words_ids": [[greedy[0]], [greedy[2]]]},
        # EOS = the first greedy token: without min_new_tokens generation would stop at once
        "min_new_tokens": {"eos_token_id": greedy[0], "min_new_tokens": 5},
        "eos": {"eos_token_id": greedy[3]},
        "stopping_criteria": {"stopping_criteria": StoppingCriteriaList([StopAt(greedy[2])])},
        "top_k_sampling": {"do_sample": True, "top_k": 4, "temperature": 0.7, "seed": 5},
        "top_p_sampling": {"do_sample": True, "top_p": 0.8, "seed": 6},
        "generation_config": {"generation_config": GenerationConfig(max_new_tokens=6, num_beams=2, do_sample=False,
                                                                    length_penalty=0.0, bos_token_id=BOS,
                                                                    eos_token_id=EOS, pad_token_id=PAD)},
    }


OPTION_NAMES = ["greedy", "beams", "beams-return-2", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
                "min_new_tokens", "eos", "stopping_criteria", "top_k_sampling", "top_p_sampling", "generation_config"]


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_generation_option_gives_the_base_models_tokens(base, mla, name):
    ids = prompts(1)[0]
    kw = dict(options_for(base, ids)[name])
    seed = kw.pop("seed", None)
    if "generation_config" in kw:
        want = base.generate(ids, **kw)
        got = mla.generate(ids, **kw)
    else:
        want = gen(base, ids, seed, **kw)
        got = gen(mla, ids, seed, **kw)
    assert torch.equal(got, want), f"{name}: {got.tolist()} != base {want.tolist()}"
    if name not in ("greedy", "top_k_sampling", "top_p_sampling"):
        # the option changes the base's output, so a model that ignored it would fail above
        plain = gen(base, ids)
        assert want.shape != plain.shape or not torch.equal(want, plain), f"{name} has no effect on this prompt"


def test_streamer_receives_the_generated_tokens(base, mla):
    ids = prompts(1)[0]
    streamer = Collect()
    out = gen(mla, ids, streamer=streamer)
    assert streamer.ended and streamer.chunks[0] == ids[0].tolist()
    assert [t for c in streamer.chunks[1:] for t in c] == out[0, ids.shape[1]:].tolist()
    assert torch.equal(out, gen(base, ids))


@pytest.mark.parametrize("kw", [{}, {"num_beams": 2}, {"repetition_penalty": 2.0}], ids=["greedy", "beams", "rep"])
def test_left_padded_batch_gives_the_base_models_tokens(base, mla, kw):
    ids, mask = left_padded(prompts())
    got = gen(mla, ids, attention_mask=mask, **kw)
    assert torch.equal(got, gen(base, ids, attention_mask=mask, **kw))


@pytest.mark.parametrize("name", ["greedy", "beams", "repetition_penalty", "top_k_sampling"])
def test_qk_norm_generation_gives_the_qwen3_base_tokens(qwen3_pair, name):
    base, mla = qwen3_pair
    ids = prompts(1)[0]
    kw = dict(options_for(base, ids)[name])
    seed = kw.pop("seed", None)
    want, got = gen(base, ids, seed, **kw), gen(mla, ids, seed, **kw)
    assert torch.equal(got, want), f"{name}: {got.tolist()} != base {want.tolist()}"


@pytest.mark.parametrize("kw", [{}, {"num_beams": 2}], ids=["greedy", "beams"])
def test_qk_norm_left_padded_batch_gives_the_qwen3_base_tokens(qwen3_pair, kw):
    base, mla = qwen3_pair
    ids, mask = left_padded(prompts())
    assert torch.equal(gen(mla, ids, attention_mask=mask, **kw), gen(base, ids, attention_mask=mask, **kw))


# ------------------------------------------------------------------ hybrids with linear layers
@pytest.mark.parametrize("kw", [{}, {"num_beams": 2}, {"no_repeat_ngram_size": 2}], ids=["greedy", "beams", "ngram"])
def test_left_padded_batch_equals_each_prompt_alone(hybrid, kw):
    rows = prompts()
    ids, mask = left_padded(rows)
    batch = gen(hybrid, ids, attention_mask=mask, **kw)
    for i, r in enumerate(rows):
        alone = gen(hybrid, r, **kw)[0, r.shape[1]:]
        new = batch[i, ids.shape[1]:]
        assert new[:alone.numel()].tolist() == alone.tolist(), f"row {i}"


@pytest.mark.parametrize("kw", [{}, {"num_beams": 3}, {"repetition_penalty": 2.0, "no_repeat_ngram_size": 2}],
                         ids=["greedy", "beams", "penalties"])
def test_cached_generation_equals_uncached(hybrid, kw):
    ids, mask = left_padded(prompts())
    cached = gen(hybrid, ids, attention_mask=mask, **kw)
    uncached = gen(hybrid, ids, attention_mask=mask, use_cache=False, **kw)
    assert torch.equal(cached, uncached)


def test_options_take_effect_on_a_hybrid(hybrid):
    ids = prompts(1)[0]
    greedy = gen(hybrid, ids, max_new_tokens=10)[0, ids.shape[1]:].tolist()
    banned = [[greedy[0]], [greedy[1]]]
    out = gen(hybrid, ids, max_new_tokens=10, bad_words_ids=banned)[0, ids.shape[1]:].tolist()
    assert greedy[0] not in out and greedy[1] not in out
    out = gen(hybrid, ids, max_new_tokens=10, no_repeat_ngram_size=1)[0].tolist()
    assert len(set(out)) == len(out)
    out = gen(hybrid, ids, eos_token_id=greedy[0], min_new_tokens=4)[0, ids.shape[1]:].tolist()
    assert len(out) >= 4 and greedy[0] not in out[:4]
    out = gen(hybrid, ids, max_new_tokens=10, stopping_criteria=StoppingCriteriaList([StopAt(greedy[3])]))
    assert out.shape[1] == ids.shape[1] + 4
    beams = gen(hybrid, ids, num_beams=3, num_return_sequences=3)
    assert beams.shape[0] == 3 and len({tuple(b.tolist()) for b in beams}) == 3
    torch.manual_seed(0)
    sampled = hybrid.generate(ids, do_sample=True, top_k=3, max_new_tokens=6, num_return_sequences=4)
    assert sampled.shape == (4, ids.shape[1] + 6)


def test_padded_forward_matches_each_row_alone(hybrid):
    rows = prompts()
    ids, mask = left_padded(rows)
    with torch.no_grad():
        logits = hybrid(ids, attention_mask=mask).logits
        for i, r in enumerate(rows):
            alone = hybrid(r).logits[0]
            torch.testing.assert_close(logits[i, -r.shape[1]:], alone, rtol=1e-9, atol=1e-9)
    # right padding too: pads after the prompt change nothing before them
    right = torch.full_like(ids, PAD)
    rmask = torch.zeros_like(mask)
    for i, r in enumerate(rows):
        right[i, :r.shape[1]], rmask[i, :r.shape[1]] = r[0], 1
    with torch.no_grad():
        logits = hybrid(right, attention_mask=rmask).logits
        for i, r in enumerate(rows):
            torch.testing.assert_close(logits[i, :r.shape[1]], hybrid(r).logits[0], rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------ the cache object and errors
def test_generate_uses_the_hybrid_cache_sized_once(hybrid):
    ids = prompts(1)[0]
    out = hybrid.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert isinstance(cache, HyLoCache) and cache.get_seq_length() == ids.shape[1] + 4
    mla_layer = cache.layers[0]
    assert mla_layer.capacity == mla_layer.seq_len == ids.shape[1] + 4
    seq, cache2 = hybrid.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, return_cache=True)
    assert torch.equal(seq, out.sequences) and isinstance(cache2, HyLoCache)


def test_unsupported_cache_requests_are_refused(hybrid):
    from transformers import DynamicCache

    ids = prompts(1)[0]
    with pytest.raises(ValueError, match="cache_implementation='static' is not supported"):
        hybrid.generate(ids, max_new_tokens=2, cache_implementation="static")
    with pytest.raises(TypeError, match="HyLoCache"):
        hybrid.generate(ids, max_new_tokens=2, cache=DynamicCache())
    with pytest.raises(ValueError, match="not used by the model"):
        hybrid.generate(ids, max_new_tokens=2, num_beam=2)
