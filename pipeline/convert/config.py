"""The convert job's configuration (jobs/convert.py), and `ConvertSection`, the conversion options as a
config section (also the training config's `model.convert`). A leaf: it imports no implementation."""

from __future__ import annotations

from dataclasses import dataclass, field

from hylo.pipeline.config import Rule, rules

from hylo.upcycle.config import ConvertConfig


@dataclass
@rules(**{name: Rule(**allowed) for name, allowed in ConvertConfig.RANGES.items()})
class ConvertSection(ConvertConfig):
    """`hylo.upcycle.ConvertConfig` as a config section (its ranges checked as config rules)."""


@dataclass
class ConvertJobConfig:
    # The base model: an HF directory, asset:NAME or an asset name (hylo.assets).
    base: str | None = None
    # Output directory: the HyLo checkpoint (or, with to_released, the released layout).
    out: str | None = None
    convert: ConvertSection = field(default_factory=ConvertSection)
    # Print the summary from base_config (a config.json) alone; no weights are loaded.
    dry_run: bool = False
    base_config: str | None = None
    # Import a checkpoint in the released layout (AMD's hybrid_config.json + config.json + mla.*/gdn.*/mamba.*
    # safetensors) and write it as a HyLo checkpoint to `out`.
    from_released: str | None = None
    # Export a HyLo checkpoint to the released layout in `out` (read back as AMD's loader would first).
    to_released: str | None = None
