"""Step-by-step reference for the Mamba-2 SSD recurrence: the definition, one token at a time.

Legend: B batch, T tokens, H heads, P head dim, G groups of B/C, N state size, S sequences.

Per head h (group g = h // (H / G)), with state `h_t` [P, N]:
    h_t = exp(dt_t * A_h) * h_{t-1} + (dt_t * x_t) B_t^T
    y_t = h_t C_t + D_h * x_t

Design choices:
* Same signature and returns as `hylo.kernels.ssd.chunk_ssd`, so tests swap one for the other.
* The state is kept in mamba_ssm's [P, N] orientation (the chunked path works in [N, P]), so the two
  paths share no layout code.
* No in-place writes into tensors autograd needs: differentiable in every input, including
  `initial_state`. `cu_seqlens` runs each sequence on its own (a Python loop: this is the reference).
"""

from __future__ import annotations

import torch

from hylo.kernels.checks import takes
from hylo.kernels.ssd.checks import SSDRowArgs, heads_from_groups


def _recurrent_one(
    x_THP: torch.Tensor,
    dt_TH: torch.Tensor,
    A_H: torch.Tensor,
    B_THN: torch.Tensor,
    C_THN: torch.Tensor,
    state_HPN: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for t in range(x_THP.shape[0]):
        decay_H = torch.exp(dt_TH[t] * A_H)
        xdt_HP = x_THP[t] * dt_TH[t][:, None]
        state_HPN = state_HPN * decay_H[:, None, None] + xdt_HP[:, :, None] * B_THN[t][:, None, :]
        outs.append(torch.einsum("hpn,hn->hp", state_HPN, C_THN[t]))
    return torch.stack(outs, 0), state_HPN


@takes(SSDRowArgs)
def naive_ssd(a: SSDRowArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference SSD scan, one token at a time; arguments `SSDRowArgs` (as `chunk_ssd` without `chunk_size`).

    Returns:
        y: [B, T, H, P] in x's dtype; final_state: [S, H, P, N] (fp32, or float64 for float64 inputs)
        or None.
    """
    batch, T, H, P, G, N, S, bounds = a.check("naive_ssd")
    out_dtype, cd, x, dt, A, B, C = a.computed()
    B, C = heads_from_groups(B, H), heads_from_groups(C, H)
    initial_state = a.initial_state

    spans = [(b, 0, T) for b in range(batch)] if bounds is None else [(0, s, e) for s, e in bounds.spans()]

    outs, finals = [], []
    for n, (b, s, e) in enumerate(spans):
        h0_HPN = x.new_zeros(H, P, N) if initial_state is None else initial_state[n].to(cd)
        y_THP, hT_HPN = _recurrent_one(x[b, s:e], dt[b, s:e], A, B[b, s:e], C[b, s:e], h0_HPN)
        outs.append(y_THP)
        finals.append(hT_HPN)

    y = torch.stack(outs, 0) if bounds is None else torch.cat(outs, 0)[None]
    if a.D is not None:
        y = y + a.D.to(cd)[:, None] * x
    final_state = torch.stack(finals, 0) if a.output_final_state else None
    return y.to(out_dtype), final_state
