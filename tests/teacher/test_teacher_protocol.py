"""The teacher as one object: one `teacher.k` and one exact form, the old spellings, the cache's k.

The three sources giving identical targets for the same rows (in-process model, Serve pool, cache) is
`test_teacher_serve.py::test_protocol_targets_are_identical_from_model_pool_and_cache` (it needs the pool).
"""

from __future__ import annotations

import pytest
import torch

from hylo.pipeline.config import ConfigError, from_dict, load_config
from hylo.pipeline.data.rows import check_row
from hylo.pipeline.teacher.cache import CacheMismatchError, compute_shard, finalize_cache, prepare_cache
from hylo.pipeline.teacher.config import (
    CacheTeacherSection,
    TeacherCacheConfig,
    TeacherFaultConfig,
    TeacherModelConfig,
    TeacherPoolConfig,
)
from hylo.pipeline.teacher.protocol import TargetSpec
from hylo.pipeline.teacher.sources import open_teacher
from hylo.pipeline.train.config import TeacherSection, config_from_dict, config_to_dict, load_stage_config

from tests.helpers.teacher import make_packed_row, save_tiny_llama, write_packed_parquet

VOCAB = 96


def _teacher(capsys, *overrides: str) -> tuple[TeacherSection, str]:
    t = load_stage_config(2, None, list(overrides)).teacher
    return t, capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides,k,form,warned",
    [
        (["teacher.top_k=8"], 8, "topk", 'teacher.top_k is deprecated; use teacher.k (top_k: 8 is k: 8)'),
        (["teacher.top_k=0"], 0, "hidden", 'teacher.top_k is deprecated; use teacher.k (top_k: 0 is k: 0)'),
        (["teacher.source=serve", "teacher.client.k=32"], 32, "topk",
         "teacher.client.k is deprecated; use teacher.k (client.k: 32 is k: 32)"),
        (["teacher.source=serve", "teacher.mode=topk"], 64, "topk",
         'teacher.mode is deprecated; use teacher.k (mode: "topk" is k: 64)'),
        (["teacher.source=serve", "teacher.mode=topk", "teacher.client.k=16"], 16, "topk",
         'teacher.mode is deprecated; use teacher.k (mode: "topk" adds nothing to k'),
        (["teacher.source=serve", "teacher.mode=stream", "teacher.client.k=16"], 0, "logits",
         'teacher.mode is deprecated; use teacher.k (mode: "stream" is k: 0)'),
        # an old key that had no effect with its source is dropped, with the warning
        (["teacher.source=serve", "teacher.top_k=8", "teacher.client.k=4"], 4, "topk",
         "teacher.top_k is deprecated; use teacher.k (top_k: 8 adds nothing to k"),
    ],
    ids=["top_k", "top_k-exact", "client.k", "mode-topk-default", "mode-topk-client.k", "mode-stream",
         "top_k-unused-with-serve"],
)
def test_old_width_keys_load_as_teacher_k_with_a_warning(capsys, overrides, k, form, warned):
    t, err = _teacher(capsys, *overrides)
    assert (t.k, t.form) == (k, form)
    assert f"warning: config key {warned}" in err


def test_old_keys_in_a_recipe_file_and_conflicts(capsys, tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("stage2:\n  teacher: {source: serve, mode: topk, client: {k: 64, max_inflight_rows: 2}}\n")
    t = load_stage_config(2, p).teacher
    assert (t.k, t.form, t.client.max_inflight_rows) == (64, "topk", 2)
    err = capsys.readouterr().err
    assert "teacher.client.k is deprecated; use teacher.k" in err and "teacher.mode is deprecated" in err
    with pytest.raises(ConfigError, match="teacher.top_k and teacher.k are both set"):
        load_stage_config(2, None, ["teacher.top_k=8", "teacher.k=8"])
    with pytest.raises(ConfigError, match='teacher.mode.*expected "topk" or "stream", got \'full\''):
        load_stage_config(2, None, ["teacher.source=serve", "teacher.mode=full"])


def test_a_config_saved_before_teacher_k_reads_the_same(capsys):
    """A checkpoint's stored config spells top_k, mode and client.k: it reads as the same teacher."""
    for overrides, old in ((["teacher.k=8"], {"top_k": 8}),
                           (["teacher.source=serve", "teacher.k=64"], {"top_k": 0, "mode": "topk"}),
                           (["teacher.source=serve"], {"top_k": 0, "mode": "stream"})):
        cfg = load_stage_config(2, None, overrides)
        d = config_to_dict(cfg)
        t = d["teacher"]
        k = t.pop("k")
        t.pop("exact_form")
        t.update(old)
        t["client"]["k"] = k if t["source"] == "serve" and k else 64
        t["client"]["chunk_tokens"] = t["model"]["logits_chunk_tokens"]
        assert config_from_dict(d) == cfg


def test_the_pools_test_only_keys_load_from_teacher_pool_into_fault_teacher_with_a_warning(capsys, tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text("stage2:\n  teacher:\n    source: serve\n    pool: {num_replicas: 2, fail_marker: /tmp/armed, "
                 "fail_on_row: 5, fail_target: node}\n")
    cfg = load_stage_config(2, p)
    assert cfg.fault.teacher == TeacherFaultConfig(kill_marker="/tmp/armed", kill_at_row=5, kill_target="node")
    assert cfg.teacher.pool.num_replicas == 2
    err = capsys.readouterr().err
    for old, new in (("fail_marker", "kill_marker"), ("fail_on_row", "kill_at_row"), ("fail_target", "kill_target")):
        assert f"warning: config key teacher.pool.{old} is deprecated; use fault.teacher.{new}\n" in err
    # the config a run stored before (every key, defaults too) reads as the same config
    now = load_stage_config(2, None, ["teacher.source=serve"])
    stored = config_to_dict(now)
    del stored["fault"]["teacher"]
    stored["teacher"]["pool"].update(fail_marker="", fail_on_row=1, fail_target="process")
    assert config_from_dict(stored) == now
    with pytest.raises(ConfigError, match="teacher.pool.fail_on_row and fault.teacher.kill_at_row are both set"):
        load_stage_config(2, None, ["teacher.pool.fail_on_row=2", "fault.teacher.kill_at_row=2"])
    with pytest.raises(ConfigError, match="fault.teacher.kill_target='disk': must be one of process, node"):
        load_stage_config(2, None, ["fault.teacher.kill_target=disk"])
    # the user-facing pool section no longer has them, and stage 1 has no teacher to kill
    with pytest.raises(ConfigError, match="unknown key.s. fail_marker in TeacherPoolConfig"):
        from_dict(TeacherPoolConfig, {"fail_marker": "/tmp/armed"})
    assert "teacher" not in config_to_dict(load_stage_config(1, None, []))["fault"]


def test_the_form_is_checked_in_one_place():
    with pytest.raises(ConfigError, match="teacher.k=0: the offline cache holds top-k records"):
        load_stage_config(2, None, ["teacher.source=offline", "teacher.cache_path=/c"])
    with pytest.raises(ConfigError, match="teacher.exact_form='hidden': needs source inprocess"):
        load_stage_config(2, None, ["teacher.source=serve", "teacher.exact_form=hidden"])
    with pytest.raises(ConfigError, match="teacher.exact_form='logits': applies to the exact teacher"):
        load_stage_config(2, None, ["teacher.k=8", "teacher.exact_form=logits"])
    assert load_stage_config(2, None, ["teacher.exact_form=logits"]).teacher.form == "logits"
    with pytest.raises(ValueError, match="form 'hidden' with k=8"):
        TargetSpec(8, "hidden")


def test_cache_job_k_and_model_load_as_teacher_k_and_teacher_model(capsys, tmp_path):
    cfg = load_config(TeacherCacheConfig, None, ["k=8", "model.path=/m", "dtype=bfloat16"])
    assert (cfg.teacher.k, cfg.teacher.model.path, cfg.dtype) == (8, "/m", "bfloat16")
    err = capsys.readouterr().err
    assert "warning: config key k is deprecated; use teacher.k" in err
    assert "warning: config key model is deprecated; use teacher.model" in err
    assert load_config(TeacherCacheConfig, None, []).teacher.k == 64
    with pytest.raises(ConfigError, match="teacher.k=0: the offline cache holds top-k records"):
        load_config(TeacherCacheConfig, None, ["teacher.k=0"])


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


def test_client_chunk_tokens_is_the_models_logits_chunk_tokens(capsys):
    t, err = _teacher(capsys, "teacher.client.chunk_tokens=512")
    assert t.model.logits_chunk_tokens == 512
    assert ("warning: config key teacher.client.chunk_tokens is deprecated; use teacher.model.logits_chunk_tokens "
            "(client.chunk_tokens: 512 is model.logits_chunk_tokens: 512)") in err
    # the same value twice (every config saved before) is one setting: dropped with the warning
    t, err = _teacher(capsys, "teacher.client.chunk_tokens=256", "teacher.model.logits_chunk_tokens=256")
    assert t.model.logits_chunk_tokens == 256 and "client.chunk_tokens: 256 adds nothing" in err
    with pytest.raises(ConfigError, match="teacher.client.chunk_tokens and teacher.model.logits_chunk_tokens are both"):
        load_stage_config(2, None, ["teacher.client.chunk_tokens=256", "teacher.model.logits_chunk_tokens=512"])
