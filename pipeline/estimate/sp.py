"""Sequence parallelism in the step estimate (`hylo estimate --sequence-parallel N`): one packed row of T tokens
split by tokens over the N ranks of a group, each rank holding T / N of them.

Legend: T tokens of the row, N ranks of the sequence-parallel group, Tq = T / N the rank's tokens, E = T - Tq the
earlier keys the LAST rank attends to when one document fills the row (the worst rank and the worst row), W
training workers (the ZeRO-3 world: ZeRO-3 shards over all W ranks whatever N), b the step dtype's bytes, H / G
MLA query heads / kv_b_proj heads, Nn / Pr / Vd the nope / rope / value head dims, R the latent rank, P = Pr the
shared roped key (R + P values per token: what MLA's latent gather sends), Hl / K / V the GDN heads and key /
value dims, (Hm, Pm, Nm, Gm) Mamba-2's heads, head dim, state size, groups, C conv channels, w conv_size - 1.

`hylo estimate --sequence-parallel N` runs the SPLIT STEP itself: `step.estimate_step(...,
sequence_parallel=N)`, the stage's own `train_step` at `train.sequence_parallel = N` as the last rank of a row
that is one document, in `split_rank` (torch's fake process group, SDPA as a fused kernel holds memory); then
`estimate_sp(..., split=True)` adds nothing but the communication count. What follows is the cheaper model the
length sweeps use (bench/sp_tables.py) and the fallback where this process already has a process group.

Per GPU at N, as `estimate_sp` computes it without `split`:
* the rank's own step: `step.estimate_step` at Tq tokens (the recipe's packed documents), measured on fake
  tensors as for N = 1: parameters, gradients and optimizer states under ZeRO-3 over W, the activations of
  Tq tokens, the loss, the teacher's targets for Tq tokens (Serve pool / cache: each shard's range).
* plus what splitting adds:
  - MLA, the last rank of a row that is one document, MEASURED (`measure_mla_extra`): one decoder layer of the
    recipe split as `hylo/seq_parallel.py` splits it (the group's latent + k_pe gathered, the E earlier keys
    decompressed, the rank's queries attending to them), forward and backward on fake tensors with the
    collectives on torch's fake process group, minus the same layer on the rank's Tq tokens unsplit; the
    attention's SDPA is counted as a GPU's fused kernel holds memory (the split attention's lower-right causal
    bias is dropped: it cannot be built on fake tensors, and on CPU tensors it selects the math kernel, whose
    [H, Tq, S] scores a GPU never materialises). One MLA layer's transient with activation checkpointing (x the
    MLA layers without it, a bound). Where this process already has a process group the fake one cannot be made:
    then the analytic bound `extra_memory` counts (the gathered latent + k_pe, the roped k_pe, kv_b_proj's
    output, its keys and values repeated to the H query heads where G < H, the keys [E, H, Nn + P], and a
    gradient of each: 2.9x the measured figure at the 3B recipe's shapes);
  - GDN, ANALYTIC (a few MiB): the group's gathered zero-start final states [N, Hl, K, V] and transitions
    [N, Hl, K, K] (fp32) and their gradients; Mamba-2: the states [N, Hm, Pm, Nm] and one decay per head; the
    gathered conv windows [N, w, C]: one layer's with checkpointing, every linear layer's without.
  The extras are added to the step's peak: an upper bound (they are one layer's transient, and the peak is not
  necessarily inside an MLA layer's backward).
* FLOPs: the rank's step at Tq, plus (last rank, one document over the row) the attention of its Tq queries to
  the E earlier keys (a fully visible Tq x E block: torch's dense SDPA count is exact for it) and kv_b_proj's
  decompression of those keys, forward (again in the recompute with checkpointing) and backward, per MLA layer;
  GDN / Mamba-2 run their local scan a second time (once from a zero state for the final state the later ranks
  need, once from the passed state) and GDN a transition pass (values of width K): fla's kernels' products
  at the rank's shape, as the step counts them (`hylo.kernels.fla_shapes`).
* Communication, bytes SENT by one GPU per step (forward, its repeat in the checkpoint recompute, backward) per
  layer, as ring collectives move them (an all-gather of a p-byte piece per rank sends (N - 1) p per rank; its
  backward, the sum of the gathered gradients, is a reduce-scatter of the same volume; an all-to-all sends
  (N - 1) / N of the rank's tensor):
  - MLA, gathering the latent: (R + P) values per token all-gathered: (N - 1) Tq (R + P) b each way;
  - MLA, Ulysses (DeepSpeed's head-sharded attention): all-to-all of q, k, v before attention and of the output
    after, and of their gradients in the backward: (N - 1) / N Tq H (2 (Nn + P) + 2 Vd) b each way; needs H
    divisible by N;
  - GDN / Mamba-2 state passing: one all-gather of each rank's state and transition (fp32; GDN [Hl, K, K],
    Mamba-2 one decay per head), and one of each rank's conv window (its last w pre-conv inputs of C channels);
  the backward's reduce-scatter is an all-reduce on gloo (CPU), which has none: N times the bytes there.
  "Per row token" is the group's total over T: independent of T for MLA's two schemes; state passing sends a
  fixed amount per step whatever T, so its share per token falls as T grows.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from hylo.kernels.backend import forced_mode
from hylo.kernels.gdn import chunk_gated_delta_rule
from hylo.kernels.ssd import chunk_ssd
from hylo.kernels.varlen import DocBounds
from hylo.pipeline.cli import BadArgument
from hylo.pipeline.estimate.fake import cast_parameters, fake_tensors, flop_registry
from hylo.pipeline.estimate.fake_group import COLLECTIVE_DEPRECATION, fused_attention
from hylo.pipeline.estimate.flops import dtype_class
from hylo.pipeline.estimate.gpus import GPUS
from hylo.pipeline.estimate.report import (
    dtype_lines,
    fits_lines,
    format_gib,
    format_tokens,
    loss_line,
    memory_lines,
    per_key_lines,
)
from hylo.pipeline.estimate.step import Estimate, estimate_call, gpu_figures
from hylo.seq_parallel import shard_row

# the row length the scans' FLOPs are counted at (linear in T: the chunked forms loop over chunks of 64)
SCAN_TOKENS = 2048


def check_sequence_parallel(n: int, world: int, tokens: list[int], n_flag: str, world_flag: str,
                            tokens_flag: str) -> None:
    """N >= 1, dividing the training workers and every row length into parts of at least 2 tokens
    (BadArgument naming the flags or settings)."""
    if n < 1:
        raise BadArgument(f"{n_flag}={n}: the sequence-parallel group size must be at least 1")
    if world % n:
        raise BadArgument(f"{n_flag}={n}: the sequence-parallel groups must divide the {world} training workers "
                          f"({world_flag}) into groups of {n}; use a divisor of {world}")
    for t in tokens:
        if t % n or t // n < 2:
            raise BadArgument(f"{n_flag}={n}: the {t:,}-token row ({tokens_flag}) does not split into {n} equal parts "
                              f"of at least 2 tokens; use row lengths divisible by {n}")


@dataclass(frozen=True)
class Dims:
    """The student's shapes that sequence parallelism moves or holds."""

    n_mla: int
    n_linear: int
    linear_type: str
    H: int
    G: int
    nope: int
    rope: int
    v: int
    R: int
    # linear layers: heads, key dim / Mamba-2 head dim, value dim / Mamba-2 state, conv channels, conv window
    lin_heads: int
    lin_k: int
    lin_v: int
    conv_channels: int
    conv_window: int

    @staticmethod
    def of(hc: Any) -> Dims:
        if hc.linear_type == "gdn":
            Hl, K, V = hc.gdn_num_heads, hc.gdn_head_dim, hc.gdn_value_dim
            C = Hl * (2 * K + V)
        else:
            Hl, K, V, Gm = hc.mamba2_dims
            C = Hl * K + 2 * Gm * V
        return Dims(len(hc.mla_layers), hc.n_layer - len(hc.mla_layers), hc.linear_type, hc.num_attention_heads,
                    hc.kv_b_heads, hc.qk_nope_head_dim, hc.qk_rope_head_dim, hc.v_head_dim, hc.kv_lora_rank,
                    Hl, K, V, C, max(hc.gdn_conv_size - 1, 0))

    @property
    def latent(self) -> int:
        """Values per token MLA's latent gather sends: latent + pre-RoPE k_pe (R + P)."""
        return self.R + self.rope

    @property
    def ulysses(self) -> int:
        """Values per token and head of Ulysses' all-to-alls: q, k (Nn + P each), v and the output (Vd each)."""
        return 2 * (self.nope + self.rope) + 2 * self.v

    @property
    def state(self) -> int:
        """fp32 values of one rank's state per linear layer: [H, K, V] (+ GDN's transition [H, K, K])."""
        if self.linear_type == "gdn":
            return self.lin_heads * self.lin_k * (self.lin_v + self.lin_k)
        return self.lin_heads * (self.lin_k * self.lin_v + 1)


@dataclass
class Comm:
    """Bytes one GPU sends per step for one layer (forward with its recompute, backward)."""

    layer: str
    scheme: str
    forward: float
    backward: float
    per_row_token: float
    note: str = ""

    @property
    def total(self) -> float:
        return self.forward + self.backward


def communication(hc: Any, T: int, N: int, b: int, checkpointing: bool) -> list[Comm]:
    """Per layer kind and scheme: bytes sent per GPU per step at a T-token row over N ranks (module docstring)."""
    d = Dims.of(hc)
    Tq = T // N
    f = 2 if checkpointing else 1
    out = []

    def row(layer: str, scheme: str, each_way: float, note: str = "") -> None:
        # the group's total over the row's tokens
        out.append(Comm(layer, scheme, f * each_way, each_way, N * (f + 1) * each_way / T, note))

    if d.n_mla:
        row("MLA", "gather latent + k_pe", (N - 1) * Tq * d.latent * b)
        if d.H % N:
            out.append(Comm("MLA", "Ulysses", math.nan, math.nan, math.nan,
                            f"{d.H} heads not divisible by N = {N}"))
        else:
            row("MLA", "Ulysses", (N - 1) / N * Tq * d.H * d.ulysses * b)
    if d.n_linear:
        kind = "GDN" if d.linear_type == "gdn" else "Mamba-2"
        what = "states + transitions"
        # all-gathers of each rank's fp32 state and transition, and of its conv window
        row(kind, f"{what} + conv window", (N - 1) * (d.state * 4 + d.conv_window * d.conv_channels * b))
    return out


MLA_MEASURED = "SP: MLA keys from the row's start (last rank, measured)"
MLA_ANALYTIC = "SP: MLA keys from the row's start (last rank, analytic bound)"
STATES = "SP: gathered states + transitions + conv windows (analytic)"


def extra_memory(hc: Any, T: int, N: int, b: int, checkpointing: bool,
                 mla_layer_bytes: float | None = None) -> dict[str, float]:
    """Bytes per GPU that splitting adds to the rank's own step (the last rank; module docstring).
    `mla_layer_bytes`: one split MLA layer's measured extra (`measure_mla_extra`), else the analytic bound."""
    d = Dims.of(hc)
    E = T - T // N
    out: dict[str, float] = {}
    if N == 1:
        return out
    if d.n_mla and mla_layer_bytes is not None:
        out[MLA_MEASURED] = mla_layer_bytes * (1 if checkpointing else d.n_mla)
    elif d.n_mla:
        # per earlier key (`MLAttention.decompressed_kv`): the gathered latent + k_pe, the roped k_pe, kv_b_proj's
        # output, its nope keys and values repeated to every query head when kv_b_proj has fewer heads, the keys
        # [H, Nn + P]; the backward holds a gradient of each
        repeat = d.H * (d.nope + d.v) if d.G != d.H else 0
        fwd = E * (d.latent + d.rope + d.G * (d.nope + d.v) + repeat + d.H * (d.nope + d.rope)) * b
        held = fwd if checkpointing else fwd * d.n_mla
        out[MLA_ANALYTIC] = held + fwd
    if d.n_linear:
        per_layer = 2 * N * (d.state * 4 + d.conv_window * d.conv_channels * b)
        out[STATES] = \
            per_layer * (1 if checkpointing else d.n_linear)
    return out


def measure_mla_extra(hc: Any, T: int, N: int, dtype: torch.dtype, kind: str = "mla") -> float | None:
    """Bytes one split MLA decoder layer (hylo/seq_parallel.py's `_attend_shard`) holds beyond the same layer
    on the rank's T / N tokens unsplit, forward and backward, as the LAST rank of a row that is one document:
    both run on fake tensors, the collectives on torch's fake process group (`FakeStore`, backend "fake"), the
    attention's SDPA as a fused kernel (`fused_attention`). None where this process already has a process
    group (the fake one cannot be made): the caller uses the analytic bound. `kind="linear"`: a GDN / Mamba-2
    layer instead (its zero-start pass, the transition pass and the second pass from the passed state)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # lazy: distributed

    from hylo.modeling import HyLoDecoderLayer  # lazy: transformers

    layers = hc.mla_layers if kind == "mla" else hc.linear_layers
    if not layers or N == 1 or (dist.is_available() and dist.is_initialized()):
        return None
    Tq = T // N
    dist.init_process_group("fake", store=FakeStore(), rank=N - 1, world_size=N)
    try:
        shard = shard_row(DocBounds.from_host([0, T], T), N - 1, N)

        def setup():
            layer = cast_parameters(HyLoDecoderLayer(hc, layers[0]), dtype)
            return layer, torch.empty(1, Tq, hc.hidden_size, dtype=dtype, requires_grad=True)

        def run(state, split: bool) -> None:
            layer, x = state
            bounds = shard.local if split else DocBounds.from_host([0, Tq], Tq)
            out, _ = layer(x, bounds.positions[None], bounds, None, None, shard if split else None)
            out.sum().backward()

        with fused_attention(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=COLLECTIVE_DEPRECATION, category=FutureWarning)
            split = estimate_call(setup, lambda st: run(st, True))
            alone = estimate_call(setup, lambda st: run(st, False))
        return max(split - alone, 0.0)
    finally:
        dist.destroy_process_group()


def _scan_flops(hc: Any, tokens: int, dtype: torch.dtype, transition: bool = False) -> tuple[int, int]:
    """(forward, backward) FLOPs of one linear layer's scan at `tokens` tokens, from a passed state, with the
    final state out: fla's kernels on fake tensors as the step prices them (`hylo.kernels.fla_shapes`).
    `transition`: GDN's transition pass (values of width K, a [K, K] state)."""
    d = Dims.of(hc)
    with fake_tensors(gpu=True) as host, forced_mode("torch"):
        host.flop_registry = flop_registry()
        if d.linear_type == "gdn":
            V = d.lin_k if transition else d.lin_v
            q, k = (torch.empty(1, tokens, d.lin_heads, d.lin_k, dtype=dtype, requires_grad=True) for _ in range(2))
            v = torch.empty(1, tokens, d.lin_heads, V, dtype=dtype, requires_grad=True)
            g = torch.empty(1, tokens, d.lin_heads, requires_grad=True)
            beta = torch.empty(1, tokens, d.lin_heads, dtype=dtype, requires_grad=True)
            h0 = torch.empty(1, d.lin_heads, d.lin_k, V, requires_grad=True)
            inputs = (q, k, v, g, beta, h0)
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, chunk_size=hc.gdn_chunk_size)
        else:
            Hm, Pm, Nm, Gm = hc.mamba2_dims
            x = torch.empty(1, tokens, Hm, Pm, dtype=dtype, requires_grad=True)
            dt = torch.empty(1, tokens, Hm, requires_grad=True)
            B, C = (torch.empty(1, tokens, Gm, Nm, dtype=dtype, requires_grad=True) for _ in range(2))
            h0 = torch.empty(1, Hm, Pm, Nm, requires_grad=True)
            inputs = (x, dt, B, C, h0)
            o, ht = chunk_ssd(x, dt, -torch.ones(Hm), B, C, None, initial_state=h0, output_final_state=True,
                              chunk_size=hc.gdn_chunk_size)
        fwd = host.flops
        torch.autograd.grad((o, ht), inputs, (torch.empty_like(o), torch.empty_like(ht)), allow_unused=True)
        return fwd, host.flops - fwd


def extra_flops(hc: Any, T: int, N: int, dtype: torch.dtype, checkpointing: bool) -> dict[str, int]:
    """FLOPs per GPU that splitting adds to the rank's own step (the last rank; module docstring)."""
    d = Dims.of(hc)
    Tq, E = T // N, T - T // N
    f = 2 if checkpointing else 1
    out: dict[str, int] = {}
    if N == 1:
        return out
    if d.n_mla:
        q, k, v = (1, d.H, Tq, d.nope + d.rope), (1, d.H, E, d.nope + d.rope), (1, d.H, E, d.v)
        attn = f * sdpa_flop_count(q, k, v) + sdpa_backward_flop_count((1, d.H, Tq, d.v), q, k, v)
        # kv_b_proj over the earlier keys: forward (x f), input and weight gradients
        decompress = (f + 2) * 2 * E * d.R * d.G * (d.nope + d.v)
        out["SP: MLA attention to the earlier keys (last rank)"] = d.n_mla * (attn + decompress)
    if d.n_linear:
        L = min(SCAN_TOKENS, Tq)
        fwd, bwd = _scan_flops(hc, L, dtype)
        scans = (f * fwd + bwd) * Tq / L
        name = "SP: the local scan again (from a zero state)"
        if d.linear_type == "gdn":
            tf, tb = _scan_flops(hc, L, dtype, transition=True)
            scans += (f * tf + tb) * Tq / L
            name += " + the transition pass"
        out[name] = int(d.n_linear * scans)
    return out


@dataclass
class SPEstimate:
    """One row length at N: the rank's own step (at T / N tokens) plus what splitting adds."""

    tokens: int
    sequence_parallel: int
    local: Estimate
    extra_memory: dict[str, float]
    extra_flops: dict[str, int]
    comm: list[Comm]
    notes: list[str] = field(default_factory=list)
    # `local` is the split step itself (the last rank's, measured), not the unsplit step at T / N
    split: bool = False

    @property
    def peak_bytes(self) -> float:
        return self.local.peak_bytes + sum(self.extra_memory.values())

    @property
    def total_flops(self) -> int:
        return self.local.total_flops + sum(self.extra_flops.values())

    @property
    def gemm_flops_by_dtype(self) -> dict[str, int]:
        """The rank's FLOPs by dtype class: its step's, and the extras at the step dtype's class (the extra
        attention and the scans' stand-ins run in it)."""
        out = dict(self.local.gemm_flops_by_dtype)
        cls = dtype_class(getattr(torch, self.local.dtype))
        extra = sum(self.extra_flops.values())
        if extra:
            out[cls] = out.get(cls, 0) + extra
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "sequence_parallel": self.sequence_parallel,
                "local_tokens": self.tokens // self.sequence_parallel, "split_step": self.split,
                "local": self.local.to_dict(),
                "extra_memory": self.extra_memory, "extra_flops": self.extra_flops,
                "peak_bytes": self.peak_bytes, "total_flops": self.total_flops,
                "communication": [dataclasses.asdict(c) | {"total": c.total} for c in self.comm],
                "gemm_flops_by_dtype": {k: v / 1e12 for k, v in self.gemm_flops_by_dtype.items()},
                "gpus": {g.name: gpu_figures(g, self.peak_bytes, self.total_flops, self.gemm_flops_by_dtype)
                         for g in GPUS}, "notes": self.notes}


def sp_extras(hc: Any, T: int, N: int, dtype: torch.dtype, checkpointing: bool,
              measure: bool = True) -> tuple[dict, dict, list[Comm]]:
    b = torch.empty((), dtype=dtype).element_size()
    mla = measure_mla_extra(hc, T, N, dtype) if measure else None
    return (extra_memory(hc, T, N, b, checkpointing, mla), extra_flops(hc, T, N, dtype, checkpointing),
            communication(hc, T, N, b, checkpointing))


def estimate_sp(cfg: Any, T: int, N: int, W: int, dtype: torch.dtype, local: Estimate, hc: Any,
                split: bool = False) -> SPEstimate:
    """`local`: `estimate_step` at T / N tokens (ZeRO-3 over W), the extras added per the module docstring; or,
    `split`, the split step itself (`estimate_step(..., sequence_parallel=N)`): nothing to add, the
    communication counted."""
    ckpt = bool(cfg.model.activation_checkpointing)
    b = torch.empty((), dtype=dtype).element_size()
    if split:
        return SPEstimate(T, N, local, {}, {}, communication(hc, T, N, b, ckpt), split=True)
    mem, flops, comm = sp_extras(hc, T, N, dtype, ckpt)
    return SPEstimate(T, N, local, mem, flops, comm)


def _mb(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x / 2 ** 20:,.1f}"


def format_sp(ests: list[SPEstimate]) -> str:
    """The per-GPU table at N (columns: the row lengths) and the communication per layer."""
    N = ests[0].sequence_parallel
    cols = [format_tokens(e.tokens) for e in ests]
    w = max(9, *(len(c) + 2 for c in cols))
    # label width: the longest row name
    L = 2 + max(len(k) + 11 for e in ests for k in (*e.extra_memory, *e.extra_flops, *e.local.memory, "x" * 50))
    lines = [f"training GPU, sequence parallel over N = {N} (each rank {', '.join(format_tokens(e.tokens // N) for e in ests)} "
             f"tokens of the row; the last rank" + (" of a row that is one document, its split step measured):"
                                                    if ests[0].split else "):"),
             f"{'per GPU at the peak (GiB)':<{L}}" + "".join(f"{c:>{w}}" for c in cols)]
    locals_ = [e.local for e in ests]
    what = "the split step (measured)" if ests[0].split else "the step of one rank (measured, T/N tokens)"
    short = {"forward/backward": "fwd/bwd", "optimizer": "optimizer"}
    if ests[0].split:
        # the split step's own peak: its parts sum to it
        lines += memory_lines(locals_, L, w)
        lines.append(f"{'peak (the sum of the lines above)':<{L}}" + "".join(f"{format_gib(e.peak_bytes):>{w}}" for e in ests))
        lines.append(f"{'  reached in':<{L}}" + "".join(f"{short.get(e.local.peak_phase, e.local.peak_phase):>{w}}"
                                                         for e in ests))
    else:
        # the rank's step (its parts under it) and the extras of the split beside it: the peak is their sum
        lines.append(f"{'  ' + what:<{L}}" + "".join(f"{format_gib(e.local.peak_bytes):>{w}}" for e in ests))
        lines += memory_lines(locals_, L, w, indent="    ")
        ekeys: list[str] = []
        for e in ests:
            ekeys += [k for k in e.extra_memory if k not in ekeys]
        for k in ekeys:
            lines.append(f"  {k:<{L - 2}}" + "".join(f"{format_gib(e.extra_memory.get(k, 0.0)):>{w}}" for e in ests))
        lines.append(f"{'peak (the step + the SP extras: an upper bound)':<{L}}"
                     + "".join(f"{format_gib(e.peak_bytes):>{w}}" for e in ests))
    lines += loss_line(locals_, L, w)
    lines += fits_lines([e.peak_bytes for e in ests], L, w)
    lines.append(f"{'FLOPs per GPU per row (TFLOP)':<{L}}")
    lines.append(f"  {what:<{L - 2}}" + "".join(f"{e.local.total_flops / 1e12:>{w}.1f}" for e in ests))
    fkeys: list[str] = []
    for e in ests:
        fkeys += [k for k in e.extra_flops if k not in fkeys]
    lines += per_key_lines(fkeys, ests, lambda e, k: e.extra_flops.get(k, 0) / 1e12, L - 2, w)
    lines.append(f"  {'total':<{L - 2}}" + "".join(f"{e.total_flops / 1e12:>{w}.1f}" for e in ests))
    lines += dtype_lines([e.gemm_flops_by_dtype for e in ests], L, w)
    lines.append("")
    lines.append("communication per layer, MiB sent per GPU per step (forward x2 with checkpointing's recompute, "
                 "+ backward); per row token: bytes")
    lines.append(f"{'layer, scheme':<40}" + "".join(f"{c:>{w}}" for c in cols) + f"{'B/token':>{w}}")
    for i, c in enumerate(ests[0].comm):
        vals = [e.comm[i].total for e in ests]
        tail = f"  ({c.note})" if c.note else ""
        per = "n/a" if math.isnan(c.per_row_token) else f"{c.per_row_token:,.0f}"
        lines.append(f"  {c.layer + ', ' + c.scheme:<38}" + "".join(f"{_mb(v):>{w}}" for v in vals) + f"{per:>{w}}" + tail)
    return "\n".join(lines)
