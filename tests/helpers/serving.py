"""Tiny HyLo checkpoints for the serving tests (tests/serving/): random weights at shapes vLLM's CPU kernels take
(GDN key and value heads of 64 or 128, bf16), each with one of the features a served model must carry; and the
interpreter of the serving environment the tests run vLLM in (`serve_python`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from hylo.config import HybridConfig

REPO = Path(__file__).resolve().parents[2]
# `make serve-install` makes it; `make test SERVE_PYTHON=...` passes another one on as HYLO_SERVE_PYTHON
SERVE_VENV_PYTHON = REPO / ".venv-serve" / "bin" / "python"


def serve_python() -> Path:
    """The Python of the serving environment (vLLM and this package's plugin): $HYLO_SERVE_PYTHON (a path or a
    command on PATH) when set, else the checkout's .venv-serve. Raises FileNotFoundError naming `make
    serve-install` when there is none: vLLM cannot share the test environment (cluster/serve_lock.py), and a
    serving test without it fails, never skips."""
    named = os.environ.get("HYLO_SERVE_PYTHON")
    if named:
        found = shutil.which(named)
        if found is None:
            raise FileNotFoundError(f"HYLO_SERVE_PYTHON={named} is not an executable; unset it to use "
                                    f"{SERVE_VENV_PYTHON} (`make serve-install`), or name vLLM's Python")
        return Path(found)
    if not os.access(SERVE_VENV_PYTHON, os.X_OK):
        raise FileNotFoundError(f"no serving environment: {SERVE_VENV_PYTHON} is missing; run `make serve-install` "
                                f"(vLLM and the hylo plugin), or set HYLO_SERVE_PYTHON to a Python that has them")
    return SERVE_VENV_PYTHON


# the CPU GDN kernels of vLLM take bf16 and head dims of 64 or 128 (vllm/model_executor/layers/mamba/ops/cpu)
GDN_HEAD = 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "mscale": 1.0,
        "mscale_all_dim": 1.0}
BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, n_layer=4, mla_layers=[0, 2],
            num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=32, gdn_num_heads=2, gdn_head_dim=GDN_HEAD, gdn_expand_v=1.0, tie_word_embeddings=False,
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=None)

# name -> (config keys over BASE, written in AMD's released layout)
EXPORTS: dict[str, tuple[dict, bool]] = {
    # MLA (whole queries, latent norm, the rope dims in two blocks as the converter writes them for GQA) + GDN,
    # untied head
    "mla-gdn": (dict(rope_key_groups=2), False),
    # q_lora, YaRN with mscale_all_dim (the softmax scale moves), a tied head
    "qlora-yarn-tied": (dict(q_lora_rank=32, rope_parameters=YARN, tie_word_embeddings=True),
                        False),
    # MLA + Mamba-2 (mamba_ssm's layer: x per head, B and C per head)
    "mla-mamba2": (dict(linear_type="mamba2", mamba2_head_dim=32, mamba2_state_size=32), False),
    # AMD's released layout: q_lora, no latent norms, kv_b_proj per KV head, interleaved RoPE on disk, GDN
    "amd-gdn": (dict(q_lora_rank=32, mla_latent_norm=False, kv_b_per_kv_head=True), True),
    # AMD's Mamba-2 (Zebra-Llama): x and B for the KV groups (d_xb), repeated to the heads
    "amd-mamba2": (dict(q_lora_rank=32, mla_latent_norm=False, kv_b_per_kv_head=True, linear_type="mamba2",
                        mamba2_head_dim=32, mamba2_state_size=32, mamba2_xb_groups=2, mamba2_norm_eps=1e-5), True),
}


def tiny_serving_model(name: str, seed: int = 0):
    """The random HyLoForCausalLM of export `name` (bf16), its norms and gates perturbed so no weight is at its
    default."""
    from hylo.modeling import HyLoForCausalLM

    keys, _ = EXPORTS[name]
    torch.manual_seed(seed)
    model = HyLoForCausalLM(HybridConfig(**{**BASE, **keys}))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith((".D", ".dt_bias")):
                p.add_(torch.randn_like(p) * 0.1)
            if pname.endswith("conv1d.bias"):
                p.normal_(0, 0.1)
    return model.to(torch.bfloat16).eval()


def write_serving_export(name: str, out: Path) -> Path:
    from hylo.io import save_hylo
    from hylo.released.export import export_released

    model = tiny_serving_model(name)
    _, released = EXPORTS[name]
    return export_released(model, out) if released else save_hylo(model, out)
