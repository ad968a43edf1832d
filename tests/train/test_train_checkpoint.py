"""Checkpoint integrity, resume walk-back, safe loading, metrics repair, run storage (local, s3://) and
the Ray resource check, in one process (no Ray, no DeepSpeed engine: a stand-in engine writes real
torch pickles the way DeepSpeed names them).

Fault tests damage real files: truncated / missing shards and RNG files, a disk that fills up
half-way through writing or uploading a checkpoint (a small tmpfs when this machine lets us mount one,
otherwise a writer that stops with ENOSPC after a byte budget), a planted pickle payload.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.checkpoint.deepspeed_io import load_checkpoint, safe_deepspeed_load, save_checkpoint
from hylo.pipeline.train.checkpoint.layout import (
    CHECKPOINT_MANIFEST,
    CheckpointError,
    checkpoint_problem,
    delete_checkpoints,
    finalize_checkpoint,
    finalize_local,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    prune,
    sha256_file,
    step_dir_name,
    step_dirs,
    write_rank_files,
)
from hylo.pipeline.train.config import Stage2Config, load_stage_config
from hylo.pipeline.train.metrics import METRICS_FILE, MetricsWriter, read_metrics
from hylo.pipeline.train.storage import Loc, StorageError, check_storage_path

from tests.helpers.logs import messages

WORLD = 2
SHARD_FLOATS = 16_384  # 64 KiB per shard


# ------------------------------------------------------------------------------------ a stand-in engine
class _Sched:
    def __init__(self, step: int) -> None:
        self.last_epoch, self.base_lrs = step, [1e-3]

    def get_last_lr(self):
        return [1e-3]


class FakeEngine:
    """Writes what `DeepSpeedEngine.save_checkpoint` writes for ZeRO-3 (file names, torch pickles holding
    tensors and DeepSpeed's loss-scaler / stage objects), through `write` so a test can fill the disk."""

    def __init__(self, rank: int, step: int, write=None) -> None:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.rank, self.step = rank, step
        self.lr_scheduler = _Sched(step)
        self.checkpoint_engine = TorchCheckpointEngine()
        self.write = write or (lambda path, obj: torch.save(obj, path))
        self.loaded: list[str] = []

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum

        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(100 * self.step + self.rank)
        self.write(d / f"zero_pp_rank_{self.rank}_mp_rank_00_model_states.pt",
                   {"module": None, "param_shapes": [{"w": torch.Size([4, 4])}], "ds_version": "0.19",
                    "global_steps": self.step, "buffers": torch.randn(SHARD_FLOATS, generator=g)})
        self.write(d / f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt",
                   {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
                                             "fp32_flat_groups": [torch.randn(SHARD_FLOATS, generator=g)]}})
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)

    def load_checkpoint(self, load_dir: str, tag: str, **_):
        """Loads every pickle like DeepSpeed does: through its checkpoint engine."""
        for f in sorted((Path(load_dir) / tag).glob("*.pt")):
            self.checkpoint_engine.load(str(f), map_location="cpu")
            self.loaded.append(f.name)
        return load_dir, {}


def _save_all_ranks(dirs: list[Path], step: int, cfg, write=None) -> None:
    for r, d in enumerate(dirs):
        save_checkpoint(FakeEngine(r, step, write), d, r, WORLD, step, cfg,
                        {"data": {"position": step * 2 + r}}, {"data_fingerprint": "fp1"})


def torchrun_checkpoint(run: Path, step: int, cfg=None, write=None, launch_id: str | None = None) -> Path:
    """What the torchrun launcher does: all ranks into `.tmp-step_N`, rank lists, manifest, rename
    (`launch_id`: the driver invocation that wrote it, recorded in the manifest)."""
    cfg = cfg or Stage2Config()
    tmp = run / f".tmp-{step_dir_name(step)}"
    _save_all_ranks([tmp] * WORLD, step, cfg, write)
    for r in range(WORLD):
        write_rank_files(tmp, r, WORLD, shared=True)
    final = run / step_dir_name(step)
    finalize_local(tmp, final, step, WORLD, launch_id=launch_id)
    return final


def ray_checkpoint(run: Loc, step: int, scratch: Path, cfg=None, upload=None) -> Loc:
    """What the Ray launcher does: each rank its own scratch directory + rank list, Ray uploads each
    into `<run>/step_N` (`upload`, default pyarrow's copy_files as Ray uses), rank 0 writes the manifest."""
    import pyarrow.fs as pafs

    cfg = cfg or Stage2Config()
    dirs = [scratch / f"s{step}-r{r}" for r in range(WORLD)]
    _save_all_ranks(dirs, step, cfg)
    target = run / step_dir_name(step)
    for r, d in enumerate(dirs):
        write_rank_files(d, r, WORLD, shared=False)
        if upload is not None:
            upload(d, target)
        else:
            target.fs.create_dir(target.path, recursive=True)
            pafs.copy_files(str(d), target.path, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=target.fs, use_threads=False)
    finalize_checkpoint(target, step, WORLD)
    return target


def _walk(run) -> tuple[Loc | None, list[str]]:
    """What `--resume` of run `run` resumes from, by the workers' own walk (`Session.resume_checkpoint`:
    the run's checkpoints newest first, each checked by every rank, sizes then sha256) in a 1-rank gloo
    group: (the checkpoint chosen, the `[resume] skipping ...` warnings it logged on the way)."""
    import contextlib
    import io
    import tempfile

    import torch.distributed as dist

    from hylo.pipeline.train.session import TorchrunSession
    from hylo.pipeline.train.worker import WorkerContext

    with tempfile.TemporaryDirectory() as scratch:
        dist.init_process_group("gloo", init_method=f"file://{scratch}/pg", rank=0, world_size=1)
        err = io.StringIO()
        try:
            cfg = load_stage_config(2, None, ["metrics.tensorboard=false", "ray.launcher=torchrun"])
            ctx = WorkerContext(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                                run_dir=Path(scratch), grad_accum=1, run_loc=Loc.of(run))
            session = TorchrunSession(ctx, {"run_loc": Loc.of(run), "resume_latest": True}, total_steps=1)
            with contextlib.redirect_stderr(err):
                chosen, _ = session.resume_checkpoint()
            session.close()  # removes its downloads (remote storage) and the process group
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return chosen, [m for m in messages(err.getvalue(), "WARNING") if m.startswith("[resume] skipping ")]


# ------------------------------------------------------------------------------------ manifest
@pytest.mark.parametrize("launcher", ["torchrun", "ray"])
def test_manifest_lists_every_file_and_is_written_last(tmp_path, launcher):
    run = tmp_path / "run"
    ck = (torchrun_checkpoint(run, 3) if launcher == "torchrun"
          else ray_checkpoint(Loc.of(run), 3, tmp_path / "scratch"))
    m = json.loads((Loc.of(ck) / CHECKPOINT_MANIFEST).read_text())
    files = Loc.of(ck).files()
    assert set(m["files"]) == set(files) - {CHECKPOINT_MANIFEST}
    assert {"zero/state/zero_pp_rank_1_mp_rank_00_optim_states.pt", "ranks/rank_1.rng.safetensors",
            "trainer_state.json", "ranks/rank_0.files.json"} <= set(m["files"])
    assert all(m["files"][f]["size"] == files[f] for f in m["files"])
    assert checkpoint_problem(ck, deep=True) is None and latest_checkpoint(run) == ck
    # before rank 0's manifest, the same files do not count
    (Loc.of(ck) / CHECKPOINT_MANIFEST).rmtree()
    assert not is_complete(ck) and latest_checkpoint(run) is None


def _truncate(p: Path) -> None:
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)


@pytest.mark.parametrize("damage,needle", [
    (lambda c: _truncate(c / "zero/state/zero_pp_rank_1_mp_rank_00_model_states.pt"),
     r"zero/state/zero_pp_rank_1_mp_rank_00_model_states\.pt: 33,\d{3} bytes, the manifest records 67,\d{3} "
     r"\(truncated"),
    (lambda c: (c / "zero/state/zero_pp_rank_0_mp_rank_00_model_states.pt").unlink(),
     r"zero/state/zero_pp_rank_0_mp_rank_00_model_states\.pt: missing"),
    (lambda c: _truncate(c / "zero/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
     r"zero/state/zero_pp_rank_1_mp_rank_00_optim_states\.pt: 33,\d{3} bytes, the manifest records 67,\d{3} "),
    (lambda c: _truncate(c / "ranks/rank_0.rng.safetensors"), r"ranks/rank_0\.rng\.safetensors: [\d,]+ bytes"),
    (lambda c: (c / "ranks/rank_1.json").write_text("{}"), r"ranks/rank_1\.json: 2 bytes"),
    (lambda c: (c / CHECKPOINT_MANIFEST).write_text('{"files": '), r"manifest\.json: not valid JSON"),
], ids=["truncated-zero-shard", "missing-model-states", "truncated-optim-shard", "truncated-rng",
        "rewritten-rank-state", "torn-manifest"])
def test_resume_walks_back_past_a_damaged_checkpoint(tmp_path, damage, needle):
    run = tmp_path / "run"
    torchrun_checkpoint(run, 3)
    newest = torchrun_checkpoint(run, 6)
    damage(newest)
    assert not is_complete(newest) and latest_checkpoint(run) == run / "step_00000003"
    chosen, lines = _walk(run)
    assert chosen == run / "step_00000003"
    assert len(lines) == 1 and lines[0].startswith("[resume] skipping step_00000006: "), lines
    assert re.search(needle, lines[0]), lines


@pytest.mark.parametrize("forge", ["copy", "manifest-step"])
def test_an_older_checkpoint_under_a_higher_steps_name_is_skipped_and_moves_nothing(tmp_path, forge):
    """step_00000009 holding step 3's files (manifest and hashes intact): `--resume` skips it with a line naming
    it, resumes from the real newest (step 6), and the new line it starts sets nothing aside (step 6 stays).
    `manifest-step`: its manifest rewritten to say step 9, its trainer state still says 3."""
    from hylo.pipeline.train.checkpoint.resume import ABANDONED_DIR, set_aside_other_lines
    from hylo.pipeline.train.driver import check_run_dir

    run = tmp_path / "run"
    torchrun_checkpoint(run, 3)
    newest = torchrun_checkpoint(run, 6)
    fake = run / step_dir_name(9)
    shutil.copytree(run / step_dir_name(3), fake)
    if forge == "manifest-step":
        m = json.loads((fake / CHECKPOINT_MANIFEST).read_text())
        (fake / CHECKPOINT_MANIFEST).write_text(json.dumps({**m, "step": 9}, indent=1, sort_keys=True))
        why = r"trainer_state\.json says step 3, its manifest\.json step 9"
    else:
        why = r"its name says step 9, its manifest\.json says step 3"
    assert re.search(why, checkpoint_problem(fake) or ""), checkpoint_problem(fake)
    assert latest_checkpoint(run) == newest and [s for s, _ in list_checkpoints(run)] == [3, 6]
    check_run_dir(load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=run"]), "latest")
    chosen, lines = _walk(run)
    assert chosen == newest
    assert len(lines) == 1 and lines[0].startswith("[resume] skipping step_00000009: ") and re.search(why, lines[0])
    # what the worker does next (Session.start_new_line): the run's checkpoints after the resumed step go aside
    step = json.loads((Loc.of(chosen) / "trainer_state.json").read_text())["step"]
    assert set_aside_other_lines(run, chosen, step) is None
    assert newest.is_dir() and fake.is_dir() and not (run / ABANDONED_DIR).exists()


def test_a_checkpoint_file_that_links_out_of_its_directory_is_refused(tmp_path):
    """A file of step 6 replaced by a link to the same bytes in another run: not the checkpoint's own file."""
    run, other = tmp_path / "run", tmp_path / "other"
    torchrun_checkpoint(run, 3)
    newest = torchrun_checkpoint(run, 6)
    shutil.copytree(newest, other / step_dir_name(6))
    rel = "zero/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    (newest / rel).unlink()
    (newest / rel).symlink_to(other / step_dir_name(6) / rel)
    problem = checkpoint_problem(newest) or ""
    assert problem.startswith(f"{newest / CHECKPOINT_MANIFEST}: files[") and f"'{rel}' is a symbolic link to " \
        f"{other / step_dir_name(6) / rel}, outside {newest}" in problem, problem
    assert latest_checkpoint(run) == run / step_dir_name(3)


def test_same_size_corruption_is_caught_by_the_checksum(tmp_path):
    run = tmp_path / "run"
    torchrun_checkpoint(run, 3)
    shard = torchrun_checkpoint(run, 6) / "zero/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert is_complete(run / "step_00000006")  # sizes match: only the checksum sees it
    chosen, lines = _walk(run)
    assert chosen == run / "step_00000003" and "optim_states.pt: content differs from the manifest" in lines[0]


def test_no_intact_checkpoint_lists_every_reason(tmp_path):
    from hylo.pipeline.train.driver import check_run_dir

    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=run"])
    run = tmp_path / "run"
    for step in (3, 6):
        ck = torchrun_checkpoint(run, step)
        (ck / "ranks/rank_0.rng.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no intact checkpoint(.|\n)*step_00000006: ranks/rank_0.rng.safetensors: "
                                          r"missing(.|\n)*step_00000003"):
        check_run_dir(cfg, "latest")
    with pytest.raises(ConfigError, match="cannot resume from it: ranks/rank_0.rng.safetensors: missing"):
        check_run_dir(cfg, str(run / "step_00000003"))


def test_prune_keeps_newest_intact_and_drops_older_partial(tmp_path):
    run = tmp_path / "run"
    for step in (3, 6, 9, 12):
        torchrun_checkpoint(run, step)
    (run / "step_00000003" / CHECKPOINT_MANIFEST).unlink()
    (run / "step_00000012" / CHECKPOINT_MANIFEST).unlink()  # newest, unfinished: never pruned
    assert prune(run, keep=1) == ["step_00000003", "step_00000006"]
    assert [p.name for _, p in step_dirs(run)] == ["step_00000009", "step_00000012"]


# ------------------------------------------------------------------------------------ a full disk
@pytest.fixture
def small_disk(tmp_path):
    """(directory, real): a 400 KiB tmpfs when it can be mounted here (real ENOSPC), else a plain
    directory and a byte budget that the test's writers enforce with OSError(ENOSPC)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    real = False
    if os.geteuid() == 0 and shutil.which("mount"):
        real = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)],
                              capture_output=True).returncode == 0
    yield mnt, real
    if real:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class Budget:
    """Writes files until `left` bytes are used, then writes what fits and raises ENOSPC (simulated disk)."""

    def __init__(self, left: int) -> None:
        self.left = left

    def put(self, path: Path, data: bytes) -> None:
        n = min(len(data), self.left)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[:n])
        self.left -= n
        if n < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["upload", "write"])
@pytest.mark.slow
def test_disk_full_half_way_leaves_an_incomplete_checkpoint(tmp_path, small_disk, where, capsys):
    """`upload`: Ray copies the ranks' directories into storage that fills up (ZeRO shards cut short
    after trainer_state.json and the rank JSONs are in: what a killed upload leaves, never resumed from);
    `write`: torchrun ranks write into a full disk, and the failed write removes its `.tmp-step_N` (issue 61:
    it stayed, filling the disk)."""
    import io

    disk, real = small_disk
    run = disk / "run"
    budget = None if real else Budget(400 * 1024)

    def write(path, obj):
        if budget is None:
            torch.save(obj, path)
        else:
            buf = io.BytesIO()
            torch.save(obj, buf)
            budget.put(Path(path), buf.getvalue())

    def upload(src: Path, target: Loc) -> None:
        # file by file like Ray's copy, the small ones first (so the rank and trainer state make it)
        for f in sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size):
            dst = target.local() / f.relative_to(src)
            if budget is None:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dst)
            else:
                budget.put(dst, f.read_bytes())

    if where == "upload":
        ray_checkpoint(Loc.of(run), 3, tmp_path / "scratch", upload=upload)
        with pytest.raises(OSError) as e:
            ray_checkpoint(Loc.of(run), 6, tmp_path / "scratch", upload=upload)
        assert e.value.errno == errno.ENOSPC
        partial = run / "step_00000006"
        assert (partial / "trainer_state.json").is_file() and (partial / "ranks/rank_0.json").is_file()
    else:
        torchrun_checkpoint(run, 3, write=write)
        with pytest.raises(CheckpointError, match=r"writing checkpoint step_00000006 \(.*\.tmp-step_00000006, "
                                                   r"rank \d's files\) failed at zero/state/zero_pp_rank_\d_"
                                                   r"mp_rank_00_\w+_states\.pt: the disk is full \(ENOSPC\); "
                                                   r"[\d.]+ GiB free of [\d.]+ GiB on "):
            torchrun_checkpoint(run, 6, write=write)
        assert not (run / ".tmp-step_00000006").exists()  # the failed write left nothing
        partial = None
    if partial is not None:
        assert partial.is_dir() and any(f.stat().st_size for f in partial.rglob("*.pt"))
    print("real tmpfs" if real else "simulated ENOSPC")
    chosen, lines = _walk(run)
    assert chosen == run / "step_00000003"
    if where == "upload":
        assert lines == ["[resume] skipping step_00000006: no manifest.json: its write never finished (or it "
                         "was not written by this project's training)"]


@pytest.mark.slow
def test_a_full_storage_during_rays_upload_names_checkpoint_file_and_free_space(tmp_path, small_disk, monkeypatch):
    """Ray's copy of a checkpoint into a full storage: the error names the checkpoint, the file that did not
    arrive whole and the space left (Ray's own says only `worker 0: No space left on device`)."""
    import ray.train
    import torch.distributed as dist

    from hylo.pipeline.train.session import RaySession
    from hylo.pipeline.train.worker import WorkerContext

    disk, real = small_disk
    budget = None
    if real:
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * max(0, free - 100 * 1024))
    else:
        budget = Budget(100 * 1024)

    def report(record, checkpoint=None, checkpoint_dir_name=None, **upload):
        # what Ray Train does with a reported checkpoint: copy the worker's directory into storage (here
        # in place of the session's checkpoint_upload_fn, which needs a Ray Train context)
        src, dst = Path(checkpoint.path), disk / "run" / checkpoint_dir_name
        for f in sorted(p for p in src.rglob("*") if p.is_file()):
            out = dst / f.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            if budget is None:
                shutil.copyfile(f, out)
            else:
                budget.put(out, f.read_bytes())

    monkeypatch.setattr(ray.train, "report", report)
    cfg = load_stage_config(2, None, [f"ray.storage_path={disk}", "ray.name=run", "metrics.tensorboard=false"])
    ctx = WorkerContext(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                        run_dir=tmp_path / "mirror", grad_accum=1)
    session = RaySession(ctx, {"launcher": "ray", "launch_id": "l"}, total_steps=6)
    scratch = tmp_path / "scratch"
    save_checkpoint(FakeEngine(0, 6), scratch, 0, 1, 6, Stage2Config(), {"data": {"position": 0}}, {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointError, match=(
                rf"writing checkpoint step_00000006 \({disk / 'run' / 'step_00000006'}, rank 0's files\) failed at "
                r"zero/state/zero_pp_rank_0_mp_rank_00_\w+_states\.pt \([\d,]+ of [\d,]+ bytes in storage\): the disk "
                r"is full \(ENOSPC\); [\d.]+ GiB free of [\d.]+ GiB on ")):
            session.report({**REC, "step": 6}, 6, scratch)
    finally:
        dist.destroy_process_group()
    # the failed write leaves nothing: neither the rank's scratch directory nor the partial copy in storage
    assert not scratch.exists() and not (disk / "run" / "step_00000006").exists()


def test_a_checkpoint_write_that_fills_the_disk_leaves_nothing_and_the_resume_takes_the_previous(tmp_path):
    """Issue 61: a disk full at a checkpoint kept the previous checkpoint but left `.tmp-step_00000002` filling
    the disk. The torchrun ranks write real partial files until the (simulated) disk is full: the error names
    the checkpoint, the file and the space left; the scratch directory is removed; the resume takes step 1."""
    import io

    run = tmp_path / "run"
    torchrun_checkpoint(run, 1)
    budget = Budget(100 * 1024)  # room for the first ZeRO shard, not the second
    on_disk: list[int] = []  # bytes of each file as written, the last one cut short by the full disk

    def write(path, obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        try:
            budget.put(Path(path), buf.getvalue())
        finally:
            on_disk.append(Path(path).stat().st_size)

    with pytest.raises(CheckpointError, match=r"writing checkpoint step_00000002 \(.*\.tmp-step_00000002, rank 0's "
                                              r"files\) failed at zero/state/zero_pp_rank_0_mp_rank_00_\w+_states\.pt: "
                                              r"the disk is full \(ENOSPC\)"):
        torchrun_checkpoint(run, 2, write=write)
    assert len(on_disk) == 2 and all(on_disk)  # a whole shard, then a partial one, were on disk
    assert sorted(p.name for p in run.iterdir()) == ["step_00000001"]
    chosen, lines = _walk(run)
    assert chosen == run / "step_00000001" and lines == []


def _a_dead_pid() -> int:
    """A pid no process has now (the highest free one below the kernel's pid_max)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(top - 1, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid")


def test_what_a_killed_checkpoint_write_left_is_swept_by_the_next_run_and_nothing_else(tmp_path):
    """A worker killed while writing leaves its scratch: torchrun's `<run>/.tmp-step_N`, Ray's
    `hylo-ckpt-<step>-r<rank>-p<pid>-*` in the temporary directory. The next run removes them before any rank
    writes (the driver under the run lock; each Ray worker before its first checkpoint): only scratch of a
    finished step name, only of a process that is gone; complete and incomplete step_N, and anything else, stay."""
    import tempfile

    from hylo.pipeline.train.checkpoint.layout import sweep_scratch
    from hylo.pipeline.train.storage import sweep_local_scratch

    run = tmp_path / "run"
    torchrun_checkpoint(run, 1)
    (run / ".tmp-step_00000002" / "zero" / "state").mkdir(parents=True)
    (run / ".tmp-step_00000002" / "zero" / "state" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(
        b"\0" * 4096)  # a half-written shard of a killed write
    (run / "step_00000003").mkdir()  # an incomplete checkpoint: the resume skips it, naming why
    (run / ".tmp-notes").mkdir()  # not a checkpoint's scratch name
    assert sweep_scratch(run) == [".tmp-step_00000002"]
    assert sorted(p.name for p in run.iterdir()) == [".tmp-notes", "step_00000001", "step_00000003"]
    prefix = f"hylo-ckpt-test-{os.getpid()}-"
    gone = Path(tempfile.mkdtemp(prefix=f"{prefix}2-r0-p{_a_dead_pid()}-"))
    alive = Path(tempfile.mkdtemp(prefix=f"{prefix}2-r1-p{os.getpid()}-"))
    (gone / "rank_0.json").write_text("{}")
    try:
        assert sweep_local_scratch(prefix) == [gone]
        assert not gone.exists() and alive.is_dir()
    finally:
        shutil.rmtree(alive, ignore_errors=True)
        shutil.rmtree(gone, ignore_errors=True)


# ------------------------------------------------------------------------------------ never unpickle
class Payload:
    """Unpickling this creates a file (what an attacker's code would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def _plant(shard: Path, marker: Path) -> None:
    """A torch checkpoint file whose unpickling runs the payload (what `torch.load(weights_only=False)`,
    DeepSpeed's default, would do)."""
    torch.save({"module": Payload(marker)}, shard)
    assert not marker.exists()


def test_planted_pickle_is_refused_by_the_manifest(tmp_path):
    run = tmp_path / "run"
    torchrun_checkpoint(run, 3)
    ck = torchrun_checkpoint(run, 6)
    marker = tmp_path / "pwned"
    _plant(ck / "zero/state/zero_pp_rank_0_mp_rank_00_model_states.pt", marker)
    problem = checkpoint_problem(ck, deep=True)
    assert problem is not None and problem.startswith("zero/state/zero_pp_rank_0_mp_rank_00_model_states.pt: ")
    chosen, lines = _walk(run)
    assert chosen == run / "step_00000003" and not marker.exists()


def test_planted_pickle_with_forged_manifest_is_never_unpickled(tmp_path):
    """Even when an attacker rewrote the manifest to match, DeepSpeed's loads are weights-only."""
    run = tmp_path / "run"
    ck = torchrun_checkpoint(run, 3)
    marker = tmp_path / "pwned"
    shard = ck / "zero/state/zero_pp_rank_0_mp_rank_00_model_states.pt"
    _plant(shard, marker)
    m = json.loads((ck / CHECKPOINT_MANIFEST).read_text())
    m["files"][str(shard.relative_to(ck))] = {"size": shard.stat().st_size, "sha256": sha256_file(shard)}
    (ck / CHECKPOINT_MANIFEST).write_text(json.dumps(m))
    assert checkpoint_problem(ck, deep=True) is None
    engine = FakeEngine(0, 3)
    with pytest.raises(CheckpointError, match="refused to load a DeepSpeed file"):
        load_checkpoint(engine, ck, 0)
    assert not marker.exists()
    # any torch.load in the process is weights-only while DeepSpeed loads, even one asking for pickles
    with safe_deepspeed_load(engine), pytest.raises(pickle.UnpicklingError):
        torch.load(shard, weights_only=False)
    assert not marker.exists()
    # and afterwards the process is as before (the engine's own loader is back)
    assert "load" not in engine.checkpoint_engine.__dict__ and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    # (the payload is real: DeepSpeed's own loader would have run it)
    engine.checkpoint_engine.load(str(shard), map_location="cpu")
    assert marker.read_text() == "pwned"


def test_genuine_deepspeed_objects_load_weights_only(tmp_path):
    """The allow-list covers what DeepSpeed's ZeRO checkpoints hold; the whole state comes back."""
    run = tmp_path / "run"
    ck = torchrun_checkpoint(run, 3)
    engine = FakeEngine(0, 3)
    state = load_checkpoint(engine, ck, 0)
    assert state["step"] == 3 and state["data"] == {"position": 6}
    assert len(engine.loaded) == 4 and (ck / "zero/latest").read_text() == "state"


def test_an_enum_pickled_by_name_loads_weights_only_and_nothing_else_through_getattr(tmp_path):
    """Python 3.11.2 pickles DeepSpeed's ZeroStageEnum as `getattr(ZeroStageEnum, 'weights')`: such a file
    loads weights-only; a getattr of anything but an allowed enum's member is refused."""
    import pickle

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from hylo.pipeline.train.checkpoint.deepspeed_io import deepspeed_safe_globals

    class ByName:  # what 3.11.2's Enum.__reduce_ex__ writes, on any Python
        def __init__(self, owner, name):
            self.args = (owner, name)

        def __reduce__(self):
            return getattr, self.args

    ok = tmp_path / "ok.pt"
    torch.save({"zero_stage": ByName(ZeroStageEnum, "weights"), "w": torch.ones(2)}, ok)
    with pytest.raises(pickle.UnpicklingError, match="getattr"):
        torch.load(ok, weights_only=True)  # without the allow-list: refused, as the fresh clone saw it
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        state = torch.load(ok, weights_only=True)
    assert state["zero_stage"] is ZeroStageEnum.weights and state["w"].tolist() == [1.0, 1.0]
    for owner, name in ((LossScaler, "__init__"), (ZeroStageEnum, "__class__"), (ZeroStageEnum, "_member_map_")):
        bad = tmp_path / f"bad-{name}.pt"
        torch.save({"x": ByName(owner, name)}, bad)
        with pytest.raises(pickle.UnpicklingError):
            with torch.serialization.safe_globals(deepspeed_safe_globals()):
                torch.load(bad, weights_only=True)


# ------------------------------------------------------------------------------------ metrics
REC = {"stage": 2, "loss": 1.0, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 100.0, "mem_peak_mib": 10.0}


def test_torn_last_metrics_line_is_skipped_with_a_warning(tmp_path, capsys):
    w = MetricsWriter(tmp_path, total_steps=6, tensorboard=False, stream=open(os.devnull, "w"))
    for step in (1, 2, 3):
        w.write({**REC, "step": step})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"loss": 0.5, "step": 4, "rows": [[1, ')  # the writer was killed mid-line
    got = read_metrics(tmp_path)
    assert list(got) == [1, 2, 3]
    assert f"{METRICS_FILE}:4: skipped a torn or unreadable line" in capsys.readouterr().err


def test_resumed_run_repairs_and_continues_the_metrics(tmp_path, capsys):
    w = MetricsWriter(tmp_path, total_steps=6, tensorboard=False)
    for step in (1, 2, 3, 4):
        w.write({**REC, "step": step, "loss": float(step)})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"loss": 0.5, "st')
    # the run resumes from its step-2 checkpoint: steps 3-4 will be recomputed, the torn line goes
    w2 = MetricsWriter(tmp_path, total_steps=6, tensorboard=False, stream=open(os.devnull, "w"))
    warnings = w2.restart_at(2)
    assert any("torn" in x for x in warnings) and any("dropped 2 record(s) of steps after 2" in x for x in warnings)
    for step in (3, 4):
        w2.write({**REC, "step": step, "loss": 10.0 + step})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    assert read_metrics(tmp_path)[4]["loss"] == 14.0


def test_a_torn_record_of_the_resumed_step_comes_back_from_the_checkpoint(tmp_path):
    """A torn last line of step 4 and a resume from the step-4 checkpoint: the checkpoint holds its steps'
    records, so step 4 comes back and every finished step is in the file once (not 1, 2, 3, 5, 6)."""
    from hylo.pipeline.train.loop import checkpoint_records

    w = MetricsWriter(tmp_path, total_steps=6, tensorboard=False, stream=open(os.devnull, "w"))
    records = [{**REC, "step": s, "loss": float(s)} for s in (1, 2, 3, 4)]
    for r in records[:3]:
        w.write(r)
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write(json.dumps(records[3])[:25])  # killed while appending step 4's line
    # the trainer state of the step-4 checkpoint (every_steps=2: it holds steps 3 and 4)
    state = {"metrics": records[3], "metrics_since_previous": records[2:4]}
    w2 = MetricsWriter(tmp_path, total_steps=6, tensorboard=False, stream=open(os.devnull, "w"))
    warnings = w2.restart_at(4, restore=checkpoint_records(state))
    assert any("restored the record(s) of step(s) 4 from the checkpoint" in x for x in warnings), warnings
    for step in (5, 6):
        w2.write({**REC, "step": step, "loss": float(step)})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert read_metrics(tmp_path)[4] == records[3]
    # a relaunch on a node whose copy of the file stops before the checkpoint: its steps come back too
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    w3 = MetricsWriter(tmp_path, total_steps=6, tensorboard=False, stream=open(os.devnull, "w"))
    w3.restart_at(4, restore=checkpoint_records(state))
    assert list(read_metrics(tmp_path)) == [1, 2, 3, 4]
    # a checkpoint written before the records travelled holds its own step's record only
    assert checkpoint_records({"metrics": records[3]}) == [records[3]]


def test_ray_worker_writes_each_step_before_reporting(tmp_path, monkeypatch):
    """Under Ray, rank 0 appends the record before `ray.train.report`: a driver interrupted while the
    report is in flight (Ctrl-C) loses no trained step."""
    import ray.train

    from hylo.pipeline.train.session import RaySession
    from hylo.pipeline.train.worker import WorkerContext

    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=r", "metrics.tensorboard=false"])
    ctx = WorkerContext(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                        run_dir=tmp_path / "r", grad_accum=1)
    session = RaySession(ctx, {"launcher": "ray"}, total_steps=4)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray.train, "report", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.report({**REC, "step": 1}, 1, None)
    assert list(read_metrics(tmp_path / "r")) == [1]


# ------------------------------------------------------------------------------------ Ray bookkeeping
def _ray_session(tmp_path, monkeypatch, registered: str | None, **loop):
    """A rank-0 RaySession of run `tmp_path/run` whose `ray.train.get_checkpoint()` says `registered`."""
    import ray.train

    from hylo.pipeline.train.session import RaySession
    from hylo.pipeline.train.worker import WorkerContext

    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=run", "metrics.tensorboard=false"])
    ctx = WorkerContext(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                        run_dir=tmp_path / "run", grad_accum=1)
    ckpt = None if registered is None else ray.train.Checkpoint(str(tmp_path / "run" / registered))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: ckpt)
    return RaySession(ctx, {"launcher": "ray", "launch_id": "this-launch", **loop}, total_steps=12)


@pytest.mark.parametrize("registered", [None, "step_00000003"], ids=["ray-registered-none", "ray-registered-older"])
def test_worker_restart_resumes_from_the_newest_intact_checkpoint_in_storage(tmp_path, monkeypatch, registered):
    """A worker killed right after step 6's manifest (Ray has registered nothing yet, or only step 3):
    the relaunched group starts from step 6, what storage holds, not from Ray's record."""
    run = tmp_path / "run"
    torchrun_checkpoint(run, 3, launch_id="this-launch")
    torchrun_checkpoint(run, 6, launch_id="this-launch")
    session = _ray_session(tmp_path, monkeypatch, registered)
    assert [c.name for c, _ in session.candidates()][:2] == ["step_00000006", "step_00000003"]
    # a damaged newest one is skipped (walk back), whatever Ray registered
    _truncate(run / "step_00000006" / "zero/state/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert [(c.name, may_skip) for c, may_skip in session.candidates()][0] == ("step_00000006", True)


def test_restart_after_resume_from_an_older_checkpoint_ignores_newer_ones_of_earlier_launches(tmp_path, monkeypatch):
    """`--resume step_3` of a run that holds an intact step 9 from an earlier launch, then a worker dies
    after this launch wrote step 6: the relaunch takes step 6 (this launch's newest), never the stale 9."""
    run = tmp_path / "run"
    torchrun_checkpoint(run, 3, launch_id="earlier")
    torchrun_checkpoint(run, 9, launch_id="earlier")
    session = _ray_session(tmp_path, monkeypatch, None, resume_from=str(run / "step_00000003"))
    assert [(c.name, s) for c, s in session.candidates()] == [("step_00000003", False)]
    torchrun_checkpoint(run, 6, launch_id="this-launch")
    assert [(c.name, s) for c, s in session.candidates()] == [("step_00000006", True), ("step_00000003", False)]
    # --resume (latest) walks every checkpoint of the run, newest first, this launch's first
    latest = _ray_session(tmp_path, monkeypatch, None, resume_latest=True)
    assert [c.name for c, _ in latest.candidates()] == ["step_00000006", "step_00000009", "step_00000003"]


def test_ray_snapshot_pointing_at_a_deleted_checkpoint_is_reset(tmp_path, capsys):
    from hylo.pipeline.train.driver import RAY_SNAPSHOT, reset_ray_snapshot

    run = tmp_path / "run"
    torchrun_checkpoint(run, 3)
    newest = torchrun_checkpoint(run, 6)
    (run / RAY_SNAPSHOT).write_text(json.dumps({
        "checkpoint_results": [{"checkpoint_dir_name": "step_00000003", "metrics": {}},
                               {"checkpoint_dir_name": "step_00000006", "metrics": {}}],
        "latest_checkpoint_result": {"checkpoint_dir_name": "step_00000006", "metrics": {}}}))
    shutil.rmtree(newest)  # the user deleted the newest checkpoint
    note = reset_ray_snapshot(Loc.of(run))
    assert "points at step_00000006, which is missing" in note and not (run / RAY_SNAPSHOT).exists()
    assert latest_checkpoint(run) == run / "step_00000003"
    assert reset_ray_snapshot(Loc.of(run)) is None


# ------------------------------------------------------------------------------------ resources
def _serve_cfg(*sets):
    return load_stage_config(2, None, ["teacher.source=serve", "ray.num_workers=2", "ray.cpus_per_worker=1",
                                       "teacher.pool.num_replicas=2", "teacher.pool.num_cpus=1", *sets])


def test_run_that_cannot_fit_the_cluster_fails_at_once():
    from hylo.pipeline.train.driver import check_resources

    with pytest.raises(ConfigError, match=r"this run needs 4 CPU \(2 train workers x 1 \+ 2 teacher replicas x 1\) "
                                          r"but the Ray cluster has 2: lower ray.num_workers"):
        check_resources(_serve_cfg(), {"CPU": 2.0}, [{"CPU": 2.0}])
    check_resources(_serve_cfg("teacher.pool.num_cpus=0.5", "ray.cpus_per_worker=0.5"), {"CPU": 2.0}, [{"CPU": 2.0}])
    with pytest.raises(ConfigError, match=r"needs 1 GPU .* has 0"):
        check_resources(_serve_cfg("teacher.pool.num_gpus=0.5"), {"CPU": 8.0}, [{"CPU": 8.0}])
    # enough in total, but no single node can hold one worker
    with pytest.raises(ConfigError, match="one train worker needs"):
        check_resources(_serve_cfg("ray.cpus_per_worker=3"), {"CPU": 12.0}, [{"CPU": 2.0}] * 6)


def test_ray_failure_is_reported_as_the_workers_own_error():
    from hylo.pipeline.train.driver import TrainingError

    class WorkerGroupError(RuntimeError):
        pass

    e = WorkerGroupError("Training failed due to worker errors")
    e.worker_failures = {1: RuntimeError("Traceback (most recent call last):\n  File \"loop.py\", line 9\n"
                                         "hylo.pipeline.train.checkpoint.layout.CheckpointError: --resume /r/step_00000003: "
                                         "cannot resume from it: ranks/rank_1.json: missing")}
    assert str(TrainingError(e)) == ("training failed: CheckpointError: --resume /r/step_00000003: cannot resume "
                                     "from it: ranks/rank_1.json: missing")


def test_worker_group_start_retries_follow_max_failures(tmp_path):
    from hylo.pipeline.train.driver import run_config, run_loc

    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.max_failures=0"])
    rc = run_config(cfg, run_loc(cfg))
    assert rc.failure_config.max_failures == 0 and rc.failure_config.controller_failure_limit == 0


# ------------------------------------------------------------------------------------ storage
def test_relative_storage_path_is_refused_in_a_submitted_job(monkeypatch):
    check_storage_path("runs", "ray")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
        {"runtime_env": {"working_dir": "gcs://_ray_pkg_abc.zip"}, "metadata": {"job_submission_id": "raysubmit_1"}}))
    with pytest.raises(StorageError, match=r"ray.storage_path='runs' is relative, and this is a `ray job submit` job: "
                                           r"the run would land in Ray's temporary copy"):
        check_storage_path("runs", "ray")
    check_storage_path("/abs/runs", "ray")
    check_storage_path("s3://bucket/runs", "ray")
    with pytest.raises(StorageError, match="URIs need ray.launcher=ray"):
        check_storage_path("s3://bucket/runs", "torchrun")


def test_uri_storage_is_not_a_local_directory(tmp_path, monkeypatch):
    from hylo.pipeline.train.storage import run_dir

    monkeypatch.chdir(tmp_path)
    cfg = load_stage_config(2, None, ["ray.storage_path=mock://bucket/runs", "ray.name=exp"])
    d = run_dir(cfg)
    assert "s3:" not in str(d) and "mock:" not in str(d) and not str(d).startswith(str(tmp_path))
    loc = Loc.of("mock://bucket/runs") / "exp"
    assert str(loc).startswith("mock://") and str(loc).endswith("runs/exp") and not loc.is_local


@pytest.mark.slow
def test_checkpoints_on_s3_save_walk_back_and_resume(tmp_path):
    """An s3:// run directory (a local S3 server, pyarrow's S3 client): Ray-style checkpoints, their
    manifest, the walk-back past a broken one, and the download a worker resumes from."""
    from tests.helpers.train import fake_s3

    with fake_s3() as s3:
        run = Loc.of(s3("runs/exp"))
        assert run.scheme == "s3" and not run.is_local
        ray_checkpoint(run, 3, tmp_path / "scratch")
        newest = ray_checkpoint(run, 6, tmp_path / "scratch")
        assert [s for s, _ in list_checkpoints(run)] == [3, 6]
        (newest / "zero/state/zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"short")
        chosen, lines = _walk(run)
        assert chosen == run / "step_00000003" and "optim_states.pt: 5 bytes" in lines[0]
        local = chosen.download(tmp_path / "resume")
        assert checkpoint_problem(local, deep=True) is None
        assert load_checkpoint(FakeEngine(1, 3), local, 1)["data"] == {"position": 7}
        assert prune(run, keep=1) == []  # step 6 is newer than the newest intact one
        assert delete_checkpoints(run)[0] == 2 and step_dirs(run) == []
