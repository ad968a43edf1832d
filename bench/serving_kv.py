"""KV bytes per token of the recipes and the demo's model, native and as vLLM serves them (MLA widened exactly to a
width its kernels take: hylo/serving/widen.py), against the base model's GQA cache.

    python bench/serving_kv.py          # prints a Markdown table (docs/serving.md#kv-bytes)

Computed from the configs alone (no model is built): stage 1's conversion of each recipe's base, bf16.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.config import base_kv_values_per_token
from hylo.pipeline.estimate.shapes import model_config
from hylo.pipeline.train.config import load_stage_config
from hylo.serving.widen import ServingShapeError, check_servable, served_bytes_per_token, served_mla
from hylo.serving.widths import CPU_WIDTHS, GPU_WIDTHS
from hylo.upcycle.options import hybrid_config_from_base

CONFIGS = ("llama-3.2-1b-8mla8gdn-64k.yaml", "llama-3.2-3b-14mla14gdn-64k.yaml", "qwen3-1.7b-7mla21gdn-64k.yaml",
           "demo-smollm2.yaml")


def rows() -> list[list[str]]:
    out = []
    for name in CONFIGS:
        s1 = load_stage_config(1, name)
        base = model_config(s1.model.base, "model.base")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hcfg = hybrid_config_from_base(base, s1.model.convert)
        base_bytes = base_kv_values_per_token(base) * 2
        native = hcfg.kv_cache_values_per_token() * 2
        try:
            check_servable(hcfg)
        except ServingShapeError as e:
            out.append([name, f"{base_bytes:,}", f"{native:,} ({native / base_bytes:.1%})", "not served", "not served",
                        str(e).split(":")[0] + ": refused (docs/serving.md#limits)"])
            continue
        gpu, cpu = served_mla(hcfg, GPU_WIDTHS), served_mla(hcfg, CPU_WIDTHS)
        _, on_gpu = served_bytes_per_token(hcfg, gpu)
        _, on_cpu = served_bytes_per_token(hcfg, cpu)
        out.append([name, f"{base_bytes:,}", f"{native:,} ({native / base_bytes:.1%})",
                    f"{on_gpu:,} ({on_gpu / base_bytes:.1%})", f"{on_cpu:,} ({on_cpu / base_bytes:.1%})",
                    f"{len(hcfg.mla_layers)} MLA layers of {hcfg.kv_lora_rank} + {hcfg.qk_rope_head_dim}: GPU "
                    f"{gpu.served_rank} + {gpu.served_rope}, CPU {cpu.served_rank} + {cpu.served_rope}"])
    return out


def main() -> int:
    head = ["config", "base K+V B/token", "HyLo native", "served on a GPU", "served on a CPU", "MLA latent + rope"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows():
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
