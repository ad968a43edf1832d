"""The teacher's computation in plain torch: packed rows in, top-k records or logit chunks out.

Legend: T tokens of a row, L tokens of one document, n documents in a forward, H hidden size,
V vocabulary, C tokens per logits chunk, K top-k.

`TeacherModel` wraps any HF causal LM directory (Llama, Qwen3, ...), a HyLo checkpoint, or an
in-memory model, and is used as is by the Serve replicas, the offline cache, and in-process by the
trainer for small teachers. Design choices:
* Document isolation: every document of a packed row is computed as if it ran alone.
  `per_doc` runs one forward per document (documents of equal length are batched together);
  it needs no block mask, so memory stays that of the longest document under SDPA's causal path.
  `packed` runs one forward per row with positions restarting per document: HyLo models take
  `cu_seqlens`, HF models derive a block-diagonal mask (or varlen flash-attention) from the
  position ids. `auto` = packed for HyLo and flash-attention models, per_doc otherwise.
* The forward stops at the final normed hidden states [T, H]; logits are produced C tokens at a
  time through the model's own output layer, so no [T, V] tensor is ever built. The same hidden
  states + `lm_head_weight` serve the "hidden-state teacher" form of the fused KL.
* Logits are computed in the model's dtype, exactly as the model's own forward does, then the
  top-k record is taken in fp32 (`topk_from_logits`).
* Identity: `teacher_id` (directory name + hash of config and sampled weight bytes) and
  `tokenizer_hash` (hash of the canonical tokenizer.json) go into every cache manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hylo.assets import resolve_path_or_asset
from hylo.json_files import read_json
from hylo.kernels.fused_kl.topk import TeacherTopK, topk_from_logits
from hylo.model_files import ModelFileError, check_finite_tensors, check_model_config
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.teacher.config import TeacherModelConfig
from hylo.pipeline.teacher.protocol import StreamedLogits, TargetSpec, check_token_range
from hylo.seq_parallel import RowShard, split_attention

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_SAMPLE_BYTES = 1 << 20


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype {name!r} is not valid; allowed: {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def resolve_model_path(path: str | os.PathLike) -> Path:
    """A directory as is, or an asset (`asset:NAME` or NAME) fetched through hylo.assets."""
    p = resolve_path_or_asset(path, "teacher model", directory=True)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"teacher model {p} has no config.json; not a Hugging Face model directory")
    # its fields within what a model can be built from (ModelFileError naming the file and the field)
    check_model_config(read_json(p / "config.json", ModelFileError, mapping=True), p / "config.json")
    return p


def tokenizer_fingerprint(path: str | os.PathLike | None) -> str:
    """Hash of a tokenizer directory's canonical tokenizer.json (formatting-insensitive)."""
    if path is None:
        return "none"
    p = Path(path)
    tj = p / "tokenizer.json" if p.is_dir() else p
    if tj.is_file():
        canonical = json.dumps(read_json(tj), sort_keys=True, ensure_ascii=False)
        return "tok-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
    vocab = p / "vocab.json"
    if vocab.is_file():
        return "tok-" + hashlib.sha256(vocab.read_bytes()).hexdigest()[:16]
    return "none"


def model_fingerprint(path: str | os.PathLike) -> str:
    """`<dir name>@<hash>` over config.json and, per weight file, its size and three sampled MiB."""
    p = Path(path)
    h = hashlib.sha256((p / "config.json").read_bytes())
    for w in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")):
        size = w.stat().st_size
        h.update(f"{w.name}:{size}".encode())
        with open(w, "rb") as f:
            for offset in (0, max(size // 2 - _SAMPLE_BYTES // 2, 0), max(size - _SAMPLE_BYTES, 0)):
                f.seek(offset)
                h.update(f.read(_SAMPLE_BYTES))
    return f"{p.name}@{h.hexdigest()[:16]}"


def _load_model(path: Path, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    if (path / "hybrid_config.json").is_file():
        from hylo.io import load_hylo  # lazy: transformers

        return load_hylo(path, dtype=dtype)
    from transformers import AutoModelForCausalLM  # lazy: transformers

    from hylo.io import from_pretrained_checked  # lazy: transformers

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    # a missing or unexpected tensor is an error naming it, not a randomly initialised teacher layer
    return from_pretrained_checked(AutoModelForCausalLM, path, **kwargs)


class TeacherModel:
    """A frozen causal LM that turns packed rows into top-k records, logit chunks or hidden states."""

    def __init__(
        self,
        path_or_model: str | os.PathLike | nn.Module | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "auto",
        isolation: str = "auto",
        logits_chunk_tokens: int = 1024,
        max_forward_tokens: int = 8192,
        tokenizer: str | os.PathLike | None = None,
        attn_implementation: str | None = None,
        teacher_id: str | None = None,
    ) -> None:
        self.dtype = torch_dtype(dtype)
        if str(device) == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if path_or_model is None:
            path_or_model = TeacherModelConfig().path
        if isinstance(path_or_model, nn.Module):
            model = path_or_model
            self.path: Path | None = None
            cfg_json = model.config.to_json_string() if hasattr(model, "config") else type(model).__name__
            self.teacher_id = teacher_id or f"{type(model).__name__}@{hashlib.sha256(cfg_json.encode()).hexdigest()[:16]}"
            self.tokenizer_hash = tokenizer_fingerprint(tokenizer)
        else:
            self.path = resolve_model_path(path_or_model)
            model = _load_model(self.path, self.dtype, attn_implementation)
            # a NaN / inf weight, refused where it is loaded (a Serve replica, a training worker, the cache
            # job) as an input error naming the teacher, which Ray Train does not retry (failures.py); the
            # drivers refuse it before Ray starts (sources/base.py check_model_weights), this catches a
            # teacher changed since or loaded without them. The parameters are in memory: one isfinite pass.
            check_finite_tensors(model.named_parameters(), f"teacher model {self.path}", ModelFileError)
            self.teacher_id = teacher_id or model_fingerprint(self.path)
            self.tokenizer_hash = tokenizer_fingerprint(tokenizer if tokenizer is not None else self.path)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        self.is_hylo = type(self.model).__name__.startswith("HyLo")
        self.base = self.model.model if self.is_hylo else self.model.base_model
        self.output_layer = self.model.get_output_embeddings()
        if self.output_layer is None:
            raise ValueError(f"teacher {self.teacher_id}: the model has no output embeddings (lm_head)")
        if getattr(self.model.config, "final_logit_softcapping", None):
            raise NotImplementedError(f"teacher {self.teacher_id}: final_logit_softcapping is not supported")
        self.vocab_size = int(self.output_layer.weight.shape[0])
        self.hidden_size = int(self.output_layer.weight.shape[1])
        if isolation not in ("auto", "per_doc", "packed"):
            raise ValueError(f"isolation={isolation!r} is not valid; allowed: auto, per_doc, packed")
        if isolation == "auto":
            attn = getattr(self.model.config, "_attn_implementation", None) or ""
            isolation = "packed" if self.is_hylo or attn.startswith("flash_attention") else "per_doc"
        self.isolation = isolation
        self.logits_chunk_tokens = logits_chunk_tokens
        self.max_forward_tokens = max_forward_tokens

    @classmethod
    def from_config(cls, cfg: TeacherModelConfig) -> TeacherModel:
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        return cls(cfg.path, dtype=cfg.dtype, device=cfg.device, isolation=cfg.isolation,
                   logits_chunk_tokens=cfg.logits_chunk_tokens, max_forward_tokens=cfg.max_forward_tokens,
                   tokenizer=cfg.tokenizer, attn_implementation=cfg.attn_implementation)

    def info(self) -> dict[str, Any]:
        return {"teacher_id": self.teacher_id, "tokenizer_hash": self.tokenizer_hash,
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "dtype": str(self.dtype).removeprefix("torch."), "isolation": self.isolation}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] output projection for the hidden-state form of the fused KL."""
        return self.output_layer.weight

    # ---------------------------------------------------------------- hidden states
    def _check_vocab(self, row: PackedRow) -> None:
        top = int(row.input_ids.max())
        if top >= self.vocab_size:
            raise ValueError(f"row {row.row_id}: token id {top} is outside the teacher's vocabulary "
                             f"({self.vocab_size}); was the data tokenized with another tokenizer?")

    def _forward_docs(self, ids_nL: torch.Tensor) -> torch.Tensor:
        n, L = ids_nL.shape
        pos_nL = torch.arange(L, device=self.device).unsqueeze(0).expand(n, L)
        return self.base(input_ids=ids_nL, position_ids=pos_nL, use_cache=False).last_hidden_state

    def _forward_packed(self, row: PackedRow) -> torch.Tensor:
        ids_1T = row.input_ids.to(self.device).unsqueeze(0)
        pos_1T = row.position_ids.to(self.device).unsqueeze(0)
        if self.is_hylo:
            # boundaries from the host row: the model never reads them back from the device
            out = self.base(input_ids=ids_1T, position_ids=pos_1T, cu_seqlens=row.bounds(self.device))
        else:
            out = self.base(input_ids=ids_1T, position_ids=pos_1T, use_cache=False)
        return out.last_hidden_state[0]

    @torch.no_grad()
    def hidden_batch(self, rows: Iterable[PackedRow]) -> list[torch.Tensor]:
        """Final normed hidden states [T, H] of each (checked) row, on the model's device, documents isolated."""
        prows = list(rows)
        for r in prows:
            self._check_vocab(r)
        if self.isolation == "packed":
            return [self._forward_packed(r) for r in prows]
        out_TH = [torch.empty(r.num_tokens, self.hidden_size, device=self.device, dtype=self.dtype) for r in prows]
        # Group documents of equal length across all rows so each group is one unpadded forward.
        by_len: dict[int, list[tuple[int, int]]] = {}
        for ri, r in enumerate(prows):
            for s, e in r.documents():
                by_len.setdefault(e - s, []).append((ri, s))
        for L, docs in sorted(by_len.items()):
            per_fwd = max(1, self.max_forward_tokens // L)
            for g in range(0, len(docs), per_fwd):
                group = docs[g:g + per_fwd]
                ids_nL = torch.stack([prows[ri].input_ids[s:s + L] for ri, s in group]).to(self.device)
                h_nLH = self._forward_docs(ids_nL)
                for j, (ri, s) in enumerate(group):
                    out_TH[ri][s:s + L] = h_nLH[j]
        return out_TH

    def hidden(self, row: PackedRow) -> torch.Tensor:
        return self.hidden_batch([row])[0]

    @torch.no_grad()
    def hidden_split(self, row: PackedRow, shard: RowShard) -> torch.Tensor:
        """Final normed hidden states [t, H] of this rank's tokens of a split row: the forward runs on those
        tokens only, with the rest of the group (`shard.group`) running theirs at the same time. A HyLo teacher
        takes the shard as the student does; a transformers one runs under `seq_parallel.split_attention`."""
        self._check_vocab(row)
        dev = shard.local.positions.device
        if dev.type != self.device.type or self.device.index not in (None, dev.index):
            raise ValueError(f"teacher {self.teacher_id}: a split row's teacher runs on the trainer's device "
                             f"({dev}), not {self.device} (teacher.model.device)")
        ids_1t = row.input_ids[shard.start:shard.end].to(self.device).unsqueeze(0)
        pos_1t = shard.local.positions.unsqueeze(0)
        if self.is_hylo:
            out = self.base(input_ids=ids_1t, position_ids=pos_1t, cu_seqlens=shard.local, shard=shard)
        else:
            with split_attention(self.model, shard):
                out = self.base(input_ids=ids_1t, position_ids=pos_1t, use_cache=False)
        return out.last_hidden_state[0]

    # ---------------------------------------------------------------- logits and top-k
    @torch.no_grad()
    def logits_chunks(
        self, hidden_TH: torch.Tensor, chunk_tokens: int | None = None, start: int = 0, end: int | None = None
    ) -> Iterator[torch.Tensor]:
        """Logits [C, V] of tokens [start, end) of a row, C tokens at a time (last chunk shorter)."""
        c = chunk_tokens or self.logits_chunk_tokens
        end = hidden_TH.shape[0] if end is None else min(end, hidden_TH.shape[0])
        for s in range(start, end, c):
            yield self.output_layer(hidden_TH[s:min(s + c, end)])

    @torch.no_grad()
    def topk_from_hidden(self, hidden_TH: torch.Tensor, k: int, dtype: str | torch.dtype = torch.float16) -> TeacherTopK:
        """Top-k record of every token of a row, on CPU."""
        dt = torch_dtype(dtype)
        parts = [topk_from_logits(lg, k, dtype=dt) for lg in self.logits_chunks(hidden_TH)]
        return TeacherTopK(
            torch.cat([p.logprobs for p in parts]).cpu(),
            torch.cat([p.indices for p in parts]).cpu(),
            torch.cat([p.tail_logmass for p in parts]).cpu(),
        )

    def topk_batch(self, rows: Iterable[PackedRow], k: int,
                   dtype: str | torch.dtype = torch.float16) -> list[TeacherTopK]:
        return [self.topk_from_hidden(h, k, dtype) for h in self.hidden_batch(rows)]

    def topk(self, row: PackedRow, k: int, dtype: str | torch.dtype = torch.float16) -> TeacherTopK:
        return self.topk_batch([row], k, dtype)[0]

    def stream(
        self, row: PackedRow, chunk_tokens: int | None = None, start: int = 0,
        end: int | None = None, dtype: str | torch.dtype | None = None,
    ) -> Iterator[torch.Tensor]:
        """Full logits of the row as CPU chunks [C, V] (tokens [start, end))."""
        dt = None if dtype is None else torch_dtype(dtype)
        for lg in self.logits_chunks(self.hidden(row), chunk_tokens, start, end):
            yield lg.to("cpu", dt) if dt is not None else lg.cpu()

    def targets(self, rows: Sequence[PackedRow], spec: TargetSpec, token_range: tuple[int, int] | None = None,
                shards: Sequence[RowShard] | None = None) -> Iterator[dict[str, Any]]:
        """The fused KL's teacher arguments of each row (protocol.TeacherSource), one row's forward at a time;
        `token_range=(start, end)`: of those tokens only (protocol.check_token_range).

        `shards` (one per row, a sequence-parallel group's): the forward is split with the group, each rank
        running its own tokens (`hidden_split`): 1 / N of the row's FLOPs and activations per rank. With a range
        alone it runs unsplit: the whole row's forward, the range kept (`train.sequence_parallel_teacher:
        whole`). Whatever follows the forward (the lm_head, top-k, logits chunks) runs for the rank's tokens."""
        rng = check_token_range(token_range, rows)
        for i, row in enumerate(rows):
            if shards is not None:
                h_TH = self.hidden_split(row, shards[i])
            else:
                h_TH = self.hidden(row)
            if rng is not None and shards is None:
                # a copy of the range's states: the whole row's [T, H] is freed with this row
                h_TH = h_TH[rng[0]:rng[1]].clone()
            if spec.form == "topk":
                yield {"teacher_topk": self.topk_from_hidden(h_TH, spec.k)}
            elif spec.form == "hidden":
                yield {"teacher_hidden": h_TH, "teacher_weight": self.lm_head_weight}
            else:
                # chunks stay on the model's device (no host round trip); index 0 is the range's first token
                yield {"teacher_logits_fn": StreamedLogits(self.logits_chunks(h_TH))}

    def logits(self, row: PackedRow) -> torch.Tensor:
        """All logits [T, V] of a row (small rows only: tests, debugging)."""
        return torch.cat(list(self.stream(row)))
