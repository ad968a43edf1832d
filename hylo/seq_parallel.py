"""Sequence parallelism: one packed row split by tokens over the N ranks of a group, exact against the unsplit row.

Legend: T tokens of the unsplit row, t = T / N tokens of this rank ([start, end)), N ranks of the group,
D hidden, R + P the MLA latent + roped key width, H heads, K / V key / value head dims (GDN),
P / Ns head dim / state size (Mamba-2), W conv_size - 1.

A rank's forward takes its tokens, their boundaries as `cu_seqlens` (`shard.local`) and the shard as its own
argument (`shard=`, a `RowShard` built by `shard_row` from the unsplit row's `DocBounds`; None for a whole
row). Embeddings, norms, MLPs and the LM head are per token and need nothing. The mixers exchange what
crosses the split:
* MLA: every rank all-gathers the normalised latent and the pre-RoPE shared key, R + P values per token
  (192 for the 3B recipe), and attends its queries to the keys from the start of each of its documents
  (the first one may start on an earlier rank: its keys are decompressed from the gathered latent, and
  the causal mask is aligned to the bottom right). Ulysses (all-to-all of q, k, v by heads) would send
  H * (2E + V) values per token each way and needs H divisible by N; the latent is the cheaper
  (`hylo estimate --sequence-parallel N` prints both).
* GDN / Mamba-2 (state passing, whatever the head count): the short conv takes the previous rank's last W
  pre-conv inputs (one all-gather of W tokens); the recurrence runs the rank's chunk from a zero state,
  all ranks all-gather that final state (and, for a rank lying inside one document, the transition
  that carries an incoming state through its chunk: a [H, K, K] matrix for GDN, the product of the
  per-token (I - beta k k^T) exp(g), one decay per head for Mamba-2) in ONE collective, each rank composes
  its incoming state from the ranks before it and, when its first document came from an earlier rank,
  runs its chunk again from that state. Through the same kernels as the unsplit row
  (`chunk_gated_delta_rule` / `chunk_ssd`: fla on GPU, torch on CPU), so NVIDIA and AMD take the same
  path (fla's own `fla.ops.cp` affine chain requires NVIDIA Ampere or newer).
* Teachers (stage 2's in-process teacher, stage 1's frozen base: transformers models) split with the row too:
  `split_attention` runs their attention over the group, all-gathering the roped keys and values
  (`shard.teacher` "allgather", any head count) or by DeepSpeed's all-to-all of heads ("ulysses").
* Every collective is differentiable: the forward all-gathers, the backward sums the gathered gradients
  over the group (`all_reduce`, or `reduce_scatter` where the backend has it) and keeps the rank's part.
  Each rank backpropagates the loss of its own tokens; the sum over the group of the ranks' parameter
  gradients is the unsplit row's gradient.
* Collective order: one collective per MLA layer and two per linear layer, each data-dependent on the
  one before, and every gathered tensor is part of every rank's graph (a zero-weighted term where a
  rank does not need it), so every rank runs the same backward collectives in the same order, also in
  activation-checkpoint recomputes. Ranks of a group must run the same layers in the same order.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hylo.kernels.gdn import chunk_gated_delta_rule
from hylo.kernels.packed_sdpa import packed_causal_sdpa
from hylo.kernels.ssd import chunk_ssd
from hylo.kernels.varlen import DocBounds, positions_from_cu_seqlens


class RowShard(NamedTuple):
    """One rank's tokens [start, end) of a packed row of `total` tokens split over a group of
    `sequence_parallel` ranks (the setting `train.sequence_parallel`).

    `local` holds the shard's boundaries (the row's clipped to the shard, 0-based) and, as its
    `positions`, the in-document positions of the UNSPLIT row for these tokens (RoPE and the conv masks
    use them). `full` is the unsplit row's boundaries. A NamedTuple so that hooks walking a module's
    inputs (DeepSpeed ZeRO-3) see its tensors."""

    local: DocBounds
    start: int
    end: int
    total: int
    rank: int
    sequence_parallel: int
    group: Any
    full: tuple[int, ...]
    # how MLA layers see the rest of the row: "latent" (gather R + P per token) or "ulysses" (DeepSpeed's
    # all-to-all of q, k, v by heads and of the output back; heads must divide by the group size)
    mla: str = "latent"
    # how the teacher and stage 1's base run on a split row (`train.sequence_parallel_teacher`): "allgather"
    # or "ulysses" (this rank's tokens only, `split_attention`), "whole" (the whole row, cut to this rank's tokens)
    teacher: str = "allgather"

    @property
    def continues_in(self) -> bool:
        """This shard's first document started on an earlier rank."""
        return continues(self.full, self.start)

    def doc_start(self, i: int) -> int:
        """Start of the unsplit row's document holding token i."""
        return max(b for b in self.full if b <= i)


def continues(full: tuple[int, ...], i: int) -> bool:
    """Token i is not the first of its document (so a shard starting at i receives a state)."""
    return i > 0 and i not in full


def shard_range(T: int, rank: int, sequence_parallel: int) -> tuple[int, int]:
    """[start, end) of rank `rank` of `sequence_parallel` in an equal contiguous split of T tokens."""
    if sequence_parallel < 1 or not 0 <= rank < sequence_parallel:
        raise ValueError(f"sequence parallelism: rank {rank} of a group of {sequence_parallel}")
    if T % sequence_parallel:
        raise ValueError(f"sequence parallelism: a row of {T} tokens does not split into {sequence_parallel} equal parts "
                         f"(data.seq_len must be a multiple of train.sequence_parallel)")
    t = T // sequence_parallel
    return rank * t, (rank + 1) * t


MLA_MODES = ("latent", "ulysses")
TEACHER_SPLITS = ("allgather", "ulysses", "whole")


def shard_row(bounds: DocBounds, rank: int, sequence_parallel: int, group: Any = None, mla: str = "latent",
              teacher: str = "allgather") -> RowShard:
    """The shard of rank `rank` (of `sequence_parallel`) of the unsplit row with boundaries `bounds`."""
    if mla not in MLA_MODES:
        raise ValueError(f"sequence parallelism: MLA mode {mla!r} is not one of {', '.join(MLA_MODES)}")
    if teacher not in TEACHER_SPLITS:
        raise ValueError(f"sequence parallelism: teacher split {teacher!r} is not one of {', '.join(TEACHER_SPLITS)}")
    full = tuple(int(b) for b in bounds.host)
    T = full[-1]
    start, end = shard_range(T, rank, sequence_parallel)
    cut = sorted({0, end - start, *(b - start for b in full if start < b < end)})
    device = bounds.positions.device
    local = DocBounds.make(torch.tensor(cut, dtype=torch.int32, device=device), cut, bounds.positions[start:end])
    return RowShard(local, start, end, T, rank, sequence_parallel, group, full, mla, teacher)


def shard_bounds(shard: RowShard, B: int, T: int, cu_seqlens: Any, cache: Any,
                 bad: Callable[[str], NoReturn]) -> DocBounds:
    """The boundaries of a split row's tokens on this rank (`shard.local`), once a forward's inputs fit the
    shard: one row (B == 1) of the shard's tokens, no generation cache, and `cu_seqlens` None or the shard's
    own boundaries. `bad(message)` raises the layer's error."""
    t = shard.end - shard.start
    if cache is not None or B != 1 or T != t:
        bad(f"a split row (RowShard) needs B == 1, no cache and the shard's {t} tokens; got B={B}, T={T}"
            + (", a cache" if cache is not None else ""))
    if cu_seqlens is not None and cu_seqlens is not shard.local:
        given = cu_seqlens.host if isinstance(cu_seqlens, DocBounds) else tuple(int(b) for b in cu_seqlens)
        if tuple(given) != shard.local.host:
            bad(f"with a shard, cu_seqlens must be the shard's own boundaries {shard.local.host} "
                f"(shard.local) or None; got {tuple(given)}")
    return shard.local


def key_positions(shard: RowShard, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """In-document positions [hi - lo] of the unsplit row's tokens lo..hi-1."""
    cut = sorted({0, hi - lo, *(b - lo for b in shard.full if lo < b < hi)})
    return positions_from_cu_seqlens(torch.tensor(cut, dtype=torch.int64), hi - lo).to(device)


# ------------------------------------------------------------------------------------------ collective
def _group_ranks(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class _GatherFromGroup(torch.autograd.Function):
    """[*shape] on every rank -> [N, *shape] (rank-major); backward: the group's gradients summed, own part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        rank, size = _group_ranks(group)
        ctx.group, ctx.rank, ctx.size = group, rank, size
        x = x.contiguous()
        out = x.new_empty((size, *x.shape))
        dist.all_gather(list(out.unbind(0)), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.GLOO:
            # gloo has no reduce_scatter: sum everything, keep ours
            dist.all_reduce(grad, group=ctx.group)
            return grad[ctx.rank].clone(), None
        # flat, so that every backend takes it (the input is N times the output along dim 0)
        out = grad.new_empty(grad[0].numel())
        dist.reduce_scatter_tensor(out, grad.reshape(-1), group=ctx.group)
        return out.view(grad.shape[1:]), None


def attend_shard(mla: Any, q_nope_BTHN: torch.Tensor, q_pe_BTHP: torch.Tensor, c_kv_BTR: torch.Tensor,
                 k_pe_BTP: torch.Tensor, shard: RowShard) -> torch.Tensor:
    """An MLA layer's attention over a split row (`mla`: the `MLAttention`, for its projections and RoPE).

    The group's latents + raw k_pe are gathered (R + P per token) and the keys of [start of this shard's first
    document, shard end) decompressed here. This rank's queries attend to them: its first document with a
    bottom-right-aligned causal mask (its keys may start on an earlier rank), the others as in the unsplit row.
    `shard.mla == "ulysses"` takes DeepSpeed's all-to-all by heads instead (`_attend_ulysses`)."""
    T, V, R = q_nope_BTHN.shape[1], mla.v_head_dim, mla.kv_lora_rank
    if shard.mla == "ulysses":
        return _attend_ulysses(mla, q_nope_BTHN, q_pe_BTHP, c_kv_BTR, k_pe_BTP, shard)
    ks = shard.doc_start(shard.start)
    kv_1SX = gather_tokens(torch.cat([c_kv_BTR, k_pe_BTP], -1), shard, end=shard.end)[:, ks:]
    c_kv_1SR, k_pe_1SP = kv_1SX.split([R, mla.qk_rope_head_dim], dim=-1)
    pos_1S = key_positions(shard, ks, shard.end, q_pe_BTHP.device)[None]
    k_BHSE, v_BHSV = mla.decompressed_kv(c_kv_1SR, k_pe_1SP, mla.rotary_emb(pos_1S, q_pe_BTHP.dtype))
    q_BHTE = torch.cat([q_nope_BTHN, q_pe_BTHP], dim=-1).transpose(1, 2)
    q_BHTE, k_BHSE, v_BHSV = mla.equal_head_dims(q_BHTE, k_BHSE, v_BHSV)
    o_BHTX = attend_keys(q_BHTE, k_BHSE, v_BHSV, shard, mla.softmax_scale)
    assert o_BHTX.shape[2] == T
    return o_BHTX[..., :V].transpose(1, 2)


def attend_keys(q_BHTE: torch.Tensor, k_BGSE: torch.Tensor, v_BGSV: torch.Tensor, shard: RowShard,
                scale: float | None) -> torch.Tensor:
    """This rank's queries [B, H, t, E] attending to the row's keys and values of tokens [start of this shard's
    first document, shard end) (S of them, G heads: H, or fewer that divide H), documents isolated: the first
    document with a bottom-right-aligned causal mask (its keys may start on an earlier rank), the others as in
    the unsplit row. -> [B, H, t, V]. Grouped keys stay grouped where they reach back to earlier ranks (SDPA's
    `enable_gqa`); only this rank's own keys are repeated to H heads, for its packed documents."""
    # lazy: torch.nn.attention.bias imports torch._dynamo and triton (this module stays light for spawned ranks)
    from torch.nn.attention.bias import causal_lower_right

    gqa = k_BGSE.shape[1] != q_BHTE.shape[1]
    off, cu = shard.start - shard.doc_start(shard.start), shard.local.host
    first = cu[1]
    outs = []
    if off:
        mask = causal_lower_right(first, off + first)
        outs.append(F.scaled_dot_product_attention(q_BHTE[:, :, :first], k_BGSE[:, :, :off + first],
                                                   v_BGSV[:, :, :off + first], attn_mask=mask, scale=scale,
                                                   **({"enable_gqa": True} if gqa else {})))
        rest = [c - first for c in cu[1:]]
        q_BHTE, k_BGSE, v_BGSV = q_BHTE[:, :, first:], k_BGSE[:, :, off + first:], v_BGSV[:, :, off + first:]
    else:
        rest = list(cu)
    if len(rest) > 1:
        if gqa:
            rep = q_BHTE.shape[1] // k_BGSE.shape[1]
            k_BGSE, v_BGSV = k_BGSE.repeat_interleave(rep, dim=1), v_BGSV.repeat_interleave(rep, dim=1)
        if len(rest) == 2:
            outs.append(F.scaled_dot_product_attention(q_BHTE, k_BGSE, v_BGSV, is_causal=True, scale=scale))
        else:
            outs.append(packed_causal_sdpa(q_BHTE, k_BGSE, v_BGSV, tuple(rest), scale=scale))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _attend_ulysses(mla: Any, q_nope_BTHN: torch.Tensor, q_pe_BTHP: torch.Tensor, c_kv_BTR: torch.Tensor,
                   k_pe_BTP: torch.Tensor, shard: RowShard) -> torch.Tensor:
    """A split row through DeepSpeed's Ulysses (`ulysses_attend`): this rank's q, k, v (decompressed here) go
    all-to-all from tokens to heads, each rank attends H / N heads over the whole row, and the output goes
    back. Sends H * (2E + V) values per token each way against the latent gather's R + P (kept for
    comparison: `bench/sp_mla.py`)."""
    H, V = mla.num_heads, mla.v_head_dim
    if H % shard.sequence_parallel:
        raise mla._err(ulysses_problem(H, shard.sequence_parallel))
    pos_1T = shard.local.positions[None]
    k_BHTE, v_BHTV = mla.decompressed_kv(c_kv_BTR, k_pe_BTP, mla.rotary_emb(pos_1T, q_pe_BTHP.dtype))
    q_BHTE = torch.cat([q_nope_BTHN, q_pe_BTHP], dim=-1).transpose(1, 2)
    q_BHTE, k_BHTE, v_BHTV = mla.equal_head_dims(q_BHTE, k_BHTE, v_BHTV)
    return ulysses_attend(q_BHTE, k_BHTE, v_BHTV, shard, mla.softmax_scale)[..., :V].transpose(1, 2)


def ulysses_problem(heads: int, sequence_parallel: int, best: int | None = None) -> str:
    """Why Ulysses cannot split `heads` heads over `sequence_parallel` ranks, with the largest group size that
    can: `best` when the caller knows more rules (the pipeline's `largest_group`: it also divides the workers and
    splits the rows), else the largest that divides the heads."""
    if best is None:
        best = max(n for n in range(1, sequence_parallel + 1) if heads % n == 0)
    return (f"Ulysses splits the {heads} attention heads over the {sequence_parallel} ranks of a group: they must "
            f"divide (the largest group size that works is {best})")


def ulysses_attend(q_BHtE: torch.Tensor, k_BGtE: torch.Tensor, v_BGtV: torch.Tensor, shard: RowShard,
                   scale: float | None) -> torch.Tensor:
    """Ulysses (DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`) over a split row: this rank's
    queries [B, H, t, E] and keys / values of G heads go all-to-all from tokens to heads, each rank attends H / N
    query heads over the whole row (documents isolated by the unsplit row's boundaries), the output goes back:
    [B, H, t, V]. H must divide by N; keys and values are repeated to H heads first where G does not."""
    import deepspeed.comm  # lazy: deepspeed
    from deepspeed.sequence.layer import DistributedAttention  # lazy: deepspeed

    if not deepspeed.comm.is_initialized():
        raise RuntimeError("sequence parallelism: Ulysses runs DeepSpeed's collectives: call "
                           "deepspeed.init_distributed() first (the trainer does, train/loop.py)")
    H, G, N = q_BHtE.shape[1], k_BGtE.shape[1], shard.sequence_parallel
    if H % N:
        raise ValueError(f"sequence parallelism: {ulysses_problem(H, N)}")
    if G % N:
        k_BGtE, v_BGtV = (x.repeat_interleave(H // G, dim=1) for x in (k_BGtE, v_BGtV))
    full = shard.full

    def local(q_BThE: torch.Tensor, k_BTgE: torch.Tensor, v_BTgV: torch.Tensor, *_: object) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q_BThE, k_BTgE, v_BTgV))
        if k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        if len(full) == 2:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            o = packed_causal_sdpa(q, k, v, full, scale=scale)
        return o.transpose(1, 2)

    attn = DistributedAttention(local, shard.group, scatter_idx=2, gather_idx=1)
    o_BtHV = attn(*(x.transpose(1, 2) for x in (q_BHtE, k_BGtE, v_BGtV)), batch_dim_idx=0)
    return o_BtHV.transpose(1, 2)


def gather(x: torch.Tensor, shard: RowShard) -> torch.Tensor:
    """All-gather `x` over the shard's group, differentiably: [*shape] -> [N, *shape]."""
    return _GatherFromGroup.apply(x, shard.group)


def gather_tokens(x_1tC: torch.Tensor, shard: RowShard, end: int | None = None) -> torch.Tensor:
    """Every rank's tokens of x [1, t, C] -> the row's [1, T', C], T' = `end` (default T): tokens after `end`
    are dropped (they are gathered all the same, the collective has one shape)."""
    g_NtC = gather(x_1tC[0], shard)
    full_TC = g_NtC.reshape(-1, x_1tC.shape[-1])
    return full_TC[: shard.total if end is None else end].unsqueeze(0)


def touch(y: torch.Tensor, *gathered: torch.Tensor) -> torch.Tensor:
    """`y` joined to gathered tensors this rank did not otherwise use (a zero-weighted term), so their
    backward collective runs on every rank of the group."""
    for g in gathered:
        y = y + (g.sum() * 0).to(y.dtype)
    return y


# ------------------------------------------------------------------------------------------ linear mixers
def conv_prefix(pre_1tC: torch.Tensor, W: int, shard: RowShard) -> torch.Tensor:
    """The previous rank's last W pre-conv inputs, [1, C, W] (the conv's `prefix_BCW`; zeros on rank 0: the
    in-document positions of the shard mask taps that reach into another document)."""
    if pre_1tC.shape[1] < W:
        raise ValueError(f"sequence parallelism: a shard of {pre_1tC.shape[1]} tokens is shorter than the conv "
                         f"window ({W} tokens): use fewer ranks per row or longer rows")
    g_NWC = gather(pre_1tC[0, pre_1tC.shape[1] - W:], shard)
    prev_WC = g_NWC[shard.rank - 1] if shard.rank > 0 else g_NWC[0] * 0
    return prev_WC.t().unsqueeze(0)


def passes_through(full: tuple[int, ...], start: int, end: int) -> bool:
    """A chunk [start, end) lying inside one document that started before it: it carries a state through."""
    return continues(full, start) and not any(start < b < end for b in full)


def pass_states(shard: RowShard, final_S: torch.Tensor, transition: torch.Tensor | None,
                transition_shape: tuple[int, ...], apply: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the state entering this rank's first document or None when that document starts here, the gathered
    tensor for `touch`).

    `final_S` [*state]: this rank's last document's final state from a zero start; `transition`
    [*transition_shape]: what carries an incoming state through this rank's chunk, given when
    `passes_through` holds for this rank (else None); `apply(transition, state)` applies it. One
    all-gather of [final state | transition] (flattened; zeros where a rank has no transition) per layer,
    none when no document crosses a split."""
    N, t = shard.sequence_parallel, shard.end - shard.start
    through = [passes_through(shard.full, r * t, (r + 1) * t) for r in range(N)]
    if not any(continues(shard.full, r * t) for r in range(N)):
        return None, None
    n_S = final_S.numel()
    parts = [final_S.reshape(-1)]
    if any(through):
        n_tr = 1
        for d in transition_shape:
            n_tr *= d
        tr = transition.reshape(-1).to(final_S.dtype) if transition is not None else final_S.new_zeros(n_tr)
        if tr.numel() != n_tr:
            raise ValueError(f"sequence parallelism: transition of {tr.numel()} values, expected {transition_shape}")
        parts.append(tr)
    g_NX = gather(torch.cat(parts), shard)
    if not shard.continues_in:
        return None, g_NX
    state = None
    for r in range(shard.rank):
        S_r = g_NX[r, :n_S].view_as(final_S)
        if through[r] and state is not None:
            state = apply(g_NX[r, n_S:].view(transition_shape), state) + S_r
        else:
            state = S_r
    return state, g_NX


def scan_shard(scan: Any, shard: RowShard, transition: Any, transition_shape: tuple[int, ...],
               apply: Any) -> torch.Tensor:
    """A linear layer's scan on this rank's chunk of a split row, the unsplit row's output for these tokens.

    `scan(initial_state)` runs the layer's kernel on the chunk (its documents: `shard.local`) and returns
    (output, final states [docs, *state]); `transition()` gives the map that carries a state through a chunk
    lying inside one document ([*transition_shape]), `apply(transition, state)` applies it (`pass_states`)."""
    o0, S_N = scan(None)
    through = passes_through(shard.full, shard.start, shard.end)
    h_in, g_NX = pass_states(shard, S_N[-1], transition() if through else None, transition_shape, apply)
    if h_in is None:
        return o0 if g_NX is None else touch(o0, g_NX)
    # the first document continues from the earlier ranks: the chunk again, from the passed state
    return scan(torch.cat([h_in[None], h_in.new_zeros(shard.local.num_docs - 1, *h_in.shape)]))[0]


def gated_delta_rule_shard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           shard: RowShard, chunk_size: int) -> torch.Tensor:
    """The GDN layer's recurrence on this rank's chunk of a split row ([1, t, H, *] in, [1, t, H, V] out): the
    same output as the unsplit row's for these tokens (see the module docstring)."""
    kw = {"cu_seqlens": shard.local, "use_qk_l2norm_in_kernel": True, "chunk_size": chunk_size,
          "output_final_state": True}
    H, K = q.shape[2], q.shape[3]

    def transition() -> torch.Tensor:
        # the state map of the chunk: run it from the identity with zero values, S_end = M S_start
        eye = torch.eye(K, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        return chunk_gated_delta_rule(q, k, torch.zeros_like(k), g, beta, initial_state=eye.expand(1, H, K, K)
                                      .contiguous(), **kw)[1][0]

    return scan_shard(lambda h0: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kw), shard,
                      transition, (H, K, K), lambda M, S: torch.einsum("hkj,hjv->hkv", M, S))


def ssd_shard(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor | None, shard: RowShard, chunk_size: int) -> torch.Tensor:
    """The Mamba-2 scan on this rank's chunk of a split row: the unsplit row's output for these tokens. A
    chunk inside one document carries an incoming state through with one decay per head,
    exp(A * sum of dt)."""
    return scan_shard(lambda h0: chunk_ssd(x, dt, A, B, C, D=D, initial_state=h0, output_final_state=True,
                                           cu_seqlens=shard.local, chunk_size=chunk_size),
                      shard, lambda: torch.exp(A.to(dt.dtype) * dt[0].sum(0)), (x.shape[2],),
                      lambda d, S: d[:, None, None] * S)


# ------------------------------------------------------------------------------------------ HF teachers
_HF_SPLIT = "hylo_split"
_SPLIT_NOW: contextvars.ContextVar[RowShard | None] = contextvars.ContextVar("hylo_split_shard", default=None)


@contextlib.contextmanager
def split_attention(model: Any, shard: RowShard) -> Iterator[None]:
    """Inside the block, the transformers model `model` runs on this rank's tokens of a split row: call it with
    the shard's input ids and `shard.local.positions` as position ids (RoPE / YaRN at the unsplit row's
    positions). Every attention layer then sees the whole row's earlier keys of each document, as
    `shard.teacher` says:
    * "allgather": the roped keys and values (G kv heads) are all-gathered, the rank's queries attend to them
      (`attend_keys`); any head count; sends (N - 1) t * 2 G E values per rank and layer;
    * "ulysses": all-to-all by heads (`ulysses_attend`); H must divide by N; sends (N - 1) / N t (2H + 2G) E.
    For frozen models (a teacher, stage 1's base): under autograd the gathers are differentiable all the same.
    Any model whose attention goes through transformers' attention interface (checked: Llama, Qwen3);
    sliding-window or soft-capped attention is refused (`train.sequence_parallel_teacher: whole` runs them)."""
    if shard.teacher not in ("allgather", "ulysses"):
        raise ValueError(f"sequence parallelism: split_attention needs the teacher split allgather or ulysses, "
                         f"not {shard.teacher!r}")
    _register_hf_split()
    cfg = model.config
    before = cfg._attn_implementation
    token = _SPLIT_NOW.set(shard)
    cfg._attn_implementation = _HF_SPLIT
    try:
        yield
    finally:
        cfg._attn_implementation = before
        _SPLIT_NOW.reset(token)


@functools.cache
def _register_hf_split() -> None:
    """Our attention function and an empty mask under one name in transformers' interfaces (once a process)."""
    from transformers import AttentionInterface  # lazy: transformers
    from transformers.masking_utils import AttentionMaskInterface  # lazy: transformers

    AttentionInterface.register(_HF_SPLIT, _hf_split_attention)
    # the documents are isolated by the shard's boundaries: no [t, T] mask is built
    AttentionMaskInterface.register(_HF_SPLIT, lambda *args, **kwargs: None)


def _hf_split_attention(module: Any, q_BHtE: torch.Tensor, k_BGtE: torch.Tensor, v_BGtV: torch.Tensor,
                        attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                        sliding_window: int | None = None, softcap: float | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: [B, H, t, E] queries (roped), [B, G, t, E] keys and values
    -> ([B, t, H, V], no weights)."""
    shard = _SPLIT_NOW.get()
    layer = getattr(module, "layer_idx", "?")
    if shard is None:
        raise RuntimeError(f"attention {_HF_SPLIT!r} runs inside seq_parallel.split_attention only")
    if sliding_window is not None or softcap is not None:
        what = f"sliding-window attention ({sliding_window} tokens)" if sliding_window else f"softcap {softcap}"
        raise ValueError(f"sequence parallelism: layer {layer} of the teacher uses {what}, which the split "
                         f"teacher does not run: set train.sequence_parallel_teacher: whole")
    t = shard.end - shard.start
    if q_BHtE.shape[0] != 1 or q_BHtE.shape[2] != t:
        raise ValueError(f"sequence parallelism: a split teacher's layer {layer} got queries of shape "
                         f"{tuple(q_BHtE.shape)}; it runs one row of the shard's {t} tokens")
    if shard.teacher == "ulysses":
        o_BHtV = ulysses_attend(q_BHtE, k_BGtE, v_BGtV, shard, scaling)
    else:
        o_BHtV = _allgather_attend(q_BHtE, k_BGtE, v_BGtV, shard, scaling)
    return o_BHtV.transpose(1, 2).contiguous(), None


def _allgather_attend(q_BHtE: torch.Tensor, k_BGtE: torch.Tensor, v_BGtV: torch.Tensor, shard: RowShard,
                      scale: float | None) -> torch.Tensor:
    """The group's keys and values all-gathered (one collective of G (E + V) values per token), this rank's
    queries attending to those from the start of its first document: [B, H, t, V]."""
    H, G, t = q_BHtE.shape[1], k_BGtE.shape[1], q_BHtE.shape[2]
    E, V = k_BGtE.shape[-1], v_BGtV.shape[-1]
    kv_1tC = torch.cat([k_BGtE, v_BGtV], dim=-1).transpose(1, 2).reshape(1, t, G * (E + V))
    kv_1SC = gather_tokens(kv_1tC, shard, end=shard.end)[:, shard.doc_start(shard.start):]
    k_1GSE, v_1GSV = kv_1SC.view(1, -1, G, E + V).transpose(1, 2).split([E, V], dim=-1)
    if H % G:
        raise ValueError(f"sequence parallelism: {H} query heads do not group over {G} key-value heads")
    return attend_keys(q_BHtE, k_1GSE, v_1GSV, shard, scale)

