"""HyLoForCausalLM: a Llama-style decoder whose mixers are MLA or a linear block (GDN, Mamba-2).

Legend: B batch, T tokens, D hidden size, V vocabulary, N packed documents.

Design choices:
* Single-device model code. Parallelism (ZeRO-3), activation checkpointing policy and compile are applied
  from outside; `gradient_checkpointing_enable()` only wraps each decoder layer.
* Packed rows: B == 1 with `cu_seqlens [N+1]` (int32, last == T). MLA attends within documents only,
  linear blocks reset state and conv windows at each boundary, positions restart per document.
* Generation uses `HyLoCache` (latent + roped key per MLA layer, fixed-size state per linear layer) and
  a small built-in decoding loop, so the cache layout is ours and never rebuilt into full K/V.
* Every decoder layer returns its mixer output too, for layer-wise distillation (stage 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.utils import ModelOutput

from hylo.cache import HyLoCache
from hylo.config import HybridConfig
from hylo.layers.norm import RMSNorm


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Positions restarting at 0 at each document start: [T] int64."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return torch.arange(total, device=cu.device) - starts


def check_packing(input_shape: tuple[int, int], cu_seqlens: torch.Tensor | None) -> None:
    if cu_seqlens is None:
        return
    b, t = input_shape
    if b != 1:
        raise ValueError(f"packed rows need batch size 1 with cu_seqlens, got batch {b}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != t:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={t}, got {cu_seqlens.tolist()[:3]}...{int(cu_seqlens[-1])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


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
        from hylo.layers.mla import MLAttention

        return MLAttention(config, layer_idx)
    if kind == "gdn":
        from hylo.layers.gdn import GatedDeltaNet

        return GatedDeltaNet(config, layer_idx)
    if kind == "mamba2":
        from hylo.layers.mamba2 import Mamba2Mixer

        return Mamba2Mixer(config, layer_idx)
    raise ValueError(f"unknown layer type {kind!r} for layer {layer_idx}")


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
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        if self.layer_type == "mla":
            return self.mixer(x_BTD, position_ids=position_ids, cu_seqlens=cu_seqlens, cache=cache)
        return self.mixer(x_BTD, cu_seqlens=cu_seqlens, cache=cache)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixer_out = self.run_mixer(self.input_layernorm(hidden_BTD), position_ids, cu_seqlens, cache)
        h = hidden_BTD + mixer_out
        out = h + self.mlp(self.post_attention_layernorm(h))
        return out, mixer_out


class HyLoPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HyLoDecoderLayer"]

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


@dataclass
class HyLoModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    cache: HyLoCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    mixer_outputs: tuple[torch.Tensor, ...] | None = None

    @property
    def past_key_values(self) -> HyLoCache | None:
        return self.cache


@dataclass
class HyLoCausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: HyLoCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    mixer_outputs: tuple[torch.Tensor, ...] | None = None

    @property
    def past_key_values(self) -> HyLoCache | None:
        return self.cache


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
        cu_seqlens: torch.Tensor | None = None,
        past_key_values: HyLoCache | None = None,
        use_cache: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_mixer_outputs: bool = False,
        **kwargs,
    ) -> HyLoModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = h.shape[:2]
        check_packing((b, t), cu_seqlens)
        cache = past_key_values
        if cache is None and use_cache:
            cache = HyLoCache(self.config)
        if cache is not None and cu_seqlens is not None:
            raise ValueError("the generation cache works on unpacked batches; drop cu_seqlens or the cache")
        if position_ids is None:
            if cu_seqlens is not None:
                position_ids = positions_from_cu_seqlens(cu_seqlens, t).unsqueeze(0)
            else:
                start = cache.get_seq_length() if cache is not None else 0
                position_ids = torch.arange(start, start + t, device=h.device).unsqueeze(0).expand(b, t)
        hidden_states: list[torch.Tensor] = []
        mixer_outputs: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                hidden_states.append(h)
            layer_cache = cache[i] if cache is not None else None
            if self.gradient_checkpointing and self.training and layer_cache is None:
                h, mixer_out = checkpoint(layer, h, position_ids, cu_seqlens, None, use_reentrant=False)
            else:
                h, mixer_out = layer(h, position_ids, cu_seqlens, layer_cache)
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


class HyLoForCausalLM(HyLoPreTrainedModel, GenerationMixin):
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
        cu_seqlens: torch.Tensor | None = None,
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
        **kwargs,
    ) -> HyLoCausalLMOutput:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("HyLo does not take padded batches; pack rows with cu_seqlens instead")
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            past_key_values=past_key_values if past_key_values is not None else cache,
            use_cache=use_cache,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_mixer_outputs=output_mixer_outputs,
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
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        return_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor | tuple[torch.Tensor, HyLoCache]:
        """Decode with the hybrid cache (prefill once, then one token per step).

        Greedy by default; `do_sample` with temperature/top-p. Rows stop independently at EOS (later
        positions are filled with EOS). Unpadded batches only.
        """
        if kwargs.get("max_length") is not None:
            max_new_tokens = int(kwargs["max_length"]) - input_ids.shape[1]
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("generate: padded prompts are not supported; generate one prompt per call")
        if eos_token_id is None:
            eos_token_id = self.generation_config.eos_token_id if self.generation_config is not None else None
        if eos_token_id is None:
            eos_token_id = self.config.eos_token_id
        eos = set(eos_token_id if isinstance(eos_token_id, list) else ([] if eos_token_id is None else [eos_token_id]))
        was_training = self.training
        self.eval()
        # the last new token is never fed back: the cache ends at prompt + max_new_tokens - 1 tokens
        cache = HyLoCache(self.config, max_length=input_ids.shape[1] + max(max_new_tokens - 1, 0))
        out = self(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        seq = input_ids
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        fill = next(iter(eos)) if eos else 0
        for i in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            if do_sample:
                probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1)
                if top_p < 1.0:
                    sp, si = probs.sort(dim=-1, descending=True)
                    keep = sp.cumsum(-1) - sp <= top_p
                    sp = sp * keep
                    probs = torch.zeros_like(probs).scatter(-1, si, sp)
                nxt = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)
            else:
                nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, fill), nxt)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if eos:
                done = done | torch.isin(nxt, torch.tensor(sorted(eos), device=nxt.device))
                if bool(done.all()):
                    break
            if i == max_new_tokens - 1:
                break  # the last token's logits would go unused
            out = self(input_ids=nxt[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        if was_training:
            self.train()
        return (seq, cache) if return_cache else seq

    # ------------------------------------------------------------------ io
    def save_pretrained(self, save_directory, *args, **kwargs):  # type: ignore[override]
        result = super().save_pretrained(save_directory, *args, **kwargs)
        self.config.save_hybrid_config(save_directory)
        return result


def register_auto_classes() -> None:
    """Make `AutoConfig` / `AutoModelForCausalLM` understand model_type 'hylo'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoConfig.register("hylo", HybridConfig)
        AutoModelForCausalLM.register(HybridConfig, HyLoForCausalLM)
    except ValueError:
        # already registered
        pass


register_auto_classes()
