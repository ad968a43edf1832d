"""THE training step of each stage, run once at world size 1 (gloo, ZeRO 0 and 3) and checked against
plain autograd of the naive loss in fp64.

The end-to-end tests compare a run with its own resumed run, so a wrong loss scale or
gradient-accumulation setting would pass them. Here the stage is built by its own `build` from a tiny
random HyLo (a tiny Llama converted), one optimiser step runs over G = 3 packed rows (so DeepSpeed
accumulates gradients) whose loss-token counts differ (two end in a padding document), and:

* the reported loss equals the naive loss of the global batch: stage 2, `kl_weight * KL + ce_weight *
  CE` summed over all loss tokens (`kernels/fused_kl/naive.py`) / their number; stage 1, the ILD
  distances of every layer summed over all real tokens / their number;
* the gradients DeepSpeed accumulated, read just before its optimiser step, equal autograd of that
  loss, for every trained parameter;
* the learning rate is the schedule's, and (ZeRO 3, where DeepSpeed computes one) the gradient norm is
  the norm of those gradients.

The reference runs every document on its own (no packing) through fp64 copies of the models; the
step runs packed rows in fp32. A 1/G or per-row normalisation mistake is off by ~1e0, the tolerance
is 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylo.pipeline.data.rows import PackedRow, check_row
from hylo.pipeline.train.config import load_stage_config
from hylo.pipeline.train.loop import cosine_with_warmup, reduce_record, setup_distributed
from hylo.pipeline.train.row_sources import SyntheticRows, open_rows
from hylo.pipeline.train.worker import StepResult, WorkerContext

from tests.helpers import train as train_helpers
from tests.helpers.common import assert_close, one_thread  # noqa: F401  (one_thread: autouse)

pytestmark = pytest.mark.slow  # starts DeepSpeed

TOL = 1e-4
G = 3
# The step's lr: the first step of a 10-step schedule with 5 warm-up steps runs at 1/5 of optim.lr.
LR, WARMUP = 1e-3, 0.5

# the one-rank gloo group of the in-process loop runs (shared with the other module that runs it)
gloo = train_helpers.gloo


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.helpers.train import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("step"))


def _config(stage: int, models, zero: int, *extra: str):
    teacher = [f"teacher.model.path={models['base']}"] if stage == 2 else []
    return load_stage_config(stage, None, [
        f"model.student={models['student']}", f"model.base={models['base']}", "model.dtype=float32", *teacher,
        "data.source=synthetic", "data.seq_len=48",
        "data.synthetic.vocab_size=96", "data.synthetic.min_doc_len=6", "data.synthetic.max_doc_len=30",
        f"train.global_batch_sequences={G}", "ray.num_workers=1", f"deepspeed.zero_stage={zero}",
        f"optim.lr={LR}", f"optim.warmup_ratio={WARMUP}",
        # clipping at a norm never reached: the gradients stay as accumulated, DeepSpeed still computes the norm
        "optim.grad_clip=1e6", *extra])


def _rows(cfg) -> list[PackedRow]:
    """G packed rows; the last document of rows 0 and 2 becomes padding (doc id "", no loss tokens)."""
    source = SyntheticRows(cfg.data, cfg.train.seed)
    raws = [source.raw(g) for g in range(G)]
    for row in raws[0], raws[2]:
        row["doc_ids"][-1] = ""
        row["loss_mask"][row["cu_seqlens"][-2]:] = 0
    return [check_row(r, f"row {g}") for g, r in enumerate(raws)]


def _documents(row: PackedRow, real_only: bool = True):
    """(start, end, ids [1, L], positions [1, L]) of each document of a row."""
    for doc, (s, e) in zip(row.doc_ids, row.documents()):
        if real_only and doc == "":
            continue
        ids = row.input_ids[s:e].unsqueeze(0)
        yield int(s), int(e), ids, torch.arange(e - s).unsqueeze(0)


def _run_step(stage, cfg, rows, tmp_path) -> tuple[dict, dict[str, torch.Tensor], StepResult]:
    """Build `stage` and run one step on `rows`: (reported record, gradients before the optimiser step
    by parameter name of the student, the step's result)."""
    from deepspeed.utils import safe_get_full_grad

    rank, world, device = setup_distributed(cfg)
    assert world == 1
    ctx = WorkerContext(cfg=cfg, rank=rank, world_size=world, device=device, dtype=torch.float32,
                        run_dir=tmp_path, grad_accum=cfg.grad_accum)
    task = stage.build(ctx, cosine_with_warmup(10, WARMUP, 0.0))
    engine = task.engine
    grads: dict[str, torch.Tensor] = {}
    optimizer_step = engine.optimizer.step

    def capture_then_step(*args, **kwargs):
        assert not grads, "one optimiser step per train step"
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                grads[name.removeprefix("student.")] = safe_get_full_grad(p).detach().double().clone()
        return optimizer_step(*args, **kwargs)

    engine.optimizer.step = capture_then_step
    ctx.step = 1
    result = stage.train_step(task, rows, ctx)
    stream = open_rows(cfg.data, cfg.train.seed, 0, 1)
    record = reduce_record(ctx, result, rows, stream, 1.0, 10)
    assert grads, "DeepSpeed never ran the optimiser step"
    engine.destroy()
    return record, grads, result


def _check(record, grads, ref_loss, ref_grads, zero: int) -> None:
    assert record["loss"] == pytest.approx(float(ref_loss), rel=TOL)
    assert record["lr"] == pytest.approx(LR / (10 * WARMUP))
    assert sorted(grads) == sorted(ref_grads)
    for name, g in grads.items():
        assert_close(name, ref_grads[name], g, TOL)
    if zero == 3:
        norm = torch.cat([g.flatten() for g in ref_grads.values()]).norm()
        assert record["grad_norm"] == pytest.approx(float(norm), rel=TOL)


def _fp64(path):
    from hylo.io import load_hylo

    return load_hylo(path, dtype=torch.float64).eval()


def _base64(path):
    from hylo.upcycle import load_base_model

    return load_base_model(path, dtype=torch.float64).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------ stage 2
def naive_kd_loss(student, teacher, rows, kd) -> torch.Tensor:
    """kl_weight * KL(teacher || student) + ce_weight * CE, summed over the loss tokens of every row and
    divided by their number; each document runs alone."""
    from hylo.kernels.fused_kl.naive import naive_kl_div

    total, n_loss = torch.zeros((), dtype=torch.float64), 0
    for row in rows:
        mask_T = row.loss_mask
        n_loss += int(mask_T.sum())
        for s, e, ids, pos in _documents(row):
            mask = mask_T[s:e]
            h = student.model(input_ids=ids, position_ids=pos).last_hidden_state[0]
            with torch.no_grad():
                t = teacher.model(input_ids=ids, position_ids=pos).last_hidden_state[0]
            kl = naive_kl_div(h, student.lm_head.weight, teacher_hidden=t, teacher_weight=teacher.lm_head.weight,
                              mask=mask, temperature=kd.temperature, reduction="sum")
            # the label of a position is the next token of its document (the mask never holds a last token)
            logits = h[:-1] @ student.lm_head.weight.t()
            ce = F.cross_entropy(logits[mask[:-1]], ids[0, 1:][mask[:-1]], reduction="sum")
            assert not mask[-1]
            total = total + kd.kl_weight * kl + kd.ce_weight * ce
    return total / n_loss


@pytest.mark.parametrize("zero,extra", [(0, ()), (3, ("kd.ce_weight=0.5",))], ids=["zero0-kl", "zero3-kl+ce"])
def test_stage2_step_is_autograd_of_the_naive_kl_over_the_global_loss_tokens(gloo, models, tmp_path, zero, extra):
    from hylo.pipeline.train.stage2 import STAGE

    cfg = _config(2, models, zero, "kd.temperature=2.0", *extra)
    rows = _rows(cfg)
    counts = [r.loss_tokens for r in rows]
    assert len(set(counts)) == G, f"rows must hold different numbers of loss tokens: {counts}"
    record, grads, result = _run_step(STAGE, cfg, rows, tmp_path)
    assert record["loss_tokens"] == sum(counts)

    student = _fp64(models["student"])
    ref_loss = naive_kd_loss(student, _base64(models["base"]), rows, cfg.kd)
    params = dict(student.named_parameters())
    ref_grads = dict(zip(params, torch.autograd.grad(ref_loss, list(params.values()))))
    _check(record, grads, ref_loss, ref_grads, zero)
    if cfg.kd.ce_weight:
        assert record["ce"] > 0 and record["loss"] == pytest.approx(record["kl"] + 0.5 * record["ce"], rel=1e-6)


# ------------------------------------------------------------------------------------ stage 1
def naive_ild_loss(student, base, rows, ild) -> torch.Tensor:
    """sum over layers of output_weight * d(student layer(x_l), y_l) + mixer_weight * d(its mixer, a_l),
    d the per-token L2 distance (or its square), summed over every real token of every row and divided
    by their number; x_l, y_l, a_l are base layer l's input, output and attention output."""
    from hylo.pipeline.train.stage1 import EPS

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def distance(u, v):
        d2 = (u - v).pow(2).sum(-1)
        return d2 if ild.squared else torch.sqrt(d2 + EPS)

    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(base.model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.__setitem__(f"x{i}", a[0] if a else kw["hidden_states"]), with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"y{i}", first(o))))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"a{i}", first(o))))
    total, n_real = torch.zeros((), dtype=torch.float64), 0
    for row in rows:
        for s, e, ids, pos in _documents(row):
            n_real += e - s
            base.model(input_ids=ids, position_ids=pos, use_cache=False)
            for i, layer in enumerate(student.model.layers):
                out, mix = layer(seen[f"x{i}"], pos, None, None)
                total = total + ild.output_weight * distance(out, seen[f"y{i}"]).sum()
                total = total + ild.mixer_weight * distance(mix, seen[f"a{i}"]).sum()
    for h in hooks:
        h.remove()
    return total / n_real


# ild.trainable: all (the default) trains every parameter of every decoder layer, mixers only the new mixers
TRAINED = {"all": lambda n: n.startswith("model.layers."), "mixers": lambda n: ".mixer." in n}


@pytest.mark.parametrize("zero,extra", [(0, ("ild.trainable=all",)),
                                        (3, ("ild.squared=true", "ild.mixer_weight=0.5", "ild.trainable=mixers"))],
                         ids=["zero0-l2-all", "zero3-l2squared-mixers"])
def test_stage1_step_is_autograd_of_the_naive_ild_over_the_global_real_tokens(gloo, models, tmp_path, zero, extra):
    from hylo.pipeline.train.stage1 import STAGE

    cfg = _config(1, models, zero, *extra)
    rows = _rows(cfg)
    counts = [sum(e - s for s, e, _, _ in _documents(r)) for r in rows]
    assert len(set(counts)) > 1, f"rows must hold different numbers of real tokens: {counts}"
    record, grads, _ = _run_step(STAGE, cfg, rows, tmp_path)
    assert record["loss_tokens"] == sum(counts)

    student = _fp64(models["student"])
    ref_loss = naive_ild_loss(student, _base64(models["base"]), rows, cfg.ild)
    trained = {n: p for n, p in student.named_parameters() if TRAINED[cfg.ild.trainable](n)}
    if cfg.ild.trainable == "all":
        assert any(".input_layernorm." in n for n in trained) and any(".mlp." in n for n in trained)
    ref_grads = dict(zip(trained, torch.autograd.grad(ref_loss, list(trained.values()))))
    _check(record, grads, ref_loss, ref_grads, zero)
