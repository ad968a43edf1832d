"""Convert a Llama / Qwen3 checkpoint into a HyLo hybrid and print what it saves.

    python jobs/convert.py --base smollm2-135m-instruct --out runs/hylo-smollm2 --mla-layers even
    python jobs/convert.py --dry-run --base-config path/to/config.json --mla-layers 0,5,10,16,21,26 \
        --kv-lora-rank 128 --qk-rope-head-dim 64
    python jobs/convert.py --from-released path/to/HyLo-Llama-14MLA14GDN-64K-SFT --out runs/hylo-3b
    python jobs/convert.py --to-released runs/hylo-3b/model --out runs/hylo-3b-released

Prints one JSON summary on stdout (layers, parameters, KV-cache bytes per token of base and hybrid at bf16,
`kv_cache_ratio` as a fraction). `--dry-run` loads no weights. `--from-released` reads a checkpoint in the
layout of AMD's released HyLo models (hybrid_config.json + base config.json + `mla.*` / `gdn.*`
safetensors) and writes ours; `--to-released` writes one of ours in that layout (see hylo/released.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cli import check_finite_args, job_main, report_error, writable_dir  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="base HF model directory or asset name (e.g. smollm2-135m-instruct)")
    p.add_argument("--out", help="output directory for the HyLo checkpoint")
    p.add_argument("--mla-layers", default="even", help="0,5,10 | even | odd | uniform:N | all | none")
    p.add_argument("--linear-type", default="gdn", choices=["gdn", "mamba2"])
    p.add_argument("--kv-lora-rank", type=int, default=None)
    p.add_argument("--q-lora-rank", type=int, default=None, help="omit for uncompressed queries")
    p.add_argument("--qk-rope-head-dim", type=int, default=None)
    p.add_argument("--qk-nope-head-dim", type=int, default=None)
    p.add_argument("--rope-key-groups", type=int, default=None,
                   help="blocks of the shared roped key: the number of KV heads (default, exact init) or 1")
    p.add_argument("--mla-latent-norm", action="store_true",
                   help="keep DeepSeek's RMSNorm on the MLA latents (off by default for upcycling)")
    p.add_argument("--v-head-dim", type=int, default=None)
    p.add_argument("--gdn-num-heads", type=int, default=None)
    p.add_argument("--gdn-head-dim", type=int, default=None)
    p.add_argument("--gdn-expand-v", type=float, default=None)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    p.add_argument("--yarn-factor", type=float, default=None,
                   help="YaRN on the MLA RoPE with this factor (the released 64K models: 32)")
    p.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN's original window (the released 64K models: 2048); default: max positions / factor")
    p.add_argument("--untie-lm-head", action="store_true",
                   help="give the hybrid its own LM head (a copy of the base's), as the released models have")
    p.add_argument("--kv-b-per-kv-head", action="store_true",
                   help="kv_b_proj rows per KV head, read by the query heads of each group (the released layout)")
    p.add_argument("--init", default="attention", choices=["attention", "random"])
    p.add_argument("--seed", type=int, default=0,
                   help="seed of what conversion does not set (linear blocks' decay/step/beta rows), per layer")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the calibration pass (MLA latent norms, linear blocks' gates and output norms)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--dry-run", action="store_true", help="print the summary from --base-config alone")
    p.add_argument("--base-config", help="config.json of the base model (for --dry-run)")
    p.add_argument("--from-released", metavar="DIR",
                   help="import a checkpoint in the released layout (AMD's hybrid_config.json + config.json + "
                        "mla.*/gdn.* safetensors) and write it as a HyLo checkpoint to --out")
    p.add_argument("--to-released", metavar="HYLO_DIR",
                   help="export a HyLo checkpoint to the released layout in --out")
    return p


def config_kwargs(args: argparse.Namespace) -> dict:
    kw = {
        "mla_layers": args.mla_layers,
        "linear_type": args.linear_type,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "rope_key_groups": args.rope_key_groups,
        "mla_latent_norm": args.mla_latent_norm,
        "v_head_dim": args.v_head_dim,
        "gdn_num_heads": args.gdn_num_heads,
        "gdn_head_dim": args.gdn_head_dim,
        "gdn_expand_v": args.gdn_expand_v,
        "max_position_embeddings": args.max_position_embeddings,
        "yarn_factor": args.yarn_factor,
        "yarn_original_max_position_embeddings": args.yarn_original_max_position_embeddings,
        "kv_b_per_kv_head": args.kv_b_per_kv_head,
    }
    if args.untie_lm_head:
        kw["tie_word_embeddings"] = False
    return kw


def released_io(args: argparse.Namespace) -> dict:
    """--from-released / --to-released: one layout in, the other out (errors as UpcycleError)."""
    from hylo.config import HybridConfigError
    from hylo.io import CheckpointMismatchError, load_hylo, save_hylo
    from hylo.released import ReleasedLayoutError, export_released, is_released_layout
    from hylo.upcycle import UpcycleError

    src = Path(args.from_released or args.to_released)
    if not args.out:
        raise UpcycleError("--out is required with --from-released / --to-released")
    if not src.is_dir():
        raise UpcycleError(f"{src} does not exist or is not a directory")
    try:
        if args.from_released:
            if not is_released_layout(src):
                raise UpcycleError(f"{src}: its hybrid_config.json is not in the released layout (AMD's keys)")
            model = load_hylo(src, dtype="auto")
            save_hylo(model, args.out, tokenizer_from=src)
        else:
            if is_released_layout(src):
                raise UpcycleError(f"{src} is already in the released layout")
            model = load_hylo(src, dtype="auto")
            export_released(model, args.out, tokenizer_from=src)
    except (ReleasedLayoutError, HybridConfigError, CheckpointMismatchError) as e:
        raise UpcycleError(str(e)) from None
    cfg = model.config
    return {"from": str(src), "out": str(args.out), "layout": "released" if args.to_released else "hylo",
            "layers": cfg.n_layer, "mla_layers": cfg.mla_layers, "parameters": sum(p.numel() for p in model.parameters())}


def rope_summary(hcfg) -> dict:
    """The MLA RoPE settings (YaRN factor and original window, usable positions)."""
    rs = {k: v for k, v in (hcfg.rope_scaling or {}).items() if k != "rope_theta"} or None
    return {"max_position_embeddings": hcfg.max_position_embeddings, "rope_theta": hcfg.rope_theta, "rope_scaling": rs}


def count_params(hcfg, base_cfg) -> dict:
    """Parameter counts from shapes alone (meta device), so --dry-run needs no weights."""
    import torch

    from hylo.modeling import HyLoForCausalLM

    with torch.device("meta"):
        model = HyLoForCausalLM(hcfg)
    hybrid = sum(p.numel() for p in model.parameters())
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(base_cfg)
        base_n = sum(p.numel() for p in base.parameters())
    except Exception:
        base_n = None
    return {"base_parameters": base_n, "hybrid_parameters": hybrid}


@job_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_finite_args(args)
    from hylo.upcycle import UpcycleError, hybrid_config_from_base, kv_summary

    try:
        if args.from_released or args.to_released:
            print(json.dumps(released_io(args), indent=2))
            return 0
        if args.dry_run:
            if not args.base_config:
                raise UpcycleError("--dry-run needs --base-config CONFIG_JSON")
            from transformers import AutoConfig

            from hylo.files import read_json

            path = Path(args.base_config)
            if not path.is_file():
                raise UpcycleError(f"--base-config {path} does not exist")
            raw = read_json(path, UpcycleError, mapping=True)
            from hylo.upcycle import SUPPORTED_BASE_TYPES

            if raw.get("model_type") not in SUPPORTED_BASE_TYPES:
                raise UpcycleError(f"{path}: model_type {raw.get('model_type')!r} is not supported; "
                                   f"supported: {', '.join(SUPPORTED_BASE_TYPES)}")
            base_cfg = AutoConfig.for_model(**raw)
            hcfg = hybrid_config_from_base(base_cfg, **config_kwargs(args))
            summary = {"dry_run": True, **kv_summary(base_cfg, hcfg), **rope_summary(hcfg), **count_params(hcfg, base_cfg)}
            print(json.dumps(summary, indent=2))
            return 0

        if not args.base or not args.out:
            raise UpcycleError("--base and --out are required (or --dry-run --base-config)")
        import torch

        from hylo.upcycle import calibration_ids_for, load_base_model, upcycle

        base_path = Path(args.base)
        if args.base.startswith("asset:") or (not base_path.exists() and "/" not in args.base):
            from hylo.assets import fetch_asset

            base_path = fetch_asset(args.base.removeprefix("asset:"))
        from hylo.files import check_weights_dir

        check_weights_dir(base_path)
        writable_dir(Path(args.out).expanduser().resolve().parent, "--out (its parent)")
        t0 = time.time()
        dtype = getattr(torch, args.dtype)
        base = load_base_model(base_path, dtype=dtype)
        hcfg = hybrid_config_from_base(base.config, **config_kwargs(args))
        tokenizer = None
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(base_path)
        except Exception as e:
            print(f"[convert] no tokenizer in {base_path} ({type(e).__name__}); the output will have none",
                  file=sys.stderr)
        calib = None
        if tokenizer is not None and not args.no_calibrate and args.init == "attention":
            calib = calibration_ids_for(tokenizer)
        model = upcycle(base, hcfg, init=args.init, calibration_ids=calib, progress=True, seed=args.seed)
        out = Path(args.out)
        from hylo.io import save_hylo

        save_hylo(model, out, tokenizer=tokenizer)
        summary = {
            "base": str(base_path),
            "out": str(out),
            **kv_summary(base.config, hcfg),
            **rope_summary(hcfg),
            "base_parameters": sum(p.numel() for p in base.parameters()),
            "hybrid_parameters": sum(p.numel() for p in model.parameters()),
            "seconds": round(time.time() - t0, 1),
        }
        print(json.dumps(summary, indent=2))
        return 0
    except UpcycleError as e:
        report_error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
