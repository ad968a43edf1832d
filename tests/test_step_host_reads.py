"""Host reads (GPU synchronisations) in one stage-2 step, counted on CPU under the GPU rule.

`pipeline/train/stage2.train_step` at world size 1 with `PlainEngine` (DeepSpeed's part of the step in
plain torch), a tiny HyLo student and an in-process tiny HyLo teacher, fused KL over hidden states,
activation checkpointing. `hylo.kernels.host_reads.HostReadLog` logs every host read made from Python and
`deferred_checks()` gives the fused KL's inputs the accelerator's rule. On CPU every tensor is a host
tensor, so the log also holds reads that are free on a GPU (the packed row and the host-int chunk
layout are CPU tensors there too); each allowed caller below says why it is allowed. A read anywhere
else (the model's forward or backward, the fused KL, the step's per-row loop) fails the test.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hylo.kernels.fused_kl.inputs import check_deferred, deferred_checks
from hylo.kernels.host_reads import HostReadLog

from hylo.config import HybridConfig
from hylo.modeling import HyLoForCausalLM

V = 64

# (file suffix, function) -> the reads allowed there in one step of G rows, as (op name, count per step or
# per row); anything not listed is a failure
ALLOWED = {
    # the packed row as read, checked on the host (CPU tensors on any machine)
    ("kernels/varlen.py", "check_row"): "host row",
    ("kernels/varlen.py", "host_cu_seqlens"): "host row",
    ("kernels/varlen.py", "documents"): "host row",
    ("pipeline/teacher/model.py", "_check_vocab"): "host row",
    # the chunked torch scan's layout from the bounds' host ints (CPU tensors; fla takes them on GPU)
    ("kernels/varlen.py", "chunk_layout"): "host ints",
    # AdamW's step counters are CPU tensors (torch keeps them there unless capturable)
    ("pipeline/train/plain_engine.py", "step"): "optimizer step counters",
}
# reads that must happen exactly this many times per step: the step's one read of its loss sums, the
# fused KL's deferred input checks read with it, and the clipped gradient norm
ONCE_PER_STEP = {
    ("pipeline/train/stage2.py", "train_step", "tolist"): 1,
    ("kernels/fused_kl/inputs.py", "check_deferred", "tolist"): 1,
    ("pipeline/train/plain_engine.py", "get_global_grad_norm", "__float__"): 1,
}


def tiny(linear_type: str = "gdn", seed: int = 0) -> HyLoForCausalLM:
    torch.manual_seed(seed)
    cfg = HybridConfig(vocab_size=V, hidden_size=32, intermediate_size=64, n_layer=4, mla_layers=[0, 3],
                       num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8, gdn_num_heads=2, gdn_head_dim=8, gdn_chunk_size=8,
                       linear_type=linear_type, tie_word_embeddings=False)
    return HyLoForCausalLM(cfg)


def row(T: int, docs: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    cu = np.linspace(0, T, docs + 1).round().astype(np.int32)
    mask = rng.random(T) > 0.2
    mask[cu[1:] - 1] = False
    return {"input_ids": rng.integers(0, V, T), "cu_seqlens": cu,
            "position_ids": np.concatenate([np.arange(e - s) for s, e in zip(cu[:-1], cu[1:])]), "loss_mask": mask}


def run_step(rows, linear_type="gdn"):
    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.teacher.protocol import TargetSpec, Teacher
    from hylo.pipeline.train.config import Stage2Config
    from hylo.pipeline.train.plain_engine import PlainEngine
    from hylo.pipeline.train.stage2 import KDStudent, Stage2Task, train_step
    from hylo.pipeline.train.worker import WorkerContext

    class Solo(WorkerContext):
        def all_sum(self, values):
            return list(values)

    cfg = Stage2Config()
    cfg.deepspeed.zero_stage = 0
    student = tiny(linear_type)
    student.gradient_checkpointing_enable()
    student.train()
    engine = PlainEngine(KDStudent(student, cfg), lr=1e-3, grad_accum=len(rows))
    teacher = Teacher(TeacherModel(tiny("gdn", seed=1), dtype="float32", device="cpu"),
                      TargetSpec(cfg.teacher.k, cfg.teacher.form))
    task = Stage2Task(engine, student, teacher, cfg)
    ctx = Solo(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32, run_dir=None,
               grad_accum=len(rows))
    train_step(task, rows, ctx)  # the first step allocates the optimiser state
    with deferred_checks(), HostReadLog() as log:
        result = train_step(task, rows, ctx)
    check_deferred()
    return result, log.reads


def _where(caller: str) -> tuple[str, str]:
    path, _, rest = caller.partition(":")
    return path.replace("\\", "/"), rest.split("(")[-1].rstrip(")")


@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
def test_a_stage2_step_reads_the_device_only_once_for_its_sums(linear_type):
    rows = [row(40, 3, 0), row(29, 2, 1)]
    result, reads = run_step(rows, linear_type)
    assert np.isfinite(result.sums["kl_sum"]) and result.sums["loss_tokens"] == sum(r["loss_mask"].sum() for r in rows)
    once = collections.Counter()
    unexpected = []
    for name, caller in reads:
        path, fn = _where(caller)
        key = next((k for k in ONCE_PER_STEP if path.endswith(k[0]) and fn == k[1] and name == k[2]), None)
        if key is not None:
            once[key] += 1
        elif not any(path.endswith(f) and fn == g for f, g in ALLOWED):
            unexpected.append(f"{name} at {caller}")
    assert not unexpected, f"host reads in the step's device path: {unexpected}"
    assert dict(once) == ONCE_PER_STEP, dict(once)
