"""Calibration: a short built-in text through the base model sets what the weights alone cannot.

Design choices:
* GDN / Mamba-2 gates: a random output gate multiplies every channel by noise and erases what the copied
  projections carry. On the calibration tokens the gate is made ~constant and the output norm takes the
  attention heads' RMS (`calibrate_linear`). Measured on SmolLM2 (bench/upcycle_quality.py): this turns
  the linear layers from worse than random into a real approximation of the attention they replace.
* MLA latent norms (only with `mla_latent_norm: true`): their weight becomes the latents' mean RMS.
* The text (English prose + code + chat, `CALIBRATION_TEXT`) is tokenised with the base's tokenizer, so a
  conversion needs no dataset. `convert` always calibrates unless told not to (`calibrate: false`): a base
  without a tokenizer is an error, never a silent skip.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from hylo.upcycle.attention import fit_rows
from hylo.upcycle.gdn import gdn_head_groups
from hylo.upcycle.options import UpcycleError

# A short, fixed calibration text (English prose + code + chat), so conversion needs no dataset.
CALIBRATION_TEXT = (
    "<|im_start|>user\nCan you explain how a hash map works and give a short Python example?<|im_end|>\n"
    "<|im_start|>assistant\nA hash map stores key-value pairs in an array of buckets. A hash function turns "
    "each key into an index; collisions are resolved by chaining or open addressing. Lookups, inserts and "
    "deletes take constant time on average.\n\n```python\nphone_book = {}\nphone_book['alice'] = '555-1234'\n"
    "print(phone_book.get('alice'))\n```\nThe history of the city dates back to the Roman period, when a small "
    "settlement grew along the river. By the twelfth century it had become an important market town, and its "
    "cathedral, finished in 1320, still dominates the skyline.<|im_end|>\n"
)


def calibration_ids_for(tokenizer, where: str = "the base's tokenizer") -> torch.Tensor:
    """`CALIBRATION_TEXT` as token ids [1, <= 512]; a tokenizer that gives no token for it is an UpcycleError
    (a forward on 0 tokens fails deep in the base model, and there would be nothing to fit)."""
    ids = tokenizer(CALIBRATION_TEXT, return_tensors="pt").input_ids
    check_calibration_ids(ids, f"{where} ({type(tokenizer).__name__})")
    return ids[:, :512]


def check_calibration_ids(ids: torch.Tensor, where: str) -> None:
    """Refuse calibration ids with no token in them, saying how to get some or skip the pass."""
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise UpcycleError(
            f"{where}: the calibration text gives {ids.shape[-1] if ids.dim() else 0} tokens (ids of shape "
            f"{tuple(ids.shape)}), nothing to calibrate on; the pass tokenises a built-in English + code + chat text "
            f"({len(CALIBRATION_TEXT)} characters) with the base's tokenizer: check its tokenizer files, give "
            "calibration_ids [1, T] with T >= 1, or convert without calibration (--no-calibrate, or calibrate: false)")


def default_calibration_ids(base_dir: str | Path) -> torch.Tensor:
    """`CALIBRATION_TEXT` tokenised with the tokenizer of base model directory `base_dir`."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
    except Exception as e:  # transformers raises many kinds for a missing or broken tokenizer
        raise UpcycleError(
            f"{base_dir}: no tokenizer could be loaded ({type(e).__name__}: {e}); calibration tokenises a built-in "
            "text with the base's tokenizer: add its tokenizer files, or convert without calibration "
            "(--no-calibrate, or calibrate: false)") from e
    return calibration_ids_for(tokenizer, f"{base_dir}: its tokenizer")


@torch.no_grad()
def calibrate_mla_norms(base_model, model, calibration_ids: torch.Tensor) -> None:
    """Set MLA latent-norm weights to the mean RMS of the latents on calibration tokens."""
    if not getattr(model.config, "mla_latent_norm", True):
        return
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    base_layers = base_model.model.layers
    for i in model.config.mla_layers:
        def hook(mod, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            captured[i] = x.detach()

        hooks.append(base_layers[i].self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        base_model(input_ids=calibration_ids)
    finally:
        for hk in hooks:
            hk.remove()
    for i, x in captured.items():
        mixer = model.model.layers[i].mixer
        x = x.to(mixer.kv_a_proj_with_mqa.weight.dtype)
        r = model.config.kv_lora_rank
        c_kv = mixer.kv_a_proj_with_mqa(x)[..., :r]
        rms = c_kv.float().pow(2).mean(-1).sqrt().mean()
        mixer.kv_a_layernorm.weight.fill_(float(rms))
        if model.config.q_lora_rank is not None:
            c_q = mixer.q_a_proj(x)
            mixer.q_a_layernorm.weight.fill_(float(c_q.float().pow(2).mean(-1).sqrt().mean()))



@torch.no_grad()
def calibrate_linear(base_model, model, calibration_ids: torch.Tensor, ridge: float = 1e-2,
                      gate_level: float = 1.2785) -> None:
    """Make each upcycled linear layer's output gate ~constant and its output scale the attention's.

    GDN's output is `o_proj(RMSNorm(o) * w * swish(g_proj x))`, Mamba-2's `out_proj(RMSNorm_G(y * SiLU(z)) * w)`
    with z from rows of `in_proj`. A random gate multiplies every channel by noise and erases what the
    copied projections carry. The gate has no bias, so we fit one direction u with u.x ~= 1 on calibration
    inputs (ridge regression) and set every gate row to `gate_level * u` (swish(1.2785) ~= 1); the norm
    weight becomes the attention heads' per-channel RMS (GDN: averaged over heads, as `o_norm` is shared;
    Mamba-2: the RMS of the base head each Mamba head stands for).
    Measured on SmolLM2 (bench/upcycle_quality.py): this turns the linear layers from worse than random
    into a real approximation of the attention they replace.
    """
    cfg = model.config
    lin = [i for i in range(cfg.n_layer) if cfg.layer_type(i) in ("gdn", "mamba2")]
    if not lin:
        return
    cap: dict[tuple[str, int], torch.Tensor] = {}
    hooks = []
    for i in lin:
        attn = base_model.model.layers[i].self_attn

        def pre(mod, args, kwargs, i=i):
            cap[("x", i)] = (args[0] if args else kwargs["hidden_states"]).detach()

        def pre_o(mod, args, i=i):
            cap[("o", i)] = args[0].detach()

        hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(attn.o_proj.register_forward_pre_hook(pre_o))
    try:
        base_model(input_ids=calibration_ids)
    finally:
        for hk in hooks:
            hk.remove()
    h, dh = cfg.num_attention_heads, cfg.base_head_dim or cfg.head_dim
    for i in lin:
        x = cap[("x", i)].reshape(-1, cap[("x", i)].shape[-1]).double()
        o = cap[("o", i)].reshape(-1, h, dh).double()
        mixer = model.model.layers[i].mixer
        d = x.shape[-1]
        gram = x.T @ x + ridge * x.shape[0] * torch.eye(d, dtype=x.dtype)
        u = torch.linalg.solve(gram, x.T @ torch.ones(x.shape[0], dtype=x.dtype))
        rms_HK = o.pow(2).mean(0).sqrt()  # [h, dh] per head and channel
        if cfg.layer_type(i) == "gdn":
            hg, vd = cfg.gdn_num_heads, cfg.gdn_value_dim
            mixer.g_proj.weight.copy_((gate_level * u).expand(hg * vd, d))
            rms = rms_HK.mean(0)  # o_norm is shared by the heads
            slots = max(len(grp) for grp in gdn_head_groups(h, hg))
            if vd < dh or slots * dh > vd:
                # value channels projected or truncated: no channel is one of the base head's
                w = rms.new_full((vd,), float(rms.mean())) if vd >= dh else fit_rows(rms[:, None], vd)[:, 0]
            else:
                # one slot of dh channels per base head (gdn_weights_from_attention's layout)
                w = rms.repeat(-(-vd // dh))[:vd]
            mixer.o_norm.weight.copy_(w)
        else:
            H, P = mixer.num_heads, mixer.head_dim
            mixer.in_proj.weight[: H * P].copy_((gate_level * u).expand(H * P, d))  # the z rows
            rows = []
            for m in range(H):  # Mamba head m stands for query head m mod h (mamba2_weights_from_attention)
                r = rms_HK[m % h]
                rows.append(r[:P] if P <= dh else torch.cat([r, r.new_full((P - dh,), float(r.mean()))]))
            mixer.norm.weight.copy_(torch.cat(rows))
