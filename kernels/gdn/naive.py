"""Step-by-step reference for the gated delta rule: the definition, one token at a time.

Legend: B batch, T tokens, H heads, K key/query head dim, V value head dim, N sequences.

Design choices:
* Same signature and returns as `hylo.kernels.gdn.chunk_gated_delta_rule` (fla 0.6 argument order
  `q, k, v, g, beta`; state `[N, H, K, V]`), so tests swap one for the other.
* Computes in fp32 for low-precision inputs and in the input dtype otherwise (float64 in tests).
* No in-place writes into tensors autograd needs: outputs are collected in a list and stacked, so
  the reference is differentiable in every input, including `initial_state`.
* `cu_seqlens` is handled by running each sequence on its own (a Python loop over sequences and
  tokens: this is the reference, not the fast path).
"""

from __future__ import annotations

import torch

from hylo.kernels.checks import takes
from hylo.kernels.gdn.checks import GDNRowArgs


def _recurrent_one(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    scale: float,
    state_HKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for t in range(q_THK.shape[0]):
        k_HK = k_THK[t]
        # decay first, then the delta-rule correction against the decayed state
        state_HKV = state_HKV * g_TH[t].exp()[:, None, None]
        pred_HV = torch.einsum("hk,hkv->hv", k_HK, state_HKV)
        delta_HV = beta_TH[t][:, None] * (v_THV[t] - pred_HV)
        state_HKV = state_HKV + k_HK[:, :, None] * delta_HV[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q_THK[t] * scale, state_HKV))
    return torch.stack(outs, 0), state_HKV


@takes(GDNRowArgs)
def naive_recurrent_gated_delta_rule(a: GDNRowArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference gated delta rule, one token at a time; arguments `GDNRowArgs` (as `chunk_gated_delta_rule`
    without `chunk_size`).

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] (fp32, or float64 for float64
        inputs) or None.
    """
    B, T, H, K, V, N, bounds = a.check("naive_recurrent_gated_delta_rule")
    out_dtype, dt, scale, q, k, v, g, beta = a.computed()
    initial_state = a.initial_state

    spans = [(b, 0, T) for b in range(B)] if bounds is None else [(0, s, e) for s, e in bounds.spans()]

    outs, finals = [], []
    for n, (b, s, e) in enumerate(spans):
        if initial_state is None:
            h0_HKV = q.new_zeros(H, K, V)
        else:
            h0_HKV = initial_state[n].to(dt)
        o_THV, hT_HKV = _recurrent_one(q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], beta[b, s:e], scale, h0_HKV)
        outs.append(o_THV)
        finals.append(hT_HKV)

    o = torch.stack(outs, 0) if bounds is None else torch.cat(outs, 0)[None]
    final_state = torch.stack(finals, 0) if a.output_final_state else None
    return o.to(out_dtype), final_state
