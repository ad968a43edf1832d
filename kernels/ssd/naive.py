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

from hylo.kernels.checks import compute_dtype
from hylo.kernels.ssd.checks import check_inputs, heads_from_groups
from hylo.kernels.varlen import DocBounds


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


def naive_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | DocBounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference SSD scan, one token at a time.

    Args:
        x: [B, T, H, P]; dt: [B, T, H] (positive step, softplus already applied); A: [H] (negative);
        B, C: [B, T, G, N]; D: [H] or None (skip term D * x).
        initial_state: [S, H, P, N] (S = B, or the number of sequences with `cu_seqlens`).
        output_final_state: also return the state after the last token of each sequence.
        cu_seqlens: [S + 1] int (or `hylo.kernels.varlen.DocBounds`), B must be 1; sequences never
            exchange state.

    Returns:
        y: [B, T, H, P] in x's dtype; final_state: [S, H, P, N] (fp32, or float64 for float64 inputs)
        or None.
    """
    batch, T, H, P, G, N, S, bounds = check_inputs("naive_ssd", x, dt, A, B, C, D, initial_state, cu_seqlens)
    out_dtype, cd = x.dtype, compute_dtype(x, dt, B, C)
    x, dt, A, B, C = (t.to(cd) for t in (x, dt, A, B, C))
    B, C = heads_from_groups(B, H), heads_from_groups(C, H)

    spans = [(b, 0, T) for b in range(batch)] if bounds is None else [(0, s, e) for s, e in bounds.spans()]

    outs, finals = [], []
    for n, (b, s, e) in enumerate(spans):
        h0_HPN = x.new_zeros(H, P, N) if initial_state is None else initial_state[n].to(cd)
        y_THP, hT_HPN = _recurrent_one(x[b, s:e], dt[b, s:e], A, B[b, s:e], C[b, s:e], h0_HPN)
        outs.append(y_THP)
        finals.append(hT_HPN)

    y = torch.stack(outs, 0) if bounds is None else torch.cat(outs, 0)[None]
    if D is not None:
        y = y + D.to(cd)[:, None] * x
    final_state = torch.stack(finals, 0) if output_final_state else None
    return y.to(out_dtype), final_state
