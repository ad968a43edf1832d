"""The convert job (jobs/convert.py): its configuration in the one config system, and what it does.

    python jobs/convert.py --config convert.yaml --set convert.kv_lora_rank=128 [--print-config]

Design choices:
* The conversion options are hylo's `ConvertConfig` (its ranges are `@rules`, hylo/rules.py, as in every
  config section), the same class as the training config's `model.convert`: one set of names, defaults and checks for
  both, and the same `hylo.upcycle.convert` behind them.
* The job's flags (`--base`, `--mla-layers`, `--kv-lora-rank`, ...) are shorthands for keys of this
  config (`SHORTHANDS` in jobs/convert.py); the order is file, then flags, then `--set`. An error in a
  value a flag set names the flag.
* `config.py`: ConvertJobConfig (a leaf, re-exported here); `job.py`: `run` and its
  three modes.
* Output: one JSON summary on stdout (layers, parameters, KV-cache bytes per token of base and hybrid at
  bf16, `kv_cache_ratio` as a fraction).
"""

from __future__ import annotations

from hylo.pipeline.convert.config import ConvertJobConfig

__all__ = ["ConvertJobConfig"]
