"""How much of the base model survives conversion, before any training.

Prints next-token KL(base || converted), averaged over the tokens of real ShareGPT conversations rendered
with SmolLM2-135M-Instruct's chat template, for: our initialisation (MLA on even layers, GDN elsewhere),
the same architecture with randomly initialised mixers, several kv_lora_rank settings, and the MLA-only /
GDN-only extremes.

    python bench/upcycle_quality.py [--n-conv 64] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.assets import fetch_asset  # noqa: E402
from hylo.pipeline.data.readers import SourceSpec, iter_records  # noqa: E402
from hylo.upcycle import calibration_ids_for, kv_summary, load_base_model, upcycle  # noqa: E402


def sharegpt_samples(tokenizer, n: int, max_tokens: int) -> list[torch.Tensor]:
    """First `n` well-formed ShareGPT conversations, rendered with the chat template and truncated."""
    out = []
    spec = SourceSpec(name="sharegpt", path=str(fetch_asset("sharegpt")))
    for item in iter_records(spec, on_reject=lambda r: None):
        text = tokenizer.apply_chat_template(item["messages"], tokenize=False)
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
        if ids.shape[1] >= 16:
            out.append(ids)
        if len(out) == n:
            break
    return out


@torch.no_grad()
def mean_kl(base_logps: list[torch.Tensor], model, samples: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for ref, ids in zip(base_logps, samples):
        lp = torch.log_softmax(model(ids).logits.float(), -1)
        total += float((ref.exp() * (ref - lp)).sum(-1).sum())
        count += ids.shape[1]
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--n-conv", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    ap.add_argument("--only", type=str, default=None,
                    help="comma list of texts: run only the variants whose name contains one (plus the first two rows)")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = fetch_asset("smollm2-135m-instruct")
    base = load_base_model(path).eval()

    tok = AutoTokenizer.from_pretrained(path)
    samples = sharegpt_samples(tok, args.n_conv, args.max_tokens)
    n_tokens = sum(s.shape[1] for s in samples)
    print(f"# {len(samples)} ShareGPT conversations, {n_tokens} tokens, SmolLM2-135M-Instruct, fp32")
    with torch.no_grad():
        base_logps = [torch.log_softmax(base(s).logits.float(), -1) for s in samples]
    calib = calibration_ids_for(tok)
    variants = [
        ("ours: even MLA, r_kv=256", dict(mla_layers="even", kv_lora_rank=256), "attention"),
        ("random mixers: even MLA, r_kv=256", dict(mla_layers="even", kv_lora_rank=256), "random"),
        ("ours: even MLA, r_kv=64", dict(mla_layers="even", kv_lora_rank=64), "attention"),
        ("ours: even MLA, r_kv=128", dict(mla_layers="even", kv_lora_rank=128), "attention"),
        ("ours: even MLA, r_kv=336 (full)", dict(mla_layers="even", kv_lora_rank=336), "attention"),
        ("ours: even MLA, one shared rope key", dict(mla_layers="even", kv_lora_rank=256, qk_rope_head_dim=32,
                                                     rope_key_groups=1), "attention"),
        ("ours: all MLA, r_kv=336 (full)", dict(mla_layers="all", kv_lora_rank=336), "attention"),
        ("ours: all GDN", dict(mla_layers="none"), "attention"),
        # fewer GDN heads than query heads, wider heads (the released 3B: 9 GDN heads x 256 for 24 query
        # heads of 128): each GDN head stands for a group of query heads (hylo.upcycle.gdn_head_groups)
        ("ours: all GDN, 3 GDN heads x 128 (v 256)", dict(mla_layers="none", gdn_num_heads=3, gdn_head_dim=128,
                                                          gdn_expand_v=2.0), "attention"),
        ("ours: even MLA, 3 GDN heads x 128 (v 256)", dict(mla_layers="even", kv_lora_rank=256, gdn_num_heads=3,
                                                           gdn_head_dim=128, gdn_expand_v=2.0), "attention"),
        ("ours: all GDN, 3 GDN heads x 64", dict(mla_layers="none", gdn_num_heads=3), "attention"),
        ("random mixers: all GDN", dict(mla_layers="none"), "random"),
        ("ours: even MLA, GDN gates not calibrated", dict(mla_layers="even", kv_lora_rank=256), "uncalibrated"),
        ("ours: even MLA, Mamba-2", dict(mla_layers="even", kv_lora_rank=256, linear_type="mamba2"), "attention"),
        ("ours: even MLA, Mamba-2 not calibrated", dict(mla_layers="even", kv_lora_rank=256, linear_type="mamba2"),
         "uncalibrated"),
        ("random mixers: even MLA, Mamba-2", dict(mla_layers="even", kv_lora_rank=256, linear_type="mamba2"),
         "random"),
    ]
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        variants = variants[:2] + [v for v in variants[2:] if any(k in v[0] for k in keys)]
    rows = []
    for name, kw, init in variants:
        t0 = time.time()
        # "uncalibrated": attention init without calibration tokens (linear gates keep their random init)
        model = upcycle(base, init="random" if init == "random" else "attention",
                        calibration_ids=calib if init == "attention" else None, **kw).eval()
        kl = mean_kl(base_logps, model, samples)
        ratio = kv_summary(base.config, model.config)["kv_cache_ratio"]
        rows.append({"variant": name, "kl": kl, "kv_cache_ratio": ratio, "seconds": time.time() - t0})
        print(f"{name:40s} KL(base||conv) = {kl:8.4f} nats/token   kv_cache_ratio = {ratio:6.3f}", flush=True)
        del model
    ours = rows[0]["kl"]
    rand = rows[1]["kl"]
    print(f"\nrandom-init / ours KL ratio: {rand / ours:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
