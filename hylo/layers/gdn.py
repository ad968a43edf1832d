"""Gated DeltaNet mixer with flash-linear-attention's parameter names, so weights interchange.

Legend: B batch, T tokens, D hidden size, H heads, K key head dim, V value head dim,
C conv channels (H*K for q/k, H*V for v), W conv_size - 1 (cached conv inputs), N documents.

Design choices:
* Parameters and shapes are exactly those of `fla.layers.GatedDeltaNet(hidden_size=D,
  head_dim=K, expand_v=V/K, num_heads=H, conv_size=W+1, norm_eps=eps)`: `q_proj k_proj v_proj
  a_proj b_proj A_log dt_bias q_conv1d k_conv1d v_conv1d g_proj o_norm o_proj` (no biases; conv
  weights [C, 1, W+1]; `o_norm.weight` [V]). A state_dict loads into either one with strict=True.
* Math, per head: q, k, v = SiLU(causal depthwise conv(proj(x))); q, k L2-normalised;
  g = -exp(A_log) * softplus(a_proj(x) + dt_bias) (fp32), beta = sigmoid(b_proj(x));
  o = gated_delta_rule(q, k, v, g, beta); y = o_proj(RMSNorm(o) * w * SiLU(g_proj(x))).
  The recurrence goes through `hylo.kernels.gdn.chunk_gated_delta_rule` (fla on GPU, torch on CPU);
  a single-token step with a cache (decoding) through `recurrent_gated_delta_rule` (fla's recurrent kernel).
* Packed rows (B == 1, `cu_seqlens`: the model's `hylo.kernels.varlen.DocBounds`, or a tensor checked here
  when the layer is called alone): the short conv is a sum of W+1 shifted copies masked by the
  token's position inside its document, so windows never reach into the previous document; the
  recurrence resets its state per document inside the kernel, which gets the same bounds.
* Cache (`LinearLayerCache`): `state` [B, H, K, V] fp32 (the kernel's K-first layout, not fla's
  value-first cache layout) and `conv['q'|'k'|'v']` = the last W conv *inputs* [B, C, W]. A
  prefill followed by single-token steps gives the full forward's output; the cache does not
  grow with T. The cache is for unpacked batches only.
* Gate and norm math run in fp32 and cast back, like fla's fused kernels.
* Every parameter is used inside the forward of the module that owns it (convs and the norm are
  called as modules), so ZeRO-3's per-module gathering hooks see them.
* Default init as fla: A ~ U(0, 16) (A_log = log A), dt log-uniform in [1e-3, 0.1] stored as its
  softplus inverse in dt_bias, o_norm weight 1. `reset_special_parameters()` re-applies it (the
  model's `_init_weights` calls it); projections and convs keep torch's defaults.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hylo.cache import LinearLayerCache
from hylo.config import HybridConfig
from hylo.kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from hylo.kernels.varlen import DocBounds
from hylo.layers.linear_common import causal_conv_silu, check_mixer_input, default_dt_bias
from hylo.seq_parallel import RowShard, conv_prefix, gated_delta_rule_shard


class ShortConvolution(nn.Conv1d):
    """Depthwise causal conv + SiLU holding fla's weight [C, 1, conv_size]. Called as a module (not
    by reading `.weight` from outside) so that ZeRO-3 gathers its weight in its forward hook."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False, padding=kernel_size - 1)

    def forward(
        self, x_BTC: torch.Tensor, prefix_BCW: torch.Tensor | None = None, pos_T: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv_silu(x_BTC, self.weight, prefix_BCW, pos_T)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head's value dim, then * weight * SiLU(gate); fp32 inside (fla's FusedRMSNormGated)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        g32 = gate.to(x32.dtype)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * self.weight.to(x32.dtype) * F.silu(g32)
        return y.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class GatedDeltaNet(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = D = config.hidden_size
        self.num_heads = H = config.gdn_num_heads
        self.head_k_dim = K = config.gdn_head_dim
        self.head_v_dim = V = config.gdn_value_dim
        self.conv_size = config.gdn_conv_size
        self.chunk_size = config.gdn_chunk_size
        self.key_dim, self.value_dim = H * K, H * V

        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.a_proj = nn.Linear(D, H, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(H, dtype=torch.float32))
        # A_log / dt_bias are decay parameters: optimisers should not weight-decay them
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.q_conv1d = ShortConvolution(H * K, self.conv_size)
        self.k_conv1d = ShortConvolution(H * K, self.conv_size)
        self.v_conv1d = ShortConvolution(H * V, self.conv_size)
        self.g_proj = nn.Linear(D, H * V, bias=False)
        self.o_norm = GatedRMSNorm(V, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        self.reset_special_parameters()

    @torch.no_grad()
    def reset_special_parameters(self) -> None:
        """fla's default init of the decay parameters and the output norm."""
        H = self.num_heads
        A = torch.empty(H, dtype=torch.float32).uniform_(0, 16)
        self.A_log.copy_(torch.log(A))
        self.dt_bias.copy_(default_dt_bias(H))
        self.o_norm.weight.fill_(1.0)

    def forward(self, hidden_states_BTD: torch.Tensor, cu_seqlens: torch.Tensor | DocBounds | None = None,
                cache: LinearLayerCache | None = None, shard: RowShard | None = None) -> torch.Tensor:
        """`shard`: this rank's part of a split row (hylo/seq_parallel.py), None for a whole row."""
        x_BTD = hidden_states_BTD
        bounds, pos_T = check_mixer_input(self, x_BTD, cu_seqlens, cache, shard)
        B, T, _ = x_BTD.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim

        conv_in = cache.conv if cache is not None else {}
        q_pre, k_pre, v_pre = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if shard is not None:
            # a split row: the conv windows start with the previous rank's last W inputs
            prefix = conv_prefix(torch.cat([q_pre, k_pre, v_pre], -1), self.conv_size - 1, shard)
            conv_in = dict(zip("qkv", prefix.split([self.key_dim, self.key_dim, self.value_dim], dim=1)))
        q_BTC, cq = self.q_conv1d(q_pre, conv_in.get("q"), pos_T)
        k_BTC, ck = self.k_conv1d(k_pre, conv_in.get("k"), pos_T)
        v_BTC, cv = self.v_conv1d(v_pre, conv_in.get("v"), pos_T)

        # the gate in fp32 at least (float64 stays float64, for exact tests)
        gdt = torch.promote_types(x_BTD.dtype, torch.float32)
        g_BTH = -self.A_log.to(gdt).exp() * F.softplus(self.a_proj(x_BTD).to(gdt) + self.dt_bias.to(gdt))
        beta_BTH = self.b_proj(x_BTD).sigmoid()
        if shard is not None:
            o_BTHV = gated_delta_rule_shard(q_BTC.view(B, T, H, K), k_BTC.view(B, T, H, K), v_BTC.view(B, T, H, V),
                                            g_BTH, beta_BTH, shard, self.chunk_size)
            return self.o_proj(self.o_norm(o_BTHV, self.g_proj(x_BTD).view(B, T, H, V)).reshape(B, T, H * V))
        qkv = q_BTC.view(B, T, H, K), k_BTC.view(B, T, H, K), v_BTC.view(B, T, H, V)
        if cache is not None and T == 1:
            # a decode step: the recurrent kernel, not a chunk kernel over one token
            o_BTHV, state_BHKV = recurrent_gated_delta_rule(*qkv, g_BTH, beta_BTH, initial_state=cache.state,
                                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        else:
            o_BTHV, state_BHKV = chunk_gated_delta_rule(
                *qkv,
                g_BTH,
                beta_BTH,
                initial_state=cache.state if cache is not None else None,
                output_final_state=cache is not None,
                cu_seqlens=bounds,
                use_qk_l2norm_in_kernel=True,
                chunk_size=self.chunk_size,
            )
        if cache is not None:
            cache.update(state_BHKV, {"q": cq, "k": ck, "v": cv}, T)

        gate_BTHV = self.g_proj(x_BTD).view(B, T, H, V)
        o_BTHV = self.o_norm(o_BTHV, gate_BTHV)
        return self.o_proj(o_BTHV.reshape(B, T, H * V))

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, conv_size={self.conv_size}")
