"""Offline top-k cache: bit-exact storage round trip, agreement with a direct forward within a
tolerance, rejection of mismatched caches, resume after partial shards.

Shard-level tests run the teacher in-process (`compute_shard`); one module-scoped local Ray runs the
real job (Ray Data actor pool) twice: a partial run, then a resumed run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hylo.outputs import OutputConflictError
from hylo.ownership import OUTPUT_RECORD, ForeignOutputError, recorded_entries
from hylo.pipeline.data.rowfile import PackedRowFile
from hylo.pipeline.data.rows import check_row
from hylo.pipeline.ray_init import ray_running
from hylo.pipeline.teacher.cache import (
    SHARD_DIR,
    CacheFormatError,
    CacheMismatchError,
    TopKCacheReader,
    compute_shard,
    finalize_cache,
    prepare_cache,
    read_shard_meta,
    run_cache_job,
)
from hylo.pipeline.teacher.config import CacheTeacherSection, TeacherCacheConfig, TeacherModelConfig
from hylo.pipeline.teacher.model import TeacherModel

from tests.helpers.common import assert_topk_matches
from tests.helpers.teacher import make_packed_row, save_tiny_llama, write_packed_parquet

VOCAB = 96


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    model = save_tiny_llama(d / "model", vocab_size=VOCAB)
    data = d / "data"
    rows = [make_packed_row([4 + i % 5, 6, 3], VOCAB, seed=i, pad=i % 3) for i in range(10)]
    write_packed_parquet(data / "part-0.parquet", rows[:7])
    write_packed_parquet(data / "part-1.parquet", rows[7:])
    return {"dir": d, "model": model, "data": data, "rows": rows, "teacher": TeacherModel(model)}


def _cfg(env, out, k: int = 64, **kw) -> TeacherCacheConfig:
    return TeacherCacheConfig(data=str(env["data"]), out=str(out), rows_per_shard=3, **kw,
                              teacher=CacheTeacherSection(k=k, model=TeacherModelConfig(path=str(env["model"]))))


def _build_inprocess(env, out, **kw) -> TeacherCacheConfig:
    cfg = _cfg(env, out, **kw)
    header, plan, todo = prepare_cache(cfg)
    for p in todo:
        compute_shard(env["teacher"], cfg.data, cfg.out, header, p)
    assert finalize_cache(cfg.out, plan)
    return cfg


class _Recorder:
    """Wraps the teacher; remembers exactly what `compute_shard` handed to the writer, per row id."""

    def __init__(self, teacher):
        self.teacher, self.written = teacher, {}

    def topk_batch(self, rows, k, dtype):
        out = self.teacher.topk_batch(rows, k, dtype=dtype)
        for r, rec in zip(rows, out):
            self.written[check_row(r).row_id] = rec
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (so -0.0, NaN payloads and -inf compare exactly)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_matches_forward(teacher, row, got, k: int, dtype: str) -> None:
    """A cached record agrees with a direct forward of the row (tolerances: `helpers.assert_topk_matches`).

    The storage itself is tested bit for bit in `test_storage_round_trip_is_bit_exact`.
    """
    assert_topk_matches(torch.log_softmax(teacher.logits(check_row(row)).float(), dim=-1), got, k, dtype)


@pytest.mark.parametrize("dtype,k", [("float16", 8), ("bfloat16", 5), ("float32", VOCAB)],
                         ids=["fp16-k8", "bf16-k5", "fp32-kV"])
def test_storage_round_trip_is_bit_exact(env, tmp_path, dtype, k):
    """What the writer was given is what the reader returns, bit for bit (the cache's own guarantee)."""
    rec = _Recorder(env["teacher"])
    cfg = _cfg(env, tmp_path / "c", k=k, dtype=dtype)
    header, plan, todo = prepare_cache(cfg)
    for p in todo:
        compute_shard(rec, cfg.data, cfg.out, header, p)
    assert finalize_cache(cfg.out, plan)
    reader = TopKCacheReader(tmp_path / "c", expect_k=k, expect_data=env["data"],
                             expect_tokenizer_hash=env["teacher"].tokenizer_hash)
    assert len(reader) == 10 and set(rec.written) == set(reader.row_ids)
    for rid, got in reader:
        exp = rec.written[rid]
        assert got.logprobs.dtype == exp.logprobs.dtype and got.indices.dtype == torch.int32
        assert torch.equal(_bits(got.logprobs), _bits(exp.logprobs))
        assert torch.equal(got.indices, exp.indices.to(torch.int32))
        assert torch.equal(_bits(got.tail_logmass), _bits(exp.tail_logmass))
    # Iteration follows the data order.
    assert [rid for rid, _ in reader] == [check_row(r).row_id for r in env["rows"]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_storage_keeps_special_values_bit_exact(tmp_path, dtype):
    """-inf, -0.0, NaN, subnormals and the largest index survive write_shard -> reader unchanged."""
    from hylo.kernels.fused_kl.topk import TeacherTopK
    from hylo.pipeline.teacher.cache import MANIFEST, SHARD_DIR, ShardPlan, make_header, write_shard

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    vals = torch.tensor([[-0.0, -1e-7, float("-inf")], [float("nan"), -3.5, -60000.0]]).to(tdt)
    idx = torch.tensor([[0, 70000, 5], [7, 7, 123456]], dtype=torch.int32)
    tail = torch.tensor([float("-inf"), -1e-30])
    header = make_header("t", "tok", 3, dtype, 200000, "data-x", 2)
    plan = ShardPlan("shard-00000", "part-0.parquet", 0, 1)
    (tmp_path / SHARD_DIR).mkdir()
    write_shard(tmp_path / SHARD_DIR / "shard-00000.parquet", header, plan, ["r0"], [TeacherTopK(vals, idx, tail)])
    (tmp_path / MANIFEST).write_text(json.dumps({**header, "shards": [{"name": plan.name}], "complete": True}))
    got = TopKCacheReader(tmp_path).get("r0")
    assert got.logprobs.dtype == tdt
    assert torch.equal(_bits(got.logprobs), _bits(vals))
    assert torch.equal(got.indices, idx) and torch.equal(_bits(got.tail_logmass), _bits(tail))


@pytest.mark.parametrize("dtype,k", [("float16", 8), ("bfloat16", 5), ("float32", VOCAB)],
                         ids=["fp16-k8", "bf16-k5", "fp32-kV"])
def test_cache_agrees_with_a_direct_forward(env, tmp_path, dtype, k):
    _build_inprocess(env, tmp_path / "c", k=k, dtype=dtype)
    reader = TopKCacheReader(tmp_path / "c", expect_k=k)
    for row in env["rows"]:
        assert_matches_forward(env["teacher"], row, reader.get_for_row(check_row(row)), k, dtype)


def test_forward_check_can_fail(env):
    """The tolerance check is not vacuous: a wrong value, a wrong index or a wrong tail is caught."""
    from hylo.kernels.fused_kl.topk import TeacherTopK

    row = env["rows"][0]
    good = env["teacher"].topk(check_row(row), 8, dtype="float32")
    assert_matches_forward(env["teacher"], row, good, 8, "float32")
    lp = good.logprobs.clone()
    lp[3, 0] += 0.05
    swapped = good.indices.clone()
    swapped[2, 7] = int(env["teacher"].logits(check_row(row))[2].argmin())
    bad_tail = good.tail_logmass.clone()
    bad_tail[1] = float("-inf")
    for bad in (TeacherTopK(lp, good.indices, good.tail_logmass),
                TeacherTopK(good.logprobs, swapped, good.tail_logmass),
                TeacherTopK(good.logprobs, good.indices, bad_tail)):
        with pytest.raises(AssertionError):
            assert_matches_forward(env["teacher"], row, bad, 8, "float32")


@pytest.fixture(scope="module")
def built(env):
    out = env["dir"] / "built"
    _build_inprocess(env, out, k=8)
    return out


@pytest.mark.parametrize(
    "kwargs,match",
    [({"expect_k": 16}, "built: it holds top-8 records, k=16 is expected"),
     ({"expect_tokenizer_hash": "tok-0000"}, "tokenizer_hash"),
     ({"expect_teacher_id": "other@123"}, "teacher_id")],
    ids=["k", "tokenizer", "teacher"],
)
def test_reader_rejects_mismatched_expectations(built, kwargs, match):
    with pytest.raises(CacheMismatchError, match=match):
        TopKCacheReader(built, **kwargs)


def test_reader_rejects_other_data(env, built, tmp_path):
    other = tmp_path / "other"
    write_packed_parquet(other / "part-0.parquet", [make_packed_row([5, 5], VOCAB, seed=99)])
    with pytest.raises(CacheMismatchError, match="data_fingerprint"):
        TopKCacheReader(built, expect_data=other)
    reader = TopKCacheReader(built)
    with pytest.raises(CacheMismatchError, match="not in the cache"):
        reader.get_for_row(check_row(make_packed_row([5, 5], VOCAB, seed=99)))
    with pytest.raises(KeyError, match="not in the cache"):
        reader.get("nope")


def test_rerun_with_other_k_or_tokenizer_is_refused(env, built, tmp_path):
    with pytest.raises(CacheMismatchError, match="k is 8 but 16"):
        prepare_cache(_cfg(env, built, k=16))
    other_tok = save_tiny_llama(tmp_path / "m2", vocab_size=VOCAB, tokenizer_salt="z")
    cfg = _cfg(env, built, k=8)
    cfg.teacher.model.path = str(other_tok)
    with pytest.raises(CacheMismatchError, match="teacher_id|tokenizer_hash"):
        prepare_cache(cfg)


def test_data_tokenized_with_another_tokenizer_is_refused(env, tmp_path):
    from hylo.pipeline.data.shards import write_manifest

    data = tmp_path / "data"
    write_packed_parquet(data / "shard-00000.parquet", env["rows"][:2])
    other_tok = save_tiny_llama(tmp_path / "tok", vocab_size=VOCAB, tokenizer_salt="q")
    write_manifest(data, {"tokenizer": str(other_tok), "tokenizer_hash": "abc", "config_hash": "x",
                          "shards": [{"file": "shard-00000.parquet", "rows": 2}]})
    cfg = _cfg(env, tmp_path / "c")
    cfg.data = str(data)
    with pytest.raises(CacheMismatchError, match="tokenized with"):
        prepare_cache(cfg)


def test_corrupt_or_foreign_files_are_named(built, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(CacheFormatError, match="no manifest.json"):
        TopKCacheReader(bad)
    (bad / "manifest.json").write_text(json.dumps({"schema": "hylo-teacher-topk", "schema_version": 99}))
    with pytest.raises(CacheFormatError, match="schema_version 99"):
        TopKCacheReader(bad)
    (bad / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(CacheFormatError, match="x.parquet"):
        read_shard_meta(bad / "x.parquet")


@pytest.mark.parametrize("how", ["dotdot", "twice", "link"])
def test_a_shard_outside_the_cache_or_listed_twice_is_refused_before_any_read(built, tmp_path, how):
    """The manifest names only files of the cache's own shards/, each once: a shard of another cache (reached by
    `..` or by a link) or one shard listed twice is refused, naming the manifest, the entry and why."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    shutil.copytree(built, mine)
    shutil.copytree(built, other)
    m = json.loads((mine / "manifest.json").read_text())
    if how == "dotdot":
        m["shards"][1]["name"] = "../../other/shards/shard-00000"
        why = "climbs out of its directory"
    elif how == "twice":
        m["shards"][1]["name"] = m["shards"][0]["name"]
        why = "is the same file as entry 'shards/shard-00000.parquet' \\(listed twice\\)"
    else:
        (mine / "shards" / "shard-00001.parquet").unlink()
        (mine / "shards" / "shard-00001.parquet").symlink_to(other / "shards" / "shard-00001.parquet")
        why = f"is a symbolic link to {other}/shards/shard-00001.parquet, outside {mine}"
    (mine / "manifest.json").write_text(json.dumps(m))
    entry = f"shards/{m['shards'][1]['name']}.parquet"
    with pytest.raises(CacheFormatError, match=rf"^{mine}/manifest.json: shards\[1\] '{entry}' {why}"):
        TopKCacheReader(mine)


def test_incomplete_cache_is_refused(env, tmp_path):
    cfg = _cfg(env, tmp_path / "c")
    header, plan, todo = prepare_cache(cfg)
    compute_shard(env["teacher"], cfg.data, cfg.out, header, todo[0])
    assert not finalize_cache(cfg.out, plan)
    with pytest.raises(CacheFormatError, match="incomplete"):
        TopKCacheReader(cfg.out)
    assert len(TopKCacheReader(cfg.out, allow_incomplete=True)) == 3


def test_read_packed_rows_round_trip(env):
    rows = list(PackedRowFile(env["data"] / "part-1.parquet").rows())
    assert len(rows) == 3
    for got, exp in zip(rows, env["rows"][7:]):
        assert (got["input_ids"] == exp["input_ids"]).all() and (got["cu_seqlens"] == exp["cu_seqlens"]).all()


@pytest.mark.slow
def test_ray_job_resumes_after_partial_shards(env, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "job"
    # A job killed after two shards: those two exist (written by the actors' own code path) ...
    cfg = _cfg(env, out, k=8)
    header, plan, todo = prepare_cache(cfg)
    # part-0: 7 rows -> 3 + 3 + 1; part-1: 3 rows -> 3.
    assert len(plan) == 4
    for p in todo[:2]:
        compute_shard(env["teacher"], cfg.data, cfg.out, header, p)
    done = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / SHARD_DIR).glob("*.parquet")}
    # ... and a write cut half-way leaves only a temporary file (atomic_path's name, of a process that is gone):
    # it must be swept, never read.
    proc = subprocess.Popen(["true"])
    proc.wait()
    (out / SHARD_DIR / f".shard-00002.parquet.tmp-{proc.pid}-0123abcd").write_bytes(b"partial")
    with ray_running(None, 2, log_to_driver=False):
        second = run_cache_job(_cfg(env, out, k=8), log=lambda *_: None)
    assert second["computed"] == ["shard-00002", "shard-00003"] and second["complete"]
    # Finished shards were not redone.
    for name, stamp in done.items():
        p = out / SHARD_DIR / name
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stamp
    assert not [p for p in os.listdir(out / SHARD_DIR) if p.startswith(".")]
    reader = TopKCacheReader(out, expect_k=8, expect_data=env["data"])
    for row in env["rows"]:
        assert_matches_forward(env["teacher"], row, reader.get_for_row(check_row(row)), 8, "float16")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == 10 and manifest["index_dtype"] == "uint16"


# ---------------------------------------------------------------------- the output directory (ours, or refused)
@pytest.mark.parametrize("where", ["data", "inside_data", "model", "holds_data"])
def test_out_over_an_input_is_refused_before_any_write(env, tmp_path, where):
    """`out` that is, lies inside or holds the data or the teacher is refused before anything is written."""
    data = tmp_path / "d" / "data"
    shutil.copytree(env["data"], data)
    cfg = _cfg(env, data)
    cfg.data = str(data)
    out = {"data": data, "inside_data": data / "cache", "model": Path(env["model"]),
           "holds_data": tmp_path / "d"}[where]
    cfg.out = str(out)
    before = sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else None
    with pytest.raises(OutputConflictError, match=f"out {out} (is|lies inside|holds) the input"):
        prepare_cache(cfg)
    assert (sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else None) == before


def test_out_holding_files_of_the_user_is_refused(env, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ForeignOutputError, match=r"out .*/c holds 1 entry .*notes.txt"):
        prepare_cache(_cfg(env, out))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_rerun_resumes_its_own_cache_and_sweeps_only_dead_leftovers(env, tmp_path):

    cfg = _cfg(env, tmp_path / "c")
    header, plan, todo = prepare_cache(cfg)
    assert recorded_entries(cfg.out) == {"manifest.json", SHARD_DIR}
    compute_shard(env["teacher"], cfg.data, cfg.out, header, todo[0])
    shards = Path(cfg.out) / SHARD_DIR
    proc = subprocess.Popen(["true"])  # a process that is gone: its temporary file is a killed writer's
    proc.wait()
    killed = shards / f".{plan[1].name}.parquet.tmp-{proc.pid}-0123abcd"
    killed.write_bytes(b"half a shard")
    live = shards / f".{plan[2].name}.parquet.tmp-{os.getpid()}-0123abcd"
    live.write_bytes(b"being written")
    users = shards / ".notes.tmp-1-x"
    users.write_bytes(b"mine")
    header2, plan2, todo2 = prepare_cache(cfg)  # resumes: the shard written is kept
    assert [p.name for p in todo2] == [p.name for p in plan[1:]]
    assert not killed.exists() and live.exists() and users.exists()
    assert (Path(cfg.out) / OUTPUT_RECORD).is_file()


def test_a_cache_is_ours_by_its_record_never_by_its_manifest(env, tmp_path):
    """A directory holding a teacher cache's manifest.json and shards/ but no record is not taken for a cache (a
    name-based guess): it is refused, naming what it holds; with its record it is resumed."""
    cfg = _cfg(env, tmp_path / "c")
    header, plan, todo = prepare_cache(cfg)
    assert len(prepare_cache(cfg)[2]) == len(plan)  # ours: resumed
    (Path(cfg.out) / OUTPUT_RECORD).unlink()
    before = sorted(p.name for p in Path(cfg.out).iterdir())
    with pytest.raises(ForeignOutputError, match=r"out .*/c holds 2 entries and no .hylo-output.json \(manifest.json, "
                                                 r"shards\): this project did not make it"):
        prepare_cache(cfg)
    assert sorted(p.name for p in Path(cfg.out).iterdir()) == before


def test_job_refuses_out_inside_the_data_in_one_line(env, tmp_path, capsys):
    from hylo.jobs import teacher_cache

    data = tmp_path / "data"
    shutil.copytree(env["data"], data)
    rc = teacher_cache.main(["--set", f"data={data}", "--set", f"out={data}/cache",
                             "--set", f"teacher.model.path={env['model']}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"out {data}/cache lies inside the input data {data}" in err
    assert not (data / "cache").exists()


@pytest.mark.slow
def test_hylo_clean_sweeps_a_killed_writers_shard(env, tmp_path, capsys):

    from hylo.jobs import clean

    cfg = _cfg(env, tmp_path / "c")
    header, plan, todo = prepare_cache(cfg)
    proc = subprocess.Popen(["true"])  # gone: its temporary shard is a killed writer's
    proc.wait()
    killed = Path(cfg.out) / SHARD_DIR / f".{plan[0].name}.parquet.tmp-{proc.pid}-0123abcd"
    killed.write_bytes(b"half a shard")
    assert clean.main([cfg.out]) == 0
    assert not killed.exists() and f"removed {killed}" in capsys.readouterr().out
