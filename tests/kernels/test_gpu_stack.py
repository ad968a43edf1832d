"""The known-bad GPU stack check (kernels/backend.fla_backward_problem / check_fla_backward): fla's gated
backward on Hopper with Triton 3.4.0 up to 3.7.1 (fla #640), seen refused on an H200 with Triton 3.6.0
(docs/gpu-check.md), and the route around it (kernels/backend.install_fla_route: fla's kernel at block width
BK = 32 where fla picks the miscompiled 64). The decision is a pure function of the stack; the check is tested
on CPU with the device's answers replaced; the route's arithmetic under Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hylo.kernels import backend
from hylo.kernels.backend import GpuStackError, check_fla_backward, fla_backward_problem


@pytest.mark.parametrize("vendor,cap,triton,kinds,tilelang,bad", [
    ("nvidia", (9, 0), "3.6.0", {"mla", "gdn"}, False, True),        # the H200 of the GPU check
    ("nvidia", (9, 0), "3.4.0", {"mamba2"}, False, True),            # torch 2.8's Triton, first bad one
    ("nvidia", (9, 0), "3.7.0", {"gdn"}, False, True),               # torch 2.12.0's
    ("nvidia", (9, 0), "3.7.0+git1234abcd", {"gdn"}, False, True),   # a local build of it
    ("nvidia", (9, 0), "3.7.1", {"gdn", "mamba2"}, False, False),    # torch 2.12.1 and 2.13.0's: fixed
    ("nvidia", (9, 0), "3.3.1", {"gdn"}, False, False),              # before the regression
    ("nvidia", (8, 0), "3.6.0", {"gdn"}, False, False),              # A100: not Hopper
    ("nvidia", (10, 0), "3.6.0", {"gdn"}, False, False),             # Blackwell: not Hopper
    ("amd", (9, 4), "3.6.0", {"gdn"}, False, False),                 # MI300X reports 9.4 too
    ("nvidia", (9, 0), "3.6.0", {"mla"}, False, False),              # no fla layer to train
    ("nvidia", (9, 0), "3.6.0", {"gdn"}, True, False),               # fla takes GDN's through TileLang
    ("nvidia", (9, 0), "3.6.0", {"gdn", "mamba2"}, True, True),      # but not Mamba-2's
])
def test_which_stacks_are_refused(vendor, cap, triton, kinds, tilelang, bad):
    problem = fla_backward_problem(vendor, cap, triton, kinds, tilelang)
    assert (problem is not None) == bad, problem
    if bad:
        assert f"Triton {triton}" in problem and "#640" in problem and ">= 3.7.1" in problem
        assert "HYLO_KERNELS=torch" in problem


@pytest.mark.parametrize("kinds,tilelang", [({"gdn", "mamba2"}, False), ({"mamba2"}, True), ({"gdn"}, False)])
def test_no_stack_is_refused_where_the_route_is_installed(kinds, tilelang):
    assert fla_backward_problem("nvidia", (9, 0), "3.6.0", kinds, tilelang) is not None
    assert fla_backward_problem("nvidia", (9, 0), "3.6.0", kinds, tilelang, route=True) is None


@pytest.mark.parametrize("K,tiling,fla_bk,route_bk", [
    (64, 128, 64, 32),     # a 64-wide GDN head or Mamba-2 state on Hopper: the miscompiled width
    (48, 128, 64, 32),     # rounded up to 64 by fla
    (128, 128, 128, 128),  # the recipes' GDN heads (256) and 128 stay at 128, which is right
    (256, 128, 128, 128),
    (32, 128, 32, 32),
    (16, 128, 16, 16),
])
def test_the_route_keeps_block_width_64_out(K, tiling, fla_bk, route_bk):
    assert backend.dqkwg_block_width(K, tiling) == (fla_bk, route_bk)


def test_the_message_names_the_layers_it_is_about():
    assert "every GDN and Mamba-2 layer" in fla_backward_problem("nvidia", (9, 0), "3.6.0", {"gdn", "mamba2"}, False)
    assert "every Mamba-2 layer" in fla_backward_problem("nvidia", (9, 0), "3.6.0", {"mamba2", "mla"}, False)


@pytest.fixture
def hopper(monkeypatch):
    """A CPU torch told it has an H200 with Triton 3.6.0."""
    import triton

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(backend, "fla_available", lambda: True)
    monkeypatch.delenv("HYLO_KERNELS", raising=False)


def test_training_on_a_bad_stack_without_the_route_stops_before_the_first_step(hopper, monkeypatch):
    monkeypatch.setattr(backend, "install_fla_route", lambda: False)
    monkeypatch.setattr(backend, "fla_route_problem", lambda: "FLA_DISABLE_BACKEND_DISPATCH=1 turns it off")
    with pytest.raises(GpuStackError, match=r"Triton 3\.6\.0 on a compute capability 9\.0 GPU, and the route .* "
                                            r"not installed \(FLA_DISABLE_BACKEND_DISPATCH=1 turns it off\)"):
        check_fla_backward(torch.device("cuda", 0), {"gdn"})


def test_training_on_a_bad_stack_goes_through_the_route(hopper, monkeypatch):
    """check_fla_backward installs the route in fla's backend registry; fla's dispatch then hands every
    chunk_bwd_dqkwg call to it on Hopper with such a Triton, and to fla's own wrapper elsewhere."""
    pytest.importorskip("fla")
    import triton
    from fla import backends as fb
    from fla.ops.common import chunk_o

    assert backend.fla_route_problem() is None  # the locked fla 0.6.0 has the registry and the arguments
    check_fla_backward(torch.device("cuda", 0), {"gdn", "mamba2"})
    registered = [b for b in fb._operation_registries["common"]._get_sorted_backends()
                  if b.backend_type == "hylo_hopper_block_width"]
    assert len(registered) == 1
    calls = []
    monkeypatch.setattr(backend, "_route_chunk_bwd_dqkwg", lambda *a, **kw: calls.append(kw) or "route")
    monkeypatch.setattr("fla.utils.IS_NVIDIA_HOPPER", True)
    x = torch.zeros(1, 64, 1, 64)
    args = dict(q=x, k=x, v=x, do=x, h=x, dh=x, g=torch.zeros(1, 64, 1))
    assert chunk_o.chunk_bwd_dqkwg(**args) == "route" and len(calls) == 1
    # off that stack the route declines (fla's own wrapper runs: here it would launch, so only the verdict)
    for hopper_gpu, version in ((False, "3.6.0"), (True, "3.7.1"), (True, "3.3.1")):
        monkeypatch.setattr("fla.utils.IS_NVIDIA_HOPPER", hopper_gpu)
        monkeypatch.setattr(triton, "__version__", version)
        assert registered[0].verify("chunk_bwd_dqkwg", **args)[0] is False, (hopper_gpu, version)


def test_the_route_launches_flas_kernel_at_block_width_32_where_fla_picks_64(monkeypatch):
    """The launch the route makes (fla's kernel is replaced by a recorder): K = 64 on Hopper's tiling gives
    BK = 32, two K blocks in the grid and dg summed over them; the value width stays fla's."""
    pytest.importorskip("fla")
    from fla.ops.common import chunk_o

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(**kw):
                launches.append((grid, kw))
                kw["dg"].fill_(1.0)
            return launch

    monkeypatch.setattr(chunk_o, "chunk_bwd_kernel_dqkwg", Recorder())
    monkeypatch.setattr("fla.utils.check_shared_mem", lambda arch="none", idx=0: True)
    B, T, H, K, V = 1, 128, 2, 64, 128
    q = torch.zeros(B, T, H, K)
    v = torch.zeros(B, T, H, V)
    dq, dk, dw, dg = backend._route_chunk_bwd_dqkwg(q, q, v, v, torch.zeros(B, 2, H, K, V), torch.zeros(B, 2, H, K, V),
                                                    g=torch.zeros(B, T, H), scale=1.0)
    (grid, kw), = launches
    assert kw["BK"] == 32 and kw["BV"] == 128 and kw["K"] == 64 and kw["BT"] == 64
    assert grid == (2 * 2, B * H)  # two K blocks x two chunks
    assert dq.shape == dk.shape == (B, T, H, K) and dw is None
    assert dg.shape == (B, T, H) and torch.all(dg == 2.0)  # the two K blocks' partial dg, summed


ROUTE_INTERPRETED = textwrap.dedent("""
    import json, sys
    from tests.helpers.fla_interpret import install
    install()
    import torch
    from fla import utils
    from fla.ops.common import chunk_o
    from hylo.kernels import backend

    # Hopper's tier on CPU tensors: fla's wrapper takes BK = 64 for K = 64, the route BK = 32
    hopper = lambda arch="none", idx=0: True
    chunk_o.check_shared_mem = utils.check_shared_mem = hopper
    fla_wrapper = __import__("inspect").unwrap(chunk_o.chunk_bwd_dqkwg)
    out = {}
    for name, cu in (("batch", None), ("packed", [0, 40, 128])):
        g = torch.Generator().manual_seed(0)
        B, T, H, K, V, BT = 1, 128, 2, 64, 32, 64
        r = lambda *s: torch.randn(*s, generator=g)
        NT = 3 if cu else 2
        args = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), do=r(B, T, H, V), h=r(B, NT, H, K, V),
                    dh=r(B, NT, H, K, V), w=r(B, T, H, K), g=-torch.rand(B, T, H, generator=g).cumsum(1) * 0.1,
                    dv=r(B, T, H, V), scale=K ** -0.5, chunk_size=BT,
                    cu_seqlens=torch.tensor(cu) if cu else None)
        ref = fla_wrapper(**args)
        mine = backend._route_chunk_bwd_dqkwg(**args)
        out[name] = [float((a - b).norm() / b.norm()) for a, b in zip(mine, ref)]
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_the_routes_block_width_gives_flas_gradients_under_the_interpreter(tmp_path):
    """fla's wrapper at BK = 64 and the route at BK = 32, both interpreted (no miscompile there): dq, dk, dw and
    dg agree to fp32 rounding, on a batch and on a packed row whose documents cross chunk boundaries."""
    pytest.importorskip("fla")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("HYLO_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", ROUTE_INTERPRETED], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(errs) == {"batch", "packed"}
    for name, rel in errs.items():
        assert len(rel) == 4 and all(e < 1e-5 for e in rel), (name, rel)


def test_the_torch_path_cpu_and_attention_only_models_are_let_through(hopper, monkeypatch):
    check_fla_backward(torch.device("cpu"), {"gdn"})
    check_fla_backward(torch.device("cuda", 0), {"mla"})
    monkeypatch.setenv("HYLO_KERNELS", "torch")
    check_fla_backward(torch.device("cuda", 0), {"gdn"})


@pytest.mark.parametrize("variant,linear", [("8mla8gdn", "gdn"), ("4mla12m2", "mamba2")])
def test_the_layer_kinds_are_found_inside_a_wrapper(variant, linear):
    from hylo.modeling import linear_layer_kinds

    from tests.helpers.fla_interpret import tiny_student

    assert linear_layer_kinds(torch.nn.Sequential(tiny_student(variant))) == {linear}
