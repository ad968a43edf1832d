"""The teacher under sequence parallelism in the step estimate (`hylo estimate --sequence-parallel N`): the frozen
model that gives the step its targets (stage 2's in-process teacher, stage 1's base), per GPU, run whole against
split (`train.sequence_parallel_teacher`); and the Serve pool's work per row.

Legend: T tokens of the row, N ranks of the group, Tq = T / N the rank's tokens, E = T - Tq the earlier keys the
LAST rank attends to when one document fills the row (the worst rank and the worst row), as in sp.py; L the
teacher's decoder layers, D its hidden size, V its vocabulary, H / Hkv its query / key-value heads of d dims, b
the teacher dtype's bytes; Hkv' = Hkv where N divides it, else H (Ulysses replicates the key-value heads).

The three modes (hylo/seq_parallel.py's `split_attention`):
* "whole", today's behaviour: every rank of a group runs the whole row and keeps its tokens: N times the
  FLOPs, the whole row's activations on every GPU, nothing sent;
* "allgather": each rank runs its Tq tokens; every layer all-gathers the roped keys and values of the group,
  and the rank's queries attend to the keys from the start of its first document; any head count;
* "ulysses": each rank runs its Tq tokens; DeepSpeed's all-to-all by heads (q, k, v tokens -> heads, attention
  over the whole row with H / N heads, the output back); needs N to divide H.

Per GPU, as `teacher_split` computes it:
* the forward of the tokens the rank runs (T whole, Tq split), MEASURED on fake tensors (`measure_forward`):
  the decoder stack over one document of that length, without gradients, SDPA as a fused kernel (flash: O(T)
  memory); its peak beyond the weights and its FLOPs (causal attention as its kernel runs it, the visible
  (query, key) pairs: `fake.flop_registry`, as the step counts the student's);
* plus, split:
  - FLOPs, ANALYTIC, beyond the measured forward of the rank's Tq tokens (their own causal triangle): all-gather,
    the last rank's Tq queries against the E earlier keys, per layer (a fully visible block, Tq E pairs a head);
    Ulysses, each rank's H / N heads over the whole row's causal triangle, T (T + 1) / 2 pairs a head, less the
    triangle of its own tokens over H heads the forward counted. So the all-gather's last rank does Tq E + Tq (Tq
    + 1) / 2 pairs a head, (2N - 1) / N of an even share: its ranks are uneven, Ulysses's are not. The split
    forward measured below counts exactly this (a test checks it);
  - memory, MEASURED (`measure_split_forward`): the last rank's forward of a row that is one document under
    hylo/seq_parallel.py's `split_attention`, its collectives on torch's fake process group (`split_rank`), SDPA
    as a fused kernel; what it holds beyond the unsplit forward of its Tq tokens. Where this process already has
    a process group, or `measure=False` (bench/sp_tables.py), an ANALYTIC BOUND of one layer's transient (the
    forward frees each layer's before the next; added to the forward's peak, which need not fall inside the
    attention): all-gather, the gathered keys and values [T, 2, Hkv, d] (grouped: SDPA's `enable_gqa`) and,
    where Hkv < H, the rank's own Tq repeated to the H query heads (its packed documents); Ulysses, the all-to-all's send and receive sides of q, k, v, o,
    2 Tq (2H + 2Hkv') d b, and the keys and values repeated to the rank's H / N heads over T tokens;
* stage 2's teacher, run whole, copies the row's final hidden states out of the forward ([T, D]:
  `TeacherModel.hidden_batch`); split, it keeps the forward's own (`TeacherModel.hidden_split`);
* the lm_head on the rank's Tq tokens (top-k records, streamed logits: every mode computes it for the
  range alone); the hidden form leaves it to the fused KL, counted in the step;
* the weights, on every GPU in every mode (frozen, not sharded by ZeRO-3).
* Bytes SENT by one GPU per layer per row (forward only: the teacher is frozen, nothing flows back), as ring
  collectives move them: all-gather (N - 1) Tq 2 Hkv d b; Ulysses (N - 1) / N Tq (2H + 2Hkv') d b (q, k, v in,
  the output back); whole 0. The all-gather's grow with N towards T 2 Hkv d b; Ulysses's fall as 1 / N.

The training GPU's peak (in-process teacher): the larger of the step's peak outside the teacher's forward
(measured, the forward marked apart: `tracking.MarkedSource`) and the teacher's forward on top of the step's
start (the states, the weights): `start + activations + buffers`.

The Serve pool computes each row once per group (after) instead of once per rank (before): N forwards of the
whole row per row before, one after. A replica runs whole rows either way, so its memory does not change.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import sdpa_flop_count

from hylo.kernels.varlen import DocBounds
from hylo.pipeline.cli import BadArgument
from hylo.pipeline.estimate.fake import build_model, causal_pairs, fake_tensors, flop_registry
from hylo.pipeline.estimate.fake_group import fused_attention, split_rank
from hylo.pipeline.estimate.gpus import GPUS
from hylo.pipeline.estimate.report import format_gib, format_tokens
from hylo.pipeline.estimate.sp import Comm
from hylo.pipeline.estimate.tracking import FROZEN_FORWARD, StepMemory
from hylo.pipeline.train.config import TEACHER_SPLITS, largest_group
from hylo.seq_parallel import shard_row, split_attention

# the split modes (each rank runs its own tokens); "whole" is today's
SPLIT_MODES = tuple(m for m in TEACHER_SPLITS if m != "whole")
TEACHER_PHASE = "teacher forward"


@dataclass(frozen=True)
class TeacherDims:
    """The teacher's shapes that a split moves or holds (a transformers Llama / Qwen3 config)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @staticmethod
    def of(config: Any) -> TeacherDims:
        H = config.num_attention_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // H
        return TeacherDims(config.num_hidden_layers, config.hidden_size, H,
                           getattr(config, "num_key_value_heads", None) or H, d, config.vocab_size)

    def ulysses_kv_heads(self, N: int) -> int:
        """Hkv': the key-value heads Ulysses sends (replicated to the query heads where N does not divide them)."""
        return self.kv_heads if self.kv_heads % N == 0 else self.heads


def ulysses_problem(td: TeacherDims, N: int, workers: int | None = None, tokens: Iterable[int] = (),
                    conv_size: int = 1) -> str | None:
    """Why Ulysses cannot split this teacher over N ranks (None: it can), with the largest N that works: it
    divides the heads and, when given, the `workers` and every row length in `tokens` (train/config.py
    `largest_group`, the rule the run checks too)."""
    if td.heads % N == 0:
        return None
    best = largest_group(N, workers=workers, heads=td.heads, tokens=tokens, conv_size=conv_size)
    return (f"the teacher's {td.heads} query heads do not split over N = {N} (Ulysses gives each rank H / N heads); "
            f"the largest N that works is {best}, or use allgather (any head count)")


def check_teacher_split(td: TeacherDims, N: int, mode: str, what: str, workers: int | None = None,
                        tokens: Iterable[int] = (), conv_size: int = 1) -> None:
    """Refuse Ulysses where N does not divide the heads (BadArgument naming `what`, the key or flag); the N it
    advises divides the `workers` and splits the rows of `tokens` too."""
    if mode == "ulysses" and N > 1 and (why := ulysses_problem(td, N, workers, tokens, conv_size)):
        raise BadArgument(f"{what}=ulysses at N = {N}: {why}")


def teacher_comm(td: TeacherDims, T: int, N: int, b: int) -> list[Comm]:
    """Bytes one GPU sends per teacher layer per row, each scheme side by side (module docstring)."""
    Tq = T // N

    def row(scheme: str, sent: float, note: str = "") -> Comm:
        # forward only; the group's total over the row's tokens
        return Comm("teacher", scheme, sent, 0.0, N * sent / T if not math.isnan(sent) else math.nan, note)

    out = [row("all-gather K, V", (N - 1) * Tq * 2 * td.kv_heads * td.head_dim * b)]
    if N > 1 and td.heads % N:
        out.append(row("Ulysses q, k, v, o", math.nan, f"{td.heads} heads not divisible by N = {N}"))
    else:
        kv = td.ulysses_kv_heads(N)
        out.append(row("Ulysses q, k, v, o", (N - 1) / N * Tq * (2 * td.heads + 2 * kv) * td.head_dim * b))
    out.append(row("whole row (today)", 0.0))
    return out


GATHERED = "gathered K, V of one layer, the rank's own repeated to H heads (bound)"
ALL_TO_ALL = "all-to-all buffers + q, k, v, o of H/N heads, one layer (bound)"
SPLIT_MEASURED = "the split forward's own (measured, fake group)"


def transient_buffers(td: TeacherDims, T: int, N: int, b: int, mode: str) -> dict[str, float]:
    """The scheme's transient bytes of one layer beyond the forward of the rank's tokens, an upper bound (they
    are added to the forward's peak, which need not fall inside the attention): all-gather, the gathered keys
    and values [T, 2, Hkv, d] and, where Hkv < H, the rank's own Tq repeated to the H query heads; Ulysses, the
    all-to-all's send and receive sides of q, k, v, o and the keys and values repeated to the H / N query heads
    over T tokens (hylo/seq_parallel.py's `_allgather_attend`, `ulysses_attend`)."""
    if mode == "whole" or N == 1:
        return {}
    Tq, d = T // N, td.head_dim
    if mode == "allgather":
        # the gathered keys stay grouped (SDPA's enable_gqa); only the rank's own Tq are repeated to H heads
        repeated = Tq * 2 * td.heads * d * b if td.kv_heads != td.heads else 0
        return {GATHERED: T * 2 * td.kv_heads * d * b + repeated}
    kv = td.ulysses_kv_heads(N)
    repeated = 2 * Tq * td.heads * d * b if kv != td.heads else 0
    return {ALL_TO_ALL: 2 * Tq * (2 * td.heads + 2 * kv) * d * b + repeated}


@dataclass
class FrozenForward:
    """The frozen model's decoder stack over one document of `tokens` tokens, measured on fake tensors."""

    tokens: int
    weights: float
    activations: float
    flops: int


def _frozen_forward(config: Any, dtype: torch.dtype, tokens: int, positions: torch.Tensor | None = None,
                    around: Callable[[Any], Any] = lambda model: contextlib.nullcontext()) -> FrozenForward:
    """The decoder stack (no lm_head) of a model of `config` in `dtype` over `tokens` tokens at `positions` (None:
    one document, made on fake tensors), without gradients, on fake tensors, inside `around(model)`: the weights'
    bytes, the forward's peak beyond them and its FLOPs."""
    with fake_tensors() as host, torch.no_grad():
        model = build_model(config, dtype).eval().requires_grad_(False)
        params = list(model.parameters())
        weights = sum(p.numel() * p.element_size() for p in params)
        host.flop_registry = flop_registry()
        memory = StepMemory(1, host)
        memory.tracker.track_external(*params)
        with memory.tracker, around(model):
            memory.phase, memory.active = TEACHER_PHASE, True
            base = memory.total()
            memory.peak = float(base)
            ids = torch.zeros(1, tokens, dtype=torch.long)
            pos = torch.arange(tokens) if positions is None else positions
            model.model(input_ids=ids, position_ids=pos[None], use_cache=False)
            memory.active = False
    return FrozenForward(tokens, float(weights), memory.peak - base, host.flops)


def measure_forward(config: Any, tokens: int, dtype: torch.dtype) -> FrozenForward:
    """The decoder stack (no lm_head) of a model of `config` in `dtype` over one document of `tokens` tokens,
    without gradients, on fake tensors: the weights' bytes, the forward's peak beyond them and its FLOPs
    (SDPA as a fused kernel holds memory, counted dense)."""
    with fused_attention():
        return _frozen_forward(config, dtype, tokens)


def measure_split_forward(config: Any, T: int, N: int, mode: str, dtype: torch.dtype) -> FrozenForward | None:
    """The decoder stack as the LAST rank of a group of N runs its T / N tokens of a row that is one document,
    split with the group (hylo/seq_parallel.py's `split_attention`, `mode` "allgather" or "ulysses"): its
    collectives on torch's fake process group (`split_rank`), as `measure_forward` measures the whole. None where
    this process already has a process group (the fake one cannot be made): the caller prices it analytically."""
    if dist.is_available() and dist.is_initialized():
        return None
    with split_rank(N, deepspeed_comm=mode == "ulysses"):
        # the shard's boundaries and positions are host values, made before the fake mode
        shard = shard_row(DocBounds.from_host([0, T], T), N - 1, N, teacher=mode)
        return _frozen_forward(config, dtype, T // N, shard.local.positions,
                               lambda model: split_attention(model, shard))


@dataclass
class TeacherSplit:
    """The frozen model per GPU at one row length in one mode (module docstring)."""

    mode: str
    tokens: int
    sequence_parallel: int
    weights: float
    activations: float
    buffers: dict[str, float]
    flops: dict[str, int]
    tokens_run: int
    notes: list[str] = field(default_factory=list)

    @property
    def memory(self) -> float:
        """The forward's transient per GPU beyond the weights: its activations and the scheme's buffers."""
        return self.activations + sum(self.buffers.values())

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "tokens": self.tokens, "sequence_parallel": self.sequence_parallel,
                "tokens_run": self.tokens_run, "weights": self.weights, "activations": self.activations,
                "buffers": self.buffers, "memory": self.memory, "flops": self.flops,
                "total_flops": self.total_flops, "notes": self.notes}


FORWARD = "forward of the tokens it runs (measured)"
KEPT = "hidden states copied out [tokens run, D]"
EARLIER = "attention to the E earlier keys (last rank)"
ULYSSES_ATTENTION = "attention of H/N heads over the row, beyond its own tokens'"
LM_HEAD = "lm_head on the rank's T/N tokens"


def teacher_split(config: Any, T: int, N: int, mode: str, dtype: torch.dtype, lm_head: bool = True,
                  measured: dict[int, FrozenForward] | None = None, kept_hidden: bool = False,
                  measure: bool = True) -> TeacherSplit:
    """The frozen model of `config` per GPU at a T-token row over N ranks in `mode` ("whole", "allgather",
    "ulysses"; module docstring). `lm_head`: the teacher computes logits (top-k records, streamed logits).
    `measured`: forwards already measured, by tokens (filled in). `kept_hidden`: run whole, the row's final hidden
    states are copied out beside the forward's own (stage 2's `TeacherModel.hidden_batch`). `measure`: the
    split forward measured on the fake group (`measure_split_forward`), else its buffers' analytic bound."""
    if mode not in TEACHER_SPLITS:
        raise ValueError(f"teacher split {mode!r} is not one of {', '.join(TEACHER_SPLITS)}")
    td = TeacherDims.of(config)
    Tq, E = T // N, T - T // N
    split = mode != "whole" and N > 1
    run = Tq if split else T
    measured = {} if measured is None else measured
    if run not in measured:
        measured[run] = measure_forward(config, run, dtype)
    fwd = measured[run]
    b = torch.empty((), dtype=dtype).element_size()
    flops = {FORWARD: fwd.flops}
    notes = []
    buffers = transient_buffers(td, T, N, b, mode)
    activations = fwd.activations
    if split:
        # per (query, key) pair and head of every layer: the forward's two products (sdpa_flop_count)
        pair = td.layers * sdpa_flop_count((1, 1, 1, td.head_dim), (1, 1, 1, td.head_dim), (1, 1, 1, td.head_dim))
        if mode == "ulysses":
            flops[ULYSSES_ATTENTION] = pair * (td.heads // N * causal_pairs(T, T) - td.heads * causal_pairs(Tq, Tq))
        else:
            flops[EARLIER] = pair * td.heads * Tq * E
        if why := (ulysses_problem(td, N) if mode == "ulysses" else None):
            notes.append(why)
        elif measure and (got := measure_split_forward(config, T, N, mode, dtype)) is not None:
            # the split forward itself: its own buffers measured, in place of the bound
            buffers = {SPLIT_MEASURED: max(got.activations - fwd.activations, 0.0)}
    if lm_head:
        flops[LM_HEAD] = 2 * Tq * td.hidden * td.vocab
    if kept_hidden and not split:
        buffers[KEPT] = run * td.hidden * b
    return TeacherSplit(mode, T, N, fwd.weights, activations, buffers, flops, run, notes)


def teacher_peak(step: Any, priced: TeacherSplit) -> float:
    """The training GPU's peak with the teacher run as `priced`: the larger of the step's phases other than the
    teacher's forward (measured) and the teacher's forward on top of the step's start (module docstring)."""
    others = step.mark_peaks.get("unmarked", step.peak_bytes)
    return max(others, step.start_bytes + priced.memory)


def format_teacher(before: list[TeacherSplit], after: list[TeacherSplit], comm: list[list[Comm]], what: str,
                   steps: list[Any] | None = None) -> str:
    """Per GPU, the frozen model run whole (before) and split (after), columns the row lengths; the training
    GPU's peak either way (`steps`: the measured steps, where the model runs in them); the bytes each scheme
    sends per layer, side by side."""
    N = before[0].sequence_parallel
    cols = [format_tokens(e.tokens) for e in before]
    w = max(9, *(len(c) + 2 for c in cols))
    L = 58
    mode = after[0].mode

    def line(label: str, vals: list[str]) -> str:
        return f"{label:<{L}}" + "".join(f"{v:>{w}}" for v in vals)

    lines = [f"{what} per GPU over N = {N}: before, the whole row on every GPU (train.sequence_parallel_teacher: "
             f"whole); after, {mode} (each GPU runs its T/N tokens):",
             line("per GPU", cols),
             line("  weights, every GPU (GiB)", [format_gib(e.weights) for e in before])]
    for label, ests in (("before, whole", before), (f"after, {mode}", after)):
        # each total first, its parts indented under it
        lines.append(line(f"  {label}: tokens run", [format_tokens(e.tokens_run) for e in ests]))
        lines.append(line("    transient beyond the weights (GiB)", [format_gib(e.memory) for e in ests]))
        lines.append(line("      forward activations (measured)", [format_gib(e.activations) for e in ests]))
        keys: list[str] = []
        for e in ests:
            keys += [k for k in e.buffers if k not in keys]
        for k in keys:
            lines.append(line(f"      {k}", [format_gib(e.buffers.get(k, 0.0)) for e in ests]))
        lines.append(line("    TFLOP per GPU per row", [f"{e.total_flops / 1e12:.1f}" for e in ests]))
        fkeys: list[str] = []
        for e in ests:
            fkeys += [k for k in e.flops if k not in fkeys]
        for k in fkeys:
            lines.append(line(f"      {k}", [f"{e.flops.get(k, 0) / 1e12:.1f}" for e in ests]))
    lines.append(line("  FLOPs per GPU, after / before", [f"{a.total_flops / b.total_flops:.3f}"
                                                         for a, b in zip(after, before)]))
    if steps is not None:
        # the teacher's forward as the measured step ran it (the code's own split, or whole), for comparison
        lines.append(line("  the measured step's teacher forward beyond its start (GiB)",
                          [format_gib(s.mark_peaks.get(FROZEN_FORWARD, s.start_bytes) - s.start_bytes) for s in steps]))
        pb = [teacher_peak(s, e) for s, e in zip(steps, before)]
        pa = [teacher_peak(s, e) for s, e in zip(steps, after)]
        lines.append(line("training GPU peak, before (GiB)", [format_gib(p) for p in pb]))
        lines.append(line("training GPU peak, after (GiB)", [format_gib(p) for p in pa]))
        for g in GPUS:
            lines.append(line(f"  fits {g.name} {g.memory_gib:.0f} GiB, before / after",
                              [f"{'yes' if g.fits(x) else 'no'}/{'yes' if g.fits(y) else 'no'}" for x, y in zip(pb, pa)]))
    for e in after:
        for note in e.notes:
            lines.append(f"  note ({format_tokens(e.tokens)}): {note}")
    lines.append("")
    lines.append(f"{what} communication per layer, MiB sent per GPU per row (forward only: frozen); per row token: bytes")
    lines.append(f"{'layer, scheme':<40}" + "".join(f"{c:>{w}}" for c in cols) + f"{'B/token':>{w}}")
    for i, c in enumerate(comm[0]):
        vals = ["n/a" if math.isnan(x[i].total) else f"{x[i].total / 2 ** 20:,.1f}" for x in comm]
        per = "n/a" if math.isnan(c.per_row_token) else f"{c.per_row_token:,.0f}"
        tail = f"  ({c.note})" if c.note else ""
        lines.append(f"  {c.layer + ', ' + c.scheme:<38}" + "".join(f"{v:>{w}}" for v in vals) + f"{per:>{w}}" + tail)
    return "\n".join(lines)


def format_pool(whole: list[FrozenForward], N: int, replicas: int) -> str:
    """The Serve pool's work per row of a group: N forwards of the whole row before, one after."""
    cols = [format_tokens(f.tokens) for f in whole]
    w = max(9, *(len(c) + 2 for c in cols))
    L = 58
    lines = [f"teacher pool ({replicas} replicas) per row of a group of N = {N}: before, one whole-row forward per "
             f"rank; after, one per row (a replica runs whole rows either way: its memory is unchanged)",
             f"{'':<{L}}" + "".join(f"{c:>{w}}" for c in cols),
             f"{'  forwards per row, before / after':<{L}}" + "".join(f"{f'{N}/1':>{w}}" for _ in whole),
             f"{'  TFLOP per row, before (measured forward x N)':<{L}}"
             + "".join(f"{N * f.flops / 1e12:>{w}.1f}" for f in whole),
             f"{'  TFLOP per row, after':<{L}}" + "".join(f"{f.flops / 1e12:>{w}.1f}" for f in whole)]
    return "\n".join(lines)
