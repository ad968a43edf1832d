"""`train.compile`: the student's decoder blocks compiled once, for rows of any document layout.

    compile_blocks(model)            # every HyLoDecoderLayer's forward through torch.compile, in place
    uncompile_blocks(model)          # back to the eager forward

Design choices (docs/cold-start.md, "Compiled blocks"):
* Per block, as torchtitan compiles each transformer block: the norms, projections, rotary, gates, short
  convolutions, activations and the MLP of a block are one or two graphs. The embedding, the final norm,
  the LM head and the losses stay eager. The parameters and the state dict are the model's own (the
  compiled function replaces the layer's `forward`; no `_orig_mod.` prefix in checkpoint keys).
* The kernel calls stay out of the graphs: the GDN / Mamba-2 scans (`chunk_gated_delta_rule`, `chunk_ssd`:
  fla's Triton kernels on a GPU, the chunked torch scans on CPU) and MLA's packed attention
  (`packed_attention`) go through `torch.compiler.disable` (`kernels/backend.kernel_call`), as fla's own
  entry points do. Each is one graph
  break per block; no other break is inside a block (tests/train/test_compile_step.py counts them).
* The boundaries of a packed row are data, not code. Inside a block only tensors are read: the
  positions, and `DocBounds` passed on to the kernels whole. Its host ints sit in a `HostInts` object,
  which torch.compile guards on by type, never by value; the kernels read them outside the graph, from
  a layout made once per row (`kernels/varlen.py`: `row_chunk_layout`, `row_varlen_tensors`). So no
  guard holds a document count or an offset, and rows of any layout reuse the first row's graphs.
  The boundary tensor's length (documents + 1) is marked dynamic here, before each call.
* One compiled function serves every layer. Dynamo tells the layers apart by the mixer's type (one
  cache entry per kind: MLA, GDN, Mamba-2), not by the layer index, so a model of any depth takes at most
  three of dynamo's `recompile_limit` (8) entries per function.
* Under ZeRO-3 each block is a ZeRO-3 leaf module (`deepspeed_cfg.leaf_blocks`, set before the engine
  starts): the block's hooks gather its parameters in its `__call__`, around this compiled `forward`, so
  no DeepSpeed code runs inside a graph. Per-module hooks inside the blocks made dynamo compile DeepSpeed's
  hook code again per module until the recompile limit. ZeRO 0-2 run the blocks as they are.
* A block that would fall back to eager at the recompile limit raises instead
  (`torch._dynamo.config.fail_on_recompile_limit_hit`): a run is never silently slower than it says.
* Eager where the graphs do not fit: a row split by sequence parallelism (a `RowShard`: its exchanges
  are collectives), a generation cache, or boundaries given as a bare tensor (checked on the host first).
  A row whose length changes compiles again once; dynamo then makes the length dynamic.
* `backend`: "inductor" in training; tests use "aot_eager" (AOTAutograd's joint forward-backward graph,
  run without code generation) or "eager" (dynamo's capture only), which see the same graphs and guards.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from hylo.kernels.backend import leave_kernels_out
from hylo.kernels.varlen import DocBounds
from hylo.layers.rope import RotaryEmbedding
from hylo.logs import get_logger
from hylo.modeling import HyLoDecoderLayer
from hylo.pipeline.train.config import COMPILE_MODES

logger = get_logger(__name__)

# the calls a compiled block leaves out of its graph (one graph break each): the kernels
KERNEL_CALLS = ("chunk_gated_delta_rule", "chunk_ssd", "packed_attention")


def _block_forward(compiled: Any) -> Any:
    """A decoder layer's forward through `compiled` (torch.compile of `HyLoDecoderLayer.forward`) where a
    graph fits the call, else the eager forward (see the module docstring)."""

    def forward(self: HyLoDecoderLayer, hidden_BTD: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: Any = None, cache: Any = None, keep_BS: torch.Tensor | None = None,
                shard: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        eager = shard is not None or cache is not None or (cu_seqlens is not None
                                                           and not isinstance(cu_seqlens, DocBounds))
        if eager:
            return HyLoDecoderLayer.forward(self, hidden_BTD, position_ids, cu_seqlens, cache, keep_BS, shard)
        if cu_seqlens is not None:
            # the number of boundaries is data: one graph for 1 to N documents
            torch._dynamo.maybe_mark_dynamic(cu_seqlens.cu_seqlens, 0)
        return compiled(self, hidden_BTD, position_ids, cu_seqlens, cache, keep_BS, shard)

    return forward


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every `HyLoDecoderLayer` inside `model` (a HyLo model, or a stage's wrapper of one) in place;
    returns how many. Idempotent. `backend`: torch.compile's (see the module docstring)."""
    layers = [m for m in model.modules() if isinstance(m, HyLoDecoderLayer)]
    if not layers:
        raise ValueError(f"train.compile: blocks: {type(model).__name__} holds no HyLo decoder layer to compile")
    # a recompile-limit fallback to eager is an error, never a silent slowdown
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # the kernel calls through torch.compiler.disable from now on (kernels/backend.kernel_call)
    leave_kernels_out()
    # per-device caches the blocks read, filled now: a graph that filled one would be guarded on it
    device = next(model.parameters()).device
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m._inv_freq_on(device)
    compiled = torch.compile(HyLoDecoderLayer.forward, backend=backend)
    forward = _block_forward(compiled)
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    logger.info(f"[compile] {len(layers)} decoder blocks compiled (backend {backend}); the kernel calls "
                f"({', '.join(KERNEL_CALLS)}) run between their graphs")
    return len(layers)


def uncompile_blocks(model: nn.Module) -> None:
    """Undo `compile_blocks`: every decoder layer runs its eager forward again."""
    for m in model.modules():
        if isinstance(m, HyLoDecoderLayer) and "forward" in vars(m):
            del m.forward


def apply_compile(model: nn.Module, mode: str, backend: str = "inductor") -> int:
    """`train.compile`'s rule: "off" leaves the model eager (0), "blocks" compiles its decoder blocks."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"train.compile={mode!r} is not valid; allowed: {', '.join(COMPILE_MODES)}")
    return compile_blocks(model, backend) if mode == "blocks" else 0
