"""The known-bad GPU stack check (kernels/backend.fla_backward_problem / check_fla_backward): fla's gated
backward on Hopper with Triton 3.4.0 up to 3.7.1 (fla #640), seen refused on an H200 with Triton 3.6.0
(docs/gpu-check.md). The decision is a pure function of the stack; the check is tested on CPU with the
device's answers replaced."""

from __future__ import annotations

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


def test_training_on_a_bad_stack_stops_before_the_first_step(hopper):
    with pytest.raises(GpuStackError, match=r"Triton 3\.6\.0 on a compute capability 9\.0 GPU"):
        check_fla_backward(torch.device("cuda", 0), {"gdn"})


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
