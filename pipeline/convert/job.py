"""What the convert job does: a conversion, a dry run from config.json alone, or a released-layout import
or export (`run`); its configuration is in config.py beside it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hylo.assets import asset_dir, asset_name
from hylo.outputs import check_not_an_input
from hylo.ownership import check_replaceable
from hylo.pipeline.cli import writable_dir
from hylo.pipeline.convert.config import ConvertJobConfig
from hylo.pipeline.paths import job_inputs
from hylo.released_facts import AMD_AT
from hylo.upcycle.config import UpcycleError


# ------------------------------------------------------------------------------------ summaries
def rope_summary(hcfg: Any) -> dict[str, Any]:
    """The MLA RoPE settings (YaRN factor and original window, usable positions)."""
    rs = {k: v for k, v in (hcfg.rope_scaling or {}).items() if k != "rope_theta"} or None
    return {"max_position_embeddings": hcfg.max_position_embeddings, "rope_theta": hcfg.rope_theta, "rope_scaling": rs}


def count_params(hcfg: Any, base_cfg: Any) -> dict[str, Any]:
    """Parameter counts from shapes alone (meta device), so a dry run needs no weights."""
    import torch  # lazy: torch

    from hylo.modeling import HyLoForCausalLM  # lazy: torch

    with torch.device("meta"):
        model = HyLoForCausalLM(hcfg)
    hybrid = sum(p.numel() for p in model.parameters())
    try:
        from transformers import AutoModelForCausalLM  # lazy: transformers

        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(base_cfg)
        base_n = sum(p.numel() for p in base.parameters())
    except Exception:
        base_n = None
    return {"base_parameters": base_n, "hybrid_parameters": hybrid}


# ------------------------------------------------------------------------------------ the three modes
def released_io(cfg: ConvertJobConfig) -> dict[str, Any]:
    """from_released / to_released: one layout in, the other out (errors as UpcycleError)."""
    from hylo.config import HybridConfigError  # lazy: transformers
    from hylo.io import CheckpointMismatchError, load_hylo, save_hylo  # lazy: transformers
    from hylo.released import (  # lazy: torch
        ReleasedLayoutError,
        export_released,
        is_released_layout,
        public_loader_refusal,
    )
    from hylo.released_xecomla import export_xecomla, is_xecomla_layout, xecomla_loader_refusal  # lazy: torch

    src = Path(cfg.from_released or cfg.to_released or "")
    if not cfg.out:
        raise UpcycleError("--out is required with --from-released / --to-released")
    if not src.is_dir():
        raise UpcycleError(f"{src} does not exist or is not a directory")
    check_not_an_input(cfg.out, job_inputs(cfg, extra=[("--from-released", cfg.from_released),
                                                       ("--to-released", cfg.to_released)]))
    check_replaceable(cfg.out, "--out")
    try:
        released = is_released_layout(src) or is_xecomla_layout(src)
        if cfg.from_released:
            if not released:
                raise UpcycleError(f"{src}: its hybrid_config.json is not in the released layout (AMD's keys), and it "
                                   f"has no X-EcoMLA MLA_config.json + mla_layer_config.json")
            model = load_hylo(src, dtype="auto")
            save_hylo(model, cfg.out, tokenizer_from=src)
        else:
            if released:
                raise UpcycleError(f"{src} is already in the released layout")
            model = load_hylo(src, dtype="auto")
            export = export_xecomla if cfg.released_layout == "x-ecomla" else export_released
            export(model, cfg.out, tokenizer_from=src)
    except (ReleasedLayoutError, HybridConfigError, CheckpointMismatchError) as e:
        raise UpcycleError(str(e)) from None
    mcfg = model.config
    summary = {"from": str(src), "out": str(cfg.out), "layout": cfg.released_layout if cfg.to_released else "hylo",
               "layers": mcfg.n_layer, "mla_layers": mcfg.mla_layers, "linear_type": mcfg.linear_type,
               "mla_qk_norm": mcfg.mla_qk_norm, "tie_word_embeddings": mcfg.tie_word_embeddings,
               "parameters": sum(p.numel() for p in model.parameters())}
    if cfg.to_released:
        # what AMD's public loader (at the commit hylo/released_facts.py was read at) does with the export
        refusal = (xecomla_loader_refusal if cfg.released_layout == "x-ecomla" else public_loader_refusal)(cfg.out)
        summary["amd_public_loader"] = f"refuses it ({AMD_AT}): {refusal}" if refusal else f"loads it ({AMD_AT})"
    return summary


def dry_run(cfg: ConvertJobConfig) -> dict[str, Any]:
    """The summary of a conversion from the base's config.json alone."""
    from transformers import AutoConfig  # lazy: transformers

    from hylo.upcycle import hybrid_config_from_base, kv_summary, read_base_config  # lazy: torch

    if not cfg.base_config:
        raise UpcycleError("--dry-run needs --base-config CONFIG_JSON")
    path = Path(cfg.base_config)
    if path.is_dir():
        # a model directory: its config.json
        if not (path / "config.json").is_file():
            raise UpcycleError(f"--base-config {path} is a directory without a config.json; give the base "
                               f"model's config.json (or its directory)")
        path = path / "config.json"
    elif not path.is_file():
        raise UpcycleError(f"--base-config {path} does not exist")
    base_cfg = AutoConfig.for_model(**read_base_config(path))
    hcfg = hybrid_config_from_base(base_cfg, cfg.convert)
    return {"dry_run": True, **kv_summary(base_cfg, hcfg), **rope_summary(hcfg), **count_params(hcfg, base_cfg)}


def convert_base(cfg: ConvertJobConfig, progress: bool = True) -> dict[str, Any]:
    """Convert `base` into `out` with the `convert` options; returns the summary."""
    from hylo.upcycle import convert, kv_summary  # lazy: torch

    if not cfg.base or not cfg.out:
        raise UpcycleError("--base and --out are required (or --dry-run --base-config)")
    base = asset_dir(name) if (name := asset_name(cfg.base)) is not None else cfg.base
    check_not_an_input(cfg.out, job_inputs(cfg, extra=[("--base", base)]))
    writable_dir(Path(cfg.out).expanduser().resolve().parent, "--out (its parent)")
    # a directory holding anything we did not write (a user's notes) is refused now, not after the work
    check_replaceable(cfg.out, "--out")
    t0 = time.time()
    conv = convert(cfg.base, cfg.convert, progress=progress)
    out = conv.save(cfg.out)
    hcfg = conv.model.config
    return {
        "base": str(conv.base_dir),
        "out": str(out),
        **kv_summary(conv.base_model.config, hcfg),
        **rope_summary(hcfg),
        "base_parameters": sum(p.numel() for p in conv.base_model.parameters()),
        "hybrid_parameters": sum(p.numel() for p in conv.model.parameters()),
        "seconds": round(time.time() - t0, 1),
    }


def run(cfg: ConvertJobConfig, progress: bool = True) -> dict[str, Any]:
    """The job: released import/export, a dry run, or a conversion; returns the summary it prints."""
    if cfg.from_released or cfg.to_released:
        return released_io(cfg)
    if cfg.dry_run:
        return dry_run(cfg)
    return convert_base(cfg, progress)
