"""The error contract of every job: bad input -> exit status 2 and one `error:` line naming the file/field.

Unit tests of pipeline/cli.py, then every job run as a subprocess (as a user would) with bad input. Each
bad input must be caught before a model loads or Ray starts, so these runs take seconds.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hylo.pipeline.cli import BadArgument, check_finite_args, input_error_message, job_main
from hylo.pipeline.config import ConfigError
from hylo.weight_files import WeightsFileError, check_safetensors, check_weights_dir

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------- pipeline/cli
def _call(fn, capsys) -> tuple[int, str]:
    rc = job_main(fn)([])
    return rc, capsys.readouterr().err


def test_input_error_is_one_line_and_rc2(capsys):
    def main(argv):
        raise ConfigError("c.yaml line 3: kd.temperature=0.0: must be > 0\n(second line)")

    rc, err = _call(main, capsys)
    assert rc == 2 and err == "error: c.yaml line 3: kd.temperature=0.0: must be > 0 (second line)\n"


def test_a_bug_keeps_its_traceback():
    def main(argv):
        return {}["missing"]

    with pytest.raises(KeyError):
        job_main(main)([])


def test_path_errors_name_the_path(capsys, tmp_path):
    def denied(argv):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "out"))

    rc, err = _call(denied, capsys)
    assert rc == 2 and err == f"error: {tmp_path / 'out'}: Permission denied\n"

    def full(argv):
        # what a write() into a full disk raises: no file name; the message says where in our code
        raise OSError(errno.ENOSPC, "No space left on device")

    rc, err = _call(full, capsys)
    assert rc == 2 and err.startswith("error: No space left on device (while writing or reading in "
                                      "tests/jobs/test_job_errors.py:")

    def exists(argv):
        raise FileExistsError("out/manifest.json exists; set output.overwrite=true to replace it")

    rc, err = _call(exists, capsys)
    assert rc == 2 and "output.overwrite" in err
    # an OSError that is not about a path (no errno) is not bad input by itself
    assert input_error_message(OSError("ZSTD decompression failed")) is None


def test_wrapped_input_errors_are_found(capsys):
    from hylo.pipeline.data.rowfile import DataFormatError

    def chained(argv):
        try:
            raise DataFormatError("d/shard-00001.parquet: unreadable")
        except DataFormatError as e:
            raise RuntimeError("training failed") from e

    rc, err = _call(chained, capsys)
    assert rc == 2 and err == "error: d/shard-00001.parquet: unreadable\n"


def test_ray_wrapped_worker_errors_are_found():
    """Ray Train's WorkerGroupError and a RayTaskError (as the driver sees them) carry the input error."""
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    from hylo.pipeline.data.rows import PackedRowError

    cause = PackedRowError("data/shard-00003.parquet row 7: cu_seqlens must end at T=64")
    task = RayTaskError("train_worker", "Traceback (most recent call last):\n  ...\nPackedRowError: ...", cause)
    remote = task.as_instanceof_cause()
    assert isinstance(remote, PackedRowError) and "\n" in str(remote)  # the remote traceback, not the message
    assert input_error_message(remote) == str(cause)
    group = WorkerGroupError("worker 1 failed", {0: RuntimeError("peer died"), 1: remote})
    assert input_error_message(group) == f"worker 1: {cause}"
    assert input_error_message(WorkerGroupError("x", {0: RuntimeError("nccl")})) is None


def test_every_listed_input_error_class_exists_under_that_module_and_name():
    """cli.INPUT_ERRORS names classes by module and name (so cli imports none of them): a class that moved
    or was renamed would silently turn its bad-input errors into tracebacks with exit status 1."""
    import importlib

    from hylo.pipeline.cli import INPUT_ERRORS

    missing = []
    for module, name in INPUT_ERRORS:
        cls = getattr(importlib.import_module(module), name, None)
        if not (isinstance(cls, type) and issubclass(cls, BaseException) and cls.__name__ == name):
            missing.append(f"{module}.{name}")
    assert not missing, f"INPUT_ERRORS names classes that do not exist there: {missing}"


def test_non_finite_float_flags_are_bad_arguments():
    import argparse

    with pytest.raises(BadArgument, match=r"--gdn-expand-v=inf: must be a finite number"):
        check_finite_args(argparse.Namespace(gdn_expand_v=float("inf"), seed=1))
    check_finite_args(argparse.Namespace(gdn_expand_v=1.5, name="x"))


def test_truncated_safetensors_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    f = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(64)}, str(f))
    check_safetensors(f)
    data = f.read_bytes()
    for cut, what in ((len(data) - 16, "truncated: its tensors need"), (100, "truncated"), (5, "no header")):
        f.write_bytes(data[:cut])
        with pytest.raises(WeightsFileError, match=f"{f}: .*{what}"):
            check_weights_dir(tmp_path)
    f.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(WeightsFileError, match="corrupt safetensors header"):
        check_safetensors(f)


# -------------------------------------------------------------------------------- jobs as subprocesses
def run_job(args: list[str], timeout: float = 240, cwd: Path = ROOT, prefix: list[str] | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*(prefix or []), sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_input_error(proc, *needles: str) -> str:
    """rc 2, no traceback, exactly one `error:` line (the last one), holding every needle."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"rc {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    assert "Started a local Ray instance" not in out and "Training started" not in out
    return errors[0]


def _unshare_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


def in_small_fs(mount: Path, options: str) -> list[str]:
    """A command prefix that runs the job with a fresh tmpfs (`options`: size=..., ro) mounted at `mount`.
    Needs user namespaces (`unshare`); the mount exists for the job only."""
    if not _unshare_ok():
        pytest.skip("needs unshare (user + mount namespaces) to give the job a read-only or full file system")
    mount.mkdir(parents=True, exist_ok=True)
    script = f'mount -t tmpfs -o {options} tmpfs "{mount}" && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.helpers.train import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny"))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _packed_dir(d: Path, split: str, seq_len: int = 64, shards: int = 3) -> Path:
    from hylo.pipeline.data.shards import ShardWriter, write_manifest

    from tests.helpers.teacher import make_packed_row

    w = ShardWriter(d, 4, 2)
    for i in range(4 * shards):
        w.add(make_packed_row([20, 30, 14], vocab_size=96, seed=i))
    write_manifest(d, {"config_hash": "x", "split": split, "max_len": seq_len, "shards": w.finish()})
    return d


@pytest.mark.slow
def test_convert_job(tmp_path, tiny):
    cfg = tmp_path / "config.json"
    cfg.write_text((tiny["base"] / "config.json").read_text())
    # HybridConfigError (was a traceback)
    proc = run_job(["jobs/convert.py", "--dry-run", "--base-config", str(cfg), "--kv-lora-rank", "12"])
    assert_input_error(proc, "kv_lora_rank", "multiple of 8")
    # OverflowError from an infinite float flag (was a traceback)
    proc = run_job(["jobs/convert.py", "--dry-run", "--base-config", str(cfg), "--gdn-expand-v", "inf"])
    assert_input_error(proc, "--gdn-expand-v", "got inf")
    # AssetError (was a traceback)
    proc = run_job(["jobs/convert.py", "--base", "asset:no-such-model", "--out", str(tmp_path / "o")])
    assert_input_error(proc, "no-such-model")
    # a truncated base checkpoint is named (safetensors' error names no file)
    base = _copy_model(tiny["base"], tmp_path / "base")
    _truncate(base / "model.safetensors", 4000)
    proc = run_job(["jobs/convert.py", "--base", str(base), "--out", str(tmp_path / "o")])
    assert_input_error(proc, str(base / "model.safetensors"), "truncated")


@pytest.mark.slow
def test_convert_into_a_full_or_read_only_directory(tmp_path, tiny):
    mnt = tmp_path / "mnt"
    proc = run_job(["jobs/convert.py", "--base", str(tiny["base"]), "--out", str(mnt / "hylo"), "--no-calibrate"],
                   prefix=in_small_fs(mnt, "size=64k"))
    assert_input_error(proc, str(mnt), "model.safetensors: No space left on device")
    proc = run_job(["jobs/convert.py", "--base", str(tiny["base"]), "--out", str(mnt / "hylo"), "--no-calibrate"],
                   prefix=in_small_fs(mnt, "ro"))
    assert_input_error(proc, f"--out (its parent)={mnt}", "Read-only file system")


@pytest.mark.slow
def test_decontaminate_job(tmp_path):
    cfg = tmp_path / "dc.yaml"
    cfg.write_text("match:\n  ngram: 8\n  mode: cut\nmatch:\n  ngram: 13\n")
    proc = run_job(["jobs/decontaminate.py", "--config", str(cfg), "--input", str(tmp_path / "x.jsonl")])
    assert_input_error(proc, str(cfg), "duplicate key 'match' at line 4 (first at line 1)")
    cfg.write_bytes(b"out: caf\xe9\n")
    proc = run_job(["jobs/decontaminate.py", "--config", str(cfg), "--input", str(tmp_path / "x.jsonl")])
    assert_input_error(proc, str(cfg), "not valid UTF-8")


@pytest.mark.slow
def test_decontaminate_into_a_full_directory(tmp_path):
    mix = tmp_path / "mix.jsonl"
    text = " ".join(f"word{i}" for i in range(200))
    with open(mix, "w") as f:
        for i in range(200):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": text},
                                                            {"role": "assistant", "content": text}]}) + "\n")
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"id": "b0", "q": "alpha beta gamma delta epsilon zeta eta theta iota"}) + "\n")
    mnt = tmp_path / "mnt"
    proc = run_job(["jobs/decontaminate.py", "--input", str(mix), "--benchmark", f"toy={bench}:q",
                    "--scanner", "local", "--out", str(mnt / "dc"), "--set", "progress=false"],
                   prefix=in_small_fs(mnt, "size=64k"))
    assert_input_error(proc, str(mnt / "dc"), "No space left on device")


@pytest.mark.slow
def test_prepare_data_job(tmp_path):
    proc = run_job(["jobs/prepare_data.py", "--config", "configs/data_smoke.yaml", "--set", "packing.close_slack=-1"])
    assert_input_error(proc, "command line", "packing.close_slack=-1: must be >= 0")
    cfg = tmp_path / "d.yaml"
    cfg.write_text("split: all\npacking:\n  max_len: .nan\n")
    proc = run_job(["jobs/prepare_data.py", "--config", str(cfg)])
    assert_input_error(proc, f"{cfg} line 3", "packing.max_len")


@pytest.mark.slow
def test_teacher_cache_job(tmp_path, tiny):
    # a missing data directory: one line, before Ray starts (was a traceback after ray.init)
    proc = run_job(["jobs/teacher_cache.py", "--set", f"data={tmp_path / 'nodata'}", "--set", f"out={tmp_path / 'c'}",
                    "--set", f"teacher.model.path={tiny['base']}"])
    assert_input_error(proc, str(tmp_path / "nodata"), "does not exist")
    data = _packed_dir(tmp_path / "data", "stage2")
    _truncate(data / "shard-00001.parquet", 300)
    proc = run_job(["jobs/teacher_cache.py", "--set", f"data={data}", "--set", f"out={tmp_path / 'c'}",
                    "--set", f"teacher.model.path={tiny['base']}"])
    assert_input_error(proc, str(data / "shard-00001.parquet"))
    proc = run_job(["jobs/teacher_cache.py", "--set", f"data={data}", "--set", f"out={tmp_path / 'c'}",
                    "--set", "teacher.k=0"])
    assert_input_error(proc, "teacher.k=0: the offline cache holds top-k records")


def _stage_config(tiny, tmp_path, stage: int, **sections) -> Path:
    from tests.helpers.train import tiny_config, write_config

    cfg = tiny_config(tiny, tmp_path / "runs", f"s{stage}", stage=stage, ray={"launcher": "ray"}, **sections)
    return write_config(cfg, tmp_path / f"stage{stage}.yaml")


@pytest.mark.slow
def test_stage1_job(tmp_path, tiny):
    cfg = _stage_config(tiny, tmp_path, 1)
    proc = run_job(["jobs/stage1.py", "--config", str(cfg), "--set", "train.total_steps=-5"])
    assert_input_error(proc, "train.total_steps=-5: must be >= 1")
    proc = run_job(["jobs/stage1.py", "--config", str(cfg), "--set", "model.student=null",
                    "--set", "model.convert={mla_layers: even, kv_lora_rank: 12}"])
    assert_input_error(proc, "model.convert=", "kv_lora_rank")
    assert not (tmp_path / "runs" / "s1" / "converted").exists()


@pytest.mark.slow
def test_stage2_job(tmp_path, tiny):
    data = _packed_dir(tmp_path / "data", "stage2")
    _truncate(data / "shard-00002.parquet", 200)
    cfg = _stage_config(tiny, tmp_path, 2, data={"source": "parquet", "path": str(data), "seq_len": 64})
    proc = run_job(["jobs/stage2.py", "--config", str(cfg)])
    assert_input_error(proc, str(data / "shard-00002.parquet"))
    proc = run_job(["jobs/stage2.py", "--config", str(cfg), "--set", "data.source=synthetic",
                    "--set", f"model.student={tmp_path / 'missing'}"])
    assert_input_error(proc, "model.student", str(tmp_path / "missing"))
    proc = run_job(["jobs/stage2.py", "--config", str(cfg), "--set", "kd.kl_weight=-5"])
    assert_input_error(proc, "kd.kl_weight=-5.0: must be >= 0")


def _foreign_data(d: Path, vocab_size: int, **manifest) -> Path:
    from hylo.pipeline.data.shards import ShardWriter, write_manifest

    from tests.helpers.teacher import make_packed_row

    w = ShardWriter(d, 4, 2)
    for i in range(8):
        w.add(make_packed_row([20, 30, 14], vocab_size=vocab_size, seed=i))
    write_manifest(d, {"config_hash": "x", "split": "stage2", "max_len": 64, "shards": w.finish(), **manifest})
    return d


@pytest.mark.slow
def test_rows_of_another_tokenizer_are_refused_before_ray_starts(tmp_path, tiny):
    """Rows tokenized with another tokenizer than the student's are refused by the stage's input check in
    one line, before Ray starts (not in the workers, where the error was retried like a machine fault and
    ended as a traceback, rc 1): ids past the student's vocabulary (the shards' footer statistics), a
    tokenizer named by the manifest that disagrees with the student's, or its recorded token table."""
    from hylo.pipeline.data.render import token_table, token_table_hash

    from tests.helpers.teacher import save_tiny_llama

    def stage2(data: Path):
        cfg = _stage_config(tiny, tmp_path, 2, data={"source": "parquet", "path": str(data)})
        return run_job(["jobs/stage2.py", "--config", str(cfg)])

    wide = _foreign_data(tmp_path / "wide", vocab_size=4000, tokenizer="another-tokenizer")
    assert_input_error(stage2(wide), f"data.path={wide}: shard-0000", "outside the student's vocabulary of 96",
                       "tokenized with another tokenizer ('another-tokenizer')")
    other = save_tiny_llama(tmp_path / "other-tok", vocab_size=96, tokenizer_salt="q")
    named = _foreign_data(tmp_path / "named", vocab_size=96, tokenizer=str(other))
    assert_input_error(stage2(named), f"tokenized with {str(other)!r}, whose tokenizer disagrees with the student's",
                       "on 96 token id(s), first id 0: 'wq0' vs 'w0'")
    table = token_table_hash(token_table((other / "tokenizer.json").read_text()))
    recorded = _foreign_data(tmp_path / "recorded", vocab_size=96, tokenizer="/elsewhere/tok", token_table=table)
    assert_input_error(stage2(recorded), f"tokenized with '/elsewhere/tok' (token table {table}), not with the "
                                         "student's tokenizer")


@pytest.mark.slow
def test_eval_job(tmp_path, tiny):
    model = _copy_model(tiny["student"], tmp_path / "student")
    _truncate(model / "model.safetensors", 2000)
    proc = run_job(["jobs/eval.py", "--model", str(model), "--suite", "kvcache", "--out", str(tmp_path / "ev"),
                    "--set", "kvcache.lengths=[16]"])
    assert_input_error(proc, str(model / "model.safetensors"), "truncated")
    proc = run_job(["jobs/eval.py", "--model", str(tiny["student"]), "--suite", "kvcache", "--out", str(tmp_path),
                    "--set", "kvcache.decode_tokens=0"])
    assert_input_error(proc, "kvcache.decode_tokens=0: must be >= 1")
    # a read-only output directory fails before the evaluation runs, not after it
    mnt = tmp_path / "mnt"
    proc = run_job(["jobs/eval.py", "--model", str(tiny["student"]), "--suite", "kvcache", "--out", str(mnt / "ev"),
                    "--set", "kvcache.lengths=[16]"], prefix=in_small_fs(mnt, "ro"))
    assert_input_error(proc, f"out={mnt / 'ev'}", "Read-only file system")


@pytest.mark.slow
def test_place_layers_job(tmp_path):
    proc = run_job(["jobs/place_layers.py", "--n-mla", "0", "--run-dir", str(tmp_path / "p")])
    assert_input_error(proc, "--n-mla")
    proc = run_job(["jobs/place_layers.py", "--n-mla", "2", "--proxy-only", "--run-dir", str(tmp_path / "p"),
                    "--heldout-data", str(tmp_path / "nothing")])
    assert_input_error(proc, str(tmp_path / "nothing"), "manifest.json")


@pytest.mark.slow
def test_fetch_assets_job():
    proc = run_job(["jobs/fetch_assets.py", "no-such-asset"])
    assert_input_error(proc, "no-such-asset")


@pytest.mark.slow
def test_demo_job(tmp_path):
    proc = run_job(["jobs/demo.py", "--steps", "0", "--run-dir", str(tmp_path / "d")])
    assert_input_error(proc, "--steps")
    (tmp_path / "file").write_text("x")
    proc = run_job(["jobs/demo.py", "--run-dir", str(tmp_path / "file" / "demo")])
    assert_input_error(proc, str(tmp_path / "file"), "Not a directory")
    mnt = tmp_path / "mnt"
    proc = run_job(["jobs/demo.py", "--run-dir", str(mnt / "demo")], prefix=in_small_fs(mnt, "ro"))
    assert_input_error(proc, str(mnt / "demo"), "Read-only file system")


def test_corrupt_shard_in_the_middle_is_named_by_the_reader(tmp_path):
    """A shard whose footer is intact but whose pages are corrupt (ZSTD error) names file and row group."""
    from hylo.pipeline.data.reader import RowReader
    from hylo.pipeline.data.rowfile import DataFormatError

    d = _packed_dir(tmp_path / "data", "stage2")
    f = d / "shard-00001.parquet"
    data = bytearray(f.read_bytes())
    for i in range(100, 300):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(DataFormatError, match=r"shard-00001.parquet.*row group 0.*unreadable"):
        list(RowReader(d))
    assert next(iter(RowReader(d))).input_ids.shape == (64,)


def _tiny_teacher_cache(tmp_path, tiny):
    """A finished top-4 teacher cache of one packed shard: (its config, its one shard file)."""
    from hylo.pipeline.teacher.cache import compute_shard, finalize_cache, prepare_cache
    from hylo.pipeline.teacher.config import CacheTeacherSection, TeacherCacheConfig, TeacherModelConfig
    from hylo.pipeline.teacher.model import TeacherModel

    data = _packed_dir(tmp_path / "data", "stage2", shards=1)
    cfg = TeacherCacheConfig(data=str(data), out=str(tmp_path / "cache"), rows_per_shard=4,
                             teacher=CacheTeacherSection(k=4, model=TeacherModelConfig(path=str(tiny["base"]))))
    header, plan, todo = prepare_cache(cfg)
    teacher = TeacherModel(tiny["base"])
    for p in todo:
        compute_shard(teacher, cfg.data, cfg.out, header, p)
    assert finalize_cache(cfg.out, plan)
    return cfg, next((tmp_path / "cache").rglob("shard-*.parquet"))


def test_corrupt_teacher_cache_shard_is_named_by_the_reader(tmp_path, tiny):
    from hylo.pipeline.teacher.cache import CacheFormatError, TopKCacheReader

    cfg, shard = _tiny_teacher_cache(tmp_path, tiny)
    raw = bytearray(shard.read_bytes())
    for i in range(64, 400):
        raw[i] ^= 0x5A
    shard.write_bytes(bytes(raw))
    with pytest.raises(CacheFormatError, match=rf"{shard}( row group \d+)?: unreadable cache shard"):
        reader = TopKCacheReader(tmp_path / "cache")
        for rid in reader.row_ids:
            reader.get(rid)


def _flip_each(path: Path, offsets, read):
    """Flip one bit at each offset of `path` in turn, call `read()` on the damaged file, and put the byte
    back; returns (offset, what read() returned or the exception it raised) per offset."""
    good = path.read_bytes()
    out = []
    for off in offsets:
        bad = bytearray(good)
        bad[off] ^= 0x10
        path.write_bytes(bytes(bad))
        try:
            out.append((off, read()))
        except Exception as e:  # noqa: BLE001 - the caller judges what was raised
            out.append((off, e))
        finally:
            path.write_bytes(good)
    return out


def _chunk_offsets(path: Path, column: str, every: int = 7):
    """(row group, offsets) of every `every`-th byte of `column`'s pages in each row group of a Parquet file."""
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    for rg in range(md.num_row_groups):
        col = md.row_group(rg).column([n.split(".")[0] for n in names].index(column))
        start = col.dictionary_page_offset or col.data_page_offset
        yield rg, range(start, start + col.total_compressed_size, every)


def test_a_flipped_byte_in_a_shards_token_ids_is_named_never_trained_on(tmp_path):
    """Shards carry Parquet page checksums (without them one flipped byte in the token ids still decoded at
    ~60 % of the offsets, zstd checking nothing, and training ran on changed ids): every flip in the
    token-id pages of a real shard is an error naming the file and the row group, or (a byte of a page
    header that is not data) changes nothing; never other rows."""
    from hylo.pipeline.data.reader import RowReader
    from hylo.pipeline.data.rowfile import DataFormatError

    d = _packed_dir(tmp_path / "data", "stage2")
    f = d / "shard-00001.parquet"
    want = [r.input_ids.tolist() for r in RowReader(d)]
    caught = 0
    for rg, offsets in _chunk_offsets(f, "input_ids"):
        for off, err in _flip_each(f, offsets, lambda: [r.input_ids.tolist() for r in RowReader(d)]):
            if not isinstance(err, Exception):
                assert err == want, f"offset {off}: read other token ids without an error"
                continue
            caught += 1
            assert isinstance(err, DataFormatError), (off, repr(err))
            assert str(err).startswith(f"{f}: row group {rg} (rows {2 * rg}..{2 * rg + 1} of the shard) is "
                                       "unreadable ("), (off, str(err))
    assert caught, "no flip was detected"
    # what the user reads when a data page's checksum does not match (the chunk's last bytes are page data)
    (rg, offsets), = list(_chunk_offsets(f, "input_ids", every=1))[1:2]
    (_, err), = _flip_each(f, [offsets[-2]], lambda: list(RowReader(d)))
    assert "a page's checksum does not match its bytes: the file changed after it was written" in str(err), err


def test_a_dataset_written_without_page_checksums_still_reads_and_the_driver_says_so(tmp_path, tiny, capsys):
    """A shard written before page checksums (no `page_checksums` in its manifest entry) reads as before,
    unverified; the stage's input check says so once."""
    import pyarrow.parquet as pq

    from hylo.pipeline.data.reader import RowReader
    from hylo.pipeline.data.rowfile import rows_to_table
    from hylo.pipeline.data.shards import write_manifest
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.inputs import check_stage_inputs

    from tests.helpers.teacher import make_packed_row

    d = tmp_path / "old"
    d.mkdir()
    rows = [make_packed_row([20, 30, 14], vocab_size=96, seed=i) for i in range(4)]
    pq.write_table(rows_to_table(rows), d / "shard-00000.parquet", row_group_size=2, compression="zstd")
    write_manifest(d, {"config_hash": "x", "split": "stage2", "max_len": 64,
                       "shards": [{"file": "shard-00000.parquet", "rows": 4, "tokens": 256}]})
    assert [r.input_ids.tolist() for r in RowReader(d)] == [list(r["input_ids"]) for r in rows]
    cfg = load_stage_config(2, _stage_config(tiny, tmp_path, 2, data={"source": "parquet", "path": str(d)}))
    capsys.readouterr()
    check_stage_inputs(cfg)
    err = capsys.readouterr().err
    assert err.count("without page checksums") == 1 and "shard-00000.parquet" in err, err


def test_a_flipped_byte_in_a_teacher_cache_shard_is_named_never_used(tmp_path, tiny):
    """The same for the teacher's top-k cache: a flipped byte of its log-probabilities is an error naming
    the cache shard and the row group (before: a silently changed teacher distribution or a zstd error)."""
    from hylo.pipeline.teacher.cache import CacheFormatError, TopKCacheReader

    cfg, shard = _tiny_teacher_cache(tmp_path, tiny)

    def read_all():
        reader = TopKCacheReader(tmp_path / "cache")
        return [tuple(t.clone() for t in reader.get(rid)) for rid in reader.row_ids]

    want = read_all()
    caught = 0
    for rg, offsets in list(_chunk_offsets(shard, "logprobs", every=5))[:2]:
        for off, err in _flip_each(shard, offsets, read_all):
            if not isinstance(err, Exception):
                assert all(all(torch_equal(a, b) for a, b in zip(x, y)) for x, y in zip(err, want)), \
                    f"offset {off}: read other teacher records without an error"
                continue
            caught += 1
            assert isinstance(err, CacheFormatError), (off, repr(err))
            assert str(err).startswith(f"{shard} row group {rg}: unreadable cache shard ("), (off, str(err))
    assert caught


def torch_equal(a, b) -> bool:
    """Bit for bit (NaNs included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
