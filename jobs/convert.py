"""Convert a Llama / Qwen3 checkpoint into a HyLo hybrid and print what it saves.

    hylo convert --base smollm2-135m-instruct --out runs/hylo-smollm2 --mla-layers even
    hylo convert --dry-run --base-config path/to/config.json --mla-layers 0,5,10,16,21,26 \\
        --kv-lora-rank 128 --qk-rope-head-dim 64
    hylo convert --base smollm2-135m-instruct --out runs/x --set convert.seed=3 [--config FILE] [--print-config]
    hylo convert --from-released path/to/HyLo-Llama-14MLA14GDN-64K-SFT --out runs/hylo-3b
    hylo convert --to-released runs/hylo-3b --out runs/hylo-3b-released

Prints one JSON summary on stdout (layers, parameters, KV-cache bytes per token of base and hybrid at bf16,
`kv_cache_ratio` as a fraction). `--dry-run` loads no weights. `--from-released` reads a checkpoint in the
layout of AMD's released HyLo models (hybrid_config.json + base config.json + `mla.*` / `gdn.*` / `mamba.*`
safetensors: GDN or Mamba-2 (`d_xb`, `ssm_cfg`) linear layers, Qwen MLA q/k norms under `mla.` or
`self_attn.`, an LM head stored apart from the embeddings under `tie_word_embeddings: true` imported as an
untied head; or X-EcoMLA's MLA_config.json + mla_layer_config.json) and writes ours; `--to-released` writes
one of ours in that layout (exactly the fields of AMD's public HybridConfig with values it accepts, the head
always stored, the base's config.json; `--released-layout x-ecomla` for X-EcoMLA's) and reads its output back
the way AMD's loader does, failing on any tensor it would drop, leave at random init or refuse for its shape
(see hylo/released/, hylo/released_facts.py).
Every flag below is a shorthand for a key of the job's config (pipeline/convert/config.py; `--print-config`
lists them all): the file (`--config`) first, then the flags, then `--set KEY=VALUE`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.model_files import MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_POSITIONS
from hylo.pipeline.cli import bounded_float, check_finite_args, job_main, positive_finite_float
from hylo.pipeline.cli import bounded_int as _INT
from hylo.pipeline.config import (
    ConfigError,
    add_config_args,
    apply_overrides,
    error_origin,
    field_rules,
    from_dict,
    maybe_print_config,
    read_config_file,
    remember_config_file,
    source_texts,
)
from hylo.pipeline.convert import ConvertJobConfig, job
from hylo.pipeline.paths import resolve_paths
from hylo.rules import SEED_MAX
from hylo.upcycle.config import MAX_YARN_FACTOR, ConvertConfig

# The bounds of the numeric flags (checked as they are parsed; a config file's values by ConvertConfig's rules and
# the model caps of hylo/model_files.py): an epsilon in (0, 1], value dims at most 64 x the head dim.
_EPS = positive_finite_float(1.0)
MAX_EXPAND_V = 64.0

_CHOICES = {name: list(r.choices) for name, r in field_rules(ConvertConfig).items() if r.choices is not None}
_ON, _OFF = {"action": "store_const", "const": True}, {"action": "store_const", "const": False}
# flag -> (config key, argparse keywords); the help of a convert.* key ends with its default
SHORTHANDS: dict[str, tuple[str, dict[str, Any]]] = {
    "--base": ("base", {"help": "base HF model directory or asset name (e.g. smollm2-135m-instruct)"}),
    "--out": ("out", {"help": "output directory for the HyLo checkpoint"}),
    "--mla-layers": ("convert.mla_layers", {"help": "0,5,10 | even | odd | uniform:N | all | none"}),
    "--linear-type": ("convert.linear_type", {"help": "gdn | mamba2"}),
    "--kv-lora-rank": ("convert.kv_lora_rank", {"type": _INT(1, MAX_HIDDEN)}),
    "--q-lora-rank": ("convert.q_lora_rank", {"type": _INT(1, MAX_HIDDEN), "help": "omit for uncompressed queries"}),
    "--qk-rope-head-dim": ("convert.qk_rope_head_dim", {"type": _INT(1, MAX_HEAD_DIM)}),
    "--qk-nope-head-dim": ("convert.qk_nope_head_dim", {"type": _INT(0, MAX_HEAD_DIM)}),
    "--rope-key-groups": ("convert.rope_key_groups", {
        "type": _INT(1, MAX_HEADS), "help": "blocks of the shared roped key: the number of KV heads (default, exact init) or 1"}),
    "--mla-latent-norm": ("convert.mla_latent_norm", {
        **_ON, "help": "keep DeepSeek's RMSNorm on the MLA latents (off by default for upcycling)"}),
    "--mla-latent-norm-eps": ("convert.mla_latent_norm_eps", {
        "type": _EPS, "help": "epsilon of the MLA latent norms (default: the base's; AMD's released layout: 1e-6)"}),
    "--v-head-dim": ("convert.v_head_dim", {"type": _INT(1, MAX_HEAD_DIM)}),
    "--gdn-num-heads": ("convert.gdn_num_heads", {"type": _INT(1, MAX_HEADS)}),
    "--gdn-head-dim": ("convert.gdn_head_dim", {"type": _INT(1, MAX_HEAD_DIM)}),
    "--gdn-expand-v": ("convert.gdn_expand_v", {"type": positive_finite_float(MAX_EXPAND_V)}),
    "--mamba2-xb-groups": ("convert.mamba2_xb_groups", {
        "type": _INT(1, MAX_HEADS), "help": "Mamba-2 x/B groups read by consecutive heads (the KV head count: AMD's released "
                             "Mamba-2 layout, d_xb = KV heads x head_dim); omit for x per head"}),
    "--mamba2-norm-eps": ("convert.mamba2_norm_eps", {
        "type": _EPS, "help": "epsilon of the Mamba-2 gated output norm (default: the base's; AMD's released "
                               "layout fixes it at 1e-5)"}),
    "--max-position-embeddings": ("convert.max_position_embeddings", {"type": _INT(1, MAX_POSITIONS)}),
    "--yarn-factor": ("convert.yarn_factor", {
        "type": bounded_float(1.0, MAX_YARN_FACTOR), "help": "YaRN on the MLA RoPE with this factor (the released 64K models: 32)"}),
    "--yarn-original-max-position-embeddings": ("convert.yarn_original_max_position_embeddings", {
        "type": _INT(1, MAX_POSITIONS), "help": "YaRN's original window (the released 64K models: 2048); default: max positions / factor"}),
    "--untie-lm-head": ("convert.tie_word_embeddings", {
        **_OFF, "help": "give the hybrid its own LM head (a copy of the base's), as the released models have"}),
    "--kv-b-per-kv-head": ("convert.kv_b_per_kv_head", {
        **_ON, "help": "kv_b_proj rows per KV head, read by the query heads of each group (the released layout)"}),
    "--init": ("convert.init", {"choices": _CHOICES["init"]}),
    "--seed": ("convert.seed", {
        "type": _INT(0, SEED_MAX), "help": "seed of what conversion does not set (linear blocks' decay/step/beta rows), per layer"}),
    "--no-calibrate": ("convert.calibrate", {
        **_OFF, "help": "skip the calibration pass (MLA latent norms, linear blocks' gates and output norms)"}),
    "--dtype": ("convert.dtype", {"choices": _CHOICES["dtype"]}),
    "--dry-run": ("dry_run", {**_ON, "help": "print the summary from --base-config alone"}),
    "--base-config": ("base_config", {"help": "config.json of the base model, or its directory (for --dry-run)"}),
    "--from-released": ("from_released", {
        "metavar": "DIR", "help": "import a checkpoint in the released layout (AMD's hybrid_config.json + "
                                  "config.json + mla.*/gdn.*/mamba.* safetensors) and write it as a HyLo checkpoint "
                                  "to --out"}),
    "--to-released": ("to_released", {
        "metavar": "HYLO_DIR", "help": "export a HyLo checkpoint to the released layout in --out, checked by "
                                       "reading it back as AMD's loader would"}),
    "--released-layout": ("released_layout", {
        "choices": ["zebra-llama", "x-ecomla"],
        "help": "the layout --to-released writes: zebra-llama (hybrid_config.json; default) or x-ecomla "
                "(MLA_config.json + mla_layer_config.json, all-MLA models)"}),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_config_args(p)
    defaults = ConvertConfig()
    for flag, (key, kw) in SHORTHANDS.items():
        kw = dict(kw)
        default = getattr(defaults, key.split(".", 1)[1]) if key.startswith("convert.") else None
        if default is not None and kw.get("action") is None:
            kw["help"] = f"{kw.get('help', '')} (default: {default})".lstrip()
        p.add_argument(flag, dest=_dest(flag), default=argparse.SUPPRESS, **kw)
    return p


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def load_job_config(args: argparse.Namespace) -> ConvertJobConfig:
    """The job's config: the file, then the flags, then the --set overrides; errors name where a value came from."""
    texts: dict[str, str] = {}
    set_texts: dict[str, str] = {}
    tree, lines = read_config_file(args.config, texts) if args.config else ({}, {})
    by_flag: dict[str, str] = {}
    for flag, (key, _) in SHORTHANDS.items():
        if hasattr(args, _dest(flag)):
            *parents, leaf = key.split(".")
            node = tree
            for part in parents:
                if node.get(part) is None:
                    node[part] = {}
                if not isinstance(node[part], dict):
                    raise ConfigError(f"{flag} sets {key}, but {part!r} is not a section", part)
                node = node[part]
            node[leaf] = getattr(args, _dest(flag))
            by_flag[key] = flag
    set_keys = apply_overrides(tree, args.overrides, set_texts)
    try:
        with source_texts(texts, set_texts, [*by_flag, *set_keys]):
            return remember_config_file(from_dict(ConvertJobConfig, tree), args.config)
    except ConfigError as e:
        origin = error_origin(e.key, str(args.config or "<defaults>"), lines, [*by_flag, *set_keys])
        if e.key in by_flag and e.key not in set_keys:
            origin += f" ({by_flag[e.key]})"
        raise ConfigError(f"{origin}: {e}", e.key) from None


@job_main(stops=True)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_finite_args(args)
    cfg = load_job_config(args)
    maybe_print_config(cfg, args)
    cfg = resolve_paths(cfg)

    print(json.dumps(job.run(cfg), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
