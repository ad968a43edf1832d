"""The packed row: its contract, the one rule for its boundaries, positions inside documents, the
boundaries kept on the host for the layers, and the chunk-aligned layout of the chunked GDN / SSD scans.

Legend: T tokens of a row, N documents, B batch, H heads, d feature dim, C chunk length, Nc chunks,
Tp = Nc * C (padded length), M = B * H (batch and heads flattened).

The contract (the data pipeline writes it; the readers, the teacher, evaluation, the model, its layers and
the kernels rely on it):
* A packed row is N >= 1 documents laid end to end: `input_ids` [T], T >= 1, token ids >= 0.
* `cu_seqlens` [N + 1] (integers; int32 on disk and in the model): starts at 0, ends at T and is strictly
  increasing, so every document holds at least one token. An empty document has no use (the packer never
  writes one; it has no last token to keep a label from, and a per-document forward of it has no input),
  so it is refused everywhere, with the same message.
* `position_ids` [T]: each token's index inside its document, restarting at 0 at every boundary
  (`positions_from_cu_seqlens`); optional where a consumer can derive it, checked where given.
* `loss_mask` [T] bool (optional), label-aligned: set at t when the label `input_ids[t + 1]` is scored;
  never on a document's last token, whose next token belongs to another document.
* `doc_ids` [N] (optional; the packer's padding tail is its own last document, doc id ""), `row_id`
  (optional; else `PackedRow.row_id` is a hash of the tokens and the boundaries).
* The model takes one packed row as a batch of one: `input_ids` [1, T] and `cu_seqlens` [N + 1].

Where it is read and checked:
* On disk a packed row is one record of a Parquet file with these fields as columns (list columns,
  `doc_ids` a list of strings, `row_id` a string). `hylo.pipeline.data.rowfile.PackedRowFile` is the one
  reader (the data pipeline's shards, the teacher's offline cache job, evaluation); a damaged file is a
  `DataFormatError` there, naming the file and row group or row.
* `check_row` checks a whole row (a mapping of arrays) where it is read or received: the training row
  streams, the teacher (in process, Serve replicas, offline cache) and evaluation, and returns it as a
  `PackedRow` (CPU tensors, positions derived when absent). `PackedRowError` names the record and the field.
* `DocBounds` carries the checked boundaries of one forward: the device tensor that kernels read, the same
  numbers as host ints, and each token's position inside its document (on the device). `HyLoModel.forward`
  builds it once (one device-to-host copy of `cu_seqlens`; none from a host row, `DocBounds.from_host`)
  and hands it to every layer, which hands it to its kernel, so no layer reads `cu_seqlens` back to the
  host, in the forward or in an activation-checkpoint recompute. A layer or kernel called alone with a
  tensor builds its own `DocBounds` under the same rule (`doc_bounds`), raising its own error class.

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
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch
import torch.nn.functional as F

Bad = Callable[[str], NoReturn]

# the fields of a packed row, in the order the data pipeline writes them
ROW_FIELDS = ("input_ids", "position_ids", "cu_seqlens", "loss_mask", "doc_ids", "row_id")
REQUIRED_FIELDS = ("input_ids", "cu_seqlens")


class PackedRowError(ValueError):
    """A packed row breaks the contract of kernels/varlen.py; the message names the record and the field."""


def _raise_row_error(message: str) -> NoReturn:
    raise PackedRowError(message)


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


def host_cu_seqlens(cu_seqlens: Any, T: int, bad: Bad = _raise_row_error) -> tuple[int, ...]:
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
class DocBounds(NamedTuple):
    """The checked boundaries of one packed row, for the model, its layers and kernels (see the module
    docstring). Build it with `from_tensor` / `from_host` (or `doc_bounds`), which apply the rule.
    A NamedTuple, so that hooks that walk a module's inputs (DeepSpeed ZeRO-3) see its tensors."""

    # [N + 1] integer boundaries on the compute device (what the GPU kernels read)
    cu_seqlens: torch.Tensor
    # the same N + 1 boundaries as Python ints (what the layers slice and lay out with)
    host: tuple[int, ...]
    # [T] int64 index of each token inside its document, on the compute device
    positions: torch.Tensor

    @classmethod
    def from_tensor(cls, cu_seqlens: torch.Tensor, T: int, bad: Bad = _raise_row_error) -> DocBounds:
        """Check a (device) boundaries tensor: its one copy to the host."""
        host = host_cu_seqlens(cu_seqlens, T, bad)
        return cls(cu_seqlens, host, positions_from_cu_seqlens(cu_seqlens, T))

    @classmethod
    def from_host(cls, cu_seqlens: Any, T: int, device: torch.device | str | None = None,
                  bad: Bad = _raise_row_error) -> DocBounds:
        """Boundaries held on the host (a row as read): checked there, then copied to `device`."""
        host = host_cu_seqlens(cu_seqlens, T, bad)
        cu = torch.tensor(host, dtype=torch.int32)
        return cls(cu.to(device), host, positions_from_cu_seqlens(cu, T).to(device))

    @property
    def num_docs(self) -> int:
        return len(self.host) - 1

    @property
    def num_tokens(self) -> int:
        return self.host[-1]

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) token spans of the documents."""
        return list(zip(self.host[:-1], self.host[1:]))


def doc_bounds(cu_seqlens: torch.Tensor | DocBounds, T: int, bad: Bad = _raise_row_error) -> DocBounds:
    """`cu_seqlens` as checked `DocBounds` for T tokens: given ones are only matched against T (no host
    read), a tensor is checked under the rule (one host read)."""
    if isinstance(cu_seqlens, DocBounds):
        if cu_seqlens.num_tokens != T:
            bad(f"cu_seqlens must end at T={T} (the row's length), got {_shown(cu_seqlens.host)}")
        return cu_seqlens
    if not isinstance(cu_seqlens, torch.Tensor):
        bad(f"cu_seqlens must be a 1-D integer torch.Tensor or DocBounds, got {type(cu_seqlens).__name__}")
    return DocBounds.from_tensor(cu_seqlens, T, bad)


# ----------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class PackedRow:
    """One checked packed row, as CPU tensors (see the module docstring for the contract)."""

    # [T] int64 token ids
    input_ids: torch.Tensor
    # [N + 1] int32 boundaries
    cu_seqlens: torch.Tensor
    # [T] int64 positions inside the documents
    position_ids: torch.Tensor
    # [T] bool, label-aligned; None when the row has none
    loss_mask: torch.Tensor | None = None
    doc_ids: tuple[str, ...] | None = None
    # the dataset's own id, when it has one
    given_id: str | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @functools.cached_property
    def row_id(self) -> str:
        """The dataset's row id, else a hash of the tokens and the boundaries (the same data, the same id)."""
        if self.given_id is not None:
            return self.given_id
        h = hashlib.blake2b(digest_size=16)
        h.update(self.input_ids.to(torch.int64).numpy().tobytes())
        h.update(b"|")
        h.update(self.cu_seqlens.to(torch.int64).numpy().tobytes())
        return h.hexdigest()

    def documents(self) -> list[tuple[int, int]]:
        """(start, end) token spans of the row's documents."""
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))

    def bounds(self, device: torch.device | str | None = None) -> DocBounds:
        """The row's boundaries for a forward on `device`, with no device-to-host copy."""
        return DocBounds.from_host(self.cu_seqlens, self.num_tokens, device)


def _int_field(row: Mapping[str, Any], name: str, where: str) -> torch.Tensor:
    value = row[name]
    try:
        # a copy, never a view of the caller's array (which may be read-only, e.g. a Parquet buffer)
        t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(np.array(value))
    except (TypeError, ValueError, RuntimeError) as e:
        raise PackedRowError(f"{where}: field {name!r} is not an integer array ({e})") from None
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise PackedRowError(f"{where}: field {name!r} must be 1-D, got shape {tuple(t.shape)}")
    # a loss mask may come as bool, 0/1 integers or 0./1. floats
    if name != "loss_mask" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise PackedRowError(f"{where}: field {name!r} must hold integers, got {t.dtype}")
    return t


def check_row(row: Mapping[str, Any] | PackedRow, where: str = "row", max_len: int | None = None,
              clear_crossing_labels: bool = False, max_len_name: str = "max_len") -> PackedRow:
    """Check a packed row against the contract and return it as a `PackedRow` (CPU tensors).

    `row`: a mapping with `input_ids` and `cu_seqlens`, optionally `position_ids` (derived when absent,
    checked when given), `loss_mask`, `doc_ids`, `row_id`. `where` names the record in errors;
    `max_len` bounds the row's length (`max_len_name`: the setting it comes from, for the message).
    `clear_crossing_labels`: a loss mask set on a document's last token is cleared instead of refused
    (evaluation scoring rows it did not pack). Raises PackedRowError.
    """
    if isinstance(row, PackedRow):
        return row
    if not isinstance(row, Mapping):
        raise PackedRowError(f"{where}: a packed row must be a mapping, got {type(row).__name__}")
    missing = [c for c in REQUIRED_FIELDS if row.get(c) is None]
    if missing:
        raise PackedRowError(f"{where}: missing field {', '.join(repr(c) for c in missing)} "
                             f"(have {sorted(row)}); a packed row needs input_ids and cu_seqlens")
    ids = _int_field(row, "input_ids", where).to(torch.int64)
    T = int(ids.shape[0])
    if T == 0:
        raise PackedRowError(f"{where}: field 'input_ids' is empty")
    if max_len is not None and T > max_len:
        raise PackedRowError(f"{where}: {T} tokens, more than {max_len_name}={max_len}")
    if int(ids.min()) < 0:
        raise PackedRowError(f"{where}: field 'input_ids' holds a negative token id {int(ids.min())}")
    host = host_cu_seqlens(_int_field(row, "cu_seqlens", where), T, lambda m: _raise_row_error(f"{where}: {m}"))
    cu = torch.tensor(host, dtype=torch.int32)
    expected = positions_from_cu_seqlens(cu, T)
    pos = expected
    if row.get("position_ids") is not None:
        pos = _int_field(row, "position_ids", where).to(torch.int64)
        if pos.shape[0] != T:
            raise PackedRowError(f"{where}: field 'position_ids' has {pos.shape[0]} entries, input_ids {T}")
        if not torch.equal(pos, expected):
            t = int((pos != expected).nonzero()[0, 0])
            raise PackedRowError(f"{where}: field 'position_ids' must restart at 0 at each document of "
                                 f"cu_seqlens; token {t} has {int(pos[t])}, expected {int(expected[t])}")
    mask = None
    if row.get("loss_mask") is not None:
        mask = _int_field(row, "loss_mask", where).to(torch.bool)
        if mask.shape[0] != T:
            raise PackedRowError(f"{where}: field 'loss_mask' has {mask.shape[0]} entries for {T} tokens")
        last = cu[1:].long() - 1
        if clear_crossing_labels:
            mask = mask.clone()
            mask[last] = False
        elif bool(mask[last].any()):
            d = int(mask[last].nonzero()[0, 0])
            raise PackedRowError(f"{where}: field 'loss_mask' is set on the last token of document {d} "
                                 f"(tokens [{host[d]}, {host[d + 1]})): its label would cross documents")
    doc_ids = None
    if row.get("doc_ids") is not None:
        doc_ids = tuple(str(d) for d in row["doc_ids"])
        if len(doc_ids) != len(host) - 1:
            raise PackedRowError(f"{where}: field 'doc_ids' has {len(doc_ids)} entries for the {len(host) - 1} "
                                 "documents of cu_seqlens")
    rid = row.get("row_id")
    return PackedRow(ids, cu, pos, mask, doc_ids, None if rid is None else str(rid))


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
    """The layout of T tokens in chunks of at most `chunk_size` (see the module docstring), computed on
    the host from the boundaries' host ints."""
    if bounds is None:
        C = min(chunk_size, T)
        Nc = -(-T // C)
        return ChunkLayout(C, Nc, None, {0: 0}, {Nc - 1: 0}, 1)
    cu = torch.tensor(bounds.host, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    C = min(chunk_size, max(lens.tolist()))
    n_chunks = (lens + C - 1) // C
    chunk0 = torch.cumsum(n_chunks, 0) - n_chunks
    seq_T = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    pos_T = chunk0[seq_T] * C + (torch.arange(T) - cu[:-1][seq_T])
    first, last = {}, {}
    for i, (c0, nc) in enumerate(zip(chunk0.tolist(), n_chunks.tolist())):
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
