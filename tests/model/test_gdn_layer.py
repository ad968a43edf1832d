"""GatedDeltaNet layer: packed rows, cached decoding, cache size, fla weight interchange, bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hylo.config import HybridConfig
from hylo.layers.gdn import GatedDeltaNet, causal_conv_silu

from tests.helpers.common import (
    assert_bad_layer_input_raises,
    assert_bf16_close_to_fp32,
    assert_cached_decode_equals_full,
    assert_close,
    assert_every_parameter_gets_a_gradient,
    bad_layer_input_cases,
    cache_after_prefill_and_step,
    one_thread,  # noqa: F401 (autouse fixture)
    packed_vs_separate,
)

REPO = Path(__file__).resolve().parents[2]
D, H, K, EXPAND_V, CONV = 32, 2, 8, 2.0, 4


def make_config(**over) -> HybridConfig:
    kw = dict(vocab_size=64, hidden_size=D, intermediate_size=64, n_layer=2, mla_layers=[0],
              num_attention_heads=4, num_key_value_heads=2, gdn_num_heads=H, gdn_head_dim=K,
              gdn_expand_v=EXPAND_V, gdn_conv_size=CONV, gdn_chunk_size=16)
    kw.update(over)
    return HybridConfig(**kw)


def make_layer(dtype=torch.float64, seed=0, **over) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(make_config(**over), layer_idx=1).to(dtype)
    # random conv/norm weights so that every tap and the norm weight matter in the checks
    with torch.no_grad():
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            conv.weight.normal_(0, 0.5)
        layer.o_norm.weight.normal_(1, 0.2)
    return layer


def test_conv_matches_torch_conv1d_orientation():
    """The shift-sum conv equals nn.Conv1d with left padding (fla's ShortConvolution convention)."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    w = torch.randn(6, 1, 4, dtype=torch.float64)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w, padding=3, groups=6)[..., :9].transpose(1, 2))
    y, tail = causal_conv_silu(x, w)
    assert_close("conv", ref, y)
    assert torch.equal(tail, x[:, -3:].transpose(1, 2))


@pytest.mark.parametrize("bounds", [[0, 1, 20, 57], [0, 16, 48], [0, 3, 5, 70]],
                         ids=["docs-1-19-37", "docs-16-32", "docs-3-2-65"])
def test_packed_row_equals_documents_one_by_one(bounds):
    x, y_packed, y_sep = packed_vs_separate(make_layer(), bounds)
    # gradients too: nothing leaks across the boundary in the backward pass either
    gy = torch.randn_like(y_packed)
    (dx_packed,) = torch.autograd.grad((y_packed * gy).sum(), x)
    (dx_sep,) = torch.autograd.grad((y_sep * gy).sum(), x)
    assert_close("d hidden", dx_sep, dx_packed)


@pytest.mark.parametrize("prefill", [1, 2, 7], ids=lambda p: f"prefill{p}")
def test_cached_decode_equals_full_forward(prefill):
    assert_cached_decode_equals_full(make_layer(), prefill)


def test_cache_size_is_constant_in_length():
    layer = make_layer(dtype=torch.float32)
    B, V = 2, int(K * EXPAND_V)
    sizes = []
    for T in (5, 60):
        cache = cache_after_prefill_and_step(layer, B, T)
        sizes.append(sum(t.numel() * t.element_size() for t in cache.tensors()))
        assert tuple(cache.state.shape) == (B, H, K, V)
        assert {k: tuple(v.shape) for k, v in cache.conv.items()} == {
            "q": (B, H * K, CONV - 1), "k": (B, H * K, CONV - 1), "v": (B, H * V, CONV - 1)}
    assert sizes[0] == sizes[1] == 4 * B * (H * K * V + (2 * H * K + H * V) * (CONV - 1))


def test_default_init_like_fla_and_reset():
    layer = make_layer(dtype=torch.float32, gdn_num_heads=64)
    A = layer.A_log.exp()
    dt = F.softplus(layer.dt_bias)
    assert ((A > 0) & (A <= 16)).all() and A.std() > 1
    assert ((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all()
    with torch.no_grad():
        layer.A_log.zero_()
        layer.dt_bias.zero_()
    layer.reset_special_parameters()
    assert layer.A_log.std() > 0.1 and ((F.softplus(layer.dt_bias) <= 0.1 + 1e-7).all())
    assert torch.equal(layer.o_norm.weight, torch.ones(int(K * EXPAND_V)))


def test_every_parameter_gets_a_gradient():
    assert_every_parameter_gets_a_gradient(make_layer(dtype=torch.float32))


def test_bf16_close_to_fp32():
    assert_bf16_close_to_fp32(make_layer(dtype=torch.float32))


@pytest.mark.parametrize(("kwargs", "match"), bad_layer_input_cases(D))
def test_bad_input_raises_clear_error(kwargs, match):
    assert_bad_layer_input_raises(make_layer(dtype=torch.float32), kwargs, match)


# ------------------------------------------------------------------ interchange with fla's layer

FLA_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.nn.functional as F
    import triton.runtime.autotuner as autotuner
    # the Triton interpreter has no GPU driver to benchmark autotune configs with: take any config
    autotuner.Autotuner._bench = lambda self, *a, config=None, **k: [0.0, 0.0, 0.0]
    from safetensors.torch import load_file, save_file
    import fla.layers.gated_deltanet as fla_gdn
    from hylo.kernels.gdn import naive_recurrent_gated_delta_rule

    def recurrence(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                   use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                   use_gate_in_kernel=False, A_log=None, dt_bias=None, **unused):
        # fla's chunk kernels do not run on CPU: its documented in-kernel gate/beta, then the reference
        if use_gate_in_kernel:
            g = -A_log.float().exp() * F.softplus(g.float() + dt_bias.float())
        if use_beta_sigmoid_in_kernel:
            beta = beta.float().sigmoid() * (2.0 if allow_neg_eigval else 1.0)
        return naive_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    fla_gdn.chunk_gated_delta_rule = recurrence
    fla_gdn.fused_recurrent_gated_delta_rule = recurrence
    args = json.loads(sys.argv[1])
    torch.manual_seed(0)
    layer = fla_gdn.GatedDeltaNet(hidden_size=args["D"], expand_v=args["expand_v"], head_dim=args["K"],
                                  num_heads=args["H"], conv_size=args["conv"], norm_eps=args["eps"],
                                  layer_idx=1).eval()
    with torch.no_grad():
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            conv.weight.normal_(0, 0.5)
        layer.o_norm.weight.normal_(1, 0.2)
    save_file({k: v.contiguous() for k, v in layer.state_dict().items()}, args["out"] + "/fla_state.safetensors")
    inp = load_file(args["out"] + "/inputs.safetensors")
    out = {}
    with torch.no_grad():
        out["fla_plain"] = layer(inp["x"])[0]
        out["fla_packed"] = layer(inp["x_packed"], cu_seqlens=inp["cu"].long())[0]
        layer.load_state_dict(load_file(args["out"] + "/ours_state.safetensors"), strict=True)
        out["fla_with_ours"] = layer(inp["x"])[0]
    save_file(out, args["out"] + "/fla_out.safetensors")
    """
)


@pytest.fixture(scope="module")
def fla_run(tmp_path_factory):
    """Run fla's real GatedDeltaNet once, in a subprocess with TRITON_INTERPRET=1 (its short conv
    and gated norm kernels run interpreted on CPU; the recurrence is swapped for the reference)."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed (dev extra)")
    out = tmp_path_factory.mktemp("fla")
    torch.manual_seed(1)
    ours = make_layer(dtype=torch.float32, seed=1)
    save_file(ours.state_dict(), str(out / "ours_state.safetensors"))
    inputs = {"x": torch.randn(2, 11, D), "x_packed": torch.randn(1, 30, D),
              "cu": torch.tensor([0, 7, 8, 30], dtype=torch.int32)}
    save_file(inputs, str(out / "inputs.safetensors"))
    args = dict(D=D, H=H, K=K, expand_v=EXPAND_V, conv=CONV, eps=make_config().rms_norm_eps, out=str(out))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", FLA_SCRIPT, json.dumps(args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"fla subprocess failed:\n{proc.stderr[-4000:]}"
    return ours, inputs, load_file(str(out / "fla_state.safetensors")), load_file(str(out / "fla_out.safetensors"))


@pytest.mark.slow
def test_state_dict_keys_and_shapes_match_fla(fla_run):
    ours, _, fla_state, _ = fla_run
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    fla_shapes = {k: tuple(v.shape) for k, v in fla_state.items()}
    assert ours_shapes == fla_shapes
    assert set(ours_shapes) == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "a_proj.weight", "b_proj.weight", "A_log",
        "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "g_proj.weight",
        "o_norm.weight", "o_proj.weight"}


@pytest.mark.slow
def test_fla_weights_give_fla_outputs(fla_run):
    _, inputs, fla_state, fla_out = fla_run
    layer = GatedDeltaNet(make_config(), layer_idx=1)
    layer.load_state_dict(fla_state, strict=True)
    with torch.no_grad():
        assert_close("plain batch", fla_out["fla_plain"], layer(inputs["x"]), 1e-5)
        assert_close("packed row", fla_out["fla_packed"], layer(inputs["x_packed"], cu_seqlens=inputs["cu"]), 1e-5)


@pytest.mark.slow
def test_our_weights_load_into_fla(fla_run):
    ours, inputs, _, fla_out = fla_run
    with torch.no_grad():
        assert_close("fla layer with our weights", fla_out["fla_with_ours"], ours(inputs["x"]), 1e-5)
