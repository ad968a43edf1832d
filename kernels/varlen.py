"""Chunk-aligned layout of a batch or a packed row, shared by the chunked GDN and SSD torch paths.

Legend: B batch, T tokens, H heads, d feature dim, C chunk length, Nc chunks, Tp = Nc * C (padded
length), M = B * H (batch and heads flattened).

The chunked scans cut the time axis into chunks of C tokens and carry a state from chunk to chunk.
* Plain batch (`cu_seqlens is None`): the T tokens are one sequence per batch row, zero-padded at
  the end to Tp; chunk 0 is the first and chunk Nc - 1 the last chunk of sequence 0 (every row).
* Packed row (B == 1, `cu_seqlens` [N + 1]): each of the N documents is laid out on its own run of
  chunks, starting chunk-aligned, its tail zero-padded to a multiple of C (C = min(chunk_size,
  longest document)). `pos_T` maps token t of the packed row to its row of the padded [Tp] layout;
  `first_chunk` / `last_chunk` map the first / last chunk of each non-empty document to the
  document's index, so the state loop knows where to load a document's initial state and where to
  read its final state. Empty documents own no chunk (their final state is their initial state).
The kernels choose padding values that leave the state untouched (zero decay and zero input), so a
document's final state is the state after its last chunk. One scatter and one gather per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ChunkLayout:
    """Where tokens go in the chunk-padded layout and where each sequence starts and ends."""

    # chunk length C and number of chunks Nc
    chunk_len: int
    Nc: int
    # token t of the packed row -> row in the padded [Tp] layout (varlen only)
    pos_T: torch.Tensor | None
    # chunk index -> sequence index, for the first / last chunk of each non-empty sequence
    first_chunk: dict[int, int]
    last_chunk: dict[int, int]
    # number of sequences (documents with cu_seqlens; 1 per batch row without)
    n_seqs: int


def chunk_layout(T: int, chunk_size: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkLayout:
    """The layout of T tokens in chunks of at most `chunk_size` (see the module docstring)."""
    if cu_seqlens is None:
        C = min(chunk_size, T)
        Nc = -(-T // C)
        return ChunkLayout(C, Nc, None, {0: 0}, {Nc - 1: 0}, 1)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]
    C = max(1, min(chunk_size, int(lens.max())))
    n_chunks = (lens + C - 1) // C
    chunk0 = torch.cumsum(n_chunks, 0) - n_chunks
    seq_T = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    pos_T = chunk0[seq_T] * C + (torch.arange(T) - cu[:-1][seq_T])
    first, last = {}, {}
    for i, (c0, nc) in enumerate(zip(chunk0.tolist(), n_chunks.tolist())):
        if nc:
            first[c0] = i
            last[c0 + nc - 1] = i
    return ChunkLayout(C, int(n_chunks.sum()), pos_T.to(device), first, last, lens.numel())


def to_chunks(x_BTHd: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """[B, T, H, d] -> [Nc, B*H, C, d], zero-padded."""
    batch, T, H, d = x_BTHd.shape
    Tp = lay.Nc * lay.chunk_len
    if lay.pos_T is None:
        x_BTHd = F.pad(x_BTHd, (0, 0, 0, 0, 0, Tp - T))
    else:
        x_BTHd = x_BTHd.new_zeros(1, Tp, H, d).index_copy(1, lay.pos_T, x_BTHd)
    x = x_BTHd.reshape(batch, lay.Nc, lay.chunk_len, H, d).permute(1, 0, 3, 2, 4)
    return x.reshape(lay.Nc, batch * H, lay.chunk_len, d)


def from_chunks(x_NcMCd: torch.Tensor, lay: ChunkLayout, batch: int, T: int, H: int) -> torch.Tensor:
    """[Nc, B*H, C, d] -> [B, T, H, d] (drops the padding)."""
    d = x_NcMCd.shape[-1]
    x = x_NcMCd.reshape(lay.Nc, batch, H, lay.chunk_len, d).permute(1, 0, 3, 2, 4)
    x = x.reshape(batch, lay.Nc * lay.chunk_len, H, d)
    if lay.pos_T is None:
        return x[:, :T]
    return x.index_select(1, lay.pos_T)
