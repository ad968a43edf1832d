"""Sequence parallelism in training (`train.sequence_parallel: N`): the config rules, the rows each
group reads and the data position that makes a checkpoint independent of N, and (gloo, one process per rank)
each stage's loss and every parameter's gradient over a split row against the unsplit row's.

Legend: W workers, N the sequence-parallel size, D = W / N data-parallel ranks (groups), B the global batch
in rows, G = B / D rows per rank per step.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.reader import RowReader
from hylo.pipeline.rehearse import free_port
from hylo.pipeline.train.config import breaking_diff, breaking_hash, config_to_dict, load_stage_config
from hylo.pipeline.train.deepspeed_cfg import build_deepspeed_config
from hylo.pipeline.train.row_sources import open_rows, resume_position

from tests.helpers.common import one_thread  # noqa: F401  (autouse: the parent computes the unsplit row on one thread, as each rank)


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("sets,needle", [
    (["ray.num_workers=4", "train.sequence_parallel=3"],
     "train.sequence_parallel=3: must divide ray.num_workers (4)"),
    (["ray.num_workers=4", "train.sequence_parallel=4", "data.seq_len=50"],
     "train.sequence_parallel=4: must divide data.seq_len (50)"),
    (["ray.num_workers=4", "train.sequence_parallel=0"], "train.sequence_parallel=0"),
    (["ray.num_workers=4", "train.sequence_parallel=2", "train.global_batch_sequences=3"],
     "train.global_batch_sequences=3: must be a multiple of ray.num_workers / train.sequence_parallel (2)"),
], ids=["workers", "seq_len", "zero", "batch"])
def test_a_sequence_parallel_size_that_does_not_divide_is_refused_naming_the_setting(sets, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        load_stage_config(2, None, sets)


def test_the_job_says_it_in_one_line_before_anything_starts(capsys):
    from hylo.jobs.stage2 import main

    assert main(["--set", "ray.num_workers=4", "--set", "train.sequence_parallel=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "train.sequence_parallel=3: must divide ray.num_workers (4)" \
        in err[0], err


def test_a_prepared_split_whose_rows_do_not_split_evenly_is_refused_before_ray(tmp_path):
    """The rows' length of a prepared split is its manifest's max_len: N must divide it (checked with the data,
    by `inputs.check_stage_inputs`, which the driver runs before Ray)."""
    from hylo.pipeline.data.shards import write_manifest
    from hylo.pipeline.train import inputs

    from tests.helpers.teacher import make_packed_row, write_packed_parquet

    write_packed_parquet(tmp_path / "shard-00000.parquet", [make_packed_row([10, 20], vocab_size=50, seed=0)] * 4)
    write_manifest(tmp_path, {"split": "stage2", "max_len": 30, "config_hash": "x",
                              "shards": [{"file": "shard-00000.parquet", "rows": 4}]})
    sets = ["ray.num_workers=4", "train.global_batch_sequences=4", "data.source=parquet", f"data.path={tmp_path}"]
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel=4: must divide the rows' length, but data\.path="
                                          r".* was packed to max_len=30 tokens"):
        inputs._data(load_stage_config(2, None, [*sets, "train.sequence_parallel=4"]))
    # N = 2 divides 30
    inputs._data(load_stage_config(2, None, [*sets, "train.sequence_parallel=2"]))


def test_the_groups_share_their_rows_and_deepspeed_sees_every_worker():
    cfg = load_stage_config(2, None, ["ray.num_workers=4", "train.sequence_parallel=2", "data.seq_len=64",
                                      "train.global_batch_sequences=6"])
    # 2 groups of 2 workers: 3 rows per group (and per worker of it) per step
    assert cfg.data_parallel == 2 and cfg.grad_accum == 3
    ds = build_deepspeed_config(cfg, world_size=4, dtype=torch.float32)
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_batch_size"] == 3 * 4
    # N = W: one group, every worker reads every row of the batch
    one = load_stage_config(1, None, ["ray.num_workers=4", "train.sequence_parallel=4", "train.global_batch_sequences=1"])
    assert one.data_parallel == 1 and one.grad_accum == 1
    # N = 1: as before (a multiple of the workers, G = B / W)
    assert load_stage_config(2, None, ["ray.num_workers=4", "train.global_batch_sequences=8"]).grad_accum == 2


def test_sequence_parallel_may_change_on_resume_the_workers_may_not():
    a = load_stage_config(2, None, ["ray.num_workers=4", "train.sequence_parallel=4", "train.global_batch_sequences=4"])
    b = load_stage_config(2, None, ["ray.num_workers=4", "train.sequence_parallel=1", "train.global_batch_sequences=4"])
    assert breaking_diff(config_to_dict(a), config_to_dict(b)) == []
    assert breaking_hash(a) == breaking_hash(b)
    c = load_stage_config(2, None, ["ray.num_workers=2", "train.sequence_parallel=1", "train.global_batch_sequences=4"])
    assert any(d.startswith("ray.num_workers") for d in breaking_diff(config_to_dict(a), config_to_dict(c)))


# ------------------------------------------------------------------------------------ rows and positions
class _Rows:
    """A row source of `n` rows whose row g is just its index (what the reader's striding decides)."""

    max_len = None
    max_len_from = None
    fingerprint = "test"

    def __init__(self, n: int) -> None:
        self.num_rows = n

    def raw(self, g: int) -> dict[str, Any]:
        return {"input_ids": [g, g], "cu_seqlens": [0, 2], "position_ids": [0, 1], "loss_mask": [1, 0],
                "row_key": f"r{g}"}

    def where(self, g: int) -> str:
        return f"row {g}"


def _readers(n_rows: int, workers: int, sp: int, positions: list[int] | None = None) -> list[RowReader]:
    """The reader of each worker (the workers of a group share their group's reader's rows)."""
    dp = workers // sp
    out = []
    for rank in range(workers):
        # what loop.train_worker opens for a parquet split (drop_to: the pass of the W workers)
        r = RowReader(_Rows(n_rows), rank // sp, dp, drop_to=workers)
        if positions is not None:
            r.seek(positions[rank])
        out.append(r)
    return out


def _step_rows(readers: list[RowReader], sp: int, batch: int) -> tuple[list[str], list[list[str]]]:
    """One step: the sorted keys the run trained on (each group's rows once), and each worker's keys."""
    per_worker = [[r.next_row().key for _ in range(batch // (len(readers) // sp))] for r in readers]
    for g in range(0, len(readers), sp):
        assert all(per_worker[g + i] == per_worker[g] for i in range(sp)), "a group's workers read other rows"
    return sorted(k for g in range(0, len(readers), sp) for k in per_worker[g]), per_worker


@pytest.mark.parametrize("saved_sp,resumed_sp", [(4, 2), (4, 1), (1, 4), (2, 1)])
def test_a_run_saved_at_one_size_reads_the_same_rows_in_the_same_steps_at_another(saved_sp, resumed_sp):
    """22 rows, W = 4, B = 4: the pass is 20 rows at every N (cut by the workers, not the groups), and steps 4 to
    6 run into the second pass. A run that saved at step 3 with N = saved_sp and resumes with N = resumed_sp
    trains steps 4 to 6 on exactly the rows an uninterrupted run at N = resumed_sp (or saved_sp) does."""
    W, B, rows = 4, 4, 22
    uninterrupted = _readers(rows, W, resumed_sp)
    want = [_step_rows(uninterrupted, resumed_sp, B)[0] for _ in range(6)]
    other = _readers(rows, W, saved_sp)
    assert [_step_rows(other, saved_sp, B)[0] for _ in range(6)] == want
    saving = _readers(rows, W, saved_sp)
    for _ in range(3):
        _step_rows(saving, saved_sp, B)
    # what each rank's checkpoint holds (rows.state()), read back by the same rank at the new size
    states = [r.state() for r in saving]
    resumed = _readers(rows, W, resumed_sp, [resume_position(states[rank], W // resumed_sp) for rank in range(W)])
    assert [_step_rows(resumed, resumed_sp, B)[0] for _ in range(3)] == want[3:]
    assert all(r.global_rows == 20 for r in resumed + saving)


def test_a_checkpoint_of_before_sequence_parallelism_resumes_at_its_position():
    # a state written before this change: position and world_size of the W workers' readers
    assert resume_position({"position": 6, "rank": 1, "world_size": 4, "num_rows": 8}, 4) == 6
    assert resume_position({"position": 6, "rank": 1, "world_size": 4, "num_rows": 8}, 2) == 12
    with pytest.raises(ValueError, match="does not divide over 4"):
        resume_position({"position": 3, "world_size": 2}, 4)


def test_synthetic_rows_are_read_by_group():
    from hylo.pipeline.train.config import DataSection, SyntheticData

    data = DataSection(source="synthetic", seq_len=16, synthetic=SyntheticData(rows=6, vocab_size=20,
                                                                               min_doc_len=2, max_doc_len=8))
    # W = 4, N = 2: groups 0 and 1 stride over the rows as two workers did
    keys = {dp: [open_rows(data, 0, dp, 2, workers=4).next_row().key for _ in range(1)] for dp in range(2)}
    assert keys == {0: ["syn-0"], 1: ["syn-1"]}


# ------------------------------------------------------------------------------------ a split row (gloo ranks)
# One packed row of T = 48 tokens whose documents cross every split at N = 2 (24) and N = 4 (12, 24, 36).
DOCS = [5, 17, 13, 13]
VOCAB = 96


@pytest.fixture(scope="module")
def split_setup(tmp_path_factory):
    """Tiny MLA + GDN and MLA + Mamba-2 students (one random Llama base, also the teacher), the row as a prepared
    split, and the offline top-k cache of that split."""
    from hylo.io import save_hylo
    from hylo.pipeline.data.shards import write_manifest
    from hylo.pipeline.teacher.cache import compute_shard, finalize_cache, prepare_cache
    from hylo.pipeline.teacher.config import CacheTeacherSection, TeacherCacheConfig, TeacherModelConfig
    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.train.config import DataSection
    from hylo.upcycle import load_base_model, upcycle

    from tests.helpers.teacher import make_packed_row, save_tiny_llama, write_packed_parquet

    root = tmp_path_factory.mktemp("sp")
    base = save_tiny_llama(root / "base", vocab_size=VOCAB, hidden_size=32, layers=2, seed=0)
    students = {}
    for linear in ("gdn", "mamba2"):
        model = upcycle(load_base_model(base), mla_layers="even", kv_lora_rank=16, gdn_head_dim=8, gdn_num_heads=4,
                        linear_type=linear)
        save_hylo(model, root / f"student-{linear}", tokenizer_from=base)
        students[linear] = root / f"student-{linear}"
    data = root / "data"
    write_packed_parquet(data / "shard-00000.parquet", [make_packed_row(DOCS, vocab_size=VOCAB, seed=3)])
    write_manifest(data, {"split": "stage2", "max_len": sum(DOCS), "config_hash": "sp",
                          "shards": [{"file": "shard-00000.parquet", "rows": 1}]})
    model_cfg = TeacherModelConfig(path=str(base))
    cache = TeacherCacheConfig(data=str(data), out=str(root / "cache"), rows_per_shard=1,
                               teacher=CacheTeacherSection(k=8, model=model_cfg))
    header, plan, todo = prepare_cache(cache)
    for p in todo:
        compute_shard(TeacherModel(base), cache.data, cache.out, header, p)
    assert finalize_cache(cache.out, plan)
    row = open_rows(DataSection(source="parquet", path=str(data), split="stage2"), 0, 0, 1).next_row()
    assert row.num_tokens == sum(DOCS) and len(row.documents()) == len(DOCS)
    return SimpleNamespace(base=base, students=students, data=data, cache=cache.out, row=row)


def _context(cfg, dtype, rank: int = 0, world: int = 1, group=None):
    from pathlib import Path

    from hylo.pipeline.train.worker import WorkerContext

    return WorkerContext(cfg=cfg, rank=rank, world_size=world, device=torch.device("cpu"), dtype=dtype,
                         run_dir=Path("."), grad_accum=1, sp_group=group, sp_rank=rank, sequence_parallel=world)


def _teacher_targets(setup, source: str, dtype, ctx) -> dict[str, Any]:
    """The targets of this rank's tokens of the row as stage 2 gets them (`stage2.teacher_targets` of the row's
    part, `loop.row_part`: the source's `targets(..., token_range=)` at N > 1), from `source`."""
    from hylo.pipeline.teacher.config import TeacherModelConfig
    from hylo.pipeline.teacher.sources import open_teacher
    from hylo.pipeline.train.config import TeacherSection
    from hylo.pipeline.train.loop import row_part
    from hylo.pipeline.train.stage2 import teacher_targets

    if source == "serve":
        # the pool's real replica class and client, the Serve handle's calls made in this process
        from hylo.pipeline.teacher.client import TeacherClient
        from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec

        from tests.helpers.teacher import LocalHandle, local_replica

        client = TeacherClient(LocalHandle(local_replica(setup.base, 16)), chunk_tokens=16, window_chunks=2,
                               dtype="float32", retry_backoff_s=0)
        return next(teacher_targets(BoundTeacher(client, TargetSpec(8, "topk"), VOCAB), [row_part(setup.row, ctx)],
                                    ctx.device))
    if source == "serve-hidden":
        # the pool's hidden states (a replica in the student's precision, one forward of the whole row per group,
        # relayed to each rank) with the LM head the trainer reads from the teacher's checkpoint
        from hylo.pipeline.teacher.client import TeacherClient
        from hylo.pipeline.teacher.head import load_head
        from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec

        from tests.helpers.teacher import LocalHandle, local_replica

        replica = local_replica(setup.base, 16, dtype=str(dtype).removeprefix("torch."))
        client = TeacherClient(LocalHandle(replica), chunk_tokens=16, head=load_head(setup.base, dtype),
                               retry_backoff_s=0)
        client.check_head(str(setup.base))
        return next(teacher_targets(BoundTeacher(client, TargetSpec(0, "hidden"), VOCAB),
                                    [row_part(setup.row, ctx)], ctx.device))
    # the in-process teacher in the student's precision: split, it sums in another order than the whole row, so
    # fp64's 1e-10 needs an fp64 teacher (an fp32 one is ~1e-7 from its unsplit self)
    model = TeacherModelConfig(path=str(setup.base), dtype=str(dtype).removeprefix("torch."))
    section = {"inprocess": TeacherSection(model=model),
               "inprocess-logits": TeacherSection(model=model, exact_form="logits"),
               "offline": TeacherSection(source="offline", k=8, cache_path=setup.cache)}[source]
    targets = next(teacher_targets(open_teacher(section, VOCAB, str(setup.data)), [row_part(setup.row, ctx)],
                                   ctx.device))
    # the exact teacher's hidden states in the student's precision (the fp64 comparison)
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in targets.items()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def _stage2_loss_grads(setup, linear: str, source: str, dtype, ctx) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage 2's loss of this rank's tokens of the row (`stage2.module_inputs` -> `KDStudent`) and its gradients."""
    from hylo.io import load_hylo
    from hylo.pipeline.train.loop import row_part
    from hylo.pipeline.train.stage2 import KDStudent, module_inputs

    cfg = ctx.cfg
    # every parameter in `dtype` (load_hylo keeps GDN's A_log / dt_bias in fp32, as training does)
    student = load_hylo(setup.students[linear], dtype=dtype).to(dtype)
    student.gradient_checkpointing_enable()
    student.train()
    kl, ce = KDStudent(student, cfg)(*module_inputs(row_part(setup.row, ctx), _teacher_targets(setup, source, dtype, ctx),
                                                    True))
    loss = cfg.kd.kl_weight * kl + cfg.kd.ce_weight * ce
    loss.backward()
    return loss.detach().double(), _grads(student)


def _stage1_loss_grads(setup, linear: str, dtype, ctx) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage 1's loss of this rank's tokens of the row (`stage1.module_inputs` -> `ILDStudent`) and its gradients."""
    from hylo.io import load_hylo
    from hylo.pipeline.train.loop import row_part
    from hylo.pipeline.train.stage1 import BaseLayerTargets, ILDStudent, module_inputs, trainable_parameters
    from hylo.upcycle import load_base_model

    cfg = ctx.cfg
    student = load_hylo(setup.students[linear], dtype=dtype).to(dtype)
    trainable_parameters(student, cfg.ild.trainable)
    student.train()
    base = load_base_model(setup.base, dtype=dtype).eval().requires_grad_(False)
    d_out, d_mix = ILDStudent(student, cfg)(*module_inputs(BaseLayerTargets(base), row_part(setup.row, ctx), ctx.device))
    loss = cfg.ild.output_weight * d_out + cfg.ild.mixer_weight * d_mix
    loss.backward()
    return loss.detach().double(), _grads(student)


SOURCES = ("inprocess", "inprocess-logits", "offline", "serve", "serve-hidden")


def _cases(setup, linear: str, dtype, ctx) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Every case of one student on this rank's slice: stage 2 with each teacher source, stage 1."""
    from dataclasses import replace

    out = {f"stage2-{s}": _stage2_loss_grads(setup, linear, s, dtype, replace(ctx, cfg=_cfg(2))) for s in SOURCES}
    out["stage1"] = _stage1_loss_grads(setup, linear, dtype, replace(ctx, cfg=_cfg(1)))
    return out


def _cfg(stage: int):
    # CE on (labels of the unsplit row), temperature != 1, activation checkpointing on (recomputes run the
    # group's collectives again); stage 1: every decoder-layer parameter, both loss terms
    sets = ["deepspeed.zero_stage=0", "kd.ce_weight=0.5", "kd.temperature=2.0"] if stage == 2 else [
        "deepspeed.zero_stage=0", "ild.mixer_weight=0.5"]
    return load_stage_config(stage, None, sets)


def _rank_main(rank: int, world: int, init: str, setup, linear: str, dtype, out_dir) -> None:
    """One rank of a gloo group of `world` (= N: one sequence-parallel group): its cases, saved for the parent."""
    import torch.distributed as dist

    from hylo.pipeline.train.worker import sequence_parallel_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group, sp_rank = sequence_parallel_group(rank, world, world)
        assert sp_rank == rank
        torch.save(_cases(setup, linear, dtype, _context(_cfg(2), dtype, rank, world, group)),
                   out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _split_run(setup, linear: str, dtype, world: int, tmp_path) -> dict[str, tuple[torch.Tensor, dict]]:
    """Every case over `world` gloo ranks, each rank's loss and gradients summed over the group (what DeepSpeed's
    averaging over the ranks does with the step's W / n_global scale).

    The ranks fork from a fork server (a fresh process that has imported this module and nothing else has run
    in), never from the pytest worker: a fork of the worker copies it after earlier tests started threads
    (OpenMP, Ray, gloo), and a child that inherits a lock held by one of them can crash (CI, 2026-12-06: a rank
    died of SIGSEGV in its first backward all-reduce). Spawning each rank is as safe and 10x slower here."""
    import multiprocessing as mp

    tmp_path.mkdir(parents=True, exist_ok=True)
    mp_ctx = mp.get_context("forkserver")
    # what a rank imports, imported once in the server (imports start no threads)
    mp_ctx.set_forkserver_preload([__name__, "hylo.io", "hylo.upcycle", "hylo.pipeline.train.worker",
                                   "hylo.pipeline.train.stage1", "hylo.pipeline.train.stage2",
                                   "hylo.pipeline.teacher.sources", "hylo.pipeline.teacher.client",
                                   "tests.helpers.teacher", "tests.helpers.common",
                                   "transformers.models.llama.modeling_llama"])
    procs = [mp_ctx.Process(target=_rank_main, args=(r, world, f"file://{tmp_path}/pg-{linear}-{world}", setup,
                                                     linear, dtype, tmp_path)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert [p.exitcode for p in procs] == [0] * world, "a rank failed (its traceback is above)"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    return {case: (sum(r[case][0] for r in ranks), {n: sum(r[case][1][n] for r in ranks) for n in ranks[0][case][1]})
            for case in ranks[0]}


@pytest.mark.parametrize("linear,dtype,tol", [
    pytest.param("gdn", torch.float64, 1e-10, id="mla+gdn-fp64"),
    # ~10 s each (forked ranks): the fast suite keeps one
    pytest.param("mamba2", torch.float64, 1e-10, id="mla+mamba2-fp64", marks=pytest.mark.slow),
    pytest.param("gdn", torch.float32, 1e-5, id="mla+gdn-fp32", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_a_split_row_gives_the_unsplit_rows_loss_and_gradients(split_setup, linear, dtype, tol, tmp_path):
    """Stage 2 (each teacher source: in-process exact hidden, in-process streamed logits, offline top-k cache,
    the Serve pool's replica and client, top-k and hidden states;
    KL + CE) and stage 1 on one packed row at N = 2 and 4: the ranks' losses and gradients summed over the
    group equal the unsplit row's, every parameter. The pool's hidden states give the in-process teacher's loss
    and gradients, at N = 1 and split."""
    from tests.helpers.common import assert_close

    want = _cases(split_setup, linear, dtype, _context(_cfg(2), dtype))
    _same_as_inprocess(want, "N=1", tol)
    for world in (2, 4):
        got = _split_run(split_setup, linear, dtype, world, tmp_path / f"n{world}")
        assert sorted(got) == sorted(want)
        for case, (loss, grads) in want.items():
            assert float(got[case][0]) == pytest.approx(float(loss), rel=tol, abs=tol), (case, world)
            assert sorted(got[case][1]) == sorted(grads)
            for name, g in grads.items():
                assert_close(f"N={world} {case} {name}", g, got[case][1][name], tol)
        _same_as_inprocess(got, f"N={world}", tol)


def _same_as_inprocess(cases: dict, where: str, tol: float) -> None:
    """The Serve pool's hidden-state teacher gives the in-process teacher's stage-2 loss and gradients."""
    from tests.helpers.common import assert_close

    (loss, grads), (pool_loss, pool_grads) = cases["stage2-inprocess"], cases["stage2-serve-hidden"]
    assert float(pool_loss) == pytest.approx(float(loss), rel=tol, abs=tol), where
    for name, g in grads.items():
        assert_close(f"{where} pool hidden vs in-process {name}", g, pool_grads[name], tol)


# ------------------------------------------------------------------------------------ the real loop (torchrun)
def _torchrun(config, *extra: str):
    from tests.helpers.train import torchrun

    return torchrun(2, config, *extra)


def _steps(run) -> dict[int, dict[str, Any]]:
    from hylo.pipeline.train.metrics import read_metrics

    return read_metrics(run)


def _trained_rows(record: dict[str, Any]) -> list[str]:
    """The rows a step trained on, each once (the workers of a group list the same rows)."""
    return sorted({k for worker in record["rows"] for k in worker})


@pytest.mark.slow  # torchrun, 2 workers, DeepSpeed ZeRO-3 (two launches, and the shared reference's)
def test_a_run_that_changes_sequence_parallel_on_resume_continues_exactly(tiny, reference):
    """Stage 2 on 2 workers, B = 4: 3 steps at N = 2 (one group holding each row split in two) resumed at N = 1
    from step 3's checkpoint for 3 more, against the first 6 steps of the uninterrupted N = 1 reference run
    (tests/helpers/runs.py). Every step trains on the same rows and its loss equals the uninterrupted run's (fp32:
    within 1e-5), before and after the change."""
    from tests.helpers.train import assert_ok, tiny_config, write_config

    root, models = tiny
    cfg = write_config(tiny_config(models, root / "runs", "sp-changed",
                                   checkpoint={"every_steps": 3, "keep": None, "consolidate": False}),
                       root / "sp-changed.yaml")
    assert_ok(_torchrun(cfg, "--set", "train.sequence_parallel=2", "--set", "train.max_steps=3"))
    resumed = _torchrun(cfg, "--resume", "--set", "train.sequence_parallel=1", "--set", "train.max_steps=6")
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout + resumed.stderr
    want, got = _steps(reference), _steps(root / "runs" / "sp-changed")
    assert sorted(got) == list(range(1, 7)) and set(got) <= set(want)
    print("relative loss differences per step:", [abs(got[s]["loss"] / want[s]["loss"] - 1) for s in range(1, 7)])
    for s in range(1, 7):
        assert _trained_rows(got[s]) == _trained_rows(want[s]), s
        assert (got[s]["tokens"], got[s]["loss_tokens"]) == (want[s]["tokens"], want[s]["loss_tokens"]), s
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5), s
    # the split steps held each row on both workers (the same rows listed twice), the resumed ones one each
    assert got[1]["rows"][0] == got[1]["rows"][1] and got[4]["rows"][0] != got[4]["rows"][1]


@pytest.mark.slow  # torchrun, 2 workers, DeepSpeed ZeRO-3 (one launch, and the shared stage-1 reference's)
def test_stage1_at_sequence_parallel_2_trains_as_at_1(tiny, references):
    """Stage 1 (Enhanced-ILD) in the real loop: 3 steps with each row split over the 2 workers give the losses of
    the same 3 steps on whole rows (the first 3 of the uninterrupted stage-1 reference run, tests/helpers/runs.py;
    fp32: within 1e-5), on the same rows, each row's tokens counted once."""
    from tests.helpers.train import assert_ok, tiny_config, torchrun, write_config

    root, models = tiny
    cfg = tiny_config(models, root / "runs", "stage1-sp2", stage=1, train={"max_steps": 3, "sequence_parallel": 2},
                      checkpoint={"every_steps": 3, "consolidate": False})
    assert_ok(torchrun(1, write_config(cfg, root / "stage1-sp2.yaml")))
    runs = {1: _steps(references(1)), 2: _steps(root / "runs" / "stage1-sp2")}
    assert sorted(runs[2]) == [1, 2, 3]
    print("stage 1 relative loss differences:", [abs(runs[2][s]["loss"] / runs[1][s]["loss"] - 1) for s in (1, 2, 3)])
    for s in (1, 2, 3):
        assert _trained_rows(runs[2][s]) == _trained_rows(runs[1][s]), s
        assert (runs[2][s]["tokens"], runs[2][s]["loss_tokens"]) == (runs[1][s]["tokens"], runs[1][s]["loss_tokens"])
        assert runs[2][s]["loss"] == pytest.approx(runs[1][s]["loss"], rel=1e-5), s
    assert runs[2][1]["rows"][0] == runs[2][1]["rows"][1]


# ------------------------------------------------------------------------------------ ray job submit
@pytest.mark.slow  # a local Ray head, a Ray job, Ray Train with 2 workers
def test_stage2_at_sequence_parallel_2_runs_under_ray_job_submit(tmp_path):
    """docs/stages.md's `ray job submit` against a local `ray start --head` (authentication off), stage 2 of a tiny
    student at train.sequence_parallel=2 on 2 Ray Train workers: it trains every step with each row split over
    the two workers and writes the consolidated model. The head is this test's own (`--block`, own ports and
    temp dir), stopped by stopping the process that started it."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    import time
    import urllib.request
    from pathlib import Path

    from tests.helpers.train import make_tiny_models, tiny_config, write_config

    repo = Path(__file__).resolve().parents[2]
    # this interpreter's Ray (and `python` in the job's entry point: this interpreter's)
    bin_dir = Path(sys.executable).parent
    ray_bin = str(bin_dir / "ray") if (bin_dir / "ray").exists() else shutil.which("ray")
    models = make_tiny_models(tmp_path / "models")
    cfg = tiny_config(models, tmp_path / "runs", "sp2", train={"global_batch_sequences": 2, "total_steps": 2},
                      checkpoint={"every_steps": 2, "keep": None}, ray={"launcher": "ray"})
    config = write_config(cfg, tmp_path / "sp2.yaml")
    # the job and its workers import the repository from Ray's copy of the working directory (a second checkout on
    # PYTHONPATH would make two roots whose `kernels` folders hand the name to each other without end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(RAY_AUTH_MODE="disabled", PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    # Ray's session sockets must fit AF_UNIX's 107 bytes: a short temp dir of our own
    ray_tmp = Path(tempfile.mkdtemp(prefix="hylo-sp-ray-", dir="/tmp"))
    dash = free_port()
    # every port of its own: the dashboard agent's default (52365) is taken by any other Ray on the machine (a test
    # process beside this one), and the head then has no agent to submit a job to
    ports = {flag: str(free_port()) for flag in ("--port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                                                 "--metrics-export-port", "--runtime-env-agent-port")}
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--num-cpus", "2", *(a for kv in ports.items() for a in kv),
                             "--dashboard-port", str(dash), "--include-dashboard", "true",
                             "--temp-dir", str(ray_tmp)], env=env, cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        for _ in range(180):
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except OSError:
                assert head.poll() is None, head.stdout.read() if head.stdout else ""
                time.sleep(1)
        # the agent registers after the dashboard answers (tens of seconds on a loaded machine): until then a
        # submission is refused with "No available agent", and `ray job submit` says to try again later
        for _ in range(60):
            job = subprocess.run([ray_bin, "job", "submit", "--address", address, "--working-dir", str(repo), "--",
                                  "python", "jobs/stage2.py", "--config", str(config),
                                  "--set", "train.sequence_parallel=2"],
                                 env=env, cwd=repo, capture_output=True, text=True, timeout=1500)
            if job.returncode == 0 or "No available agent" not in job.stdout + job.stderr:
                break
            assert head.poll() is None, head.stdout.read() if head.stdout else ""
            time.sleep(2)
    finally:
        head.terminate()
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    shown = "\n".join(line for line in (job.stdout + job.stderr).splitlines() if "packaging.py" not in line)
    assert job.returncode == 0, shown[-6000:]
    records = _steps(tmp_path / "runs" / "sp2")
    assert sorted(records) == [1, 2]
    for r in records.values():
        # one group of two workers: both list the same rows, each row's tokens counted once
        assert r["rows"][0] == r["rows"][1] and len(r["rows"][0]) == 2
        assert r["tokens"] == 2 * 64 and r["loss"] > 0
    assert (tmp_path / "runs" / "sp2" / "model" / "hybrid_config.json").is_file()
