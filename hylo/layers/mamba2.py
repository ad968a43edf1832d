"""Mamba-2 mixer (`linear_type: mamba2`) with mamba_ssm / transformers parameter names, so weights interchange.

Legend: B batch, T tokens, D hidden size, H heads, P head dim, G groups of B/C, N state size,
E = H * P (inner size), Cv = E + 2 * G * N (conv channels: x | B | C), W conv_size - 1 (cached conv inputs);
with grouped x/B (`mamba2_xb_groups`): X groups of x and B, Cv = X * P + X * N + G * N.

Design choices:
* Parameters and shapes are those of `transformers.Mamba2Mixer` / mamba_ssm's `Mamba2` (no biases on the
  projections, conv bias on, D per head, grouped gated norm): `in_proj` [2E + 2GN + H, D] with rows
  `[z | x | B | C | dt]`, `conv1d` (depthwise, weight [Cv, 1, W+1], bias [Cv]) over `x | B | C`, `dt_bias`,
  `A_log`, `D` [H], `norm.weight` [E], `out_proj` [D, E]. One fused `in_proj` rather than separate
  projections: the attention initialisation only has to write row blocks of it, and a state_dict loads
  into transformers' `Mamba2Mixer` with strict=True (tested).
* Math, per head: xBC = SiLU(causal depthwise conv(in_proj(u)[x|B|C]) + bias); dt = softplus(dt_raw +
  dt_bias) (fp32); A = -exp(A_log); y = SSD(x, dt, A, B, C) + D x; out = out_proj(RMSNorm_G(y * SiLU(z)) * w),
  the RMS taken per group of E / G channels (mamba_ssm's `norm_before_gate=False`). The scan goes through
  `hylo.kernels.ssd.chunk_ssd` (fla on GPU, chunked torch on CPU); a single-token step with a cache (decoding)
  through `recurrent_ssd` (fla's recurrent simple-GLA kernel).
* Shapes derive from the attention when the config leaves them null (`HybridConfig.mamba2_dims`): H = query
  heads, P = N = head_dim, G = H. Then x copies W_v (KV heads expanded to their query heads), B copies W_k,
  C copies W_q and out_proj copies W_o with no truncation, and each head keeps its own query as C. Conv width
  and chunk size reuse `gdn_conv_size` / `gdn_chunk_size`.
* Packed rows (B == 1, `cu_seqlens`: the model's `hylo.kernels.varlen.DocBounds`, or a tensor checked here when the
  mixer is called alone): the conv is a sum of W+1 shifted copies masked by the token's position inside its
  document, so windows never reach into the previous document; the scan resets per document.
* Cache (`LinearLayerCache`): `state` [B, H, P, N] fp32 (mamba_ssm's layout) and `conv['xBC']` = the last W
  conv *inputs* [B, Cv, W]. A prefill followed by single-token steps gives the full forward's output; the
  cache does not grow with T. Unpacked batches only.
* Default init as mamba_ssm: A ~ U(1, 16), dt log-uniform in [1e-3, 0.1] stored as its softplus inverse in
  dt_bias, D = 1, norm weight 1 (`reset_special_parameters()`, called by the model's `_init_weights`).
* Grouped x/B (`mamba2_xb_groups` = X, the Zebra-Llama / HyLo layer AMD's released Mamba-2 models use, there
  `d_xb = X * N`): in_proj rows `[z (E) | x (X P) | B (X N) | C (G N) | dt (H)]`, the conv over those X P + X N
  + G N channels, then x and B repeated to the heads (head h reads group h // (H / X), GQA's rule) before the
  scan. Repeating after the depthwise conv equals convolving repeated channels, so nothing else changes.
  AMD's layer is the case G = H, P = N, norm eps 1e-5 (`mamba2_norm_eps`).
* Initialisation from attention: `hylo/upcycle/mamba2.py` (x <- W_v, B <- W_k, C <- W_q, out_proj <- W_o).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hylo.cache import LinearLayerCache
from hylo.config import HybridConfig
from hylo.kernels.ssd import chunk_ssd, recurrent_ssd
from hylo.kernels.varlen import DocBounds
from hylo.layers.linear_common import causal_conv_silu, check_mixer_input, default_dt_bias
from hylo.seq_parallel import RowShard, conv_prefix, ssd_shard


def causal_conv1d_silu(
    x_BTC: torch.Tensor,
    weight_C1K: torch.Tensor,
    bias_C: torch.Tensor | None,
    prefix_BCW: torch.Tensor | None = None,
    pos_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + bias + SiLU: the GDN layer's `causal_conv_silu` with mamba_ssm's conv bias."""
    return causal_conv_silu(x_BTC, weight_C1K, prefix_BCW, pos_T, bias_C)


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm of (x * SiLU(gate)) over groups of `group_size` channels, then * weight; fp32 inside."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"GatedGroupRMSNorm: group_size {group_size} must divide dim {dim}")
        self.dim = dim
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BTE: torch.Tensor, gate_BTE: torch.Tensor) -> torch.Tensor:
        dtype = x_BTE.dtype
        cd = torch.promote_types(dtype, torch.float32)
        y = x_BTE.to(cd) * F.silu(gate_BTE.to(cd))
        y = y.unflatten(-1, (self.dim // self.group_size, self.group_size))
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (y * self.weight.to(cd)).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, group_size={self.group_size}, eps={self.eps}"


class Mamba2Mixer(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = D = config.hidden_size
        self.num_heads, self.head_dim, self.state_size, self.n_groups = H, P, N, G = config.mamba2_dims
        self.intermediate_size = E = H * P
        # x / B widths: per head and per group of C (mamba_ssm), or X shared groups (Zebra-Llama's d_xb)
        self.xb_groups = config.mamba2_xb_groups
        self.x_dim = E if self.xb_groups is None else self.xb_groups * P
        self.b_dim = G * N if self.xb_groups is None else self.xb_groups * N
        self.conv_dim = Cv = self.x_dim + self.b_dim + G * N
        self.conv_size = config.gdn_conv_size
        self.chunk_size = config.gdn_chunk_size

        self.in_proj = nn.Linear(D, E + Cv + H, bias=False)
        self.conv1d = nn.Conv1d(Cv, Cv, self.conv_size, groups=Cv, bias=True, padding=self.conv_size - 1)
        self.dt_bias = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(H, dtype=torch.float32))
        # decay / skip parameters: optimisers should not weight-decay them
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self.norm = GatedGroupRMSNorm(E, group_size=E // G, eps=config.mamba2_norm_eps_value)
        self.out_proj = nn.Linear(E, D, bias=False)
        self.reset_special_parameters()

    @torch.no_grad()
    def reset_special_parameters(self) -> None:
        """mamba_ssm's default init of the decay, step, skip and norm parameters."""
        H = self.num_heads
        A = torch.empty(H, dtype=torch.float32).uniform_(1, 16)
        self.A_log.copy_(torch.log(A))
        self.dt_bias.copy_(default_dt_bias(H))
        self.D.fill_(1.0)
        self.norm.weight.fill_(1.0)

    def forward(self, hidden_states_BTD: torch.Tensor, cu_seqlens: torch.Tensor | DocBounds | None = None,
                cache: LinearLayerCache | None = None, shard: RowShard | None = None) -> torch.Tensor:
        """`shard`: this rank's part of a split row (hylo/seq_parallel.py), None for a whole row."""
        u_BTD = hidden_states_BTD
        bounds, pos_T = check_mixer_input(self, u_BTD, cu_seqlens, cache, shard)
        B, T, _ = u_BTD.shape
        H, P, N, G, E = self.num_heads, self.head_dim, self.state_size, self.n_groups, self.intermediate_size

        z_BTE, xBC_BTC, dt_BTH = self.in_proj(u_BTD).split([E, self.conv_dim, H], dim=-1)
        prefix = cache.conv.get("xBC") if cache is not None else None
        if shard is not None:
            # a split row: the conv window starts with the previous rank's last W inputs
            prefix = conv_prefix(xBC_BTC, self.conv_size - 1, shard)
        xBC_BTC, conv_tail = causal_conv1d_silu(xBC_BTC, self.conv1d.weight, self.conv1d.bias, prefix, pos_T)
        x_BTE, B_BTGN, C_BTGN = xBC_BTC.split([self.x_dim, self.b_dim, G * N], dim=-1)
        if self.xb_groups is not None:
            # each group of x / B serves H / X consecutive heads; C's groups are expanded to the heads too
            X = self.xb_groups
            x_BTE = x_BTE.view(B, T, X, P).repeat_interleave(H // X, dim=2).reshape(B, T, E)
            B_BTGN = B_BTGN.view(B, T, X, N).repeat_interleave(H // X, dim=2).reshape(B, T, H * N)
            C_BTGN = C_BTGN.view(B, T, G, N).repeat_interleave(H // G, dim=2).reshape(B, T, H * N)
            G = H

        # step and decay in fp32 at least (float64 stays float64, for exact tests)
        cd = torch.promote_types(u_BTD.dtype, torch.float32)
        dt_BTH = F.softplus(dt_BTH.to(cd) + self.dt_bias.to(cd))
        A_H = -self.A_log.to(cd).exp()
        if shard is not None:
            y_BTHP = ssd_shard(x_BTE.view(B, T, H, P), dt_BTH, A_H, B_BTGN.view(B, T, G, N), C_BTGN.view(B, T, G, N),
                               self.D, shard, self.chunk_size)
            return self.out_proj(self.norm(y_BTHP.reshape(B, T, E), z_BTE))
        xBC = x_BTE.view(B, T, H, P), dt_BTH, A_H, B_BTGN.view(B, T, G, N), C_BTGN.view(B, T, G, N)
        if cache is not None and T == 1:
            # a decode step: the recurrent kernel, not a chunk kernel over one token
            y_BTHP, state = recurrent_ssd(*xBC, D=self.D, initial_state=cache.state, output_final_state=True)
        else:
            y_BTHP, state = chunk_ssd(
                *xBC,
                D=self.D,
                initial_state=cache.state if cache is not None else None,
                output_final_state=cache is not None,
                cu_seqlens=bounds,
                chunk_size=self.chunk_size,
            )
        if cache is not None:
            cache.update(state, {"xBC": conv_tail}, T)

        y_BTE = self.norm(y_BTHP.reshape(B, T, E), z_BTE)
        return self.out_proj(y_BTE)

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, head_dim={self.head_dim}, "
                f"state_size={self.state_size}, n_groups={self.n_groups}, xb_groups={self.xb_groups}, "
                f"conv_size={self.conv_size}")

