"""HyLoForCausalLM: a Llama-style decoder whose mixers are MLA or a linear block (GDN, Mamba-2).

Legend: B batch, T tokens, D hidden size, V vocabulary, N packed documents.

Design choices:
* Single-device model code. Parallelism (ZeRO-3), activation checkpointing policy and compile are applied
  from outside; `gradient_checkpointing_enable()` only wraps each decoder layer.
* Packed rows: B == 1 with `cu_seqlens [N+1]` (int32; the one rule: `kernels/varlen.py`). The boundaries
  become one `DocBounds` that every layer and kernel receives, so no layer reads them back, in the forward
  or in a checkpoint recompute. Given as host boundaries (a list of ints, or a CPU tensor for a model on
  another device) they are checked on the host and copied over; given as `DocBounds` (a checked row's
  `bounds()`, as the trainer and the teacher pass them) they are used as they are; given as a tensor on
  the model's device (an HF-style call) they are checked with one device-to-host copy. MLA attends within documents only,
  linear blocks reset state and conv windows at each boundary, positions restart per document.
* Generation is transformers' own `GenerationMixin.generate` (greedy, sampling, beam search, every
  logits processor, stopping criteria, streamers, `generation_config=`) over `HyLoCache` (latent + roped
  key per MLA layer, + a key 1/RMS per kv_b head with `mla_qk_norm`; fixed-size state per linear layer), a `transformers.Cache` subclass created by
  `_prepare_cache_for_generation` and sized once to prompt + new tokens, so full K/V are never rebuilt.
* Padded batches (`attention_mask` with zeros, e.g. a left-padded batch in `generate`): MLA masks the pad
  keys; linear layers run each padded row on its real tokens only, so pads never enter a recurrent
  state or a conv window and every row gives what it gives alone. Positions follow the mask.
* Every decoder layer returns its mixer output too, for layer-wise distillation (stage 1).
* This file is also copied (with the modules it imports) beside every saved checkpoint, so that
  `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works without this project
  installed (`hylo/remote_code.py`); importing it as `hylo.modeling` registers the auto classes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.utils import ModelOutput

from hylo.cache import HyLoCache, LinearLayerCache
from hylo.config import HybridConfig, check_config_files
from hylo.kernels.varlen import (
    DocBounds,
    doc_bounds,
    # imported from here by hylo.pipeline.placement
    positions_from_cu_seqlens,  # noqa: F401
)
from hylo.layers.gdn import GatedDeltaNet
from hylo.layers.mamba2 import Mamba2Mixer
from hylo.layers.mla import MLAttention
from hylo.layers.norm import RMSNorm
from hylo.seq_parallel import RowShard, shard_bounds


class HyLoMLP(nn.Module):
    """Llama's gated MLP, copied verbatim from the base model."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def build_mixer(config: HybridConfig, layer_idx: int) -> nn.Module:
    kind = config.layer_type(layer_idx)
    if kind == "mla":
        return MLAttention(config, layer_idx)
    if kind == "gdn":
        return GatedDeltaNet(config, layer_idx)
    if kind == "mamba2":
        return Mamba2Mixer(config, layer_idx)
    raise ValueError(f"unknown layer type {kind!r} for layer {layer_idx}")


def linear_layer_kinds(module: nn.Module) -> set[str]:
    """The kinds of linear mixer ("gdn", "mamba2") anywhere inside `module` (a model, or a stage's wrapper of
    one): what `kernels.backend.check_fla_backward` asks about before training."""
    kinds = {GatedDeltaNet: "gdn", Mamba2Mixer: "mamba2"}
    return {kind for m in module.modules() for cls, kind in kinds.items() if isinstance(m, cls)}


def linear_mixer_on_real_tokens(mixer: nn.Module, x_BTD: torch.Tensor, real_BT: torch.Tensor,
                                cache: LinearLayerCache | None) -> torch.Tensor:
    """Run a linear mixer (GDN / Mamba-2) on each row's real tokens only; zeros at pad positions.

    A padded token must not touch a recurrent state or a conv window, wherever it sits. Rows without
    pads run as one batch, every padded row alone on its real tokens (with its slice of the cache), and
    the rows' new states are put back together. A row without real tokens keeps its state; a row that
    never had one gets zeros (the same as no initial state).
    """
    B, T, _ = x_BTD.shape
    out_BTD: torch.Tensor | None = None
    full = [b for b in range(B) if bool(real_BT[b].all())]
    groups = ([full] if full else []) + [[b] for b in range(B) if b not in full]
    results: list[tuple[list[int], LinearLayerCache | None]] = []
    for rows in groups:
        idx_T = real_BT[rows[0]].nonzero().squeeze(-1)
        if idx_T.numel() == 0:
            results.append((rows, None))
            continue
        sub = None
        if cache is not None:
            sel = torch.tensor(rows, device=x_BTD.device)
            sub = LinearLayerCache(
                state=cache.state.index_select(0, sel.to(cache.state.device)) if cache.state is not None else None,
                conv={k: v.index_select(0, sel.to(v.device)) for k, v in cache.conv.items()}, seen=cache.seen)
        y = mixer(x_BTD[rows][:, idx_T], cache=sub)
        if out_BTD is None:
            out_BTD = y.new_zeros(B, T, y.shape[-1])
        out_BTD[torch.tensor(rows, device=y.device)[:, None], idx_T[None, :]] = y
        results.append((rows, sub))
    if out_BTD is None:
        raise ValueError(f"{type(mixer).__name__}: every row of the batch is padding")
    if cache is not None:
        done = [(rows, sub) for rows, sub in results if sub is not None and sub.state is not None]
        _, ref = done[0]
        state = cache.state.clone() if cache.state is not None else ref.state.new_zeros(B, *ref.state.shape[1:])
        conv = {k: (cache.conv[k].clone() if k in cache.conv else v.new_zeros(B, *v.shape[1:]))
                for k, v in ref.conv.items()}
        for rows, sub in done:
            sel = torch.tensor(rows, device=state.device)
            state[sel] = sub.state.to(state.dtype)
            for k in conv:
                conv[k][sel] = sub.conv[k].to(conv[k].dtype)
        cache.update(state, conv, T)
    return out_BTD


class HyLoDecoderLayer(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_type(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = build_mixer(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = HyLoMLP(config)

    def run_mixer(
        self,
        x_BTD: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | DocBounds | None = None,
        cache=None,
        keep_BS: torch.Tensor | None = None,
        shard: RowShard | None = None,
    ) -> torch.Tensor:
        """`keep_BS`: [B, cached + new] bool, True at real tokens; None when nothing is padded. `shard`: this
        rank's part of a split row (hylo/seq_parallel.py), None for a whole row."""
        if self.layer_type == "mla":
            if keep_BS is None:
                return self.mixer(x_BTD, position_ids=position_ids, cu_seqlens=cu_seqlens, cache=cache, shard=shard)
            return self.mixer(x_BTD, position_ids=position_ids, cache=cache, attention_mask=keep_BS)
        if keep_BS is None or bool(keep_BS[:, -x_BTD.shape[1]:].all()):
            return self.mixer(x_BTD, cu_seqlens=cu_seqlens, cache=cache, shard=shard)
        return linear_mixer_on_real_tokens(self.mixer, x_BTD, keep_BS[:, -x_BTD.shape[1]:], cache)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | DocBounds | None = None,
        cache=None,
        keep_BS: torch.Tensor | None = None,
        shard: RowShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixer_out = self.run_mixer(self.input_layernorm(hidden_BTD), position_ids, cu_seqlens, cache, keep_BS, shard)
        h = hidden_BTD + mixer_out
        out = h + self.mlp(self.post_attention_layernorm(h))
        return out, mixer_out


class HyLoPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HyLoDecoderLayer"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):  # type: ignore[override]
        """transformers' loader; a local directory whose config.json and hybrid_config.json disagree is refused
        (whichever way it is reached: AutoModel with or without remote code, or this class)."""
        if isinstance(pretrained_model_name_or_path, str | os.PathLike) and os.path.isdir(pretrained_model_name_or_path):
            check_config_files(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        reset = getattr(module, "reset_special_parameters", None)
        if callable(reset):
            reset()


class _CacheOutput(ModelOutput):
    """`past_key_values`, the name transformers' generation reads, is the output's `cache`."""

    @property
    def past_key_values(self) -> HyLoCache | None:
        return self.cache


@dataclass
class HyLoModelOutput(_CacheOutput):
    last_hidden_state: torch.Tensor | None = None
    cache: HyLoCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    mixer_outputs: tuple[torch.Tensor, ...] | None = None


@dataclass
class HyLoCausalLMOutput(_CacheOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: HyLoCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    mixer_outputs: tuple[torch.Tensor, ...] | None = None


class HyLoModel(HyLoPreTrainedModel):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([HyLoDecoderLayer(config, i) for i in range(config.n_layer)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | DocBounds | list[int] | None = None,
        past_key_values: HyLoCache | None = None,
        use_cache: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_mixer_outputs: bool = False,
        attention_mask: torch.Tensor | None = None,
        cache: HyLoCache | None = None,
        shard: RowShard | None = None,
        **kwargs,
    ) -> HyLoModelOutput:
        """`attention_mask`: [B, cached + new tokens], 1 at real tokens, 0 at pads (HF convention).
        `cu_seqlens`: a packed row's boundaries [N + 1] (B == 1): a tensor, host ints or `DocBounds`.
        `shard`: this rank's part of a split row (hylo/seq_parallel.py; None for a whole row): the tokens given
        are the shard's, `cu_seqlens` is None or their boundaries `shard.local`, and the layers exchange what
        crosses the split."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = h.shape[:2]
        if shard is not None:

            def wrong(message: str) -> NoReturn:
                raise ValueError(f"HyLoModel: {message}")

            cu_seqlens = shard_bounds(shard, b, t, cu_seqlens, past_key_values or cache, wrong)
        elif cu_seqlens is not None:
            if b != 1:
                raise ValueError(f"packed rows need batch size 1 with cu_seqlens, got batch {b}")
            # the one check of the boundaries for every layer of this forward (none for DocBounds; a host
            # copy only for a tensor on the device)
            cu_seqlens = doc_bounds(cu_seqlens, t, device=h.device)
        cache = past_key_values if past_key_values is not None else cache
        if cache is None and use_cache:
            cache = HyLoCache(self.config)
        if cache is not None and not hasattr(cache, "advance"):
            raise TypeError(f"HyLo generates with its own HyLoCache, got a {type(cache).__name__}; "
                            "let generate() create it (do not pass cache_implementation or a DynamicCache)")
        if cache is not None and cu_seqlens is not None:
            raise ValueError("the generation cache works on unpacked batches; drop cu_seqlens or the cache")
        past = cache.get_seq_length() if cache is not None else 0
        keep_BS = padding_mask(attention_mask, b, past + t, cu_seqlens)
        if position_ids is None:
            if cu_seqlens is not None:
                position_ids = cu_seqlens.positions.unsqueeze(0)
            elif keep_BS is not None:
                # positions count real tokens only: a left-padded prompt starts at 0 like the prompt alone
                position_ids = (keep_BS.long().cumsum(-1) - 1).clamp_min(0)[:, -t:]
            else:
                position_ids = torch.arange(past, past + t, device=h.device).unsqueeze(0).expand(b, t)
        hidden_states: list[torch.Tensor] = []
        mixer_outputs: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                hidden_states.append(h)
            layer_cache = cache[i] if cache is not None else None
            if self.gradient_checkpointing and self.training and layer_cache is None:
                h, mixer_out = checkpoint(layer, h, position_ids, cu_seqlens, None, keep_BS, shard,
                                           use_reentrant=False)
            else:
                h, mixer_out = layer(h, position_ids, cu_seqlens, layer_cache, keep_BS, shard)
            if output_mixer_outputs:
                mixer_outputs.append(mixer_out)
        h = self.norm(h)
        if output_hidden_states:
            hidden_states.append(h)
        if cache is not None:
            cache.advance(t)
        return HyLoModelOutput(
            last_hidden_state=h,
            cache=cache,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            mixer_outputs=tuple(mixer_outputs) if output_mixer_outputs else None,
        )


def padding_mask(attention_mask: torch.Tensor | None, b: int, s: int,
                 cu_seqlens: DocBounds | None) -> torch.Tensor | None:
    """The [B, S] bool mask of real tokens when `attention_mask` has pads; None when it has none."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (b, s):
        raise ValueError(f"attention_mask must be 2-D [batch, cached + new tokens] = [{b}, {s}], "
                         f"got shape {tuple(attention_mask.shape)}")
    keep_BS = attention_mask.to(torch.bool)
    if bool(keep_BS.all()):
        return None
    if cu_seqlens is not None:
        raise ValueError("a padded attention_mask cannot be combined with cu_seqlens (packed rows have no pads)")
    return keep_BS


class HyLoForCausalLM(HyLoPreTrainedModel, GenerationMixin):
    """A HyLo hybrid causal LM: Llama-style decoder layers whose mixer is MLA or a linear block (GDN, Mamba-2).

    `config` (a `HybridConfig`) says which layers are MLA (`mla_layers`) and the shapes of both mixers. The MLPs,
    norms, embeddings and LM head are a Llama's. It is a transformers `PreTrainedModel`: `from_pretrained`,
    `save_pretrained`, `generate` and `AutoModelForCausalLM` work as for any causal LM. A checkpoint saved by
    this project carries this code, so it also loads where the project is not installed
    (`trust_remote_code=True`). `hylo.io.load_hylo` loads one with the project's checks, and imports AMD's
    released layout too.

    ```python
    from hylo.io import load_hylo

    model = load_hylo("runs/demo/stage2/model")
    out = model.generate(input_ids, max_new_tokens=32)
    ```
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig) -> None:
        super().__init__(config)
        self.model = HyLoModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:  # noqa: D401
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | DocBounds | list[int] | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: HyLoCache | None = None,
        use_cache: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_mixer_outputs: bool = False,
        logits_to_keep: int = 0,
        return_logits: bool = True,
        cache: HyLoCache | None = None,
        attention_mask: torch.Tensor | None = None,
        shard: RowShard | None = None,
        **kwargs,
    ) -> HyLoCausalLMOutput:
        """Logits (and the loss, given `labels`) of a batch, a packed row or one decoding step.

        * A batch: `input_ids` `[B, T]`, with `attention_mask` `[B, cached + new tokens]` (1 at real tokens, 0 at
          pads) when padded.
        * A packed row: `input_ids` `[1, T]` with `cu_seqlens`, the `N + 1` document boundaries (a tensor, host
          ints or `DocBounds`). Attention stays within each document; linear layers reset their state at each
          boundary; positions restart at 0.
        * One rank's part of a row split by sequence parallelism: `shard` (hylo/seq_parallel.py), with the
          shard's tokens.
        * Decoding: `past_key_values` (or `cache`), a `HyLoCache` (`new_cache`). `generate` makes one itself.

        `labels` are aligned with `input_ids` (shifted inside; -100 is ignored): the loss is their mean
        cross-entropy in fp32. `logits_to_keep` = k > 0 computes the last k positions' logits only;
        `return_logits=False` none (the fused losses take the hidden states instead). `output_hidden_states`
        returns each layer's input and the final normed state; `output_mixer_outputs` each layer's mixer
        output (stage 1's layer-wise distillation).
        """
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            shard=shard,
            past_key_values=past_key_values if past_key_values is not None else cache,
            use_cache=use_cache,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_mixer_outputs=output_mixer_outputs,
            attention_mask=attention_mask,
        )
        h = out.last_hidden_state
        logits = None
        if return_logits or labels is not None:
            h_keep = h[:, -logits_to_keep:] if logits_to_keep else h
            logits = self.lm_head(h_keep)
        loss = None
        if labels is not None:
            # labels are aligned with input_ids (HF convention); shift inside
            shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
            loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        return HyLoCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=out.cache,
            hidden_states=out.hidden_states,
            mixer_outputs=out.mixer_outputs,
        )

    # ------------------------------------------------------------------ generation
    def new_cache(self, max_length: int | None = None) -> HyLoCache:
        """An empty hybrid cache; `max_length` (prompt + new tokens) lets MLA layers allocate once."""
        return HyLoCache(self.config, max_length=max_length)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """transformers' hook: put a `HyLoCache` (sized to the longest sequence) where it would put a DynamicCache."""
        key = "cache" if "cache" in model_kwargs or "past_key_values" not in model_kwargs else "past_key_values"
        given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if given is not None:
            if not isinstance(given, HyLoCache):
                raise TypeError(f"HyLo generates with its own HyLoCache, got a {type(given).__name__}")
            given._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        impl = generation_config.cache_implementation
        if impl not in (None, "dynamic", "hybrid"):
            raise ValueError(f"cache_implementation={impl!r} is not supported: HyLo generates with its own hybrid "
                             "cache (MLA latents + linear states); leave cache_implementation unset")
        if getattr(generation_config, "is_assistant", False) or kwargs.get("assistant_model") is not None:
            raise NotImplementedError("assisted decoding needs a cache that can be rolled back; HyLo's cannot")
        max_cache_length = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
        if not isinstance(max_cache_length, int):
            max_cache_length = generation_config.max_length - 1 if generation_config.max_length else None
        model_kwargs[key] = self.new_cache(max_length=max_cache_length)

    @torch.no_grad()
    def generate(self, *args, return_cache: bool = False, **kwargs):
        """transformers' `GenerationMixin.generate` (every option: beams, logits processors, stopping
        criteria, streamers, `generation_config=`); `return_cache=True` also returns the cache used,
        as `(sequences, cache)`."""
        if not return_cache:
            return super().generate(*args, **kwargs)
        out = super().generate(*args, return_dict_in_generate=True, **kwargs)
        cache = getattr(out, "cache", None)
        if cache is None:
            cache = getattr(out, "past_key_values", None)
        return out.sequences, cache

    # ------------------------------------------------------------------ io
    def save_pretrained(self, save_directory, *args, **kwargs):  # type: ignore[override]
        """transformers' save, plus hybrid_config.json (a copy of config.json's architecture) and, where the
        project is installed, the model code beside the weights with config.json's auto_map pointing at it."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        self.config.save_hybrid_config(save_directory)
        try:
            from hylo.remote_code import write_remote_code  # optional: not in a trust_remote_code copy
        except ImportError:
            # a copy loaded through trust_remote_code: transformers already copied its own files
            return result
        write_remote_code(save_directory)
        return result


def register_auto_classes() -> None:
    """Make `AutoConfig` / `AutoModelForCausalLM` understand model_type 'hylo'."""
    try:
        AutoConfig.register("hylo", HybridConfig)
        AutoModelForCausalLM.register(HybridConfig, HyLoForCausalLM)
    except ValueError:
        # already registered
        pass


# Only the project's own module registers; the copy saved beside a checkpoint is loaded through auto_map.
if __name__ == "hylo.modeling":
    register_auto_classes()
