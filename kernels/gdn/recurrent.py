"""The gated delta rule one token at a time: the decode step of a GDN layer with a cache.

Legend: B batch, T tokens (1 when decoding), H heads, K key head dim, V value head dim.

Design choices:
* A decode step is one rank-1 update of each head's [K, V] state. The chunk kernels pay for a whole
  chunk's triangular system (fla: several launches; the torch path: the block-doubling inverse) to do it,
  so single-token steps go through a recurrent kernel instead: fla's `fused_recurrent_gated_delta_rule`
  (one launch, T is not a compile-time constant: no recompilation per token) on the GPU path, a few
  batched torch ops per token on the torch path. The switch is `hylo.kernels.backend.use_fla`, as for
  the chunk op.
* fla's recurrent kernel has no backward. When autograd needs the graph (grad mode on and an input
  that requires grad) the GPU path takes fla's chunk kernel instead; the torch path is differentiable.
* Arguments, layouts and returns are `chunk_gated_delta_rule`'s for an unpacked batch (state [B, H, K, V],
  fp32 or float64; the output in v's dtype), so a layer swaps one for the other.
"""

from __future__ import annotations

import torch

from hylo.kernels.backend import use_fla
from hylo.kernels.checks import takes
from hylo.kernels.gdn.checks import GDNStepArgs
from hylo.kernels.gdn.chunk import chunk_gated_delta_rule


@takes(GDNStepArgs)
def torch_recurrent_gated_delta_rule(a: GDNStepArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-torch recurrent gated delta rule, batched over B and H, a Python loop over T."""
    B, T, H, K, V, _, _ = a.check("recurrent_gated_delta_rule")
    out_dtype, dt, scale, q, k, v, g, beta = a.computed()
    h_BHKV = q.new_zeros(B, H, K, V) if a.initial_state is None else a.initial_state.to(dt)
    outs = []
    for t in range(T):
        k_BH1K = k[:, t, :, None, :]
        # decay first, then the delta-rule correction against the decayed state
        h_BHKV = h_BHKV * g[:, t].exp()[..., None, None]
        delta_BH1V = beta[:, t, :, None, None] * (v[:, t, :, None, :] - k_BH1K @ h_BHKV)
        h_BHKV = h_BHKV + k_BH1K.transpose(-1, -2) @ delta_BH1V
        outs.append((q[:, t, :, None, :] * scale) @ h_BHKV)
    o = torch.cat(outs, dim=2).transpose(1, 2).to(out_dtype)
    return o, (h_BHKV if a.output_final_state else None)


@takes(GDNStepArgs)
def recurrent_gated_delta_rule(a: GDNStepArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule token by token over an unpacked batch (the decode step); arguments (`GDNStepArgs`) and
    returns as `chunk_gated_delta_rule` without `cu_seqlens` / `chunk_size`. GPU tensors go to fla's recurrent
    kernel (`hylo.kernels.backend.use_fla`), everything else to the torch loop above."""
    if isinstance(a.q, torch.Tensor) and use_fla(a.q):
        a.check("recurrent_gated_delta_rule")
        leaves = (a.q, a.k, a.v, a.g, a.beta, a.initial_state)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves):
            return chunk_gated_delta_rule(**vars(a))
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # optional: fla

        # keywords: fla 0.6's recurrent op takes `q, k, v, g, gk, gv, beta`
        return fused_recurrent_gated_delta_rule(
            a.q, a.k, a.v,
            g=a.g,
            beta=a.beta,
            scale=a.scale,
            initial_state=a.initial_state,
            output_final_state=a.output_final_state,
            use_qk_l2norm_in_kernel=a.use_qk_l2norm_in_kernel,
        )
    return torch_recurrent_gated_delta_rule(**vars(a))
