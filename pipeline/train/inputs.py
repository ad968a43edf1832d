"""What a training stage reads, checked before Ray or torchrun starts; every error names the key and file.

`check_stage_inputs(cfg)` is cheap (config files, safetensors headers, Parquet footers; no weights):
* model.student: a HyLo checkpoint (a valid hybrid_config.json, whole .safetensors files). Stage 1
  without one: model.base's config.json with the model.convert options must give a valid HybridConfig;
* model.base (stage 1) and the teacher (stage 2 inprocess, or serve when the driver starts the pool): a
  model directory or asset with whole .safetensors files;
* teacher.cache_path (offline): a teacher cache manifest;
* data (parquet): the manifest, its split and seq_len, and every shard's Parquet footer and row count
  (a truncated or half-copied shard is named here; a shard corrupt inside is named by the reader).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import ConfigError
from pipeline.train.config import StageConfig, run_dir


def _weights(directory: str | Path) -> None:
    from hylo.files import check_weights_dir

    check_weights_dir(directory)


def _hylo_checkpoint(key: str, path: str) -> None:
    from hylo.config import HYBRID_CONFIG_NAME, HybridConfig

    p = Path(path).expanduser()
    if not (p / HYBRID_CONFIG_NAME).is_file():
        what = "does not exist" if not p.exists() else f"has no {HYBRID_CONFIG_NAME}"
        raise ConfigError(f"{key}={path!r}: {what}; it must be a HyLo checkpoint directory (jobs/convert.py "
                          "writes one)", key)
    HybridConfig.from_hybrid_json(p)
    _weights(p)


def _convert_options_fit_the_base(cfg: StageConfig, base_dir: str | Path) -> None:
    """model.convert against the base's config.json, without loading weights (HybridConfigError names the key)."""
    from transformers import AutoConfig

    from hylo.config import HybridConfigError
    from hylo.upcycle import UpcycleError, hybrid_config_from_base

    options = cfg.model.convert
    try:
        hybrid_config_from_base(AutoConfig.from_pretrained(base_dir), options)
    except (HybridConfigError, UpcycleError) as e:
        raise ConfigError(f"model.convert={options.non_defaults()}: {e} (base {base_dir})", "model.convert") from None


def _data(cfg: StageConfig) -> None:
    from pipeline.train.rows import ParquetRows

    ParquetRows(cfg.data, 0, cfg.ray.num_workers).reader.check_shards()


def check_stage_inputs(cfg: StageConfig) -> None:
    from hylo.assets import resolve_path_or_asset

    if cfg.model.student:
        _hylo_checkpoint("model.student", cfg.model.student)
    if cfg.stage == 1:
        if not cfg.model.base:
            raise ConfigError("stage 1 needs model.base (the model whose layers the student imitates)", "model.base")
        base_dir = resolve_path_or_asset(cfg.model.base, "model.base", directory=True)
        _weights(base_dir)
        converted = run_dir(cfg) / "converted" / "hybrid_config.json"
        if not cfg.model.student and cfg.model.convert is not None and not converted.is_file():
            _convert_options_fit_the_base(cfg, base_dir)
    else:
        t = cfg.teacher
        if t.source == "inprocess" or (t.source == "serve" and t.start_pool):
            from pipeline.teacher.model import resolve_model_path

            _weights(resolve_model_path(t.model.path))
        if t.source == "offline":
            from pipeline.teacher.cache import load_manifest

            load_manifest(t.cache_path)
    if cfg.data.source == "parquet":
        _data(cfg)
