"""Causal attention counted as the kernels run it (pipeline/estimate/fake.py `flop_registry`): a causal SDPA call
counts its visible (query, key) pairs, not the whole [q, k] block torch's counter takes for a fused kernel, so
the estimate's time at a GPU's peak is a lower bound. Each count is checked against an independent one: the
same attention on real tensors with the mask written out, its open entries counted (`count_flops`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from hylo.kernels import packed_sdpa
from hylo.pipeline.estimate.fake import causal_pairs, count_flops, fake_tensors, flop_registry
from hylo.pipeline.estimate.fake_group import fused_attention

B, H, E = 1, 2, 16


def dense(L: int, S: int) -> int:
    """torch's count of one SDPA call, forward and backward: the whole [L, S] block."""
    q, k = (B, H, L, E), (B, H, S, E)
    return sdpa_flop_count(q, k, k) + sdpa_backward_flop_count(q, q, k, k)


def fake_count(L: int, S: int, **kw) -> int:
    """The estimate's count of one SDPA call on fake tensors, forward and backward."""
    with fake_tensors() as host:
        host.flop_registry = flop_registry()
        q = torch.empty(B, H, L, E, requires_grad=True)
        k, v = (torch.empty(B, H, S, E, requires_grad=True) for _ in range(2))
        o = F.scaled_dot_product_attention(q, k, v, **kw)
        torch.autograd.grad(o, (q, k, v), torch.empty_like(o))
        return host.flops


def masked_count(L: int, S: int) -> int:
    """The same attention on real tensors with its lower-right causal mask written out: the mask's open entries."""
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)

    def run() -> None:
        q = torch.randn(B, H, L, E, requires_grad=True)
        k, v = (torch.randn(B, H, S, E, requires_grad=True) for _ in range(2))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.autograd.grad(o, (q, k, v), torch.ones_like(o))

    return count_flops(run)[1]


def test_causal_pairs_by_hand():
    assert causal_pairs(4, 4) == 10  # 1 + 2 + 3 + 4
    assert causal_pairs(2, 5) == 4 + 5  # the last 2 queries over 5 keys, aligned at the lower right
    assert causal_pairs(5, 2) == 3  # more queries than keys: the keys' triangle


@pytest.mark.parametrize("L", [64, 257])
def test_a_causal_call_counts_its_triangle_as_the_written_out_mask_does(L: int):
    got = fake_count(L, L, is_causal=True)
    # about half of torch's dense count, exactly its visible pairs, and the same as the real masked attention
    assert got == pytest.approx(dense(L, L) * (L + 1) / (2 * L), rel=1e-6)
    assert got == pytest.approx(masked_count(L, L), rel=1e-6)
    assert fake_count(L, L) == dense(L, L)  # no mask: the whole block


def test_the_split_rows_lower_right_causal_block_counts_its_visible_pairs():
    """A split row's last rank: its L queries over the S keys from the document's start (hylo/seq_parallel.py's
    `causal_lower_right`), as the estimator runs it (`fused_attention`: `is_causal` on fake tensors)."""
    import torch.nn.attention.bias as masks

    L, S = 48, 80
    with fake_tensors() as host, fused_attention():
        host.flop_registry = flop_registry()
        q = torch.empty(B, H, L, E, requires_grad=True)
        k, v = (torch.empty(B, H, S, E, requires_grad=True) for _ in range(2))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.causal_lower_right(L, S))
        torch.autograd.grad(o, (q, k, v), torch.empty_like(o))
        got = host.flops
    assert got == pytest.approx(masked_count(L, S), rel=1e-6)
    assert got == pytest.approx(dense(L, S) * causal_pairs(L, S) / (L * S), rel=1e-6)
    assert got < dense(L, S)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_a_packed_row_counts_each_documents_triangle_and_stays_a_lower_bound_of_the_grouped_kernel(impl: str):
    """Block-diagonal attention over a packed row (`packed_causal_sdpa`): each call causal, so the count is the
    documents' triangles, plus (grouped) the padding the kernel runs; never the row's [T, T] square."""
    docs = [100, 90, 30, 7]
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    T = cu[-1]
    with fake_tensors() as host, packed_sdpa.implementation(impl):
        host.flop_registry = flop_registry()
        q, k, v = (torch.empty(B, H, T, E, requires_grad=True) for _ in range(3))
        o = packed_sdpa.packed_causal_sdpa(q, k, v, tuple(cu))
        torch.autograd.grad(o, (q, k, v), torch.empty_like(o))
        got = host.flops
    # per (query, key) pair: the forward's two products and the backward's four, at E
    per_pair = dense(1, 1)
    own = sum(causal_pairs(n, n) for n in docs) * per_pair
    if impl == "loop":
        assert got == own
    else:
        # the groups as planned, each document padded to its group's longest: what the grouped kernel runs
        ran = sum(len(ds) * causal_pairs(L, L) for L, ds in packed_sdpa.plan_groups(tuple(cu))) * per_pair
        assert got == ran and own <= got <= (1 + packed_sdpa.SLACK) * own
    assert got < dense(T, T) / 4
