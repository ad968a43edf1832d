"""HybridConfig writes RoPE the transformers-5 way (`rope_parameters`) and reads configs written before
(`rope_scaling` + `rope_theta`); no deprecation warning either way (pyproject makes it an error)."""

from __future__ import annotations

import json
import warnings

from hylo.config import HybridConfig

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}


def test_config_json_holds_rope_parameters_and_no_rope_scaling(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        HybridConfig(n_layer=2, mla_layers=[0], rope_theta=500.0, rope_scaling=YARN).save_pretrained(tmp_path)
        data = json.loads((tmp_path / "config.json").read_text())
        assert "rope_scaling" not in data
        assert data["rope_parameters"] == {**YARN, "rope_theta": 500.0}
        back = HybridConfig.from_pretrained(tmp_path)
    assert back.rope_scaling == YARN and back.rope_theta == 500.0


def test_a_config_written_with_rope_scaling_reads_the_same(tmp_path):
    HybridConfig(n_layer=2, mla_layers=[0]).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("rope_parameters")
    data.update(rope_theta=250.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048})
    (tmp_path / "config.json").write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cfg = HybridConfig.from_pretrained(tmp_path)
    assert cfg.rope_scaling == YARN and cfg.rope_theta == 250.0
    assert cfg.rope_parameters == {**YARN, "rope_theta": 250.0}


def test_plain_rope_has_no_scaling():
    cfg = HybridConfig(n_layer=2, mla_layers=[0], rope_theta=123.0)
    assert cfg.rope_scaling is None and cfg.rope_parameters == {"rope_type": "default", "rope_theta": 123.0}
