"""HyLo for vLLM: MLA layers on vLLM's latent cache, Gated DeltaNet and Mamba-2 layers on its recurrent states.

Imported by vLLM (the `hylo` plugin, `hylo.serving.plugin`), never by training code: it needs vLLM.

Design choices:
* The layers are vLLM's own: `MultiHeadLatentAttentionWrapper` (the latent + roped key cache, the query
  absorbed at decode), `QwenGatedDeltaNetAttention` in its flat layout (Qwen3.5's: q, k, v, gate stacked;
  fla's separate convs become one depthwise conv over [q | k | v]), `MambaMixer2`, and Llama's MLP. This
  file builds them from a `HybridConfig` and maps our tensors onto them; no kernel is ours.
* MLA at a width vLLM takes: `hylo.serving.widen` pads the latent and rope exactly (zero dims, the latent
  norm compensated), our rotary embedding turns the native rope dims only, and the softmax scale is the
  native one. The served width is chosen once from the platform (`served_widths`).
* A released (AMD) checkpoint is read by the plugin's config parser into a `HybridConfig`; its tensors go
  through `hylo.released.importing.released_to_state_dict`, the importer the training side uses.
* Weights are handed to each vLLM parameter's own `weight_loader`, full-sized, so tensor parallelism shards
  them as vLLM does for its own models (only TP = 1 is tested here).

Legend: T tokens (flattened batch), D hidden, H heads, N nope dims, P rope dims, R latent, V value dims.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.utils import make_layers, maybe_prefix
from vllm.sequence import IntermediateTensors

from hylo.config import HybridConfig
from hylo.layers.rope import RotaryEmbedding, mla_softmax_scale
from hylo.serving.widen import (
    ServedMLA,
    ServingShapeError,
    rotate_native_dims,
    widen_kv_a,
    widen_kv_b,
    widen_latent_norm,
    widen_query,
)
from hylo.serving.widths import served_widths


class HyLoRotary(nn.Module):
    """Our RoPE (rotate-half, YaRN as `hylo.layers.rope`) on the first `rope` dims of a served rope part;
    `vLLM`'s MLA wrapper calls it as `rotary_emb(positions, q_pe [T, H, P'], k_pe [T, 1, P'])`."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.rope = cfg.qk_rope_head_dim
        # `rope_key_groups` blocks of the rope dims share one frequency ladder (the converter's layout)
        self.emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                   cfg.max_position_embeddings, groups=cfg.rope_key_groups)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor,
                k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_TP, sin_TP = self.emb(positions.reshape(1, -1), q_pe.dtype)
        cos_T1P, sin_T1P = cos_TP[0].unsqueeze(1), sin_TP[0].unsqueeze(1)
        return (rotate_native_dims(q_pe, cos_T1P, sin_T1P, self.rope),
                rotate_native_dims(k_pe, cos_T1P, sin_T1P, self.rope))


class HyLoMLA(nn.Module):
    """An MLA mixer on vLLM's latent cache, at the served widths."""

    def __init__(self, vllm_config: VllmConfig, cfg: HybridConfig, served: ServedMLA, prefix: str) -> None:
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        N, V, Q = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
        R, P = served.served_rank, served.served_rope
        bias = bool(cfg.attention_bias)
        quant = vllm_config.quant_config
        self.served = served
        self.q_lora_rank = Q
        latent_eps = cfg.latent_norm_eps
        if Q is not None:
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                D, [Q, R + P], bias=bias, quant_config=quant, disable_tp=True, prefix=f"{prefix}.fused_qkv_a_proj")
            self.q_a_layernorm = RMSNorm(Q, eps=latent_eps) if cfg.mla_latent_norm else nn.Identity()
            self.q_b_proj = ColumnParallelLinear(Q, H * (N + P), bias=False, quant_config=quant,
                                                 prefix=f"{prefix}.q_b_proj")
        else:
            self.kv_a_proj_with_mqa = ReplicatedLinear(D, R + P, bias=bias, quant_config=quant,
                                                       prefix=f"{prefix}.kv_a_proj_with_mqa")
            self.q_proj = ColumnParallelLinear(D, H * (N + P), bias=bias, quant_config=quant,
                                               prefix=f"{prefix}.q_proj")
        # the widened latent's norm: eps scaled by R / R' (hylo.serving.widen); its weight is scaled on load
        self.kv_a_layernorm = (RMSNorm(R, eps=latent_eps * served.rank / served.served_rank)
                               if cfg.mla_latent_norm else nn.Identity())
        self.kv_b_proj = ColumnParallelLinear(R, H * (N + V), bias=False, quant_config=quant,
                                              prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(H * V, D, bias=bias, quant_config=quant, prefix=f"{prefix}.o_proj")
        self.rotary_emb = HyLoRotary(cfg)
        modules = MLAModules(
            kv_a_layernorm=self.kv_a_layernorm, kv_b_proj=self.kv_b_proj, rotary_emb=self.rotary_emb,
            o_proj=self.o_proj, fused_qkv_a_proj=getattr(self, "fused_qkv_a_proj", None),
            kv_a_proj_with_mqa=getattr(self, "kv_a_proj_with_mqa", None),
            q_a_layernorm=getattr(self, "q_a_layernorm", None), q_b_proj=getattr(self, "q_b_proj", None),
            q_proj=getattr(self, "q_proj", None), indexer=None, is_sparse=False, topk_indices_buffer=None)
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.mla_attn = MultiHeadLatentAttentionWrapper(
            D, H // tp, mla_softmax_scale(N + cfg.qk_rope_head_dim, cfg.rope_scaling, cfg.max_position_embeddings),
            N, P, V, Q, R, modules, vllm_config.cache_config, quant, prefix=prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mla_attn(positions, hidden_states)


def mamba2_served_dims(cfg: HybridConfig) -> tuple[int, int, int, int]:
    """(heads, head dim, state size, groups of B and C) of the served Mamba-2 layer. vLLM's layer reads one group
    count for B and C (and the gated norm); grouped x / B (`mamba2_xb_groups`, AMD's layer) are repeated to the
    heads on load, which needs C per head (G = H) or B's groups equal to C's."""
    H, P, N, G = cfg.mamba2_dims
    X = cfg.mamba2_xb_groups
    if X is not None and X != G and G != H:
        raise ServingShapeError(
            f"mamba2_xb_groups={X} with mamba2_n_groups={G} (of {H} heads): vLLM's Mamba-2 layer takes one group "
            f"count for B and C; served when B's groups equal C's or C is per head")
    return H, P, N, G


def gdn_layer_config(cfg: HybridConfig) -> SimpleNamespace:
    """What vLLM's Qwen GDN layer reads of its config, from ours (one K head per V head; SiLU conv and gate)."""
    return SimpleNamespace(
        hidden_size=cfg.hidden_size, hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps,
        linear_num_key_heads=cfg.gdn_num_heads, linear_num_value_heads=cfg.gdn_num_heads,
        linear_key_head_dim=cfg.gdn_head_dim, linear_value_head_dim=cfg.gdn_value_dim,
        linear_conv_kernel_dim=cfg.gdn_conv_size, output_gate_type="silu")


class HyLoDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, cfg: HybridConfig, served: ServedMLA, prefix: str) -> None:
        super().__init__()
        idx = int(prefix.rsplit(".", 1)[-1])
        self.kind = cfg.layer_type(idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if self.kind == "mla":
            self.mixer = HyLoMLA(vllm_config, cfg, served, prefix=f"{prefix}.mixer")
        elif self.kind == "gdn":
            self.mixer = QwenGatedDeltaNetAttention(gdn_layer_config(cfg), vllm_config=vllm_config,
                                                    prefix=f"{prefix}.mixer", gqa_interleaved_layout=False)
        else:
            H, P, N, G = mamba2_served_dims(cfg)
            self.mixer = MambaMixer2(
                hidden_size=cfg.hidden_size, ssm_state_size=N, conv_kernel_size=cfg.gdn_conv_size,
                intermediate_size=H * P, use_conv_bias=True, use_bias=False, n_groups=G, num_heads=H,
                head_dim=P, rms_norm_eps=cfg.mamba2_norm_eps_value, activation="silu",
                model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config, prefix=f"{prefix}.mixer")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                            quant_config=vllm_config.quant_config, bias=cfg.mlp_bias, prefix=f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.kind == "mla":
            hidden_states = self.mixer(positions, hidden_states)
        else:
            hidden_states = self.mixer(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


# the dims that vary per step (annotations are strings here, so vLLM cannot find them itself)
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                          "inputs_embeds": 0})
class HyLoModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg: HybridConfig = vllm_config.model_config.hf_config
        self.config = cfg
        served = served_widths(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.n_layer, lambda prefix: HyLoDecoderLayer(vllm_config, cfg, served, prefix), prefix=f"{prefix}.layers")
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class HyLoForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM's entry class for a HyLo checkpoint (`architectures: ["HyLoForCausalLM"]`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg: HybridConfig = vllm_config.model_config.hf_config
        self.config = cfg
        self.vllm_config = vllm_config
        self.model = HyLoModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if cfg.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(cfg.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # ------------------------------------------------------------------ recurrent state (IsHybrid)
    # one kind of linear layer a model (`linear_type`): its state's dtypes, shapes and copy functions
    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        cache = vllm_config.cache_config
        of = (MambaStateDtypeCalculator.gated_delta_net_state_dtype
              if vllm_config.model_config.hf_config.linear_type == "gdn" else MambaStateDtypeCalculator.mamba2_state_dtype)
        return of(vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        cfg: HybridConfig = vllm_config.model_config.hf_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        spec = vllm_config.speculative_config
        n_spec = spec.num_speculative_tokens if spec else 0
        if cfg.linear_type == "gdn":
            return MambaStateShapeCalculator.gated_delta_net_state_shape(
                tp, cfg.gdn_num_heads, cfg.gdn_num_heads, cfg.gdn_head_dim, cfg.gdn_value_dim, cfg.gdn_conv_size,
                n_spec)
        H, P, N, G = mamba2_served_dims(cfg)
        return MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=tp, intermediate_size=H * P, n_groups=G, num_heads=H, head_dim=P, state_size=N,
            conv_kernel=cfg.gdn_conv_size, num_spec=n_spec)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        # both kinds keep (conv inputs, recurrent state) and copy them alike
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        cfg = self.config
        state = dict(weights)
        source = Path(self.vllm_config.model_config.model)
        state = our_state_dict(state, cfg, source)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor, shard in served_tensors(state, cfg, served_widths(cfg)):
            if name not in params:
                if name.startswith("lm_head.") and cfg.tie_word_embeddings:
                    continue
                raise KeyError(f"{source}: no served parameter {name} for this model's tensors")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(name)
        return loaded


def our_state_dict(state: dict[str, torch.Tensor], cfg: HybridConfig, source: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names: an export's as they are, a released layout's imported."""
    from hylo.released.layout import is_released_layout

    if source.is_dir() and is_released_layout(source):
        from hylo.released.importing import released_to_state_dict

        return released_to_state_dict(state, cfg, where=str(source))
    return state


def served_tensors(state: dict[str, torch.Tensor], cfg: HybridConfig,
                   served: ServedMLA) -> Iterator[tuple[str, torch.Tensor, int | str | None]]:
    """(vLLM parameter name, full tensor, shard id for merged parameters) for every served parameter."""
    yield "model.embed_tokens.weight", state["model.embed_tokens.weight"], None
    yield "model.norm.weight", state["model.norm.weight"], None
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", state["lm_head.weight"], None
    for i in range(cfg.n_layer):
        ours = f"model.layers.{i}."
        for part in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.down_proj.weight"):
            yield ours + part, state[ours + part], None
        if cfg.mlp_bias:
            yield ours + "mlp.down_proj.bias", state[ours + "mlp.down_proj.bias"], None
        for j, proj in enumerate(("gate_proj", "up_proj")):
            yield ours + "mlp.gate_up_proj.weight", state[f"{ours}mlp.{proj}.weight"], j
            if cfg.mlp_bias:
                yield ours + "mlp.gate_up_proj.bias", state[f"{ours}mlp.{proj}.bias"], j
        mixer = {k[len(ours + "mixer."):]: v for k, v in state.items() if k.startswith(ours + "mixer.")}
        kind = cfg.layer_type(i)
        parts = (mla_tensors(mixer, cfg, served) if kind == "mla" else gdn_tensors(mixer) if kind == "gdn"
                 else mamba2_tensors(mixer, cfg))
        for name, tensor, shard in parts:
            yield f"{ours}mixer.{name}", tensor, shard


def mla_tensors(m: dict[str, torch.Tensor], cfg: HybridConfig,
                s: ServedMLA) -> Iterator[tuple[str, torch.Tensor, int | None]]:
    bias = bool(cfg.attention_bias)
    if cfg.q_lora_rank is not None:
        yield "fused_qkv_a_proj.weight", m["q_a_proj.weight"], 0
        yield "fused_qkv_a_proj.weight", widen_kv_a(m["kv_a_proj_with_mqa.weight"], s), 1
        if bias:
            yield "fused_qkv_a_proj.bias", m["q_a_proj.bias"], 0
            yield "fused_qkv_a_proj.bias", widen_kv_a(m["kv_a_proj_with_mqa.bias"], s), 1
        if cfg.mla_latent_norm:
            yield "q_a_layernorm.weight", m["q_a_layernorm.weight"], None
        yield "q_b_proj.weight", widen_query(m["q_b_proj.weight"], cfg, s), None
    else:
        yield "kv_a_proj_with_mqa.weight", widen_kv_a(m["kv_a_proj_with_mqa.weight"], s), None
        yield "q_proj.weight", widen_query(m["q_proj.weight"], cfg, s), None
        if bias:
            yield "kv_a_proj_with_mqa.bias", widen_kv_a(m["kv_a_proj_with_mqa.bias"], s), None
            yield "q_proj.bias", widen_query(m["q_proj.bias"], cfg, s), None
    if cfg.mla_latent_norm:
        weight, _ = widen_latent_norm(m["kv_a_layernorm.weight"], cfg.latent_norm_eps, s)
        yield "kv_a_layernorm.weight", weight, None
    yield "kv_b_proj.weight", widen_kv_b(m["kv_b_proj.weight"], cfg, s), None
    yield "o_proj.weight", m["o_proj.weight"], None
    if bias:
        yield "o_proj.bias", m["o_proj.bias"], None


def gdn_tensors(m: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, int | None]]:
    """fla's GatedDeltaNet tensors onto vLLM's flat-layout Qwen GDN layer."""
    for j, proj in enumerate(("q_proj", "k_proj", "v_proj", "g_proj")):
        yield "in_proj_qkvz.weight", m[f"{proj}.weight"], j
    for j, proj in enumerate(("b_proj", "a_proj")):
        yield "in_proj_ba.weight", m[f"{proj}.weight"], j
    yield "conv1d.weight", torch.cat([m["q_conv1d.weight"], m["k_conv1d.weight"], m["v_conv1d.weight"]]), None
    yield "A_log", m["A_log"], None
    yield "dt_bias", m["dt_bias"], None
    yield "norm.weight", m["o_norm.weight"], None
    yield "out_proj.weight", m["o_proj.weight"], None


def mamba2_tensors(m: dict[str, torch.Tensor], cfg: HybridConfig) -> Iterator[tuple[str, torch.Tensor, int | None]]:
    """Our (mamba_ssm's) Mamba-2 tensors onto vLLM's `MambaMixer2`; grouped x / B repeated to the heads (exact:
    the conv is depthwise, so repeating its channels after it equals convolving repeated channels)."""
    H, P, N, G = mamba2_served_dims(cfg)
    X = cfg.mamba2_xb_groups
    E = H * P
    x_dim = E if X is None else X * P
    b_dim = G * N if X is None else X * N

    def grouped(t: torch.Tensor) -> list[torch.Tensor]:
        """[x | B | C] rows of the conv (or of in_proj after z), x and B at their served sizes."""
        x, b, c = t.split([x_dim, b_dim, G * N])
        if X is not None:
            x = x.unflatten(0, (X, P)).repeat_interleave(H // X, 0).flatten(0, 1)
            b = b.unflatten(0, (X, N)).repeat_interleave(G // X, 0).flatten(0, 1)
        return [x, b, c]

    z, xbc, dt = m["in_proj.weight"].split([E, x_dim + b_dim + G * N, H])
    for j, part in enumerate([z, *grouped(xbc), dt]):
        yield "in_proj.weight", part, j
    for j, part in enumerate(grouped(m["conv1d.weight"])):
        yield "conv1d.weight", part, j
    for j, part in enumerate(grouped(m["conv1d.bias"])):
        yield "conv1d.bias", part, j
    # vLLM's loader turns A_log into A = -exp(A_log)
    yield "A", m["A_log"], None
    yield "D", m["D"], None
    yield "dt_bias", m["dt_bias"], None
    yield "norm.weight", m["norm.weight"], None
    yield "out_proj.weight", m["out_proj.weight"], None
