"""The SSD (Mamba-2) scan one token at a time: the decode step of a Mamba-2 layer with a cache.

Legend: B batch, T tokens (1 when decoding), H heads, P head dim, G groups of B/C, N state size.

Design choices:
* A decode step is h <- exp(dt A) h + (dt x) B^T and y = h C + D x per head: one multiply-add of a
  [P, N] state. The chunk kernels would run a chunk's worth of work for it, so single-token steps go
  through a recurrent kernel: fla's `fused_recurrent_simple_gla` (SSD is simple GLA with q = C, k = B,
  v = dt x, g = dt A, scale 1, the value-first state = mamba_ssm's [P, N]; T is not a compile-time
  constant, so no recompilation per token; it has a backward) on the GPU path, a few batched torch ops
  per token on the torch path. The switch is `hylo.kernels.backend.use_fla`, as for the chunk op.
* Arguments, layouts and returns are `chunk_ssd`'s for an unpacked batch (state [B, H, P, N], fp32 or
  float64; y in x's dtype), so a layer swaps one for the other.
"""

from __future__ import annotations

import torch

from hylo.kernels.backend import use_fla
from hylo.kernels.checks import takes
from hylo.kernels.ssd.checks import SSDArgs, heads_from_groups
from hylo.kernels.ssd.chunk import simple_gla_operands, with_skip


@takes(SSDArgs)
def torch_recurrent_ssd(a: SSDArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-torch recurrent SSD scan, batched over B and H, a Python loop over T."""
    batch, T, H, P, G, N, _, _ = a.check("recurrent_ssd")
    out_dtype, cd, x, dt, A, B, C = a.computed()
    B_BTHN, C_BTHN = heads_from_groups(B, H), heads_from_groups(C, H)
    h_BHPN = x.new_zeros(batch, H, P, N) if a.initial_state is None else a.initial_state.to(cd)
    outs = []
    for t in range(T):
        dt_BH = dt[:, t]
        xdt_BHP1 = (x[:, t] * dt_BH[..., None])[..., None]
        h_BHPN = torch.addcmul(xdt_BHP1 * B_BTHN[:, t, :, None, :], h_BHPN, (dt_BH * A).exp()[..., None, None])
        outs.append(h_BHPN @ C_BTHN[:, t, :, :, None])
    y = torch.cat(outs, dim=-1).permute(0, 3, 1, 2)
    if a.D is not None:
        y = y + a.D.to(cd)[:, None] * x
    return y.to(out_dtype), (h_BHPN if a.output_final_state else None)


@takes(SSDArgs)
def fla_recurrent_ssd(a: SSDArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SSD through fla's `fused_recurrent_simple_gla` (Triton, GPU): q = C, k = B, v = dt x, g = dt A, scale 1."""
    from fla.ops.simple_gla import fused_recurrent_simple_gla  # optional: fla

    H = a.check("recurrent_ssd")[2]
    q, k, v, g = simple_gla_operands(a.x, a.dt, a.A, a.B, a.C, H)
    o, final = fused_recurrent_simple_gla(q, k, v, g=g, scale=1.0, initial_state=a.initial_state,
                                          output_final_state=a.output_final_state, state_v_first=True)
    return with_skip(o, a.D, a.x), final


@takes(SSDArgs)
def recurrent_ssd(a: SSDArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SSD token by token over an unpacked batch (the decode step); arguments (`SSDArgs`) and returns as
    `chunk_ssd` without `cu_seqlens` / `chunk_size`. GPU tensors go to fla's recurrent kernel (`use_fla`),
    everything else to the torch loop above."""
    if isinstance(a.x, torch.Tensor) and use_fla(a.x):
        return fla_recurrent_ssd(**vars(a))
    return torch_recurrent_ssd(**vars(a))
