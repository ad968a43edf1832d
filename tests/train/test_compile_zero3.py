"""`train.compile: blocks` under DeepSpeed ZeRO-3 (world size 1, gloo, DeepSpeed's CPU accelerator).

Two real DeepSpeed engines, built by the trainer's `init_engine` from the same stage config but for
`train.compile`, train the same tiny HyLo (an MLA and a GDN block, activation checkpointing on as in the
recipes) over the same 6 rows of 1 to 6 documents, one optimiser step a row. The compiled one makes each
decoder block a ZeRO-3 leaf module (`deepspeed_cfg.leaf_blocks`): ZeRO-3 gathers a block's parameters
around its compiled forward, never inside it. Without that, ZeRO-3's per-module hooks run inside the
graphs and dynamo hits its recompile limit on the first row (docs/cold-start.md#compiled-blocks).

Backend aot_eager, as in test_compile_step.py: the same capture, breaks and guards as inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hylo.kernels.compile_count import count_dynamo
from hylo.kernels.varlen import DocBounds
from hylo.modeling import HyLoDecoderLayer
from hylo.pipeline.train.compile import KERNEL_CALLS, apply_compile
from hylo.pipeline.train.config import Stage2Config, from_dict
from hylo.pipeline.train.deepspeed_cfg import import_deepspeed, init_engine

from tests.helpers import train as train_helpers
from tests.helpers.common import one_thread  # noqa: F401  (one_thread: autouse)
from tests.helpers.compile import T, rows, tiny

pytestmark = pytest.mark.slow  # starts DeepSpeed

ROWS = 6
# compiled (aot_eager) against eager, fp32, after up to 5 AdamW steps: the same ops in another order at most
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4

gloo = train_helpers.gloo


def engine(model: torch.nn.Module, compile_mode: str):
    cfg = from_dict(Stage2Config, {"train": {"compile": compile_mode, "global_batch_sequences": 1},
                                   "deepspeed": {"zero_stage": 3}, "ray": {"num_workers": 1},
                                   "optim": {"lr": 1e-3}})
    eng = init_engine(model, list(model.parameters()), cfg, 1, torch.float32, lambda step: 1.0)
    # the trainer's order (loop.py): the engine first, then the blocks compiled
    apply_compile(eng.module, compile_mode, backend="aot_eager")
    return eng


def step(eng, ids: torch.Tensor, bounds: DocBounds) -> tuple[float, list[torch.Tensor]]:
    """One ZeRO-3 step: (loss, every parameter's full gradient before the optimiser step)."""
    from deepspeed.utils import safe_get_full_grad

    loss = eng(input_ids=ids, cu_seqlens=bounds, labels=ids).loss
    eng.backward(loss)
    grads = [safe_get_full_grad(p).clone() for p in eng.module.parameters()]
    eng.step()
    return float(loss.detach()), grads


@pytest.fixture(scope="module")
def run(gloo):
    import_deepspeed()
    torch._dynamo.reset()
    model = tiny()
    model.gradient_checkpointing_enable()
    eager, compiled = engine(copy.deepcopy(model), "off"), engine(model, "blocks")
    gen = torch.Generator().manual_seed(1)
    out = {"steps": [], "docs": [], "eager": eager, "compiled": compiled}
    with count_dynamo() as log:
        for i, cu in enumerate(rows(ROWS)):
            bounds = DocBounds.from_host(cu, T)
            ids = torch.randint(0, 64, (1, T), generator=gen)
            out["steps"].append((step(eager, ids, bounds), step(compiled, ids, bounds)))
            out["docs"].append(len(cu) - 1)
            if i == 0:
                log.next_phase()
    out["log"] = log
    yield out
    for eng in eager, compiled:
        eng.destroy()
    torch._dynamo.reset()


def test_zero3_blocks_are_leaf_modules_only_when_compiled(run):
    from deepspeed.utils import z3_leaf_module

    blocks = [m for m in run["compiled"].module.modules() if isinstance(m, HyLoDecoderLayer)]
    assert len(blocks) == 2 and all(z3_leaf_module(m) for m in blocks)
    assert all("forward" in vars(m) for m in blocks)
    # the eager engine keeps ZeRO-3's per-module hooks
    assert not any(z3_leaf_module(m) for m in run["eager"].module.modules())


def test_zero3_rows_of_any_layout_reuse_the_first_rows_graphs(run):
    log = run["log"]
    assert sorted(run["docs"]) == [1, 2, 3, 4, 5, 6]
    assert log.graphs[0] > 0
    assert log.graphs_since(1) == 0, f"recompiles after the first row: {log.recompiles}"
    assert log.recompiles == []
    # no DeepSpeed code inside a block: the only breaks are the kernel calls
    calls = log.break_calls()
    assert set(calls) <= set(KERNEL_CALLS), f"graph breaks besides the kernel calls: {calls}"


def test_zero3_compiled_loss_and_gradients_equal_eager_zero3(run):
    for ((le, ge), (lc, gc)), docs in zip(run["steps"], run["docs"]):
        assert abs(lc - le) <= LOSS_RTOL * abs(le), (docs, le, lc)
        assert len(ge) == len(gc)
        for a, b in zip(ge, gc):
            assert float(a.norm()) > 0, docs
            assert float((b - a).norm()) <= GRAD_RTOL * float(a.norm()), docs
