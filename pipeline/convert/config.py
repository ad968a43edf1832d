"""The convert job's configuration (jobs/convert.py). Its `convert` section is hylo's `ConvertConfig` itself
(also the training config's `model.convert`), whose `@rules` state each option's range. A leaf: it imports
no implementation."""

from __future__ import annotations

from dataclasses import dataclass, field

from hylo.pipeline.config import OUTPUT_PATH, PATH, one_of, rules
from hylo.upcycle.config import ConvertConfig


@dataclass
@rules(released_layout=one_of("zebra-llama", "x-ecomla"), base=PATH, out=OUTPUT_PATH, base_config=PATH, from_released=PATH,
       to_released=PATH)
class ConvertJobConfig:
    # The base model: an HF directory, asset:NAME or an asset name (hylo.assets).
    base: str | None = None
    # Output directory: the HyLo checkpoint (or, with to_released, the released layout).
    out: str | None = None
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    # Print the summary from base_config (a config.json) alone; no weights are loaded.
    dry_run: bool = False
    base_config: str | None = None
    # Import a checkpoint in the released layout (AMD's hybrid_config.json + config.json + mla.*/gdn.*/mamba.*
    # safetensors) and write it as a HyLo checkpoint to `out`.
    from_released: str | None = None
    # Export a HyLo checkpoint to the released layout in `out` (read back as AMD's loader would first).
    to_released: str | None = None
    # The layout to_released writes: Zebra-Llama's hybrid_config.json (MLA + Mamba-2 / GDN) or X-EcoMLA's
    # MLA_config.json + mla_layer_config.json (all-MLA models). --from-released recognises either.
    released_layout: str = "zebra-llama"
