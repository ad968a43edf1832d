"""The boundaries of a packed row: the one rule they follow, positions inside documents, the boundaries kept
on the host for the layers, and the chunk-aligned layout of the chunked GDN / SSD scans.

Legend: T tokens of a row, N documents, B batch, H heads, d feature dim, C chunk length, Nc chunks,
Tp = Nc * C (padded length), M = B * H (batch and heads flattened).

The row itself (its fields, their check, the on-disk columns, its id) is `hylo.pipeline.data.rows`; this
module is the compute the model, its layers and the kernels do with its boundaries:
* `cu_seqlens` [N + 1] (integers; int32 in the model): starts at 0, ends at T and is strictly increasing,
  so every document holds at least one token (`boundaries_problem`, the one rule; an empty document has
  no use and is refused everywhere, with the same message).
* positions: each token's index inside its document, restarting at 0 at every boundary
  (`positions_from_cu_seqlens`).
* The model takes one packed row as a batch of one: `input_ids` [1, T] and `cu_seqlens` [N + 1].
* `DocBounds` carries the checked boundaries of one forward: the device tensor that kernels read, the same
  numbers as host ints, and each token's position inside its document (on the device). `HyLoModel.forward`
  builds it once, or takes it as given: from a row read on the host (`DocBounds.from_host`, or the reader's
  checked row, `PackedRow.bounds`) no boundary is read back from the device; from a device tensor (a plain
  HF-style call) it makes its one device-to-host copy. It hands it to every layer, which hands it to its
  kernel, so no layer reads `cu_seqlens` back to the host, in the forward or in an activation-checkpoint
  recompute. A layer or kernel called alone with a tensor builds its own `DocBounds` under the same rule
  (`doc_bounds`), raising its own error class (`BoundaryError` by default).

Chunk layout of the chunked scans (`chunk_layout`), which cut the time axis into chunks of C tokens and
carry a state from chunk to chunk:
* Plain batch (no boundaries): the T tokens are one sequence per batch row, zero-padded at the end to
  Tp; chunk 0 is the first and chunk Nc - 1 the last chunk of sequence 0 (every row).
* Packed row (B == 1): each document is laid out on its own run of chunks, starting chunk-aligned, its
  tail zero-padded to a multiple of C (C = min(chunk_size, longest document)). `pos_T` maps token t of
  the packed row to its row of the padded [Tp] layout; `first_chunk` / `last_chunk` map the first / last
  chunk of each document to the document's index, so the state loop knows where to load a document's
  initial state and where to read its final state.
The kernels choose padding values that leave the state untouched (zero decay and zero input), so a
document's final state is the state after its last chunk. One scatter and one gather per tensor.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import torch
import torch.nn.functional as F

Bad = Callable[[str], NoReturn]



class BoundaryError(ValueError):
    """Boundaries `cu_seqlens` break the rule of this module (a packed row's own error,
    `hylo.pipeline.data.rows.PackedRowError`, is one of these)."""


def _raise_boundary_error(message: str) -> NoReturn:
    raise BoundaryError(message)


# ----------------------------------------------------------------------------------------- the rule
def _shown(cu: Sequence[int]) -> str:
    if len(cu) <= 10:
        return str(list(cu))
    return f"[{', '.join(map(str, cu[:5]))}, ..., {', '.join(map(str, cu[-3:]))}] ({len(cu)} entries)"


def boundaries_problem(cu: Sequence[int], T: int) -> str | None:
    """What is wrong with boundaries `cu` (host ints) of a row of T tokens, or None: the one rule."""
    if len(cu) < 2:
        return f"cu_seqlens must hold at least 2 entries [0, ..., T] (one document or more), got {_shown(cu)}"
    if cu[0] != 0:
        return f"cu_seqlens must start at 0, got {_shown(cu)}"
    if cu[-1] != T:
        return f"cu_seqlens must end at T={T} (the row's length), got {_shown(cu)}"
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        if e <= s:
            return (f"cu_seqlens must be strictly increasing (every document holds a token); document {i} "
                    f"spans [{s}, {e}) in {_shown(cu)}")
    return None


def host_cu_seqlens(cu_seqlens: Any, T: int, bad: Bad = _raise_boundary_error) -> tuple[int, ...]:
    """Check `cu_seqlens` (tensor, array or sequence of ints) for a row of T tokens; return it as host ints.
    A device tensor is copied to the host once, here."""
    if not isinstance(cu_seqlens, torch.Tensor):
        try:
            cu_seqlens = torch.as_tensor(cu_seqlens)
        except (TypeError, ValueError, RuntimeError) as e:
            bad(f"cu_seqlens is not an integer array ({e})")
    if cu_seqlens.dim() != 1:
        bad(f"cu_seqlens must be 1-D [N + 1], got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        bad(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    host = tuple(cu_seqlens.tolist())
    problem = boundaries_problem(host, T)
    if problem is not None:
        bad(problem)
    return host


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] int64 index of each token inside its document, on `cu_seqlens`' device (valid boundaries;
    no device-to-host copy)."""
    cu = cu_seqlens.to(torch.long)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=T)
    return torch.arange(T, device=cu.device) - starts


# ----------------------------------------------------------------------------------------- boundaries
class HostInts:
    """A row's N + 1 boundaries as Python ints (`values`), held in an object of their own: what a compiled
    decoder block passes on to the kernels it leaves out of its graph without reading it, so torch.compile
    guards on its type only, never on a document count or an offset (a tuple would be guarded entry by
    entry, and every new layout would compile again). Compared and hashed by value."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[int]) -> None:
        self.values: tuple[int, ...] = tuple(values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostInts) and other.values == self.values

    def __hash__(self) -> int:
        return hash(self.values)

    def __repr__(self) -> str:
        return f"HostInts({list(self.values)})"

    def __getstate__(self) -> tuple[int, ...]:
        return self.values

    def __setstate__(self, values: tuple[int, ...]) -> None:
        self.values = values


class DocBounds(NamedTuple):
    """The checked boundaries of one packed row, for the model, its layers and kernels (see the module
    docstring). Build it with `from_tensor` / `from_host` / `make` (or `doc_bounds`), which apply the rule.
    A NamedTuple, so that hooks that walk a module's inputs (DeepSpeed ZeRO-3) see its tensors."""

    # [N + 1] integer boundaries on the compute device (what the GPU kernels read)
    cu_seqlens: torch.Tensor
    # the same N + 1 boundaries as Python ints (`host`: what the layers slice and lay out with)
    ints: HostInts
    # [T] int64 index of each token inside its document, on the compute device
    positions: torch.Tensor

    @classmethod
    def make(cls, cu_seqlens: torch.Tensor, host: Sequence[int], positions: torch.Tensor) -> DocBounds:
        """From parts already checked (a row as read, a shard's cut of checked bounds)."""
        return cls(cu_seqlens, HostInts(host), positions)

    @classmethod
    def from_tensor(cls, cu_seqlens: torch.Tensor, T: int, bad: Bad = _raise_boundary_error) -> DocBounds:
        """Check a (device) boundaries tensor: its one copy to the host."""
        host = host_cu_seqlens(cu_seqlens, T, bad)
        return cls.make(cu_seqlens, host, positions_from_cu_seqlens(cu_seqlens, T))

    @classmethod
    def from_host(cls, cu_seqlens: Any, T: int, device: torch.device | str | None = None,
                  bad: Bad = _raise_boundary_error) -> DocBounds:
        """Boundaries held on the host (a row as read): checked there, then copied to `device`."""
        host = host_cu_seqlens(cu_seqlens, T, bad)
        cu = torch.tensor(host, dtype=torch.int32)
        return cls.make(cu.to(device), host, positions_from_cu_seqlens(cu, T).to(device))

    @property
    def host(self) -> tuple[int, ...]:
        """The N + 1 boundaries as Python ints (read outside a compiled block's graph only)."""
        return self.ints.values

    @property
    def num_docs(self) -> int:
        return len(self.host) - 1

    @property
    def num_tokens(self) -> int:
        return self.host[-1]

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) token spans of the documents."""
        return list(zip(self.host[:-1], self.host[1:]))


def doc_bounds(cu_seqlens: torch.Tensor | DocBounds | Sequence[int], T: int, bad: Bad = _raise_boundary_error,
               device: torch.device | str | None = None) -> DocBounds:
    """`cu_seqlens` as checked `DocBounds` for T tokens computed on `device`: given ones are only matched
    against T (no host read); host boundaries (a list or tuple of ints, or a CPU tensor when `device` is
    another one) are checked on the host and copied to `device` (no device-to-host copy); a tensor on the
    compute device is checked under the rule (its one host read)."""
    if isinstance(cu_seqlens, DocBounds):
        # matched by the positions' length (a shape), not the host ints: a compiled block then guards on no
        # document count or offset
        if cu_seqlens.positions.shape[-1] != T:
            bad(f"cu_seqlens must end at T={T} (the row's length), got {_shown(cu_seqlens.host)}")
        return cu_seqlens
    if isinstance(cu_seqlens, (list, tuple)):
        return DocBounds.from_host(cu_seqlens, T, device, bad)
    if not isinstance(cu_seqlens, torch.Tensor):
        bad(f"cu_seqlens must be a 1-D integer torch.Tensor, host ints or DocBounds, got {type(cu_seqlens).__name__}")
    if device is not None and cu_seqlens.device.type == "cpu" and torch.device(device).type != "cpu":
        return DocBounds.from_host(cu_seqlens, T, device, bad)
    return DocBounds.from_tensor(cu_seqlens, T, bad)


# ----------------------------------------------------------------------------------------- chunk layout
@dataclass
class ChunkLayout:
    """Where tokens go in the chunk-padded layout and where each sequence starts and ends."""

    # chunk length C and number of chunks Nc
    chunk_len: int
    Nc: int
    # token t of the packed row -> row in the padded [Tp] layout (packed rows only)
    pos_T: torch.Tensor | None
    # chunk index -> sequence index, for the first / last chunk of each sequence
    first_chunk: dict[int, int]
    last_chunk: dict[int, int]
    # number of sequences (documents of a packed row; 1 per batch row without)
    n_seqs: int


def chunk_layout(T: int, chunk_size: int, bounds: DocBounds | None, device: torch.device) -> ChunkLayout:
    """The layout of T tokens in chunks of at most `chunk_size` (see the module docstring). A packed row's is
    made from the boundaries' host ints once per row and device (`row_chunk_layout`, cached): the linear
    layers after the first, and their backward, reuse it; nothing is read back from a tensor."""
    if bounds is None:
        C = min(chunk_size, T)
        Nc = -(-T // C)
        return ChunkLayout(C, Nc, None, {0: 0}, {Nc - 1: 0}, 1)
    if bounds.num_tokens != T:
        raise BoundaryError(f"cu_seqlens must end at T={T} (the row's length), got {_shown(bounds.host)}")
    return row_chunk_layout(bounds.host, chunk_size, torch.device(device))


@functools.lru_cache(maxsize=8)
def row_chunk_layout(host: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    """`chunk_layout` of a packed row with boundaries `host` (checked ints), computed on the host in Python
    (no tensor is read back) and copied to `device` once: the row's layout for every layer."""
    lens = [e - s for s, e in zip(host[:-1], host[1:])]
    C = min(chunk_size, max(lens))
    n_chunks = [-(-n // C) for n in lens]
    chunk0 = list(itertools.accumulate(n_chunks, initial=0))[:-1]
    # token t of document i (start s_i) goes to row chunk0_i * C + (t - s_i) of the padded layout
    shift = torch.tensor([c0 * C - s for c0, s in zip(chunk0, host[:-1])], dtype=torch.int64)
    T = host[-1]
    pos_T = torch.arange(T) + torch.repeat_interleave(shift, torch.tensor(lens), output_size=T)
    first = {c0: i for i, c0 in enumerate(chunk0)}
    last = {c0 + nc - 1: i for i, (c0, nc) in enumerate(zip(chunk0, n_chunks))}
    return ChunkLayout(C, sum(n_chunks), to_device(pos_T, device), first, last, len(lens))


def to_device(host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory without blocking (a pageable copy would
    synchronise the host with the device)."""
    if device.type == "cuda":
        return host_tensor.pin_memory().to(device, non_blocking=True)
    return host_tensor.to(device)


@functools.lru_cache(maxsize=8)
def row_varlen_tensors(host: tuple[int, ...], chunk_size: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's packed-row arguments of one row, made once per row from its host ints: `cu_seqlens` int64 on
    `device`, the same on the host (`cu_seqlens_cpu`), and `chunk_indices` [chunks, 2] (document, chunk of
    the document) for chunks of `chunk_size`: what fla's `prepare_chunk_indices` computes from `cu_seqlens`
    (`fla.ops.utils.index`), so fla reads nothing back. The same tensor objects for every layer of the row,
    so fla's own identity cache (`tensor_cache`) hits for whatever else it derives from them."""
    cu_cpu = torch.tensor(host, dtype=torch.int64)
    index = [(i, c) for i, (s, e) in enumerate(zip(host[:-1], host[1:])) for c in range(-(-(e - s) // chunk_size))]
    chunks = torch.tensor(index, dtype=torch.int64).reshape(-1, 2)
    return to_device(cu_cpu, device), cu_cpu, to_device(chunks, device)


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


def clear_row_caches() -> None:
    """Forget every row's layout (`row_chunk_layout`, `row_varlen_tensors`): the estimator's fake tensors
    must not reach a real step later, nor real ones a fake step."""
    row_chunk_layout.cache_clear()
    row_varlen_tensors.cache_clear()
