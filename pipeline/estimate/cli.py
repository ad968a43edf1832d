"""`hylo estimate`'s command line: the step estimate (step.py) and, at `--sequence-parallel N`, what splitting a
row adds (sp.py). Its own module so that the estimator and its sequence-parallel part import each other in one
direction only (sp -> step)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from hylo.outputs import write_output_file
from hylo.ownership import WRITTEN_BY
from hylo.pipeline.cli import BadArgument
from hylo.pipeline.config import flag_overrides
from hylo.pipeline.estimate.advice import advise, check_layout, world_sizes
from hylo.pipeline.estimate.args import FLAG_KEYS, estimate_args
from hylo.pipeline.estimate.report import format_table
from hylo.pipeline.estimate.shapes import Shapes, conversion_for_student, conversion_note, shapes_of
from hylo.pipeline.estimate.sp import check_sequence_parallel, estimate_sp, format_sp
from hylo.pipeline.estimate.sp_teacher import (
    TeacherDims,
    check_teacher_split,
    format_pool,
    format_teacher,
    teacher_comm,
    teacher_peak,
    teacher_split,
)
from hylo.pipeline.estimate.step import (
    DOC_TOKENS,
    check_estimate_tokens,
    estimate_step,
    estimate_teacher_replica,
)
from hylo.pipeline.estimate.tracking import Progress
from hylo.pipeline.estimate.wire import format_wire, teacher_wire
from hylo.pipeline.paths import resolve_paths
from hylo.pipeline.teacher.model import torch_dtype
from hylo.pipeline.teacher.protocol import TargetSpec
from hylo.pipeline.teacher.sources import source_kind
from hylo.pipeline.train.config import (
    Stage2Config,
    StageConfig,
    load_stage_config,
    sp_shard_problem,
)
from hylo.pipeline.train.deepspeed_cfg import resolve_dtype


def describe(cfg: StageConfig, shapes: Shapes, W: int, dtype: torch.dtype, config_path: str | None) -> str:
    s = shapes.student
    n_mla = len(s.mla_layers)
    kind = s.linear_type.upper() if s.linear_type != "gdn" else "GDN"
    head = f"stage {cfg.stage} of {config_path or '<defaults>'}: student {n_mla}MLA{s.n_layer - n_mla}{kind} " \
           f"(hidden {s.hidden_size}, vocab {s.vocab_size}), {str(dtype).removeprefix('torch.')}, ZeRO-3 over " \
           f"{W} GPU{'s' if W > 1 else ''}, activation checkpointing {'on' if cfg.model.activation_checkpointing else 'off'}"
    if isinstance(cfg, Stage2Config):
        t = cfg.teacher
        form = f"top-{t.k} + tail" if t.k else t.form
        tshape = ""
        if shapes.teacher is not None:
            tshape = f" {Path(t.model.path).name} shape ({shapes.teacher.num_hidden_layers} layers, hidden " \
                     f"{shapes.teacher.hidden_size})"
        head += f"\nteacher{tshape} {source_kind(t.source).where}, fused KL over {form}"
    return head + "\n" + gpu_count(cfg, W)


def gpu_count(cfg: StageConfig, W: int) -> str:
    """The run's GPUs in all: the W training workers, plus the Serve pool's teacher replicas (each
    `teacher.pool.num_gpus`) where the teacher runs there."""
    line = f"GPUs in all: {W} training"
    if not (isinstance(cfg, Stage2Config) and source_kind(cfg.teacher.source).model_runs == "replicas"):
        where = {True: "the teacher runs on them", False: "the teacher's records are read from the cache"}
        if isinstance(cfg, Stage2Config):
            line += f" ({where[source_kind(cfg.teacher.source).model_runs == 'step']})"
        return line
    pool = cfg.teacher.pool
    gpus = pool.num_replicas * pool.num_gpus
    if not gpus:
        return line + f" (+ {pool.num_replicas} teacher replica(s) on CPU: teacher.pool.num_gpus is 0)"
    each = f"{pool.num_gpus:g} GPU" + ("s" if pool.num_gpus != 1 else "")
    total = W + math.ceil(gpus)
    return (f"GPUs in all: {total} = {W} training + {pool.num_replicas} teacher replica"
            f"{'s' if pool.num_replicas > 1 else ''} x {each} (teacher.pool)")


def frozen_model(cfg: StageConfig, shapes: Shapes, dtype: torch.dtype) -> tuple[Any, str, torch.dtype, bool]:
    """The frozen model a split row splits (stage 1's base, stage 2's teacher in-process or in the pool): its config,
    what it is, its dtype, whether it computes logits (top-k records, streamed logits); (None, ...) if none."""
    if not isinstance(cfg, Stage2Config):
        return shapes.base, "stage 1's base", dtype, False
    t = cfg.teacher
    runs = source_kind(t.source).model_runs
    if runs is None or shapes.teacher is None:
        return None, "", dtype, False
    what = "teacher" if runs == "step" else "teacher replica"
    return shapes.teacher, what, torch_dtype(t.model.dtype), TargetSpec(t.k, t.form).form != "hidden"


def print_teacher(config: Any, what: str, dtype: torch.dtype, lm_head: bool, tokens: list[int], N: int, mode: str,
                  steps: list[Any] | None, replicas: int = 0) -> dict[str, Any]:
    """Print the frozen model per GPU whole (before) and split (after), and the bytes of each scheme; the Serve
    pool's work per row (sp_teacher.py). Returns the figures for --json."""
    after_mode = mode if mode != "whole" else "allgather"
    measured: dict = {}
    kept = what != "stage 1's base"
    progress = Progress(f"[estimate] {what}")

    def priced(T: int, m: str) -> Any:
        run = T if m == "whole" else T // N
        what = f"its forward {'whole' if m == 'whole' else 'split (' + m + ')'}"
        progress.say(f"{what}, {run:,} of the row's {T:,} tokens on each GPU")
        t0 = time.perf_counter()
        out = teacher_split(config, T, N, m, dtype, lm_head, measured, kept)
        progress.say(f"{what}: done in {time.perf_counter() - t0:.0f} s")
        return out

    before = [priced(T, "whole") for T in tokens]
    after = [priced(T, after_mode) for T in tokens]
    b = torch.empty((), dtype=dtype).element_size()
    comm = [teacher_comm(TeacherDims.of(config), T, N, b) for T in tokens]
    name = f"{what} ({config.num_hidden_layers} layers, {config.num_attention_heads} heads, " \
           f"{getattr(config, 'num_key_value_heads', None) or config.num_attention_heads} kv heads)"
    if what == "teacher replica":
        print(format_pool([measured[T] for T in tokens], N, replicas))
        print()
        print(format_teacher(before, after, comm, f"{name} if it ran on the training GPUs"))
    else:
        print(format_teacher(before, after, comm, name, steps))
    if mode == "whole":
        print("(train.sequence_parallel_teacher is whole: the split shown is allgather, the default)")
    out: dict[str, Any] = {"mode": mode, "before": [e.to_dict() for e in before], "after": [e.to_dict() for e in after],
                           "communication": [[dataclasses.asdict(c) | {"total": c.total} for c in x] for x in comm]}
    if steps is not None:
        out["training_gpu_peak"] = {"before": [teacher_peak(s, e) for s, e in zip(steps, before)],
                                    "after": [teacher_peak(s, e) for s, e in zip(steps, after)]}
    return out


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """`hylo estimate`: print the per-GPU memory and the FLOPs of one training step of a config
    (`description`: the help's text, jobs/estimate.py's docstring)."""
    args, cfg = estimate_args(argv, description)
    cfg = resolve_paths(cfg)  # every path relative to this directory, as the stage jobs read them
    # the student's shape comes from its checkpoint, or else (stage 2) from the file's stage-1 conversion; a named
    # student that does not exist is refused as the stages refuse it, unless stage 1 of this config writes it
    stage1 = conversion_for_student(cfg, args.config, args.overrides)
    try:
        tokens = [int(x) for x in args.tokens.split(",")] if args.tokens else [cfg.data.seq_len]
    except ValueError:
        raise BadArgument(f"--tokens={args.tokens}: expected comma-separated integers such as 8192,65536") from None
    if any(t is None or t < 2 for t in tokens):
        raise BadArgument("--tokens: give the row lengths (the config sets no data.seq_len)" if None in tokens
                          else f"--tokens={args.tokens}: every length must be at least 2")
    W = args.world_size or cfg.ray.num_workers

    N = args.sequence_parallel or int(getattr(cfg.train, "sequence_parallel", 1) or 1)
    check_sequence_parallel(N, W, tokens, "--sequence-parallel" if args.sequence_parallel else "train.sequence_parallel",
                            "--world-size" if args.world_size else "ray.num_workers",
                            "--tokens" if args.tokens else "data.seq_len")
    # the step that runs is one rank's: T / N tokens
    check_estimate_tokens([t // N for t in tokens], "--tokens" if args.tokens else "data.seq_len")
    replicas = isinstance(cfg, Stage2Config) and source_kind(cfg.teacher.source).model_runs == "replicas"
    if replicas:
        # the replica's estimate runs one batch of up to teacher.pool.max_batch_tokens
        check_estimate_tokens([cfg.teacher.pool.max_batch_tokens], "teacher.pool.max_batch_tokens")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype] if args.dtype else \
        resolve_dtype(cfg.model.dtype, not args.cpu)
    shapes = shapes_of(cfg, stage1)
    conv = shapes.student.gdn_conv_size if shapes.student.linear_layers else 1
    for T in tokens:
        if why := sp_shard_problem(T, N, conv):
            raise BadArgument(f"{'--sequence-parallel' if args.sequence_parallel else 'train.sequence_parallel'}={N}: "
                              f"{why}")
    frozen, frozen_what, frozen_dtype, lm_head = frozen_model(cfg, shapes, dtype)
    split_key = "--teacher-split" if args.teacher_split else "train.sequence_parallel_teacher"
    if frozen is not None:
        check_teacher_split(TeacherDims.of(frozen), N, cfg.train.sequence_parallel_teacher, split_key, workers=W,
                            tokens=tokens, conv_size=conv)
    # with sequence parallelism: the split step itself, as the last rank of a row that is one document (its MLA
    # layers attend to every earlier key of the row: the worst rank of the worst row)
    def measure(T: int, n: int, w: int, other_worlds: tuple[int, ...] = (), what: str = "", count: str = "") -> Any:
        over = f" over {n} GPUs" if n > 1 else ""
        return estimate_step(cfg, T, w, dtype, gpu=not args.cpu, shapes=shapes, stage1=stage1, sequence_parallel=n,
                             doc_tokens=(T, T) if n > 1 else DOC_TOKENS, other_worlds=other_worlds,
                             progress=Progress(f"[estimate] {what}{T:,} tokens{over}{count}"))

    # the per-GPU peak at larger world sizes too, tracked in the same pass (the advice's ZeRO-3 figures)
    ests = [measure(T, N, W, tuple(world_sizes(W)), count=f" ({i}/{len(tokens)})") for i, T in enumerate(tokens, 1)]
    note = conversion_note(cfg, stage1)
    print(describe(cfg, shapes, W, dtype, args.config) + (f"\n{note}" if note else "")
          + (f"\nsequence parallel: each row split by tokens over N = {N} GPUs ({W // N} group{'s' if W // N > 1 else ''})" if N > 1 else ""))
    # "written_by": the file says it is ours, so a later run may replace it (hylo.ownership.is_own_file)
    out: dict[str, Any] = {"written_by": WRITTEN_BY, "config": args.config, "stage": args.stage, "world_size": W,
                           "sequence_parallel": N, "estimates": [e.to_dict() for e in ests]}
    mode = cfg.train.sequence_parallel_teacher
    teacher_fix: list[tuple[str, float] | None] = [None] * len(tokens)
    if N > 1:
        sp = [estimate_sp(cfg, T, N, W, dtype, e, shapes.student, split=True) for T, e in zip(tokens, ests)]
        print(format_sp(sp))
        out["sequence_parallel_estimates"] = [e.to_dict() for e in sp]
        if frozen is not None:
            print()
            in_step = frozen_what != "teacher replica"
            out["teacher_split"] = print_teacher(frozen, frozen_what, frozen_dtype, lm_head, tokens, N, mode,
                                                 ests if in_step else None,
                                                 cfg.teacher.pool.num_replicas if replicas else 0)
            if in_step and mode == "whole":
                teacher_fix = [("allgather", p) for p in out["teacher_split"]["training_gpu_peak"]["after"]]
    else:
        print(format_table("training GPU:", ests))
    teacher_dims = TeacherDims.of(frozen) if frozen is not None else None

    def load(keys: list[str]) -> StageConfig:
        return load_stage_config(args.stage, args.config, [*args.overrides, *flag_overrides(args, FLAG_KEYS), *keys])

    advice: list[str] = []
    out["advice"] = []
    for i, (T, e) in enumerate(zip(tokens, ests)):
        lines, records = advise(T, e.peak_bytes, W, N, e.peaks_by_world,
                                lambda w, n, T=T: check_layout(load, T, w, n, (W, N), conv, teacher_dims, mode),
                                lambda n, w, T=T: measure(T, n, w, what="advice: ").peak_bytes, teacher_fix[i])
        advice += lines
        out["advice"] += records
    if advice:
        print("\nwhere a GPU does not fit, the smallest change that fits it (each checked by the config's rules first):")
        print("\n".join(advice))
    if replicas:
        # a replica runs whole rows: before, once per rank of a group (each answered with its range); after, once
        # per row of a group
        teach = [estimate_teacher_replica(cfg, T, shapes, progress=Progress(
                    f"[estimate] teacher replica, {T:,} tokens ({i}/{len(tokens)})", what=""))
                 for i, T in enumerate(tokens, 1)]
        print()
        print(format_table(f"teacher replica GPU (teacher.pool: {cfg.teacher.pool.num_replicas} replicas, "
                           f"{teach[0].notes[0]}):", teach))
        out["teacher_replica"] = [e.to_dict() for e in teach]
        t = cfg.teacher
        wires = [teacher_wire(t, shapes.teacher, T) for T in tokens]
        for w in wires:
            print()
            print(format_wire(w, t.form, t.model.dtype, t.client.dtype))
        out["teacher_wire"] = [w.to_dict() | {"form": t.form} for w in wires]
    print("\nThe step runs on fake tensors (pipeline/estimate/): ZeRO-3 sharding is arithmetic on the "
          "real sizes; times are the FLOPs of each dtype at its dense peak, a lower bound.")
    if N > 1:
        print("Sequence parallelism (pipeline/estimate/sp.py): the split step itself, measured as the last rank "
              "of a row that is one document, its collectives on torch's fake process group, SDPA counted as a "
              "fused kernel; the communication is ANALYTIC, from the layers' shapes (checked against the "
              "collectives of one split layer of each kind in tests/train/test_estimate_sp.py).")
        if frozen is not None:
            print("The teacher split (pipeline/estimate/sp_teacher.py): its forward measured whole and, split, as the "
                  "last rank under seq_parallel.split_attention on the fake group; its bytes ANALYTIC, checked "
                  "against split_attention's collectives in the same test file.")
    if args.json:
        write_output_file(args.json, json.dumps(out, indent=1, default=str) + "\n")
    return 0
