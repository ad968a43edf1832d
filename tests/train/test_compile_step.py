"""`train.compile: blocks` (pipeline/train/compile.py): the student's decoder blocks compile once for rows of
any document layout, break only at the kernel calls, match the eager step, and never fall back to eager
silently. One compiled model runs 10 rows of 1-6 documents (module fixture); the tests read what it did.

Backend aot_eager: AOTAutograd's joint forward-backward graphs, as inductor gets them, without code generation
(minutes of C++ compiles on this CPU); dynamo's capture, graph breaks and guards are the same for every backend.
bench/compile_step.py measures inductor's graphs (docs/results.md).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hylo.kernels.compile_count import count_dynamo
from hylo.kernels.host_reads import HostReadLog
from hylo.kernels.varlen import DocBounds
from hylo.modeling import HyLoDecoderLayer, HyLoForCausalLM
from hylo.pipeline.train.compile import KERNEL_CALLS, apply_compile, compile_blocks, uncompile_blocks

from tests.helpers.compile import T, rows, tiny

ROWS = 10
# compiled (aot_eager) against eager, fp32: the same ops in another order at most
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5


def step(model: HyLoForCausalLM, ids: torch.Tensor, bounds: DocBounds) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, cu_seqlens=bounds, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def run():
    """Eager and compiled (activation checkpointing on, as the trainer's stage 2) over the same 10 rows."""
    torch._dynamo.reset()
    eager = tiny()
    eager.gradient_checkpointing_enable()
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled, backend="aot_eager") == 2
    gen = torch.Generator().manual_seed(1)
    out = {"losses": [], "grads": [], "docs": []}
    with count_dynamo() as log:
        for i, cu in enumerate(rows(ROWS)):
            bounds = DocBounds.from_host(cu, T)
            ids = torch.randint(0, 64, (1, T), generator=gen)
            (le, ge), (lc, gc) = step(eager, ids, bounds), step(compiled, ids, bounds)
            out["losses"].append((le, lc))
            out["grads"].append((ge, gc))
            out["docs"].append(len(cu) - 1)
            if i == 0:
                log.next_phase()
    out["log"] = log
    yield out
    torch._dynamo.reset()


def test_rows_of_any_layout_reuse_the_first_rows_graphs(run):
    log = run["log"]
    assert sorted(set(run["docs"])) == [1, 2, 3, 4, 5, 6]
    # the first row compiles each kind's block (MLA, GDN); no later row compiles again, whatever its layout
    assert log.graphs[0] > 0
    assert log.graphs_since(1) == 0, f"recompiles after the first row: {log.recompiles}"
    assert log.recompiles == []


def test_the_only_graph_breaks_in_a_block_are_the_kernel_calls(run):
    calls = run["log"].break_calls()
    assert set(calls) <= set(KERNEL_CALLS), f"graph breaks besides the kernel calls: {calls}"
    assert {"packed_attention", "chunk_gated_delta_rule"} <= set(calls)


def test_compiled_loss_and_gradients_equal_eager(run):
    for (le, lc), (ge, gc), docs in zip(run["losses"], run["grads"], run["docs"]):
        assert abs(float(lc - le)) <= LOSS_RTOL * abs(float(le)), (docs, float(le), float(lc))
        for a, b in zip(ge, gc):
            assert float((b - a).norm()) <= GRAD_RTOL * float(a.norm()) + 1e-12, docs


def test_a_recompile_limit_fallback_is_an_error():
    # one cache entry per function: the second mixer kind would have to fall back to eager
    torch._dynamo.reset()
    model = tiny()
    compile_blocks(model, backend="eager")
    bounds = DocBounds.from_host([0, 20, T], T)
    try:
        with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            model(input_ids=torch.zeros(1, T, dtype=torch.long), cu_seqlens=bounds)
    finally:
        torch._dynamo.reset()


def test_the_eager_step_reads_nothing_back_however_many_linear_layers():
    # the chunk layout is made once per row from the host ints (no tensor read), fla's arguments too
    for layers in (2, 6):
        model = tiny(layers, mla=(0,))
        # the row's bounds as the reader makes them: checked on the host, before the step
        bounds, ids = DocBounds.from_host([0, 5, 30, T], T), torch.randint(0, 64, (1, T))
        with HostReadLog() as log:
            step(model, ids, bounds)
        assert log.reads == [], f"{layers} layers: {log.reads}"


def test_train_compile_off_leaves_the_model_eager_and_blocks_is_undone():
    model = tiny()
    assert apply_compile(model, "off") == 0
    assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, HyLoDecoderLayer))
    with pytest.raises(ValueError, match="allowed: off, blocks"):
        apply_compile(model, "fullgraph")
    compile_blocks(model, backend="eager")
    assert all("forward" in vars(m) for m in model.modules() if isinstance(m, HyLoDecoderLayer))
    uncompile_blocks(model)
    assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, HyLoDecoderLayer))
    # the state dict keeps the model's own keys (checkpoints and resumes see no difference)
    assert list(model.state_dict()) == list(tiny().state_dict())


def test_the_config_key_is_checked_with_the_valid_values_listed():
    from hylo.pipeline.train.config import ConfigError, Stage2Config, from_dict

    assert Stage2Config().train.compile == "off"
    with pytest.raises(ConfigError, match="train.compile.*off.*blocks"):
        from_dict(Stage2Config, {"train": {"compile": "all"}})


def test_blocks_loads_with_every_zero_stage():
    # ZeRO-3 runs the compiled blocks as leaf modules (test_compile_zero3.py runs its step)
    from hylo.pipeline.train.config import Stage2Config, from_dict

    for zero in (0, 1, 2, 3):
        cfg = from_dict(Stage2Config, {"train": {"compile": "blocks"}, "deepspeed": {"zero_stage": zero}})
        assert (cfg.train.compile, cfg.deepspeed.zero_stage) == ("blocks", zero)
