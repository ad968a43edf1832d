"""Helpers shared by the linear-recurrence tests: the GDN and SSD kernels (kernels/test_gdn_kernel.py,
model/test_mamba2.py) and the GDN and Mamba-2 mixers (model/test_gdn_layer.py, model/test_mamba2.py); the
check of a teacher's top-k records against reference log-probabilities (the teacher tests); a clean source
copy of the checkout.

Test modules import it as `from tests.helpers.common import ...`; importing `one_thread` makes it autouse in
that module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hylo.cache import LinearLayerCache


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny shapes: intra-op threads only add barrier waits (x10-x30 slower on a loaded 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float = 1e-10) -> None:
    """Relative RMS error check: rms(ref - got) / rms(ref) <= ratio, and no NaN/inf in `got`."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    ref, got = ref.detach().double(), got.detach().double()
    err = (ref - got).pow(2).mean().sqrt()
    base = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    assert err / base <= ratio, f"{name}: relative rms error {float(err / base):.3e} > {ratio:.1e}"


# ------------------------------------------------------------------ kernels: values and gradients

Run = tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]


def forward_backward(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    inputs: Sequence[torch.Tensor | None],
    h0: torch.Tensor | None,
    seed: int = 1,
    **kw: Any,
) -> Run:
    """`fn(*inputs, initial_state=h0, output_final_state=True, **kw)`, then the backward of a random
    projection of (output, final_state); returns (output, final_state, grads of the non-None inputs and h0)."""
    out, ht = fn(*inputs, initial_state=h0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    loss = loss + (ht * torch.randn(ht.shape, generator=gen, dtype=ht.dtype)).sum()
    leaves = [t for t in (*inputs, h0) if t is not None]
    return out, ht, torch.autograd.grad(loss, leaves)


def compare_runs(ref: Run, got: Run, out_name: str, grad_names: Sequence[str], ratio: float = 1e-10) -> None:
    """Two `forward_backward` results agree: output, final state and every gradient."""
    assert_close(out_name, ref[0], got[0], ratio)
    assert_close("final_state", ref[1], got[1], ratio)
    assert len(ref[2]) == len(got[2])
    for name, a, b in zip(grad_names, ref[2], got[2]):
        assert_close(name, a, b, ratio)


def bad_cu_seqlens_cases() -> list[Any]:
    """(cu_seqlens for T = 10, the error it must raise) for `test_bad_cu_seqlens`."""
    return [
        pytest.param([0, 5, 9], r"end at T=10", id="short-end"),
        pytest.param([1, 5, 10], r"start at 0", id="nonzero-start"),
        pytest.param([0, 6, 4, 10], r"strictly increasing", id="decreasing"),
        pytest.param([0, 5, 5, 10], r"strictly increasing .*document 1 spans \[5, 5\)", id="empty-document"),
        pytest.param([0.0, 10.0], r"integer tensor", id="float"),
    ]


# ------------------------------------------------------------------ mixers (GatedDeltaNet, Mamba2Mixer)


def fake_fla_gdn(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Our GDN call site sends CPU tensors to a stand-in for fla's `chunk_gated_delta_rule` that records the
    keyword arguments of each call (returned list) and returns zeros: what the call site passes fla."""
    import sys
    import types

    import hylo.kernels.gdn.chunk as gdn_chunk

    calls: list[dict[str, Any]] = []

    def fake_fla(q, k, v, g, beta, **kw):
        calls.append(kw)
        return v * 0, None

    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = fake_fla  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    monkeypatch.setattr(gdn_chunk, "use_fla", lambda x: True)
    return calls


def packed_vs_separate(layer: nn.Module, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed row of documents `bounds` (float64) through `layer`, and each document on its own:
    asserts the outputs agree; returns (x, y_packed, y_separate) for gradient checks."""
    T = bounds[-1]
    x = torch.randn(1, T, layer.hidden_size, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor(bounds, dtype=torch.int32)
    y_packed = layer(x, cu_seqlens=cu)
    y_sep = torch.cat([layer(x[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:])], 1)
    assert_close("packed vs one-by-one", y_sep, y_packed)
    return x, y_packed, y_sep


LINEAR_OPS = ("chunk_gated_delta_rule", "chunk_ssd", "recurrent_gated_delta_rule", "recurrent_ssd")


def assert_cached_decode_equals_full(layer: nn.Module, prefill: int) -> None:
    """A prefill of `prefill` tokens, then single-token steps with a cache, equals the full forward; every
    single-token step goes through the layer's recurrent op (`recurrent_*`), never a chunk op at T = 1."""
    import sys

    B, T = 2, 20
    x = torch.randn(B, T, layer.hidden_size, dtype=torch.float64)
    mod = sys.modules[type(layer).__module__]
    calls: list[tuple[str, int]] = []
    saved = {name: getattr(mod, name) for name in LINEAR_OPS if hasattr(mod, name)}
    for name, fn in saved.items():
        def recorded(first: torch.Tensor, *args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            calls.append((_name, first.shape[1]))
            return _fn(first, *args, **kwargs)

        setattr(mod, name, recorded)
    try:
        with torch.no_grad():
            y_full = layer(x)
            cache = LinearLayerCache()
            outs = [layer(x[:, :prefill], cache=cache)]
            for t in range(prefill, T):
                outs.append(layer(x[:, t : t + 1], cache=cache))
    finally:
        for name, fn in saved.items():
            setattr(mod, name, fn)
    assert cache.seen == T
    assert_close("decode vs full", y_full, torch.cat(outs, 1))
    single = [name for name, n in calls[1:] if n == 1]
    assert len(single) == T - prefill + (prefill == 1), calls
    assert all(name.startswith("recurrent_") for name in single), f"single-token steps took {calls}"


def cache_after_prefill_and_step(layer: nn.Module, B: int, T: int) -> LinearLayerCache:
    """Prefill T tokens, then one step: the cache tensors keep their shapes; returns the cache."""
    cache = LinearLayerCache()
    with torch.no_grad():
        layer(torch.randn(B, T, layer.hidden_size), cache=cache)
        after_prefill = [tuple(t.shape) for t in cache.tensors()]
        layer(torch.randn(B, 1, layer.hidden_size), cache=cache)
    assert [tuple(t.shape) for t in cache.tensors()] == after_prefill
    return cache


def assert_every_parameter_gets_a_gradient(layer: nn.Module) -> None:
    x = torch.randn(1, 40, layer.hidden_size)
    layer(x, cu_seqlens=torch.tensor([0, 25, 40], dtype=torch.int32)).pow(2).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


def assert_bf16_close_to_fp32(layer: nn.Module) -> None:
    """An fp32 layer's output, and the same layer cast to bf16, agree to bf16 precision."""
    x = torch.randn(1, 50, layer.hidden_size)
    with torch.no_grad():
        y32 = layer(x)
        y16 = layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    assert_close("bf16", y32, y16, 5e-2)


def bad_layer_input_cases(hidden: int) -> list[Any]:
    """(forward arguments incl. `x`, the error it must raise) for a mixer of hidden size `hidden`."""
    return [
        pytest.param(dict(x=torch.randn(1, 5, hidden + 1)), rf"hidden_states must be \[B, T, {hidden}\]",
                     id="wrong-hidden"),
        pytest.param(dict(x=torch.randn(2, 5, hidden), cu_seqlens=torch.tensor([0, 2, 5])), r"need B == 1",
                     id="packed-batch2"),
        pytest.param(dict(x=torch.randn(1, 5, hidden), cu_seqlens=torch.tensor([0, 5]), cache=LinearLayerCache()),
                     r"cache works on unpacked batches", id="cache-with-packed"),
        pytest.param(dict(x=torch.randn(1, 5, hidden), cu_seqlens=torch.tensor([0, 2, 4])), r"end at T=5",
                     id="cu-not-ending-at-T"),
    ]


def assert_bad_layer_input_raises(layer: nn.Module, kwargs: dict[str, Any], match: str) -> None:
    kwargs = dict(kwargs)
    x = kwargs.pop("x")
    with pytest.raises(ValueError, match=match):
        layer(x, **kwargs)


_TOPK_RTOL = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 1e-5}


def assert_topk_matches(ref_logprobs_TV: torch.Tensor, got: Any, k: int, dtype: str) -> None:
    """A top-k record (logprobs, indices, tail_logmass) agrees with reference log-probabilities [T, V].

    Two different computations (a batch vs one row, a pool vs in-process) differ in the last bits with
    the batch shape and the CPU, so this is a tolerance check, never torch.equal. Per token: every stored
    (index, logprob) pair equals the reference log-probability of that index; the stored values are
    sorted and are a top-k up to ties within the tolerance (near-ties may swap order or membership); the
    tail mass agrees as a probability, so -inf (the top-k hold all the mass, e.g. k = V) and a tiny
    finite tail match.
    """
    ref_TV = ref_logprobs_TV.float()
    lp, idx = got.logprobs.float(), got.indices.long()
    assert lp.shape == idx.shape == (ref_TV.shape[0], k)
    rtol = _TOPK_RTOL[dtype]
    at_idx = ref_TV.gather(1, idx)
    torch.testing.assert_close(lp, at_idx, rtol=rtol, atol=1e-3)
    assert (lp[:, :-1] >= lp[:, 1:]).all(), "stored top-k are not sorted"
    assert all(len(set(r)) == k for r in idx.tolist()), "an index is stored twice in one token"
    kth = ref_TV.topk(k, dim=-1).values[:, -1]
    assert (at_idx[:, -1] >= kth - (rtol * kth.abs() + 1e-3)).all(), "a stored index is not in the top-k"
    ref_tail = (1.0 - ref_TV.topk(k, dim=-1).values.exp().sum(-1)).clamp_min(0.0)
    torch.testing.assert_close(got.tail_logmass.exp(), ref_tail, rtol=0.0, atol=1e-3)


def source_copy(repo: Path, dst: Path) -> Path:
    """The tracked files of checkout `repo` (what `pip install .` of a clone sees, without runs or caches) in
    `dst`; tracked symlinks (hylo/pipeline -> ../pipeline, ...: the folder mapping) stay links."""
    files = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (repo / f).is_symlink():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            (dst / f).symlink_to(os.readlink(repo / f))
        elif (repo / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / f, dst / f)
    return dst
