"""The whole-model conversion: `upcycle` (a loaded base model -> HyLo) and `convert` (a base directory or
asset -> HyLo, with the options of a ConvertConfig).

Design choices:
* `convert` is the one conversion of the project: jobs/convert.py, the training driver (stage 1 with
  `model.convert`) and placement all go through it, so the same options and seed give the same weights.
  It calibrates unless `calibrate` is false (see calibrate.py).
* Mixers come from the attention weights (mla.py, gdn.py, mamba2.py); the MLP, norms, embeddings and LM
  head are copied.
* What conversion does not set (decay / step / beta / gate rows of the linear blocks, or every mixer
  weight with init="random") is drawn from a generator seeded by (seed, layer): the result is
  reproducible, and layer i starts the same whatever type the other layers have, so two placements differ
  only where their layer types differ.
* A base with NaN/inf weights is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from hylo.assets import resolve_path_or_asset
from hylo.io import save_hylo
from hylo.modeling import HyLoForCausalLM
from hylo.upcycle.base import check_base_weights, load_base_model
from hylo.upcycle.calibrate import (
    calibrate_linear,
    calibrate_mla_norms,
    check_calibration_ids,
    default_calibration_ids,
)
from hylo.upcycle.config import INITS, ConvertConfig, UpcycleError
from hylo.upcycle.gdn import gdn_weights_from_attention, identity_convs_
from hylo.upcycle.mamba2 import mamba2_weights_from_attention
from hylo.upcycle.mla import mla_weights_from_attention
from hylo.upcycle.options import (
    check_base_type,
    hybrid_config_from_base,
    make_options,
)
from hylo.weight_files import check_weights_dir


def _mixer_weights(attn: nn.Module, dst: nn.Module, hcfg: Any) -> dict[str, torch.Tensor]:
    """The converted weights of one decoder layer's mixer (identity convs are set on `dst` directly)."""
    if dst.layer_type == "mla":
        return mla_weights_from_attention(attn, hcfg)
    if dst.layer_type == "gdn":
        identity_convs_(dst.mixer)
        return gdn_weights_from_attention(attn, hcfg, o_fill=dst.mixer.o_proj.weight)
    return mamba2_weights_from_attention(attn, hcfg)


@torch.no_grad()
def upcycle(
    base_model,
    hcfg: Any = None,
    *,
    init: str = "attention",
    calibration_ids: torch.Tensor | None = None,
    progress: bool = False,
    seed: int = 0,
    step: Callable[[str], None] | None = None,
    **config_kwargs: Any,
):
    """Convert a loaded base `LlamaForCausalLM`/`Qwen3ForCausalLM` into a `HyLoForCausalLM` (in memory).

    `init="attention"` (default) initialises mixers from the attention weights; `init="random"` keeps
    the mixers' random init (the ablation used by bench/upcycle_quality.py). `seed` fixes what conversion
    does not set (per layer), so a conversion is reproducible. Extra keyword arguments (the shape options
    of ConvertConfig) go to `hybrid_config_from_base` when `hcfg` is None. Calibration runs on
    `calibration_ids` only: this is the step under `convert`, which supplies them by default.
    `step(what)` (`convert`'s progress bar) is called as each part starts: building, each layer,
    calibrating; without it, `progress` shows a bar of the layers.
    """
    inits = INITS
    if init not in inits:
        raise UpcycleError(f"init={init!r}; allowed: {', '.join(inits)}")
    base_cfg = base_model.config
    check_base_type(getattr(base_cfg, "model_type", None))
    check_base_weights(base_model)
    if hcfg is None:
        valid = list(ConvertConfig().hybrid_options())
        unknown = sorted(set(config_kwargs) - set(valid))
        if unknown:
            raise UpcycleError(f"unknown conversion option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
        hcfg = hybrid_config_from_base(base_cfg, **config_kwargs)
    dtype = next(base_model.parameters()).dtype
    layers = range(hcfg.n_layer)
    if progress and step is None:
        layers = tqdm(layers, desc="upcycling layers", unit="layer")
    step = step or (lambda what: None)
    step("building the hybrid")
    model = HyLoForCausalLM(hcfg).to(dtype)
    base = base_model.model
    tgt = model.model
    tgt.embed_tokens.weight.copy_(base.embed_tokens.weight)
    tgt.norm.weight.copy_(base.norm.weight)
    if not hcfg.tie_word_embeddings:
        model.lm_head.weight.copy_(base_model.lm_head.weight)
    for i in layers:
        step(f"layer {i} ({hcfg.layer_type(i)})")
        src, dst = base.layers[i], tgt.layers[i]
        dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        dst.mlp.load_state_dict(src.mlp.state_dict())
        # what conversion does not set comes from a generator seeded by (seed, layer) (module docstring)
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(seed * 100_003 + i)
        try:
            dst.mixer.apply(model._init_weights)
            if init == "random":
                continue
            weights = _mixer_weights(src.self_attn, dst, hcfg)
        finally:
            torch.random.set_rng_state(rng_state)
        params = dict(dst.mixer.named_parameters())
        for name, w in weights.items():
            if name not in params:
                raise UpcycleError(f"layer {i}: converter produced {name!r} which the {dst.layer_type} mixer lacks")
            if params[name].shape != w.shape:
                raise UpcycleError(f"layer {i}: {name} shape {tuple(w.shape)} != mixer's {tuple(params[name].shape)}")
            params[name].copy_(w.to(params[name].dtype))
    if init == "attention" and calibration_ids is not None:
        check_calibration_ids(calibration_ids, "calibration_ids")
        step(f"calibrating on {calibration_ids.numel()} tokens")
        if hcfg.mla_layers:
            calibrate_mla_norms(base_model, model, calibration_ids)
        calibrate_linear(base_model, model, calibration_ids)
    if hcfg.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = base_model.generation_config
    return model



class _Steps:
    """`convert`'s progress: a tqdm bar of the conversion's steps; calling it starts the next step (the one
    before counts as done) and names it beside the bar."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.started = bar, False

    def __call__(self, what: str) -> None:
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_postfix_str(what, refresh=True)

    def finish(self) -> None:
        self.bar.update(max(0, (self.bar.total or 0) - self.bar.n))


@dataclass
class Conversion:
    """A converted model, with the base it was converted from and the options used."""

    model: nn.Module
    base_model: nn.Module
    base_dir: Path
    options: ConvertConfig

    def save(self, out_dir: str | Path) -> Path:
        """Write the HyLo checkpoint atomically, with the base's tokenizer files."""
        return save_hylo(self.model, out_dir, tokenizer_from=self.base_dir)


def convert(base: str | Path, options: ConvertConfig | None = None, *, calibration_ids: torch.Tensor | None = None,
            progress: bool = False, **overrides: Any) -> Conversion:
    """Convert base model `base` (a directory, `asset:NAME` or an asset name: `hylo.assets.resolve_path_or_asset`)
    with `options` (default: all defaults) and `overrides` of its fields.

    Calibration runs unless `calibrate` is false: on `calibration_ids` when given, else on the built-in text
    tokenised with the base's tokenizer (a base without one is an UpcycleError saying how to skip it).
    """
    opts = make_options(options, **overrides)
    if calibration_ids is not None and not opts.calibrate:
        raise UpcycleError("calibration_ids were given with calibrate=False; give one or the other")
    base_dir = resolve_path_or_asset(base, "base model", directory=True)
    check_weights_dir(base_dir)
    # one bar for the whole conversion: load, build, each layer, calibrate (the total is known once the
    # base's config is read)
    with tqdm(total=None, desc=f"converting {base_dir.name}", unit="step", disable=not progress) as bar:
        steps = _Steps(bar)
        steps("loading the base model")
        base_model = load_base_model(base_dir, dtype=getattr(torch, opts.dtype))
        hcfg = hybrid_config_from_base(base_model.config, opts)
        calibrate = opts.calibrate and opts.init == "attention"
        bar.total = 2 + hcfg.n_layer + int(calibrate)
        if calibrate and calibration_ids is None:
            calibration_ids = default_calibration_ids(base_dir)
        model = upcycle(base_model, hcfg, init=opts.init, calibration_ids=calibration_ids, progress=progress,
                        seed=opts.seed, step=steps if progress else None)
        steps.finish()
    return Conversion(model, base_model, base_dir, opts)
