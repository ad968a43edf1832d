"""The estimate of one training step (`estimate_step`: see the package docstring), of one teacher replica of the
Serve pool (`estimate_teacher_replica`) and of one measured call (`estimate_call`, for bench/gpu_check.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from hylo.kernels.backend import forced_mode
from hylo.kernels.fused_kl.chunked import auto_chunk_size
from hylo.kernels.fused_kl.inputs import deferred_checks

# --world-size: the ZeRO-3 world the per-GPU figures divide by (bounded with every flag in pipeline/cli.py)
from hylo.pipeline.cli import (
    MAX_WORLD_SIZE,  # noqa: F401
    BadArgument,
)
from hylo.pipeline.data.rows import PackedRow, check_row
from hylo.pipeline.estimate.fake import EstimateError, build_model, fake_tensors, flop_registry
from hylo.pipeline.estimate.fake_group import split_rank
from hylo.pipeline.estimate.gpus import GPU, GPUS
from hylo.pipeline.estimate.shapes import Shapes, ShapeTeacher, shapes_of
from hylo.pipeline.estimate.tracking import (
    MarkedCall,
    MarkedSource,
    Phases,
    Progress,
    StepMemory,
    TrackedEngine,
    loss_marked,
)
from hylo.pipeline.teacher.model import TeacherModel, torch_dtype
from hylo.pipeline.train import stage1, stage2
from hylo.pipeline.train.config import DataSection, Stage1Config, Stage2Config, StageConfig, SyntheticData
from hylo.pipeline.train.loop import train_step
from hylo.pipeline.train.plain_engine import plain_engine
from hylo.pipeline.train.row_sources import SyntheticRows
from hylo.pipeline.train.worker import SoloContext

# DeepSpeed's default limit of gathered parameter elements (stage3_max_live_parameters)
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000
# tokens of each document of the synthetic row, drawn uniformly: chat-length documents, an assumption (not
# measured from a data set)
DOC_TOKENS = (256, 2048)


# The longest row `hylo estimate` takes. The step runs on fake tensors in time linear in T (the chunked scans
# loop over T / 64 chunks): 3-4 ms of CPU per token for the 1B and 3B recipes (their 128K rows took 7 and 8.5
# minutes, README), so 2^20 tokens take about an hour; the packed row itself is a real host tensor (its ids,
# positions, labels: 2^40 tokens would be terabytes). `MAX_ESTIMATE_TOTAL` bounds the sum of --tokens.
MAX_ESTIMATE_TOKENS = 1 << 20
MAX_ESTIMATE_TOTAL = 2 * MAX_ESTIMATE_TOKENS


@dataclass
class Estimate:
    """One step's estimate: memory per GPU (bytes, by part and by phase, and the peak) and FLOPs (by phase and by
    dtype class), at `tokens` tokens a row over `world_size` GPUs. `to_dict()` is what `hylo estimate --json`
    writes of it."""

    stage: int
    tokens: int
    world_size: int
    dtype: str
    parameters: int
    trainable_parameters: int
    # per GPU, bytes
    memory: dict[str, float]
    peak_bytes: float
    peak_phase: str
    loss_chunk_bytes: float
    flops: dict[str, int]
    host_reads: list[str]
    # per GPU at the step's start (states, frozen weights) and the peak of each phase of the step
    start_bytes: float = 0.0
    phase_peaks: dict[str, float] = field(default_factory=dict)
    peaks_by_world: dict[int, float] = field(default_factory=dict)
    # per GPU, the peak inside the frozen model's forward (tracking.FROZEN_FORWARD) and outside it ("unmarked")
    mark_peaks: dict[str, float] = field(default_factory=dict)
    # (op, operand shapes, calls, FLOPs) of the step's matrix products, largest first
    gemms: list[tuple[str, tuple, int, int]] = field(default_factory=list)
    teacher_parameters: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # phase -> the dtype class its matrix products run at on a GPU (flops.py) -> FLOPs
    flops_by_dtype: dict[str, dict[str, int]] = field(default_factory=dict)
    # per GPU, the fused loss's bytes at the peak when the peak falls inside the loss (a part of the activations)
    loss_at_peak: float | None = None

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    @property
    def gemm_flops_by_dtype(self) -> dict[str, int]:
        """The row's matrix-product FLOPs by dtype class, over every phase."""
        return dtype_totals(self.flops_by_dtype)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["total_flops"] = self.total_flops
        by_dtype = self.gemm_flops_by_dtype
        d["gemm_flops_by_dtype"] = {k: v / 1e12 for k, v in by_dtype.items()}
        d["gpus"] = {g.name: gpu_figures(g, self.peak_bytes, self.total_flops, by_dtype) for g in GPUS}
        return d


def dtype_totals(by_phase: dict[str, dict[str, int]]) -> dict[str, int]:
    """dtype class -> FLOPs summed over the phases, largest first."""
    out: dict[str, int] = {}
    for classes in by_phase.values():
        for k, v in classes.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def gpu_figures(g: GPU, peak_bytes: float, total_flops: float, by_dtype: dict[str, int]) -> dict[str, Any]:
    """A GPU's entry of `--json`: fits, the time at each dtype's dense peak (`seconds`, None when a class has
    no rate: `unpriced`), each class's share, and the time had every FLOP run at the bf16 peak."""
    return {"fits": g.fits(peak_bytes), "seconds": g.time(by_dtype), "seconds_by_dtype": g.seconds_by_dtype(by_dtype),
            "unpriced": [k for k, n in by_dtype.items() if n and g.rate(k) is None],
            "seconds_at_bf16_peak": g.seconds(total_flops)}


def synthetic_row(tokens: int, vocab: int, doc_tokens: tuple[int, int] = DOC_TOKENS, seed: int = 0) -> PackedRow:
    """A packed row of `tokens` tokens (documents of random length in `doc_tokens`, the second half of each
    scored), as the training reader yields it: `pipeline/train/rows.SyntheticRows`, checked."""
    lo, hi = min(doc_tokens[0], tokens), min(doc_tokens[1], tokens)
    data = DataSection(source="synthetic", seq_len=tokens, synthetic=SyntheticData(vocab_size=vocab, min_doc_len=lo,
                                                                                   max_doc_len=hi))
    return check_row(SyntheticRows(data, seed).raw(0))


def _state_bytes(tensors) -> int:
    """Bytes of distinct storages, as MemTracker counts CPU storages (exact: it rounds CUDA ones only)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if id(st) in seen:
            continue
        seen.add(id(st))
        total += st.nbytes()
    return total


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]



def gpu_chunk_size(tokens: int, vocab: int) -> int:
    """The fused KL's chunk rows as a GPU picks them (fp32 compute, the accelerator's byte budget)."""
    return auto_chunk_size(tokens, vocab, torch.device("cuda"), torch.float32)



def check_estimate_tokens(tokens: list[int], flag: str = "--tokens") -> None:
    """Refuse rows the estimate cannot finish (BadArgument naming the flag): see MAX_ESTIMATE_TOKENS."""
    given = ",".join(map(str, tokens))
    for t in tokens:
        if t > MAX_ESTIMATE_TOKENS:
            raise BadArgument(
                f"{flag}={given}: {t:,} tokens is more than the estimate can run, at most {MAX_ESTIMATE_TOKENS:,} "
                f"(2^20) a row: the step runs on fake tensors at about 3-4 ms of CPU per token (a 128K row of the 3B "
                f"recipe: 8.5 min), so 2^20 tokens already take about an hour, and the row is a real host tensor")
    if sum(tokens) > MAX_ESTIMATE_TOTAL:
        raise BadArgument(f"{flag}={given}: {sum(tokens):,} tokens in all is more than the estimate can run in one call, "
                          f"at most {MAX_ESTIMATE_TOTAL:,} (2 x 2^20; about 3-4 ms of CPU per token): split the lengths "
                          f"over several calls")


def build_task(ctx: SoloContext, shapes: Shapes, gpu: bool) -> tuple[Any, nn.Module | None]:
    """The stage's task from its own build (`stage1.build` / `stage2.build`) on the current (fake) mode: models of
    `shapes` in ctx.dtype, `TrackedEngine` (AdamW's multi-tensor form on the accelerator's rule `gpu`), the
    teacher at its shape; and the frozen model the step runs (the base, the in-process teacher, else None)."""
    def student() -> nn.Module:
        return build_model(shapes.student, ctx.dtype)

    engine = plain_engine(ctx.cfg.optim, TrackedEngine, foreach=gpu)
    if isinstance(ctx.cfg, Stage1Config):
        task = stage1.build(ctx, student=student, base=lambda: build_model(shapes.base, ctx.dtype), engine=engine)
        return task, task.base.base
    teacher = ShapeTeacher(ctx.cfg, shapes)
    task = stage2.build(ctx, student=student, engine=engine, teacher=teacher)
    return task, teacher.model


def estimate_step(cfg: StageConfig, tokens: int, world_size: int | None = None, dtype: torch.dtype = torch.bfloat16,
                  gpu: bool = True, shapes: Shapes | None = None, stage1: Stage1Config | None = None,
                  doc_tokens: tuple[int, int] = DOC_TOKENS, count_flops: bool = True,
                  variant: Callable[..., Any] | None = None, other_worlds: tuple[int, ...] = (),
                  progress: Progress | None = None, sequence_parallel: int = 1) -> Estimate:
    """Memory per GPU and FLOPs of one step of `cfg`'s stage on rows of `tokens` tokens (see the module
    docstring). `world_size`: the ZeRO-3 world (default: the config's ray.num_workers). `gpu`: the
    accelerator's rules (deferred checks, its chunk size); False runs the CPU path as a CPU step runs it.
    `variant(task, frozen_model) -> (task, frozen_model)`: changes the built task (the paper's comparison
    forms, bench only). `other_worlds`: also the per-GPU peak at these world sizes (`Estimate.peaks_by_world`).
    `progress`: where its progress lines go (None: none)."""
    t0 = time.perf_counter()
    W = world_size or cfg.ray.num_workers
    shapes = shapes or shapes_of(cfg, stage1)
    vocab = shapes.student.vocab_size
    if isinstance(cfg, Stage2Config) and gpu and cfg.kd.chunk_size is None:
        cfg = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, chunk_size=gpu_chunk_size(tokens, vocab)))
    N = sequence_parallel
    warm = min(256, tokens) // N * N
    warm_row = synthetic_row(warm, vocab, (min(64, warm), min(128, warm)), seed=1)
    row = synthetic_row(tokens, vocab, doc_tokens)
    stage = 1 if isinstance(cfg, Stage1Config) else 2
    rules = deferred_checks() if gpu else contextlib.nullcontext()
    # sequence parallelism: the LAST rank of a group of N on torch's fake process group (fake_group.split_rank)
    split = contextlib.nullcontext()
    if N > 1:
        if dist.is_available() and dist.is_initialized():
            raise EstimateError("the split step runs on a fake process group, and this process has a process group")

        split = split_rank(N, deepspeed_comm=getattr(cfg.train, "sequence_parallel_teacher", "") == "ulysses")
    with split, fake_tensors(gpu) as host, rules:
        memory = StepMemory(W, host)
        memory.other_worlds = tuple(other_worlds)
        if progress is not None:
            progress.say("building the models")
        ctx = SoloContext(cfg=cfg, rank=N - 1, world_size=N, device=torch.device("cpu"), dtype=dtype,
                          run_dir=Path("."), grad_accum=1, sp_group=None, sp_rank=N - 1, sequence_parallel=N)
        task, frozen = build_task(ctx, shapes, gpu)
        if variant is not None:
            task, frozen = variant(task, frozen)
        engine: TrackedEngine = task.engine
        if progress is not None:
            progress.say(f"warm-up step ({warm_row.num_tokens} tokens)")
        train_step(task, [warm_row], ctx)
        student_params = [p for p in engine.params]
        masters = [m for p, m in zip(engine.params, engine.masters) if m is not p]
        p_bytes, m_bytes = _state_bytes(student_params), _state_bytes(masters)
        o_bytes = _state_bytes(_optimizer_tensors(engine.optimizer))
        frozen_params = list(frozen.parameters()) if frozen is not None else []
        f_bytes = _state_bytes(frozen_params)
        memory.sharded_static = p_bytes + m_bytes + o_bytes
        host.flop_registry = flop_registry() if count_flops else None
        phases = Phases(host, memory, progress)
        engine.phases = phases
        hooks = []
        if progress is not None:
            progress.phases = phases
            hooks = progress.watch(task.student, "student") + progress.watch(frozen, "base" if stage == 1 else "teacher")
        if stage == 2:
            task.teacher.source = MarkedSource(task.teacher.source, phases)
        else:
            task.base = MarkedCall(task.base, phases)
        host.reads.clear()
        host.gemms.clear()
        tracker = memory.tracker
        tracker.track_external(task.engine.module, engine.optimizer, *masters, *frozen_params)
        with tracker, loss_marked(phases):
            memory.phase, memory.active = "forward/backward", True
            memory.peak = 0.0
            base_total = memory.total()
            start = base_total - memory.sharded_static + memory.sharded_static / W
            phases._account()
            train_step(task, [row], ctx)
            phases._account()
            memory.active = False
        for h in hooks:
            h.remove()
        if progress is not None:
            progress.say(f"done in {time.perf_counter() - t0:.0f} s")
    at = memory.at_peak
    W_shard = W
    grads = at.get("gradients", 0) / W_shard
    other = at.get("total", 0) - memory.sharded_static - at.get("gradients", 0) - f_bytes
    opt_temps = 0.0
    if at.get("phase") == "optimizer":
        floor = memory.step_floor or 0.0
        opt_temps = (at["total"] - floor - memory.sharded_static - at.get("gradients", 0)) / W_shard
        other = floor - f_bytes
    mem = {"parameters": p_bytes / W, "gradients": grads, "optimizer states (fp32 master + AdamW)": (m_bytes + o_bytes) / W,
           "optimizer step temporaries": opt_temps, "activations, temporaries, loss buffers": other,
           "frozen model" if stage == 1 else "teacher weights": f_bytes}
    el = next(iter(engine.params)).element_size()
    n = sum(p.numel() for p in engine.params)

    def zero3(world: int) -> float:
        if world == 1:
            return 0.0
        return min(n, ZERO3_MAX_LIVE_PARAMETERS) * el * (1 - 1 / world) + cfg.deepspeed.reduce_bucket_size * el

    zero = zero3(W)
    if zero:
        mem["ZeRO-3 gathered parameters + reduce bucket"] = zero
    peak = memory.peak + zero
    by_world = {w: v + zero3(w) for w, v in memory.other_peaks.items()}
    by_world[W] = peak
    flops = {k: v for k, v in phases.flops.items() if v}
    n_params = sum(p.numel() for p in task.student.parameters())
    return Estimate(stage=stage, tokens=tokens, world_size=W, dtype=str(dtype).removeprefix("torch."),
                    parameters=n_params, trainable_parameters=sum(p.numel() for p in engine.params), memory=mem,
                    peak_bytes=peak, peak_phase=str(at.get("phase")), loss_chunk_bytes=max(phases.loss_peaks, default=0.0),
                    flops=flops, host_reads=sorted(set(host.reads)), start_bytes=start + zero, peaks_by_world=by_world,
                    phase_peaks={k: v + zero for k, v in memory.phase_peaks.items()},
                    mark_peaks={k: v + zero for k, v in memory.mark_peaks.items()},
                    gemms=sorted(((op, shp, c, f) for (op, shp), (c, f) in host.gemms.items()), key=lambda g: -g[3]),
                    teacher_parameters=sum(p.numel() for p in frozen_params), seconds=time.perf_counter() - t0,
                    flops_by_dtype={k: v for k, v in phases.by_dtype.items() if any(v.values())},
                    loss_at_peak=at.get("loss_share"))


def estimate_teacher_replica(cfg: Stage2Config, tokens: int, shapes: Shapes | None = None,
                             doc_tokens: tuple[int, int] = DOC_TOKENS, progress: Progress | None = None) -> Estimate:
    """One GPU of the teacher pool (`teacher.source: serve`): its `TeacherModel` over one batch of rows
    (as many rows of `tokens` as `teacher.pool.max_batch_tokens` holds, at least one), giving top-k records
    (`teacher.k` > 0) or the logit chunks of one row's stream. Weights and the forward's peak. `progress`: where
    its progress lines go (None: none)."""
    t0 = time.perf_counter()
    shapes = shapes or shapes_of(cfg)
    t = cfg.teacher
    vocab = shapes.teacher.vocab_size
    n_rows = max(1, t.pool.max_batch_tokens // tokens)
    rows = [synthetic_row(tokens, vocab, doc_tokens, seed=i) for i in range(n_rows)]
    memory = StepMemory(1)
    with fake_tensors() as host:
        memory.host = host
        if progress is not None:
            progress.say(f"building the teacher; then its forward over {n_rows} row(s) of {tokens:,} tokens")
        model = build_model(shapes.teacher, torch_dtype(t.model.dtype))
        m = t.model
        teacher = TeacherModel(model, dtype=m.dtype, device="cpu", isolation=m.isolation,
                               logits_chunk_tokens=m.logits_chunk_tokens, max_forward_tokens=m.max_forward_tokens)
        params = list(model.parameters())
        w_bytes = _state_bytes(params)
        host.flop_registry = flop_registry()
        phases = Phases(host, memory, progress)
        hooks = []
        if progress is not None:
            progress.phases = phases
            hooks = progress.watch(model, "teacher")
        memory.tracker.track_external(*params)
        with memory.tracker:
            memory.phase, memory.active = "teacher forward", True
            base = memory.total()
            with phases.phase("teacher forward"):
                if t.k > 0:
                    teacher.topk_batch(rows, t.k, t.client.dtype)
                else:
                    hidden = teacher.hidden_batch(rows[:1])[0]
                    for _ in teacher.logits_chunks(hidden):
                        pass
            memory.active = False
        for h in hooks:
            h.remove()
    if progress is not None:
        progress.say(f"done in {time.perf_counter() - t0:.0f} s")
    return Estimate(stage=2, tokens=tokens, world_size=1, dtype=t.model.dtype, parameters=sum(p.numel() for p in params),
                    trainable_parameters=0,
                    memory={"teacher weights": w_bytes, "activations, temporaries, loss buffers": memory.peak - w_bytes},
                    peak_bytes=memory.peak, peak_phase="teacher forward", loss_chunk_bytes=0.0,
                    flops={k: v // n_rows for k, v in phases.flops.items() if v}, host_reads=sorted(set(host.reads)),
                    start_bytes=float(base), teacher_parameters=sum(p.numel() for p in params),
                    seconds=time.perf_counter() - t0,
                    notes=[f"a batch of {n_rows} row(s) of {tokens} tokens (teacher.pool.max_batch_tokens "
                           f"{t.pool.max_batch_tokens})"],
                    flops_by_dtype={p: {k: v // n_rows for k, v in c.items()} for p, c in phases.by_dtype.items()
                                    if any(c.values())})



def estimate_call(setup: Callable[[], Any], run: Callable[[Any], Any], gpu: bool = True) -> float:
    """Peak bytes `run(setup())` allocates beyond what `setup()` made (inputs, modules, their states): the
    estimate of one measured call, for bench/gpu_check.py. Both run on fake CPU tensors, on the torch kernel
    paths (`HYLO_KERNELS=torch`'s), under the accelerator's rules of the fused KL and fla's scans when `gpu`."""
    rules = deferred_checks() if gpu else contextlib.nullcontext()
    with fake_tensors(gpu) as host, forced_mode("torch"), rules:
        state = setup()
        memory = StepMemory(1, host)
        tracked = [x for x in tree_leaves(state, is_leaf=lambda x: isinstance(x, nn.Module))
                   if isinstance(x, torch.Tensor | nn.Module)]
        memory.tracker.track_external(*tracked)
        with memory.tracker:
            memory.phase, memory.active = "call", True
            base = memory.total()
            memory.peak = float(base)
            run(state)
            memory.active = False
    return memory.peak - base
