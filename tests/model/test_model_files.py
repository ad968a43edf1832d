"""Hostile model files: each is refused with one line naming the file and the field (or tensor), exit status 2,
before anything is built from it (hylo/model_files.py is the one place the fields are checked).

What each test guards (before its fix): a base config.json with 0 heads gave a ZeroDivisionError traceback,
hidden % heads a transformers validation traceback, 0 KV heads or a NaN rope_theta a dry run with exit 0,
10^6 layers a dry run running for minutes; a NaN weight in a released-layout or X-EcoMLA import was imported
silently; an X-EcoMLA rank of 4096 was an IndexError traceback, a NaN rope_theta an import with exit 0, a
rank entry for a layer the model does not have was ignored; a teacher with a NaN weight was caught only
inside the workers (retried, its message not naming the teacher).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hylo.config import HybridConfig, HybridConfigError
from hylo.jobs import convert, stage2
from hylo.model_files import MAX_LAYERS, ModelFileError, check_model_config

from tests.helpers import released, xecomla
from tests.helpers.models import LLAMA_1B
from tests.helpers.teacher import save_tiny_llama
from tests.helpers.train import make_tiny_models, tiny_config, write_config


def _one_error_line(err: str) -> str:
    """The job's error line (exactly one, no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------ a base's config.json
HOSTILE_BASE = {
    "zero-heads": ({"num_attention_heads": 0}, "num_attention_heads = 0: must be >= 1"),
    "hidden-not-divisible": ({"num_attention_heads": 30, "num_key_value_heads": 6, "head_dim": None},
                             "hidden_size = 2048: must be a multiple of num_attention_heads = 30"),
    "zero-kv-heads": ({"num_key_value_heads": 0}, "num_key_value_heads = 0: must be >= 1"),
    "kv-heads-not-dividing": ({"num_key_value_heads": 5}, "num_key_value_heads = 5: must divide"),
    "million-layers": ({"num_hidden_layers": 10**6}, f"num_hidden_layers = 1000000: must be <= {MAX_LAYERS:,}"),
    "nan-rope-theta": ({"rope_theta": float("nan")}, "rope_theta = nan: not a finite number"),
    "inf-in-rope-scaling": ({"rope_scaling": {"rope_type": "yarn", "factor": float("inf"),
                                              "original_max_position_embeddings": 8192}},
                            "rope_scaling.factor = inf: not a finite number"),
    "negative-vocab": ({"vocab_size": -5}, "vocab_size = -5: must be >= 1"),
    "string-layers": ({"num_hidden_layers": "16"}, "num_hidden_layers = '16': must be an integer"),
}


@pytest.mark.parametrize("name", HOSTILE_BASE)
def test_a_hostile_base_config_is_one_line_naming_the_file_and_field(tmp_path, capsys, name):
    change, needle = HOSTILE_BASE[name]
    path = tmp_path / "config.json"
    cfg = {k: v for k, v in {**LLAMA_1B, **change}.items() if v is not None}
    # json writes NaN / Infinity, which Python's reader (and transformers') accept
    path.write_text(json.dumps(cfg))
    rc = convert.main(["--dry-run", "--base-config", str(path), "--mla-layers", "even", "--kv-lora-rank", "128"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and line.startswith(f"error: {path}: {needle}"), line


def test_the_field_checks_themselves():
    good = {**LLAMA_1B}
    check_model_config(good, "c.json")
    for change, needle in [({"kv_lora_rank": 4096, "hidden_size": 2048}, "kv_lora_rank = 4096: must be <= hidden_size"),
                           ({"qk_rope_head_dim": 7}, "qk_rope_head_dim = 7: must be even"),
                           ({"rms_norm_eps": 0.0}, "rms_norm_eps = 0.0: must be > 0"),
                           ({"max_position_embeddings": True}, "max_position_embeddings = True: must be an integer"),
                           ({"rope_parameters": {"rope_theta": -1.0}}, "rope_parameters.rope_theta = -1.0: must be > 0")]:
        with pytest.raises(ModelFileError, match="^c.json: " + needle.replace("(", r"\(")):
            check_model_config({**good, **change}, "c.json")
    # AMD's / DeepSeek's files do not derive the head dim from hidden_size
    check_model_config({"hidden_size": 30, "num_attention_heads": 4}, "h.json", derives_head_dim=False)
    # our own config: the same checks (a NaN rope_theta made a directory every job refused after the import)
    with pytest.raises(HybridConfigError, match="HybridConfig: rope_theta = nan: not a finite number"):
        HybridConfig(rope_theta=float("nan"))
    with pytest.raises(HybridConfigError, match="n_layer = 100000: must be <= 1,024"):
        HybridConfig(n_layer=100_000)


# ------------------------------------------------------------------------------------ released layouts
def _import(src: Path, out: Path, capsys) -> tuple[int, str]:
    rc = convert.main(["--from-released", str(src), "--out", str(out)])
    return rc, _one_error_line(capsys.readouterr().err)


def _poison(d: Path, key: str, value: float) -> None:
    t = load_file(str(d / "model.safetensors"))
    t[key].view(-1)[3] = value
    save_file(t, str(d / "model.safetensors"))


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "-inf"])
def test_a_released_import_with_a_non_finite_weight_is_refused_naming_file_and_tensor(tmp_path, capsys, value):
    d = tmp_path / "rel"
    released.write_released(d, released.VARIANTS["qlora-perkv"])
    key = "model.layers.0.mla.kv_b_proj.weight"
    _poison(d, key, value)
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and f"{d / 'model.safetensors'}: non-finite (NaN/inf) weights in 1 tensor: {key} (1 value)" in line
    assert not (tmp_path / "out").exists()


def test_a_released_rank_that_disagrees_with_its_tensors_is_named_not_an_index_error(tmp_path, capsys):
    d = tmp_path / "rel"
    released.write_released(d, released.VARIANTS["qlora-perkv"])
    hyb = json.loads((d / "hybrid_config.json").read_text())
    (d / "hybrid_config.json").write_text(json.dumps({**hyb, "kv_lora_rank": hyb["kv_lora_rank"] + 8}))
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and "kv_a_proj_with_mqa.weight has shape" in line and "kv_lora_rank + qk_rope_head_dim" in line


def test_released_rank_entries_for_layers_without_mla_are_refused(tmp_path, capsys):
    d = tmp_path / "rel"
    v = released.variant(linear="mamba2", legacy=True)
    released.write_released(d, v)
    hyb = json.loads((d / "hybrid_config.json").read_text())
    linear = next(i for i in range(hyb["n_layer"]) if i not in hyb["mla_layers"])
    ranks = {**hyb["layer_rank_list"], str(linear): {"q_rank": v["q_lora_rank"], "kv_rank": hyb["kv_lora_rank"]}}
    (d / "hybrid_config.json").write_text(json.dumps({**hyb, "layer_rank_list": ranks}))
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and f"layer_rank_list names layer {linear}, which is not an MLA layer" in line, line


# ------------------------------------------------------------------------------------ X-EcoMLA
def _xecomla(tmp_path: Path, **kw) -> Path:
    d = tmp_path / "xe"
    xecomla.write_xecomla(d, xecomla.variant(**kw))
    return d


def _edit_layer_config(d: Path, **changes) -> None:
    layer = json.loads((d / "mla_layer_config.json").read_text())
    (d / "mla_layer_config.json").write_text(json.dumps({**layer, **changes}))


def test_x_ecomla_rank_4096_is_one_line_not_an_index_error(tmp_path, capsys):
    d = _xecomla(tmp_path)
    ranks = json.loads((d / "mla_layer_config.json").read_text())["layer_rank_list"]
    _edit_layer_config(d, layer_rank_list={**ranks, "1": {"q_rank": 16, "kv_rank": 4096}})
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and line == (f"error: {d / 'mla_layer_config.json'}: layer_rank_list['1'].kv_rank = 4096: must be "
                                f"<= hidden_size = {xecomla.D} (a latent of the hidden states is at most as wide as they are)")
    # a rank within the hidden size that is not its tensors' is named too (was the same IndexError)
    _edit_layer_config(d, layer_rank_list={**ranks, "1": {"q_rank": 16, "kv_rank": 24}})
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and "layer 1's kv rank is 24 but model.layers.1.mla.kv_a_proj_with_mqa.weight has shape" in line


def test_x_ecomla_nan_rope_theta_is_refused_and_nothing_written(tmp_path, capsys):
    d = _xecomla(tmp_path, rope_theta=float("nan"))
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and line == f"error: {d / 'config.json'}: rope_theta = nan: not a finite number"
    assert not (tmp_path / "out").exists()
    # the layer config alone holding it is named as such
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "rope_theta": 500.0}))
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and line == f"error: {d / 'mla_layer_config.json'}: rope_theta = nan: not a finite number"


@pytest.mark.parametrize("key", ["7", "-1", "x"])
def test_x_ecomla_rank_entries_for_absent_layers_are_refused(tmp_path, capsys, key):
    d = _xecomla(tmp_path)
    ranks = json.loads((d / "mla_layer_config.json").read_text())["layer_rank_list"]
    _edit_layer_config(d, layer_rank_list={**ranks, key: {"q_rank": 8, "kv_rank": 8}})
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and line.startswith(f"error: {d / 'mla_layer_config.json'}: layer_rank_list: "), line
    assert ("out of range; the model has layers 0..2" if key != "x" else "'x' is not a layer index") in line


def test_an_x_ecomla_import_with_a_nan_weight_is_refused(tmp_path, capsys):
    d = _xecomla(tmp_path)
    _poison(d, "model.layers.2.mla.q_b_proj.weight", float("nan"))
    rc, line = _import(d, tmp_path / "out", capsys)
    assert rc == 2 and "model.layers.2.mla.q_b_proj.weight (1 value)" in line and str(d / "model.safetensors") in line


# ------------------------------------------------------------------------------------ the teacher
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("tiny"))


def _nan_teacher(root: Path) -> tuple[Path, str]:
    teacher = save_tiny_llama(root / "nan-teacher")
    key = "model.layers.1.mlp.down_proj.weight"
    t = load_file(str(teacher / "model.safetensors"))
    t[key][0, 0] = float("nan")
    save_file(t, str(teacher / "model.safetensors"), metadata={"format": "pt"})
    return teacher, key


def test_a_nan_teacher_stops_stage2_before_ray_naming_the_teacher_and_tensor(tmp_path, tiny, capsys, monkeypatch):
    from hylo.pipeline.train import driver

    def no_ray(*a, **k):
        raise AssertionError("Ray started with a NaN teacher")

    monkeypatch.setattr(driver, "ray_training", no_ray)
    teacher, key = _nan_teacher(tmp_path)
    cfg = tiny_config(tiny, tmp_path / "runs", "nan-teacher", stage=2, ray={"launcher": "ray"},
                      teacher={"model": {"path": str(teacher)}})
    rc = stage2.main(["--config", str(write_config(cfg, tmp_path / "s2.yaml"))])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2, line
    assert f"teacher model (teacher.model.path) {teacher}: model.safetensors has non-finite (NaN/inf) weights in " \
           f"1 tensor: {key} (1 value)" in line, line


def test_a_nan_teacher_loaded_in_a_worker_is_an_input_error_ray_does_not_retry(tmp_path):
    """Where the driver did not scan it (a pool started elsewhere, a file changed since), the replica or
    worker loading it refuses it as an input error naming the teacher: failures.py ends the run at once."""
    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.train.failures import worker_input_error

    teacher, key = _nan_teacher(tmp_path)
    with pytest.raises(ModelFileError) as e:
        TeacherModel(teacher)
    assert f"teacher model {teacher}: non-finite (NaN/inf) weights in 1 tensor: {key} (1 value)" in str(e.value)

    class Failed(Exception):
        worker_failures = {0: e.value}

    assert worker_input_error(Failed()) == f"worker 0: {e.value}"


def test_a_hostile_teacher_config_is_refused_before_its_weights_are_read(tmp_path):
    from hylo.pipeline.teacher.model import resolve_model_path

    teacher = save_tiny_llama(tmp_path / "t")
    cfg = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    with pytest.raises(ModelFileError, match=f"^{teacher / 'config.json'}: num_attention_heads = 0: must be >= 1$"):
        resolve_model_path(teacher)
