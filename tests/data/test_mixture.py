"""Mixture: deterministic seeded order, up/down-sampling by weight, the stage-1 sample and stage 2."""

from __future__ import annotations

import json
import random

import pytest

from hylo.pipeline.config import ConfigError, load_config
from hylo.pipeline.data.config import PrepareDataConfig
from hylo.pipeline.data.mixture import build_mixture, mix


def _recs(source: str, n: int, start: int = 0) -> list[dict]:
    return [{"id": f"r{i}", "source": source,
             "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(start, start + n)]


def _ids(records) -> list[str]:
    return [r["doc_id"] for r in records]


@pytest.mark.parametrize("frac", [0.2, 0.5], ids=["f0.2", "f0.5"])
def test_splits_are_disjoint_complete_and_seed_independent(frac):
    recs = _recs("a", 3000)
    s1, _ = mix([("a", 1.0, recs)], "stage1", seed=0, stage1_fraction=frac)
    s2, _ = mix([("a", 1.0, recs)], "stage2", seed=1, stage1_fraction=frac, stage2="rest")
    every, _ = mix([("a", 1.0, recs)], "all", seed=2)
    a, b = set(_ids(s1)), set(_ids(s2))
    assert not a & b
    assert a | b == set(_ids(every))
    assert abs(len(a) / 3000 - frac) < 0.03
    # The published recipe (the default): stage 1 is the sample, stage 2 reads the whole mixture.
    full, _ = mix([("a", 1.0, recs)], "stage2", seed=1, stage1_fraction=frac)
    assert set(_ids(full)) == set(_ids(every)) and a < set(_ids(full))
    # Adding another source or changing the weights never moves a record between the stages.
    s1b, _ = mix([("b", 1.0, _recs("b", 50)), ("a", 2.0, recs)], "stage1", seed=5, stage1_fraction=frac)
    assert {d for d in _ids(s1b) if d.startswith("a:")} == {d + s for d in a for s in ("", "~1")}


def test_same_seed_same_order_other_seed_other_order():
    streams = lambda: [("a", 1.0, _recs("a", 300)), ("b", 1.0, _recs("b", 300))]
    x, _ = mix(streams(), "all", seed=7)
    y, _ = mix(streams(), "all", seed=7)
    z, _ = mix(streams(), "all", seed=8)
    assert _ids(x) == _ids(y)
    assert _ids(x) != _ids(z) and sorted(_ids(x)) == sorted(_ids(z))
    # The order depends on the seed, not on the order the records were read in.
    shuffled = _recs("a", 300)
    random.Random(0).shuffle(shuffled)
    w, _ = mix([("a", 1.0, shuffled), ("b", 1.0, _recs("b", 300))], "all", seed=7)
    assert _ids(w) == _ids(x)
    # Sources are interleaved, not concatenated.
    first = {d.split(":")[0] for d in _ids(x)[:50]}
    assert first == {"a", "b"}


@pytest.mark.parametrize("weight,lo,hi", [(2.0, 2000, 2000), (0.5, 440, 560), (1.5, 1440, 1560), (0.0, 0, 0)],
                         ids=["w2", "w0.5", "w1.5", "w0"])
def test_weights_up_and_down_sample(weight, lo, hi):
    out, stats = mix([("a", weight, _recs("a", 1000))], "all", seed=3)
    assert lo <= len(out) <= hi
    assert stats.sources["a"].out == len(out) and stats.sources["a"].read == 1000
    assert len(set(_ids(out))) == len(out)
    again, _ = mix([("a", weight, _recs("a", 1000))], "all", seed=3)
    assert _ids(again) == _ids(out)
    if weight == 2.0:
        assert {d for d in _ids(out) if d.endswith("~1")} == {f"a:r{i}~1" for i in range(1000)}


def test_repeated_ids_in_a_source_stay_distinct():
    recs = _recs("a", 3) + _recs("a", 2)
    out, stats = mix([("a", 1.0, recs)], "all", seed=0)
    assert sorted(_ids(out)) == ["a:r0", "a:r0#dup1", "a:r1", "a:r1#dup1", "a:r2"]
    assert stats.sources["a"].duplicate_ids == 2


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="split 'stage3'"):
        mix([], "stage3", seed=0)
    with pytest.raises(ValueError, match="source 'a': weight"):
        mix([("a", -1.0, [])], "all", seed=0)


def test_config_from_yaml_and_its_errors(tmp_path):
    path = tmp_path / "data.yaml"
    path.write_text(
        "split: stage1\nmixture:\n  seed: 3\n  sources:\n"
        "    - {name: chat, path: /x.jsonl, weight: 0.5}\n    - {name: math, path: /y.parquet}\n"
        "packing: {max_len: 2048}\n")
    cfg = load_config(PrepareDataConfig, path, ["mixture.stage1_fraction=0.3"])
    assert [s.name for s in cfg.mixture.sources] == ["chat", "math"]
    assert cfg.mixture.sources[0].weight == 0.5 and cfg.mixture.sources[1].weight == 1.0
    assert cfg.mixture.stage1_fraction == 0.3 and cfg.packing.max_len == 2048
    cases = {
        "mixture:\n  sources:\n    - {name: a, path: /x, wieght: 2}\n": "wieght",
        "mixture:\n  sources:\n    - {name: a, path: /x}\n    - {name: a, path: /y}\n": "duplicate source",
        "mixture:\n  sources:\n    - {name: a, path: /x, weight: -1}\n": "weight=-1.0: must be >= 0",
        "split: stage3\n": "split='stage3'",
        "packing: {long_doc_policy: wrap}\n": "long_doc_policy",
        "mixture: {stage1_fraction: 1.5}\n": "stage1_fraction",
        "mixture: {stage2: remaining}\n": "mixture.stage2='remaining': must be one of all, rest",
    }
    for text, msg in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            load_config(PrepareDataConfig, path)


def test_build_mixture_reads_sources_and_reports_rejects(tmp_path):
    f = tmp_path / "chat.jsonl"
    lines = [json.dumps({"id": f"x{i}", "messages": [{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}]}) for i in range(20)]
    lines.insert(3, "{not json")
    lines.insert(7, json.dumps({"id": "bad", "messages": [{"role": "wizard", "content": "q"}]}))
    f.write_text("\n".join(lines) + "\n")
    cfg = load_config(PrepareDataConfig, None, [f"mixture.sources=[{{name: chat, path: '{f}'}}]"]).mixture
    rejects: list[dict] = []
    out, stats = build_mixture(cfg, "all", rejects.append)
    assert len(out) == 20 and stats.sources["chat"].read == 20
    reasons = sorted(r["reason"] for r in rejects)
    assert len(reasons) == 2
    assert reasons[0].startswith("invalid JSON") and "unknown role" in reasons[1]
    assert stats.sources["chat"].rejected == 2 and stats.sources["chat"].records_lost == 2


def test_build_mixture_refuses_a_source_that_gives_nothing(tmp_path):
    from hylo.pipeline.data.readers import EmptySourceError

    good, empty = tmp_path / "good.jsonl", tmp_path / "empty.json"
    good.write_text(json.dumps({"id": "g", "messages": [{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": "a"}]}) + "\n")
    empty.write_text("[]")
    srcs = f"mixture.sources=[{{name: good, path: '{good}'}}, {{name: empty, path: '{empty}'}}]"
    cfg = load_config(PrepareDataConfig, None, [srcs]).mixture
    with pytest.raises(EmptySourceError, match="source 'empty': no usable record"):
        build_mixture(cfg, "all", lambda r: None)
    cfg.sources[1].allow_empty = True
    out, stats = build_mixture(cfg, "all", lambda r: None)
    assert len(out) == 1 and stats.sources["empty"].read == 0 and stats.sources["empty"].unknown_losses == 1


def test_restrict_removes_every_copy_and_keeps_order():
    from hylo.pipeline.data.mixture import restrict

    full, stats = mix([("a", 2.0, _recs("a", 200)), ("b", 1.0, _recs("b", 100))], "all", seed=4)
    s1, st1 = mix([("a", 2.0, _recs("a", 200)), ("b", 1.0, _recs("b", 100))], "stage1", seed=4)
    got, gst = restrict(full, stats, "stage1", 0.2, "hylo-split-v1")
    assert _ids(got) == _ids(s1) and gst.sources["a"].in_split == st1.sources["a"].in_split
    gone = {r["doc_base"] for r in got[:5]}
    got2, gst2 = restrict(full, stats, "stage1", 0.2, "hylo-split-v1", removed=gone)
    assert not {r["doc_base"] for r in got2} & gone and len(got2) < len(got)
    assert sum(c.decontaminated for c in gst2.sources.values()) >= len(gone)
    assert [d for d in _ids(got) if d.split("~")[0] not in gone] == _ids(got2)
