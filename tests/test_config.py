"""HybridConfig validation, the job config system, and the KV-cache accounting of the published family."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import LlamaConfig, Qwen3Config

from hylo.config import HybridConfig, HybridConfigError
from hylo.upcycle import UpcycleError, hybrid_config_from_base, kv_summary, parse_placement
from pipeline.config import ConfigError, config_hash, load_config


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
    # 7 * (128 + 64) / (28 * 2 * 8 * 128) = 2.34 %
    assert kv_summary(base, hcfg)["kv_cache_ratio"] == pytest.approx(7 * 192 / 57344)


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

    from pipeline.config import add_config_args, config_from_args
    from pipeline.data.config import PrepareDataConfig
    from pipeline.train.config import config_to_dict, load_stage_config
    from pipeline.train.driver import run

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
