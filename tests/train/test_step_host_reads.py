"""Host reads (GPU synchronisations) in one stage-2 step and one stage-1 step, counted on CPU under the GPU rule.

the trainer's step (`pipeline/train/loop.train_step`) of stage 2 at world size 1 with `PlainEngine` (DeepSpeed's part of the step in
plain torch), a tiny HyLo student and an in-process tiny HyLo teacher, fused KL over hidden states,
activation checkpointing. `hylo.kernels.host_reads.HostReadLog` logs every host read made from Python and
`deferred_checks()` gives the fused KL's inputs the accelerator's rule. On CPU every tensor is a host
tensor, so the log also holds reads that are free on a GPU (the packed row is a CPU tensor there too);
each allowed caller below says why it is allowed. The chunked scans' layout is made from the bounds' host
ints without reading a tensor (`kernels/varlen.row_chunk_layout`): no read per linear layer. A read anywhere
else (the model's forward or backward, the fused KL, the step's per-row loop) fails the test.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from hylo.config import HybridConfig
from hylo.kernels.fused_kl.inputs import check_deferred, deferred_checks
from hylo.kernels.host_reads import HostReadLog
from hylo.kernels.varlen import DocBounds
from hylo.modeling import HyLoForCausalLM, HyLoModel
from hylo.pipeline.data.rows import PackedRow, check_row

V = 64

# (file suffix, function) -> the reads allowed there in one step of G rows, as (op name, count per step or
# per row); anything not listed is a failure
ALLOWED = {
    # the packed row as the reader checked it (CPU tensors on any machine); its boundaries are not checked
    # or read again in the step (test_a_stage2_step_never_checks_or_reads_back_boundaries)
    ("pipeline/teacher/model.py", "_check_vocab"): "host row",
    ("pipeline/data/rows.py", "loss_tokens"): "host row",
    # AdamW's step counters are CPU tensors (torch keeps them there unless capturable)
    ("pipeline/train/plain_engine.py", "step"): "optimizer step counters",
}
# reads that must happen exactly this many times per step: the step's one read of its loss sums, the
# fused KL's deferred input checks read with it, and the clipped gradient norm
ONCE_PER_STEP = {
    ("pipeline/train/loop.py", "train_step", "tolist"): 1,
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


def row(T: int, docs: int, seed: int) -> PackedRow:
    """A packed row as the reader yields it (checked, host boundaries)."""
    rng = np.random.default_rng(seed)
    cu = np.linspace(0, T, docs + 1).round().astype(np.int32)
    mask = rng.random(T) > 0.2
    mask[cu[1:] - 1] = False
    return check_row({"input_ids": rng.integers(0, V, T), "cu_seqlens": cu, "loss_mask": mask,
                      "position_ids": np.concatenate([np.arange(e - s) for s, e in zip(cu[:-1], cu[1:])])})


def run_step(rows, linear_type="gdn"):
    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec
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
    teacher = BoundTeacher(TeacherModel(tiny("gdn", seed=1), dtype="float32", device="cpu"),
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
    assert np.isfinite(result.sums["kl_sum"]) and result.sums["loss_tokens"] == sum(r.loss_tokens for r in rows)
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


@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
def test_a_stage2_step_never_checks_or_reads_back_boundaries(linear_type, monkeypatch):
    # rows as the one reader yields them: each checked once there, carrying its host boundaries on
    from hylo.kernels import varlen
    from hylo.pipeline.train.config import DataSection, SyntheticData
    from hylo.pipeline.train.row_sources import open_rows

    checks = []
    rule = varlen.boundaries_problem
    # every check of boundaries (a row's, DocBounds.from_host's, and from_tensor's device-to-host copy) applies it
    monkeypatch.setattr(varlen, "boundaries_problem", lambda cu, T: checks.append(T) or rule(cu, T))
    reader = open_rows(DataSection(source="synthetic", seq_len=40, synthetic=SyntheticData(
        rows=4, vocab_size=V, min_doc_len=5, max_doc_len=20)), 0, 0, 1)
    rows = [reader.next_row(), reader.next_row()]
    assert checks == [40, 40] and all(isinstance(r, PackedRow) and len(r.host) > 2 for r in rows)
    given = []
    forward = HyLoModel.forward

    def spy(self, *args, **kwargs):
        given.append(kwargs.get("cu_seqlens"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(HyLoModel, "forward", spy)
    checks.clear()
    run_step(rows, linear_type)
    # not checked again by the step, the teacher or the model, nor rebuilt from a device tensor
    assert checks == [], f"{len(checks)} boundary checks in two stage-2 steps of {len(rows)} rows"
    # the student (forward and recompute) and the in-process teacher took the row's own host boundaries
    assert given and all(isinstance(b, DocBounds) for b in given)
    assert {id(b.host) for b in given} == {id(r.host) for r in rows}


# ------------------------------------------------------------------------------------ stage 1
# stage 1's step: the frozen base (a tiny Llama from transformers) gives each student layer its input and
# targets; reads allowed besides the ones the stage-2 step makes too
STAGE1_ALLOWED = {
    ("pipeline/train/plain_engine.py", "step"): "optimizer step counters",
    # transformers builds the base's block-diagonal mask from the restarting position ids (its own code)
    ("transformers/masking_utils.py", "find_packed_sequence_indices"): "the base model's mask",
}
STAGE1_ONCE_PER_STEP = {
    ("pipeline/train/loop.py", "train_step", "tolist"): 1,
    ("pipeline/train/plain_engine.py", "get_global_grad_norm", "__float__"): 1,
}


def run_stage1_step(rows, linear_type="gdn"):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hylo.pipeline.train.config import Stage1Config
    from hylo.pipeline.train.plain_engine import PlainEngine
    from hylo.pipeline.train.stage1 import (
        BaseLayerTargets,
        ILDStudent,
        Stage1Task,
        train_step,
        trainable_parameters,
    )
    from hylo.pipeline.train.worker import WorkerContext

    class Solo(WorkerContext):
        def all_sum(self, values):
            return list(values)

    cfg = Stage1Config()
    cfg.deepspeed.zero_stage = 0
    torch.manual_seed(2)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    base.requires_grad_(False)
    student = tiny(linear_type)
    trainable_parameters(student, cfg.ild.trainable)
    student.train()
    engine = PlainEngine(ILDStudent(student, cfg), lr=1e-3, grad_accum=len(rows))
    task = Stage1Task(engine, student, BaseLayerTargets(base), cfg)
    ctx = Solo(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32, run_dir=None,
               grad_accum=len(rows))
    train_step(task, rows, ctx)  # the first step allocates the optimiser state
    with HostReadLog() as log:
        result = train_step(task, rows, ctx)
    return result, log.reads


@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
def test_a_stage1_step_reads_the_device_only_once_for_its_sums(linear_type):
    """Like stage 2: the loss terms stay on the device until the step's end (one read for all three sums of
    all rows), and the student's layers get the row's host-checked boundaries, never read back."""
    rows = [row(40, 3, 0), row(29, 2, 1)]
    result, reads = run_stage1_step(rows, linear_type)
    sums = result.sums
    assert np.isfinite(sums["loss_sum"]) and sums["loss_tokens"] == sums["tokens"] == 69.0
    assert sums["loss_sum"] == pytest.approx(sums["ild_output_sum"] + sums["ild_mixer_sum"], rel=1e-6)
    once = collections.Counter()
    unexpected = []
    for name, caller in reads:
        path, fn = _where(caller)
        key = next((k for k in STAGE1_ONCE_PER_STEP if path.endswith(k[0]) and fn == k[1] and name == k[2]), None)
        if key is not None:
            once[key] += 1
        elif not any(path.endswith(f) and fn == g for f, g in STAGE1_ALLOWED):
            unexpected.append(f"{name} at {caller}")
    assert not unexpected, f"host reads in the step's device path: {collections.Counter(unexpected)}"
    assert dict(once) == STAGE1_ONCE_PER_STEP, dict(once)
