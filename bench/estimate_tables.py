"""The paper's memory table and our recipes' steps by GPU, from the step estimate (pipeline/estimate/).

    python bench/estimate_tables.py                     # both tables (the step on fake tensors, CPU only)
    python bench/estimate_tables.py --paper             # the paper's table only
    python bench/estimate_tables.py --recipes --tokens 8192 65536

1. The paper's table (HyLo, arXiv 2604.24715; docs/recipes.md#published-figures): its 1B 4MLA12M2 student
   (Llama-3.2-1B converted as configs/llama-3.2-1b-8mla8gdn-64k.yaml converts it, with Mamba-2 in 12 layers
   and MLA in layers 0, 5, 10, 15), a Llama-3.1-8B-shaped teacher in the trainer's process, 64K tokens, bf16, AdamW,
   per GPU. Each row is stage 2's own step (`pipeline/train/stage2.train_step`) with the loss the row names:
   * plain CE: the model's own forward with labels (`HyLoForCausalLM.forward`: full logits, fp32 CE);
   * fused linear CE: `fused_linear_cross_entropy` (kernels/fused_kl);
   * plain KL: `naive_kl_div` (kernels/fused_kl/naive.py: full student and teacher logits, what published
     distillation code does), the teacher's hidden states and LM head as its input;
   * fused KL: `fused_linear_kl_div` over the teacher's full logits, materialised [T, V] by the teacher's
     own LM head (`TeacherModel.logits_chunks` over the row, concatenated);
   * fused KL over hidden states: stage 2 as configured in-process (`teacher.exact_form: hidden`).
   The paper does not say its world size: ours is given at ZeRO-3 over 8 GPUs (its 8x MI300X node) and
   at 1 (no sharding).
2. Our recipes (configs/*-64k.yaml) at 8K / 32K / 64K / 128K tokens: the training GPU (ZeRO-3 over the
   config's training workers, top-64 targets from the Serve pool) and one teacher replica GPU, and which
   GPUs each fits (`GPU.fits`: peak within 90 % of the memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hylo.kernels.fused_kl import fused_linear_cross_entropy, fused_linear_kl_div, naive_kl_div  # noqa: E402
from hylo.pipeline.estimate import (  # noqa: E402
    GPUS,
    Shapes,
    estimate_step,
    estimate_teacher_replica,
    model_config,
    shapes_of,
)
from hylo.pipeline.teacher.protocol import StreamedLogits  # noqa: E402
from hylo.pipeline.train.config import load_stage_config  # noqa: E402
from hylo.upcycle.options import hybrid_config_from_base  # noqa: E402

RECIPE_1B = REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml"
RECIPES = [RECIPE_1B, REPO / "configs" / "llama-3.2-3b-14mla14gdn-64k.yaml",
           REPO / "configs" / "qwen3-1.7b-7mla21gdn-64k.yaml"]
GIB = 1 << 30
PAPER_OOM = "OOM on 192 GB"
# (row, teacher, loss, activation checkpointing, the paper's figure in GiB or PAPER_OOM)
PAPER_ROWS = [
    ("no teacher + checkpointing", False, "plain CE", True, 131.0),
    ("no teacher + checkpointing + fused linear CE", False, "fused CE", True, 29.6),
    ("8B teacher, plain loss", True, "plain KL", False, PAPER_OOM),
    ("8B teacher, fused KL alone", True, "fused KL (logits)", False, PAPER_OOM),
    ("8B teacher, checkpointing alone", True, "plain KL", True, PAPER_OOM),
    ("8B teacher, fused KL over hidden states", True, "fused KL (hidden)", False, 158.8),
    ("8B teacher, fused KL + checkpointing", True, "fused KL (logits)", True, 144.8),
    ("8B teacher, fused KL over hidden states + checkpointing", True, "fused KL (hidden)", True, 54.2),
]


def paper_student():
    convert = dataclasses.replace(load_stage_config(1, RECIPE_1B).model.convert, linear_type="mamba2",
                                  mla_layers=[0, 5, 10, 15])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hybrid_config_from_base(model_config("Llama-3.2-1B-Instruct", "model.base"), convert)


def comparison_variant(loss: str, teacher: bool):
    """The `variant` of `estimate_step` that gives the built stage-2 task the row's loss and teacher."""
    class ComparisonStudent(nn.Module):
        """KDStudent's interface, forward(ids, bounds, loss mask, teacher, ...) -> (loss, 0), with the row's loss
        form (a whole row: the positions, labels and shard the step also gives are the row's own or None)."""

        def __init__(self, student: nn.Module, kd) -> None:
            super().__init__()
            self.student, self.kd = student, kd

        def forward(self, input_ids_T, bounds, loss_mask_T, targets, *_):
            zero = torch.zeros((), dtype=torch.float32)
            ids, pos = input_ids_T[None], bounds.positions[None]
            if loss == "plain CE":
                out = self.student(input_ids=ids, position_ids=pos, cu_seqlens=bounds, labels=ids)
                return out.loss, zero
            h = self.student.model(input_ids=ids, position_ids=pos, cu_seqlens=bounds).last_hidden_state[0]
            w = self.student.lm_head.weight
            if loss == "fused CE":
                return fused_linear_cross_entropy(h, w, torch.roll(input_ids_T, -1), mask=loss_mask_T,
                                                  reduction="sum", chunk_size=self.kd.chunk_size), zero
            if loss == "plain KL":
                # every token (a masked selection of a [T] vector changes no memory figure)
                return naive_kl_div(h, w, **targets, reduction="sum"), zero
            return fused_linear_kl_div(h, w, **targets, mask=loss_mask_T, reduction="sum",
                                       chunk_size=self.kd.chunk_size), zero

    class NoTeacher:
        def targets(self, rows, spec):
            for _ in rows:
                yield {}

    class FullTeacherLogits:
        """The teacher's logits of the whole row [T, V] at once, sliced for the fused KL."""

        def __init__(self, model) -> None:
            self.model = model

        def targets(self, rows, spec):
            for r in rows:
                full = torch.cat(list(self.model.logits_chunks(self.model.hidden(r))))
                # one "chunk" holding the whole row: the fused KL reads its slices
                yield {"teacher_logits_fn": StreamedLogits(iter([full]))}

    def variant(task, frozen):
        task.engine.module = ComparisonStudent(task.student, task.cfg.kd)
        if not teacher:
            task.teacher.source = NoTeacher()
            return task, None
        if loss == "fused KL (logits)":
            task.teacher.source = FullTeacherLogits(task.teacher.source)
        return task, frozen

    return variant


def paper_table(tokens: int = 65536, worlds: tuple[int, int] = (8, 1)) -> list[dict]:
    shapes = Shapes(paper_student(), teacher=model_config("Llama-3.1-8B-Instruct", "teacher.model.path"))
    W, other = worlds
    out = []
    print(f"The paper's memory table: 1B 4MLA12M2 student, Llama-3.1-8B teacher in the trainer, {tokens} tokens, "
          f"bf16, per GPU (ours: ZeRO-3 over {W} and over {other})", flush=True)
    print(f"{'':<58}{'paper':>14}{f'ours W={W}':>12}{f'ours W={other}':>12}   fits (W={W})")
    for name, teacher, loss, ac, paper in PAPER_ROWS:
        over = ["teacher.source=inprocess", "teacher.k=0", "teacher.exact_form=hidden", "teacher.model.dtype=bfloat16",
                "teacher.model.isolation=per_doc", f"model.activation_checkpointing={str(ac).lower()}",
                f"ray.num_workers={W}", f"train.global_batch_sequences={W}"]
        cfg = load_stage_config(2, RECIPE_1B, over)
        # the variant's step, so the estimate's loss-window marks see the variant's loss too
        est = estimate_step(cfg, tokens, W, torch.bfloat16, gpu=True, shapes=shapes,
                            variant=comparison_variant(loss, teacher), other_worlds=(other,))
        mine, mine1 = est.peak_bytes / GIB, est.peaks_by_world[other] / GIB
        fits = " ".join(g.name for g in GPUS if g.fits(est.peak_bytes)) or "none"
        shown = paper if isinstance(paper, str) else f"{paper:.1f} GiB"
        print(f"{name:<58}{shown:>14}{mine:>9.1f} GiB{mine1:>9.1f} GiB   {fits}  ({est.seconds:.0f} s)", flush=True)
        out.append({"row": name, "loss": loss, "teacher": teacher, "checkpointing": ac, "paper": paper,
                    "estimate": est.to_dict(), f"peak_gib_w{W}": mine, f"peak_gib_w{other}": mine1})
    return out


def recipes_table(tokens: list[int]) -> list[dict]:
    out = []
    for path in RECIPES:
        cfg = load_stage_config(2, path)
        shapes = shapes_of(cfg, load_stage_config(1, path))
        W = cfg.ray.num_workers
        s = shapes.student
        n_mla = len(s.mla_layers)
        print(f"\n{path.name}: student {n_mla}MLA{s.n_layer - n_mla}GDN, stage 2, bf16, ZeRO-3 over {W} training "
              f"GPUs; teacher {Path(cfg.teacher.model.path).name} in the Serve pool "
              f"({cfg.teacher.pool.num_replicas} replicas), top-{cfg.teacher.k} targets", flush=True)
        print(f"{'tokens':>8} {'training GPU':>13} {'teacher GPU':>12}  " + "  ".join(f"{g.name:>7}" for g in GPUS)
              + "   student / teacher TFLOP per row")
        for T in tokens:
            t0 = time.perf_counter()
            train = estimate_step(cfg, T, W, torch.bfloat16, gpu=True, shapes=shapes)
            teach = estimate_teacher_replica(cfg, T, shapes)
            fits = ["both" if g.fits(train.peak_bytes) and g.fits(teach.peak_bytes) else
                    "train" if g.fits(train.peak_bytes) else "teacher" if g.fits(teach.peak_bytes) else "no"
                    for g in GPUS]
            print(f"{T:>8} {train.peak_bytes / GIB:>9.1f} GiB {teach.peak_bytes / GIB:>8.1f} GiB  "
                  + "  ".join(f"{f:>7}" for f in fits)
                  + f"   {train.total_flops / 1e12:.0f} / {teach.total_flops / 1e12:.0f}"
                  f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            out.append({"config": path.name, "tokens": T, "training": train.to_dict(), "teacher": teach.to_dict()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true", help="the paper's table only")
    p.add_argument("--recipes", action="store_true", help="the recipes' table only")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    p.add_argument("--paper-tokens", type=int, default=65536, help="the row length of the paper's table")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    both = not (args.paper or args.recipes)
    out: dict = {}
    if args.paper or both:
        out["paper"] = paper_table(args.paper_tokens)
    if args.recipes or both:
        out["recipes"] = recipes_table(args.tokens)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
