"""HybridConfig validation, the job config system, and the KV-cache accounting of the published family."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from transformers import LlamaConfig, Qwen3Config

from hylo.config import HybridConfig, HybridConfigError
from hylo.pipeline.config import ConfigError, config_hash, load_config
from hylo.upcycle import UpcycleError, hybrid_config_from_base, kv_summary, parse_placement

from tests.helpers.cli import job_config_roots, walk_fields


def llama_3b() -> LlamaConfig:
    return LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0)


def llama_1b() -> LlamaConfig:
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0)


@pytest.mark.parametrize(
    "name,base,mla,rank,rope,expected",
    [
        ("3B-14MLA14GDN", llama_3b, "even", 128, 64, 0.0469),
        ("3B-6MLA22GDN", llama_3b, [0, 5, 10, 16, 21, 26], 128, 64, 0.020),
        ("1B-8MLA8GDN", llama_1b, "even", 128, 32, 0.078),
        ("1B-4MLA12GDN", llama_1b, "uniform:4", 128, 32, 0.039),
    ],
)
def test_published_kv_ratios(name, base, mla, rank, rope, expected):
    hcfg = hybrid_config_from_base(base(), mla_layers=mla, kv_lora_rank=rank, qk_rope_head_dim=rope)
    ratio = kv_summary(base(), hcfg)["kv_cache_ratio"]
    assert ratio == pytest.approx(expected, abs=5e-4), name


def test_qwen3_1p7b_ratio():
    base = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936)
    hcfg = hybrid_config_from_base(base, mla_layers="uniform:7", kv_lora_rank=128, qk_rope_head_dim=64)
    # MLA keeps Qwen3's q/k norms: latent + roped key + one key 1/RMS per kv_b head (16 query heads here, 8
    # with kv_b_per_kv_head): 7 * (128 + 64 + 16) / (28 * 2 * 8 * 128) = 2.54 % (2.34 % without the norms)
    assert hcfg.mla_qk_norm and hcfg.mla_cache_values_per_token() == 208
    assert kv_summary(base, hcfg)["kv_cache_ratio"] == pytest.approx(7 * 208 / 57344)
    per_kv = hybrid_config_from_base(base, mla_layers="uniform:7", kv_lora_rank=128, qk_rope_head_dim=64,
                                     kv_b_per_kv_head=True)
    assert kv_summary(base, per_kv)["kv_cache_ratio"] == pytest.approx(7 * 200 / 57344)


def test_placements():
    assert parse_placement("even", 6) == [0, 2, 4]
    assert parse_placement("odd", 6) == [1, 3, 5]
    assert parse_placement("uniform:3", 30) == [5, 15, 25]
    assert parse_placement("0,5,10", 30) == [0, 5, 10]
    assert len(parse_placement("uniform:15", 30)) == 15
    with pytest.raises(UpcycleError, match="out of range"):
        parse_placement([0, 30], 30)
    with pytest.raises(UpcycleError, match="not understood"):
        parse_placement("sometimes", 30)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mla_layers": [0, 40]}, "mla_layers: layer index 40 is out of range"),
        ({"kv_lora_rank": 100}, "kv_lora_rank: must be a multiple of 8"),
        ({"q_lora_rank": 12}, "q_lora_rank"),
        ({"linear_type": "lstm"}, "linear_type: 'lstm' is unknown; allowed: gdn, mamba2"),
        ({"base_head_dim": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 32}, "must equal the base model's head_dim 64"),
        ({"qk_rope_head_dim": 31}, "qk_rope_head_dim: must be even"),
        ({"num_key_value_heads": 4}, "num_key_value_heads"),
        ({"hidden_act": "swoosh"}, "hidden_act"),
    ],
    ids=["layer-range", "rank-mult8", "q-rank", "linear-type", "head-dim", "rope-odd", "gqa", "act"],
)
def test_hybrid_config_errors(kwargs, match):
    with pytest.raises(HybridConfigError, match=match):
        HybridConfig(**kwargs)


def test_hybrid_config_roundtrip_and_load_validation(tmp_path):
    cfg = HybridConfig(n_layer=4, mla_layers=[0, 2], kv_lora_rank=64)
    cfg.save_hybrid_config(tmp_path)
    back = HybridConfig.from_hybrid_json(tmp_path)
    assert back.mla_layers == [0, 2] and back.kv_lora_rank == 64 and back.layer_type(1) == "gdn"
    data = json.loads((tmp_path / "hybrid_config.json").read_text())
    data["mla_layers"] = [0, 9]
    (tmp_path / "hybrid_config.json").write_text(json.dumps(data))
    with pytest.raises(HybridConfigError, match="hybrid_config.json.*layer index 9 is out of range"):
        HybridConfig.from_hybrid_json(tmp_path)


@pytest.mark.parametrize("value,entry", [(["0"], "entry 0, '0', is a str"), ([0, "2"], "entry 1, '2', is a str"),
                                         ([0, 2.0], "entry 1, 2.0, is a float"), ([True], "entry 0, True, is a bool")],
                         ids=["str-0", "str-2", "float", "bool"])
def test_mla_layers_entries_that_are_not_integers_are_refused(tmp_path, value, entry):
    """A non-integer entry in mla_layers (the string "0" of a hand-edited hybrid_config.json) is refused,
    naming it, never read as layer 0."""
    with pytest.raises(HybridConfigError, match=re.escape(entry)):
        HybridConfig(n_layer=4, mla_layers=value, kv_lora_rank=64)
    HybridConfig(n_layer=4, mla_layers=[0, 2], kv_lora_rank=64).save_hybrid_config(tmp_path)
    data = json.loads((tmp_path / "hybrid_config.json").read_text())
    data["mla_layers"] = value
    (tmp_path / "hybrid_config.json").write_text(json.dumps(data))
    with pytest.raises(HybridConfigError, match=r"hybrid_config.json.*mla_layers: must be a list of integer layer"):
        HybridConfig.from_hybrid_json(tmp_path)


@dataclasses.dataclass
class _Inner:
    lr: float = 1e-3
    steps: int = 10


@dataclasses.dataclass
class _Outer:
    name: str = "run"
    train: _Inner = dataclasses.field(default_factory=_Inner)
    layers: list[int] = dataclasses.field(default_factory=list)


def test_job_config_yaml_overrides_and_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: demo\ntrain:\n  lr: 2.0e-4\nlayers: [0, 2]\n")
    cfg = load_config(_Outer, path, ["train.steps=12", "train.lr=1e-5"])
    assert cfg.name == "demo" and cfg.train.steps == 12 and cfg.train.lr == 1e-5 and cfg.layers == [0, 2]
    assert config_hash(cfg) != config_hash(load_config(_Outer, path))
    path.write_text("train:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) train.lrr.*valid keys: lr, steps"):
        load_config(_Outer, path)
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(_Outer, None, ["train.steps=abc"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(_Outer, tmp_path / "missing.yaml")


def test_non_llama_base_config_rejected():
    with pytest.raises(UpcycleError, match="model_type 'gpt2' is not supported"):
        hybrid_config_from_base({"model_type": "gpt2", "n_layer": 2})


def test_print_config_shows_every_key_and_round_trips(capsys):
    import argparse

    import yaml

    from hylo.pipeline.config import add_config_args, config_from_args
    from hylo.pipeline.data.config import PrepareDataConfig
    from hylo.pipeline.train.config import config_to_dict, load_stage_config
    from hylo.pipeline.train.driver import run

    p = argparse.ArgumentParser()
    add_config_args(p)
    args = p.parse_args(["--config", "configs/data_stage1.yaml", "--set", "packing.max_len=1024", "--print-config"])
    with pytest.raises(SystemExit) as e:
        config_from_args(PrepareDataConfig, args)
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["packing"]["max_len"] == 1024
    assert load_config(PrepareDataConfig, None, [f"{k}={json.dumps(v)}" for k, v in printed.items()]) == \
        load_config(PrepareDataConfig, "configs/data_stage1.yaml", ["packing.max_len=1024"])
    # the training driver prints the merged stage config (shared sections + stage2:) before touching Ray
    with pytest.raises(SystemExit) as e:
        run(2, ["--config", "configs/demo-smollm2.yaml", "--set", "optim.lr=3e-5", "--print-config"])
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    want = config_to_dict(load_stage_config(2, "configs/demo-smollm2.yaml", ["optim.lr=3e-5"]))
    assert printed == json.loads(json.dumps(want))


# ----------------------------------------------------------------------------- values checked at load
# Every config class of every job: a new numeric field must state its range (hylo.pipeline.config.rules).
def _is_numeric(tp) -> bool:
    import typing

    if tp in (int, float):
        return True
    return typing.get_origin(tp) in (list, dict) and any(a in (int, float) for a in typing.get_args(tp))


def test_every_numeric_field_of_every_job_config_states_its_range():
    from hylo.pipeline.config import field_rules

    missing = sorted({f"{cls.__name__}.{name}" for root in job_config_roots().values()
                      for _, cls, name, tp, _ in walk_fields(root)
                      if _is_numeric(tp) and name not in field_rules(cls)})
    assert not missing, f"numeric config fields without a declared range: {missing}"


def _required_kwargs(cls: type) -> dict:
    return {f.name: "x" for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def test_every_declared_rule_rejects_its_counterexample_at_load_naming_the_field():
    """For every rule of every job config: an out-of-range value is a ConfigError naming the dotted key."""
    from hylo.pipeline.config import field_rules, from_dict

    checked = 0
    for root in job_config_roots().values():
        for path, cls, name, tp, _ in walk_fields(root):
            rule = field_rules(cls).get(name)
            if rule is None:
                continue
            for bad in rule.counterexamples(tp):
                data = {**_required_kwargs(cls), name: bad}
                where = path.rsplit(".", 1)[0] if "." in path else ""
                with pytest.raises(ConfigError) as e:
                    from_dict(cls, data, where)
                assert f"{path}=" in str(e.value), (path, bad, str(e.value))
                checked += 1
    assert checked > 150


@pytest.mark.parametrize("override,key", [
    ("train.total_steps=-5", "train.total_steps"),
    ("kd.kl_weight=-5", "kd.kl_weight"),
    ("optim.lr=.nan", "optim.lr"),
    ("optim.lr=.inf", "optim.lr"),
    ("checkpoint.every_steps=0", "checkpoint.every_steps"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("data.synthetic.rows=0", "data.synthetic.rows"),
    ("ray.max_failures=-5", "ray.max_failures"),
    ("ray.name=../../etc", "ray.name"),
    ("ray.name=/etc", "ray.name"),
    ("ray.name=a/../../b", "ray.name"),
    ("ray.name=''", "ray.name"),
    ("kd.temperature=0", "kd.temperature"),
    ("kd.temperature=-1", "kd.temperature"),
    ("kd.chunk_size=0", "kd.chunk_size"),
    ("kd.kl_precision=exact", "kd.kl_precision"),
    ("teacher.model.logits_chunk_tokens=.nan", "teacher.model.logits_chunk_tokens"),
    ("teacher.pool.port=70000", "teacher.pool.port"),
    ("train.global_batch_sequences=null", "train.global_batch_sequences"),
    ("ray.name={a: 1}", "ray.name"),
    ("model.convert={kv_lora_rank: 0}", "model.convert.kv_lora_rank"),
    ("model.convert={init: svd}", "model.convert.init"),
])
def test_out_of_range_values_are_rejected_at_load_naming_the_key(override, key):
    from hylo.pipeline.train.config import load_stage_config

    with pytest.raises(ConfigError) as e:
        load_stage_config(2, "configs/demo-smollm2.yaml", [override])
    msg = str(e.value)
    assert re.search(re.escape(key) + "[=:]", msg) and msg.startswith("command line") and "\n" not in msg, msg


def test_convert_options_are_the_converters_own_and_listed():
    """model.convert is the converter's own ConvertConfig: an unknown key is listed with every option."""
    from hylo.pipeline.train.config import load_stage_config
    from hylo.upcycle import ConvertConfig

    with pytest.raises(ConfigError) as e:
        load_stage_config(1, "configs/demo-smollm2.yaml", ["model.convert={mla_layerz: even, kv_lora_rank: 64}"])
    msg = str(e.value)
    assert msg.startswith("command line") and "unknown key(s) model.convert.mla_layerz" in msg, msg
    valid = msg.split("valid keys:")[1]
    for f in dataclasses.fields(ConvertConfig):
        assert f.name in valid, (f.name, valid)
    assert "calibration_ids" not in valid and "base_model" not in valid
    cfg = load_stage_config(1, "configs/demo-smollm2.yaml", ["model.convert={mla_layers: odd, seed: 3}"])
    assert isinstance(cfg.model.convert, ConvertConfig)
    assert cfg.model.convert.non_defaults() == {"mla_layers": "odd", "seed": 3}


def test_nested_run_names_are_allowed():
    from hylo.pipeline.train.config import load_stage_config

    cfg = load_stage_config(2, "configs/demo-smollm2.yaml", ["ray.name=study/seed1", "ray.max_failures=-1"])
    assert cfg.ray.name == "study/seed1" and cfg.ray.max_failures == -1


def test_duplicate_yaml_key_is_an_error_naming_key_and_lines(tmp_path):
    from hylo.pipeline.train.config import load_stage_config

    p = tmp_path / "c.yaml"
    p.write_text("name: a\ntrain:\n  lr: 1.0\n  steps: 3\ntrain:\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml: duplicate key 'train' at line 5 \(first at line 2\)"):
        load_config(_Outer, p)
    p.write_text("train:\n  lr: 1.0\n  steps: 3\n  lr: 2.0\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'lr' at line 4 \(first at line 2\)"):
        load_config(_Outer, p)
    # a stage file: a second kd: block in stage2: would silently replace the first
    p.write_text(open("configs/demo-smollm2.yaml").read() + "  kd: {kl_weight: 0.5}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'kd' at line \d+ \(first at line \d+\)"):
        load_stage_config(2, p)
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(_Outer, None, ["layers={a: 1, a: 2}"])
    # YAML merge keys are not duplicates
    p.write_text("train:\n  <<: {lr: 1.0, steps: 2}\n  steps: 5\n")
    assert load_config(_Outer, p).train.steps == 5


def test_config_file_that_is_not_utf8_or_not_a_file_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not valid UTF-8 \(byte 0xe9 at line 1"):
        load_config(_Outer, p)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(_Outer, tmp_path)


def test_value_errors_name_the_file_line_or_the_override(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: ok\ntrain:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match=r"c.yaml line 3: train.lr=nan: must be a finite number"):
        load_config(_Outer, p)
    with pytest.raises(ConfigError, match=r"^command line: train.lr=inf: must be a finite number"):
        load_config(_Outer, None, ["train.lr=.inf"])
    with pytest.raises(ConfigError, match=r"train.steps: expected an integer, got None"):
        load_config(_Outer, None, ["train.steps=null"])
    with pytest.raises(ConfigError, match=r"name: expected a string, got \{'a': 1\}"):
        load_config(_Outer, None, ["name={a: 1}"])


def test_rules_run_on_direct_construction_too():
    from hylo.pipeline.train.config import CheckpointSection, KDSection

    with pytest.raises(ValueError, match="temperature=0.0: must be > 0"):
        KDSection(temperature=0.0)
    with pytest.raises(ValueError, match="every_steps=0: must be >= 1"):
        CheckpointSection(every_steps=0)


def test_eval_config_knows_the_retrieval_tasks():
    from hylo.pipeline.eval.config import RETRIEVAL_TASKS
    from hylo.pipeline.eval.retrieval import TASKS

    assert RETRIEVAL_TASKS == TASKS


def test_a_section_given_in_part_keeps_the_defaults_its_config_sets(tmp_path):
    """Stage 2's `data.split: stage2` and `optim.lr: 4e-5` come from the config class's default_factory, not
    from the section's class: a file or --set that names the section for another key keeps them."""
    from hylo.pipeline.data.config import PrepareDataConfig
    from hylo.pipeline.train.config import load_stage_config

    p = tmp_path / "s2.yaml"
    p.write_text("data: {path: runs/x/data}\noptim: {weight_decay: 0.1}\nstage1: {data: {split: stage1}}\n")
    cfg = load_stage_config(2, p)
    assert (cfg.data.split, cfg.data.path, cfg.optim.lr, cfg.optim.weight_decay) == ("stage2", "runs/x/data", 4e-5, 0.1)
    assert load_stage_config(2, None, ["data.path=x"]).data.split == "stage2"
    assert load_stage_config(2, None, ["data.split=stage1"]).data.split == "stage1"  # what is set still wins
    assert load_stage_config(1, p).data.split == "stage1"
    q = tmp_path / "prep.yaml"
    q.write_text("ray: {address: null}\n")
    assert load_config(PrepareDataConfig, q).ray.num_cpus == 2
    assert load_config(PrepareDataConfig, q, ["ray.num_cpus=3"]).ray.num_cpus == 3
