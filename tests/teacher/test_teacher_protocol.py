"""The teacher as one object: one `teacher.k` and one exact form, old spellings refused, the cache's k.

The three sources giving identical targets for the same rows (in-process model, Serve pool, cache) is
`test_teacher_serve.py::test_protocol_targets_are_identical_from_model_pool_and_cache` (it needs the pool).
"""

from __future__ import annotations

import pytest
import torch

from hylo.pipeline.config import ConfigError, load_config
from hylo.pipeline.data.rows import check_row
from hylo.pipeline.teacher.cache import CacheMismatchError, compute_shard, finalize_cache, prepare_cache
from hylo.pipeline.teacher.config import (
    CacheTeacherSection,
    TeacherCacheConfig,
    TeacherFaultConfig,
    TeacherModelConfig,
)
from hylo.pipeline.teacher.protocol import TargetSpec
from hylo.pipeline.teacher.sources import open_teacher
from hylo.pipeline.train.config import TeacherSection, config_to_dict, load_stage_config

from tests.helpers.teacher import make_packed_row, save_tiny_llama, write_packed_parquet

VOCAB = 96


@pytest.mark.parametrize("overrides,error", [
    (["teacher.top_k=8"], "unknown key(s) teacher.top_k in TeacherSection; did you mean 'teacher.k'? valid keys: "
                             "cache_path, client, exact_form, k, model, pool, source, start_pool"),
    (["teacher.source=serve", "teacher.client.k=32"], "unknown key(s) teacher.client.k in TeacherClientConfig"),
    (["teacher.client.chunk_tokens=512"], "unknown key(s) teacher.client.chunk_tokens in TeacherClientConfig"),
    (["teacher.pool.fail_marker=/tmp/armed"], "unknown key(s) teacher.pool.fail_marker in TeacherPoolConfig"),
], ids=["top_k", "client.k", "client.chunk_tokens", "pool.fail_marker"])
def test_an_old_spelling_is_an_unknown_key(overrides, error):
    """The spellings of before teacher.k and fault.teacher are unknown keys like any other."""
    with pytest.raises(ConfigError) as e:
        load_stage_config(2, None, overrides)
    assert str(e.value).startswith(f"command line: {error}"), e.value


def test_the_pools_test_only_keys_are_stage2s_fault_teacher():
    cfg = load_stage_config(2, None, ["teacher.source=serve", "fault.teacher.kill_marker=/tmp/armed",
                                      "fault.teacher.kill_at_row=5", "fault.teacher.kill_target=node"])
    assert cfg.fault.teacher == TeacherFaultConfig(kill_marker="/tmp/armed", kill_at_row=5, kill_target="node")
    with pytest.raises(ConfigError, match="fault.teacher.kill_target='disk': must be one of process, node"):
        load_stage_config(2, None, ["fault.teacher.kill_target=disk"])
    # stage 1 has no teacher to kill
    assert "teacher" not in config_to_dict(load_stage_config(1, None, []))["fault"]


def test_the_form_is_checked_in_one_place():
    with pytest.raises(ConfigError, match="teacher.k=0: the offline cache holds top-k records"):
        load_stage_config(2, None, ["teacher.source=offline", "teacher.cache_path=/c"])
    # both exact sources give both forms (the pool's auto: tests/teacher/test_teacher_head.py)
    assert load_stage_config(2, None, ["teacher.source=serve", "teacher.exact_form=hidden"]).teacher.form == "hidden"
    with pytest.raises(ConfigError, match="teacher.exact_form='logits': applies to the exact teacher"):
        load_stage_config(2, None, ["teacher.k=8", "teacher.exact_form=logits"])
    assert load_stage_config(2, None, ["teacher.exact_form=logits"]).teacher.form == "logits"
    with pytest.raises(ValueError, match="form 'hidden' with k=8"):
        TargetSpec(8, "hidden")


def test_the_cache_jobs_teacher_is_spelled_as_stage2s():
    cfg = load_config(TeacherCacheConfig, None, ["teacher.k=8", "teacher.model.path=/m", "dtype=bfloat16"])
    assert (cfg.teacher.k, cfg.teacher.model.path, cfg.dtype) == (8, "/m", "bfloat16")
    assert load_config(TeacherCacheConfig, None, []).teacher.k == 64
    with pytest.raises(ConfigError, match="teacher.k=0: the offline cache holds top-k records"):
        load_config(TeacherCacheConfig, None, ["teacher.k=0"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) k in TeacherCacheConfig"):
        load_config(TeacherCacheConfig, None, ["k=8"])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("protocol")
    model = save_tiny_llama(d / "model", vocab_size=VOCAB)
    rows = [make_packed_row([3 + i, 7], VOCAB, seed=i) for i in range(4)]
    write_packed_parquet(d / "data" / "part-0.parquet", rows)
    cfg = TeacherCacheConfig(data=str(d / "data"), out=str(d / "cache"), rows_per_shard=2,
                             teacher=CacheTeacherSection(k=8, model=TeacherModelConfig(path=str(model))))
    header, plan, todo = prepare_cache(cfg)
    from hylo.pipeline.teacher.model import TeacherModel

    tm = TeacherModel(model)
    for p in todo:
        compute_shard(tm, cfg.data, cfg.out, header, p)
    assert finalize_cache(cfg.out, plan)
    return {"cfg": cfg, "rows": [check_row(r) for r in rows], "model": tm}


def test_stage2_refuses_a_cache_of_another_k(cache):
    out = cache["cfg"].out
    with pytest.raises(CacheMismatchError) as e:
        open_teacher(TeacherSection(source="offline", k=16, cache_path=out), VOCAB, cache["cfg"].data)
    assert f"teacher cache {out}: it holds top-8 records, k=16 is expected" in str(e.value)
    # and before Ray starts: the stage's input checks read the same manifest
    from hylo.pipeline.train.inputs import check_stage_inputs

    cfg = load_stage_config(2, None, ["data.source=synthetic", "teacher.source=offline", "teacher.k=16",
                                      f"teacher.cache_path={out}"])
    with pytest.raises(CacheMismatchError, match=f"teacher cache {out}: it holds top-8 records, k=16"):
        check_stage_inputs(cfg)
    # the right k opens it, and its targets are the stored records, row by row
    t = open_teacher(TeacherSection(source="offline", k=8, cache_path=out), VOCAB, cache["cfg"].data)
    got = list(t.targets(cache["rows"], "cpu"))
    assert [g["teacher_topk"].logprobs.shape for g in got] == [(r.num_tokens, 8) for r in cache["rows"]]


def test_model_targets_of_each_form(cache):
    tm, rows = cache["model"], cache["rows"]
    topk = list(tm.targets(rows, TargetSpec(8, "topk")))
    hidden = list(tm.targets(rows, TargetSpec(0, "hidden")))
    logits = list(tm.targets(rows, TargetSpec(0, "logits")))
    for r, a, h, lg in zip(rows, topk, hidden, logits):
        full = lg["teacher_logits_fn"](0, r.num_tokens)
        torch.testing.assert_close(h["teacher_hidden"] @ h["teacher_weight"].T, full, rtol=1e-5, atol=1e-5)
        assert torch.equal(a["teacher_topk"].indices, torch.topk(full.float(), 8).indices.to(torch.int32))
