"""Causal attention over a packed row (block-diagonal, documents never see each other) through SDPA.

Legend: H heads, T tokens of the row, E head dim, n documents in a group, L a group's padded length.

Two implementations, the same function:
* `loop` (the reference): one causal `scaled_dot_product_attention` call per document. Exact and
  mask-free, but 2 launches (forward + backward) per document and layer: with many short documents
  (64 documents of 1K tokens at 64K) the GPU runs many small kernels.
* `grouped` (default): documents of similar length are stacked into one batched causal SDPA call
  per group, each padded at its END to the group's longest length L. Under a causal mask a real
  query (position j < its document's length) only sees keys at positions <= j, all real, so the
  padding changes nothing for real tokens; the padded query rows are dropped. Groups are formed
  greedily from the longest document down, while the group's padded attention area n * L^2 stays
  within (1 + SLACK) of its documents' own sum of l^2, so the padding costs at most SLACK more
  attention arithmetic. One gather of q/k/v and one of the output (index tensors built once per row
  on the host, cached, copied without blocking), no [T, T] mask.
When no two documents share a group (lengths all very different) `grouped` runs the loop.
`packed_attention` (a row's `DocBounds`) is the layers' entry, left out of a compiled block's graph.
`implementation("loop")` switches for a block (tests, benchmarks); `HYLO_PACKED_SDPA=loop` for a process.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from hylo.kernels.backend import kernel_call
from hylo.kernels.varlen import DocBounds

SLACK = 0.25
_CHOICES = ("grouped", "loop")
_FORCED: list[str | None] = [None]


def current_implementation() -> str:
    mode = _FORCED[0] or os.environ.get("HYLO_PACKED_SDPA", "grouped")
    if mode not in _CHOICES:
        raise ValueError(f"HYLO_PACKED_SDPA={mode!r} is not valid; allowed: {', '.join(_CHOICES)}")
    return mode


@contextlib.contextmanager
def implementation(mode: str) -> Iterator[None]:
    if mode not in _CHOICES:
        raise ValueError(f"packed SDPA implementation {mode!r} is not valid; allowed: {', '.join(_CHOICES)}")
    before = _FORCED[0]
    _FORCED[0] = mode
    try:
        yield
    finally:
        _FORCED[0] = before


@functools.lru_cache(maxsize=64)
def plan_groups(cu: tuple[int, ...], slack: float = SLACK) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """((L, document indices), ...): documents grouped by length, longest first."""
    lengths = sorted(((cu[i + 1] - cu[i], i) for i in range(len(cu) - 1)), reverse=True)
    groups: list[tuple[int, list[int], int]] = []
    for length, doc in lengths:
        if groups:
            L, docs, area = groups[-1]
            if (len(docs) + 1) * L * L <= (1 + slack) * (area + length * length):
                docs.append(doc)
                groups[-1] = (L, docs, area + length * length)
                continue
        groups.append((length, [doc], length * length))
    return tuple((L, tuple(docs)) for L, docs, _ in groups)


@functools.lru_cache(maxsize=8)
def _indices(cu: tuple[int, ...], device: torch.device) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """(group sizes n*L, gather index [sum n*L] into the row, inverse index [T] into the padded layout)."""
    gather: list[int] = []
    inverse = [0] * cu[-1]
    sizes = []
    for L, docs in plan_groups(cu):
        for doc in docs:
            s, e = cu[doc], cu[doc + 1]
            for j in range(e - s):
                inverse[s + j] = len(gather) + j
            # padded positions repeat the document's last token: only padded queries ever see them
            gather.extend(min(s + j, e - 1) for j in range(L))
        sizes.append(L * len(docs))
    host = (torch.tensor(gather, dtype=torch.long), torch.tensor(inverse, dtype=torch.long))
    if device.type == "cuda":
        # from pinned memory without blocking: a pageable copy would synchronise the GPU
        gather_t, inverse_t = (t.pin_memory().to(device, non_blocking=True) for t in host)
    else:
        gather_t, inverse_t = (t.to(device) for t in host)
    return tuple(sizes), gather_t, inverse_t


def packed_causal_sdpa_loop(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                            cu: tuple[int, ...], scale: float | None = None) -> torch.Tensor:
    """The reference: one causal SDPA call per document of the packed row (B == 1)."""
    outs = [F.scaled_dot_product_attention(q_BHTE[:, :, s:e], k_BHTE[:, :, s:e], v_BHTE[:, :, s:e],
                                           is_causal=True, scale=scale)
            for s, e in zip(cu[:-1], cu[1:])]
    return torch.cat(outs, dim=2)


def packed_causal_sdpa(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                       cu: tuple[int, ...], scale: float | None = None) -> torch.Tensor:
    """Block-diagonal causal attention of a packed row [1, H, T, E] with host boundaries `cu`."""
    groups = plan_groups(tuple(cu))
    if current_implementation() == "loop" or len(groups) == len(cu) - 1:
        return packed_causal_sdpa_loop(q_BHTE, k_BHTE, v_BHTE, cu, scale)
    sizes, gather, inverse = _indices(tuple(cu), q_BHTE.device)
    _, H, _, _ = q_BHTE.shape
    qkv = [x.index_select(2, gather).split(sizes, dim=2) for x in (q_BHTE, k_BHTE, v_BHTE)]
    outs = []
    for (L, docs), q, k, v in zip(groups, *qkv):
        n = len(docs)
        # [1, H, n*L, E] -> [n, H, L, E]: the group's documents as a batch
        q, k, v = (x.reshape(H, n, L, x.shape[-1]).transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1).reshape(1, H, n * L, o.shape[-1]))
    return torch.cat(outs, dim=2).index_select(2, inverse)


@kernel_call
def packed_attention(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor, bounds: DocBounds,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of a packed row [1, H, T, E] within its documents (`DocBounds`): one causal SDPA call
    for a row of one document, else `packed_causal_sdpa` on the row's host boundaries. The layers' entry: a
    compiled decoder block (`train.compile: blocks`) leaves this call out of its graph, as it leaves fla's,
    since how the documents are grouped is decided on the host ints (a graph would guard on them)."""
    if bounds.num_docs == 1:
        # contiguous as the packed paths' output is: the compiled code after the call sees one layout
        o = F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTE, is_causal=True, scale=scale)
        return o.contiguous()
    return packed_causal_sdpa(q_BHTE, k_BHTE, v_BHTE, bounds.host, scale)
