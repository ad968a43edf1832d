"""Upcycle a Llama / Qwen3 checkpoint into a HyLo hybrid (MLA + linear layers).

    from hylo.upcycle import ConvertConfig, convert

    convert("smollm2-135m-instruct", ConvertConfig(mla_layers="even", kv_lora_rank=128)).save("runs/hylo")

Modules (each one idea; none imports this package's `__init__`, and there are no import cycles):
* `config.py`: `ConvertConfig` (every option of a conversion) and `UpcycleError`; imports nothing of the project.
* `options.py`: `hybrid_config_from_base` (options + a base config -> HybridConfig), placements, YaRN,
  KV-cache accounting. Imports no torch.
* `base.py`: reading and checking the base model (config.json, weights, NaN/inf).
* `attention.py`: the base attention's projections per head, what every mixer converter starts from.
* `mla.py`, `gdn.py`, `mamba2.py`: one mixer's weights from one attention layer.
* `calibrate.py`: the calibration pass on a built-in text (linear gates and norms, MLA latent norms).
* `model.py`: `upcycle` (a loaded base model -> HyLo) and `convert` (a base directory or asset -> HyLo,
  calibrated unless `calibrate` is false), the one conversion jobs/convert.py and the training driver use.

The names below are loaded on first use, so `from hylo.upcycle import ConvertConfig` (the config loaders)
does not import torch.
"""

from __future__ import annotations

from hylo.lazy import lazy_exports

_EXPORTS = {
    "config": ("ConvertConfig", "UpcycleError"),
    "options": ("SUPPORTED_BASE_TYPES", "hybrid_config_from_base", "kv_summary", "make_options", "parse_placement",
                "yarn_rope_scaling"),
    "base": ("check_base_weights", "load_base_model", "read_base_config"),
    "attention": ("AttentionWeights", "attention_weights"),
    "mla": ("absorb_rope_factors", "mla_weights_from_attention", "rope_dim_split", "shared_rope_key"),
    "gdn": ("gdn_head_groups", "gdn_weights_from_attention"),
    "mamba2": ("mamba2_weights_from_attention",),
    "calibrate": ("CALIBRATION_TEXT", "calibration_ids_for", "default_calibration_ids"),
    "model": ("Conversion", "convert", "upcycle"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
