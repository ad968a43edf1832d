"""KL(teacher || model) and perplexity on held-out packed rows or chat records.

Legend: T tokens of a row, N scored tokens, D / D' model / teacher hidden size, V vocabulary,
C tokens per logits chunk.

Design choices:
* A token t is scored when `loss_mask[t]` is set (its label, input_ids[t + 1], is a valid
  assistant token of the same document), exactly the tokens training distils on. Rows without a
  loss mask score every token except the last of each document.
* Documents are isolated: HyLo models take the whole packed row with `cu_seqlens`; HF models run
  one forward per document (no block mask needed, positions restart by construction).
* The losses are the kernels' LM-head losses (`hylo.kernels.fused_kl`: hidden states + output weights
  in, fp32 logits chunk by chunk, no [N, V] tensor): `fused_linear_kl_div` for the KL and
  `fused_linear_cross_entropy` for the NLL. `use_fused=False` runs them on their pure-torch path even
  where the Triton kernels would run (`kl_backend` in the result says which: "chunked_exact").
* Perplexity = exp(mean NLL over scored tokens), from the same hidden states, for the model and (when
  given) the teacher.
* Inputs: a packed-data directory (manifest.json + shards, from jobs/prepare_data.py), a Parquet
  file / directory of packed rows (its *.parquet files in name order), both read by the one reader of
  packed rows (`hylo.pipeline.data.reader.RowReader`), or chat records (JSON / JSONL, `messages` or
  ShareGPT `conversations`) rendered with the model's chat template, one document per row. Every row is a
  `PackedRow` checked against the packed-row contract (`hylo.pipeline.data.rows.check_row`,
  `PackedRowError`), except that a loss mask set on a document's last token is cleared, not refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hylo.atomic import atomic_path
from hylo.kernels.backend import forced_mode
from hylo.kernels.fused_kl import fused_linear_cross_entropy, fused_linear_kl_div
from hylo.pipeline.data.packing import label_aligned_mask
from hylo.pipeline.data.reader import ParquetRows, RowReader
from hylo.pipeline.data.readers import SourceSpec, is_reject, iter_source
from hylo.pipeline.data.render import ChatRenderer
from hylo.pipeline.data.rows import PackedRow, check_row
from hylo.pipeline.data.shards import MANIFEST
from hylo.pipeline.eval.decode import EvalError, final_hidden, is_hylo
from hylo.pipeline.eval.progress import progress

LOGITS_CHUNK = 1024


# ----------------------------------------------------------------------------------------- rows
def check_eval_row(row: Mapping[str, Any] | PackedRow, where: str) -> PackedRow:
    """One packed row checked (`hylo.pipeline.data.rows.check_row`, PackedRowError naming `where` and the
    field) with the tokens evaluation scores in its `loss_mask`: a mask set on a document's last token is
    cleared, and a row without a mask scores every token except the last of each document."""
    prow = check_row(row, where, clear_crossing_labels=True)
    if prow.loss_mask is None:
        # no label crosses a document: the last token of every document is never scored
        mask = torch.ones(prow.num_tokens, dtype=torch.bool)
        mask[prow.cu_seqlens[1:].long() - 1] = False
        prow = dataclasses.replace(prow, loss_mask=mask)
    return prow


def scored_tokens(row: PackedRow) -> torch.Tensor:
    """[N] indices of the tokens a row checked by `check_eval_row` scores (their label is the next token)."""
    return row.loss_mask.nonzero().squeeze(-1)


def _chat_rows(path: Path, tokenizer_dir: str | Path, limit: int | None,
               rejects: list[dict[str, Any]] | None) -> Iterator[dict[str, Any]]:
    try:
        renderer = ChatRenderer.from_pretrained(str(tokenizer_dir))
    except Exception as e:  # transformers raises many kinds for a missing or broken tokenizer
        raise EvalError(f"{path}: could not load a tokenizer with a chat template from {tokenizer_dir} "
                        f"({type(e).__name__}: {str(e).splitlines()[0]})") from e
    n = 0
    for item in iter_source(SourceSpec(name="eval", path=str(path))):
        if limit is not None and n >= limit:
            return
        # a broken record is never skipped silently: it fails the run, or goes into `rejects`
        if is_reject(item):
            where, reason = f"{Path(item['file']).name} record {item['record']}", item["reason"]
        else:
            enc = renderer.encode_batch([{"id": item["id"], "messages": item["messages"]}])[0]
            where, reason = f"{path.name} record {item['id']}", getattr(enc, "reason", None)
        if reason is not None:
            if rejects is None:
                raise EvalError(f"{where}: {reason}")
            rejects.append({"record": where, "reason": reason})
            continue
        ids = enc.input_ids.astype(np.int64)
        yield {"input_ids": ids, "cu_seqlens": np.array([0, len(ids)], dtype=np.int32),
               "loss_mask": label_aligned_mask(enc.assistant_mask), "_where": f"{path.name} record {item['id']}"}
        n += 1


def iter_eval_rows(data: str | Path, tokenizer_dir: str | Path | None = None, max_rows: int | None = None,
                   rejects: list[dict[str, Any]] | None = None) -> Iterator[tuple[str, PackedRow]]:
    """(where, checked row) for every held-out row of `data` (see the module docstring for formats),
    through the one reader of packed rows (`hylo.pipeline.data.reader.RowReader`) for Parquet input.

    Chat records that cannot be read or rendered raise EvalError, or, when a `rejects` list is
    given, are appended to it ({record, reason}) and skipped.
    """
    p = Path(data)
    if not p.exists():
        raise EvalError(f"eval data {p} does not exist")
    if p.is_dir() and (p / MANIFEST).is_file():
        reader = RowReader(p, drop_last=False, clear_crossing_labels=True)

        def label(g: int) -> str:
            return f"{p.name} row {g}"
    elif p.suffix == ".parquet" or (p.is_dir() and any(p.glob("*.parquet"))):
        files = ParquetRows(sorted(p.glob("*.parquet")) if p.is_dir() else [p])
        reader = RowReader(files, drop_last=False, clear_crossing_labels=True)

        def label(g: int) -> str:
            path, r = files.locate(g)
            return f"{path.name} row {r}"
    elif p.is_file() and any(s in (".json", ".jsonl") for s in p.suffixes):
        if tokenizer_dir is None:
            raise EvalError(f"{p}: chat records need a tokenizer (the model directory has none)")
        for row in _chat_rows(p, tokenizer_dir, max_rows, rejects):
            where = row.pop("_where")
            yield where, check_eval_row(row, where)
        return
    else:
        raise EvalError(f"{p}: not a packed-data directory (manifest.json), Parquet rows or JSON/JSONL chat records")
    for g, row in enumerate(itertools.islice(reader, max_rows)):
        yield label(g), check_eval_row(row, label(g))


# ----------------------------------------------------------------------------------------- math
def hidden_states(model: nn.Module, row: PackedRow) -> torch.Tensor:
    """Final normed hidden states [T, D] with documents isolated."""
    device = next(model.parameters()).device
    ids_T = row.input_ids.to(device)
    if is_hylo(model):
        # the row's checked host boundaries: the model never reads them back from the device
        return final_hidden(model, ids_T, row.bounds(device) if len(row.host) > 2 else None)
    return torch.cat([final_hidden(model, ids_T[s:e]) for s, e in row.documents()], dim=0)


def _path(exact: bool) -> contextlib.AbstractContextManager:
    """The losses' fastest path, or with `exact` their pure-torch one (fp32, chunk by chunk)."""
    return forced_mode("torch") if exact else contextlib.nullcontext()


def sum_nll(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, chunk: int | None = LOGITS_CHUNK,
            exact: bool = False) -> float:
    """Sum over tokens of -log softmax(h W^T)[label], C tokens at a time (None: the op's own size)."""
    with _path(exact):
        return float(fused_linear_cross_entropy(h_ND, w_VD, labels_N, reduction="sum", chunk_size=chunk))


def sum_kl(hs_ND: torch.Tensor, ws_VD: torch.Tensor, ht_ND: torch.Tensor, wt_VD: torch.Tensor,
           chunk: int | None = LOGITS_CHUNK, exact: bool = False) -> float:
    """Sum over tokens of KL(teacher || student) at temperature 1, C tokens at a time (None: the op's own)."""
    with _path(exact):
        return float(fused_linear_kl_div(hs_ND, ws_VD, teacher_hidden=ht_ND, teacher_weight=wt_VD,
                                         reduction="sum", chunk_size=chunk))


class TeacherStateCache:
    """The teacher's scored hidden states [N, D] and NLL sum per held-out row, kept in one safetensors
    file so that later evaluations against the same teacher and rows skip the teacher's forward (the
    demo evaluates three students against one teacher). Rows are keyed by a hash of their tokens and
    loss mask; a file written for another teacher (`key`) is ignored and rewritten."""

    def __init__(self, path: str | Path, key: str) -> None:
        self.path, self.key = Path(path), key
        self.states: dict[str, tuple[torch.Tensor, float]] = {}
        self.hits = self.misses = 0
        self.dirty = False
        if self.path.is_file():
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") == key:
                    nll = json.loads(meta.get("nll", "{}"))
                    self.states = {h: (f.get_tensor(h), float(v)) for h, v in nll.items()}

    @staticmethod
    def row_hash(row: PackedRow) -> str:
        h = hashlib.sha256(row.input_ids.numpy().tobytes())
        h.update(row.loss_mask.numpy().tobytes())
        return h.hexdigest()[:32]

    def get(self, row: PackedRow) -> tuple[torch.Tensor, float] | None:
        hit = self.states.get(self.row_hash(row))
        self.hits += hit is not None
        self.misses += hit is None
        return hit

    def put(self, row: PackedRow, h_ND: torch.Tensor, nll_sum: float) -> None:
        self.states[self.row_hash(row)] = (h_ND.detach().cpu().contiguous(), nll_sum)
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.path) as tmp:
            save_file({h: t for h, (t, _) in self.states.items()}, str(tmp),
                      metadata={"key": self.key, "nll": json.dumps({h: v for h, (_, v) in self.states.items()})})
        self.dirty = False


@dataclass
class KLResult:
    rows: int
    documents: int
    tokens: int
    kl: float | None
    nll: float
    ppl: float
    teacher_nll: float | None
    teacher_ppl: float | None
    kl_backend: str | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _output_weight(model: nn.Module) -> torch.Tensor:
    head = model.get_output_embeddings()
    if head is None:
        raise EvalError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return head.weight


@torch.no_grad()
def evaluate_kl(model: nn.Module, rows: Iterable[tuple[str, Mapping[str, Any] | PackedRow]], teacher: nn.Module | None = None, use_fused: bool = True,
                chunk: int = LOGITS_CHUNK, total: int | None = None, show_progress: bool = False,
                teacher_cache: TeacherStateCache | None = None) -> KLResult:
    """KL(teacher || model) per scored token, and NLL / perplexity of model (and teacher).

    rows: (where, packed row) pairs, e.g. from `iter_eval_rows` (a row that is not a `PackedRow` is checked
    here, as `check_eval_row` does); `where` names the row in errors.
    `show_progress`: a progress bar over rows (`total` = the expected count, when known).
    teacher_cache: reuse (and record) the teacher's hidden states per row instead of its forward.
    """
    ws = _output_weight(model)
    wt = _output_weight(teacher) if teacher is not None else None
    if wt is not None and wt.shape[0] != ws.shape[0]:
        raise EvalError(f"teacher vocabulary {wt.shape[0]} != model vocabulary {ws.shape[0]}: "
                        "KL needs the same tokenizer")
    backend = None if teacher is None else ("fused_linear_kl_div" if use_fused else "chunked_exact")
    exact = not use_fused
    n_rows = n_docs = n_tok = 0
    kl_sum = nll_sum = t_nll_sum = 0.0
    for where, row in progress(rows, desc="kl rows", total=total, unit="row", disable=not show_progress):
        row = check_eval_row(row, where)
        vocab = ws.shape[0]
        top = int(row.input_ids.max())
        if top >= vocab:
            raise EvalError(f"{where}: token id {top} is outside the model's vocabulary ({vocab})")
        idx = scored_tokens(row)
        n_rows += 1
        n_docs += len(row.host) - 1
        if idx.numel() == 0:
            continue
        labels_N = row.input_ids[idx + 1].to(ws.device)
        hs_ND = hidden_states(model, row)[idx.to(ws.device)]
        nll_sum += sum_nll(hs_ND, ws, labels_N, chunk, exact)
        if teacher is not None:
            hit = teacher_cache.get(row) if teacher_cache is not None else None
            if hit is None:
                ht_ND = hidden_states(teacher, row)[idx.to(wt.device)].to(ws.device)
                hit = (ht_ND, sum_nll(ht_ND, wt.to(ws.device), labels_N, chunk, exact))
                if teacher_cache is not None:
                    teacher_cache.put(row, *hit)
            ht_ND, t_nll_sum = hit[0].to(ws.device), t_nll_sum + hit[1]
            kl_sum += sum_kl(hs_ND, ws, ht_ND, wt.to(ws.device), chunk, exact)
        n_tok += idx.numel()
    if n_rows == 0:
        raise EvalError("no evaluation rows were read")
    if n_tok == 0:
        raise EvalError(f"{n_rows} row(s) read but none has a scored token (loss_mask all zero)")
    nll = nll_sum / n_tok
    t_nll = t_nll_sum / n_tok if teacher is not None else None
    return KLResult(
        rows=n_rows, documents=n_docs, tokens=n_tok,
        kl=kl_sum / n_tok if teacher is not None else None,
        nll=nll, ppl=math.exp(nll),
        teacher_nll=t_nll, teacher_ppl=math.exp(t_nll) if t_nll is not None else None,
        kl_backend=backend,
    )
