"""Small fixtures shared by the teacher and training tests: a tiny random Llama and packed rows.

Test modules import it as `from tests.helpers.teacher import ...`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import torch


def save_tiny_llama(out_dir: str | Path, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2,
                    seed: int = 0, tokenizer_salt: str = "") -> Path:
    """A random LlamaForCausalLM (fp32, safetensors) plus a word-level tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    # Random init gives near-uniform logits; a larger lm_head makes top-k orderings well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"w{tokenizer_salt}{i}": i for i in range(vocab_size)}
    Tokenizer(WordLevel(vocab, unk_token=f"w{tokenizer_salt}0")).save(str(out / "tokenizer.json"))
    return out


def make_packed_row(doc_lengths: list[int], vocab_size: int, seed: int, pad: int = 0) -> dict[str, Any]:
    """A packed row of random documents; `pad` trailing tokens form a final padding document."""
    g = np.random.default_rng(seed)
    lengths = list(doc_lengths) + ([pad] if pad else [])
    t = sum(lengths)
    ids = g.integers(0, vocab_size, size=t, dtype=np.int64)
    if pad:
        ids[-pad:] = 0
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    mask = np.ones(t, dtype=np.bool_)
    mask[cu[1:] - 1] = False
    if pad:
        mask[-pad:] = False
    return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "loss_mask": mask,
            "doc_ids": [f"s{seed}-d{i}" for i in range(len(lengths))]}


def write_packed_parquet(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write packed rows as one Parquet file in the data pipeline's row schema."""
    import pyarrow.parquet as pq

    from hylo.pipeline.data.rowfile import rows_to_table

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows_to_table(rows), path)
    return path


# ------------------------------------------------------------------------------ Serve pool without Ray
def local_replica(model_dir: str | Path, chunk_tokens: int, dtype: str = "float32") -> Any:
    """The pool's real replica class (`TeacherDeployment`) built in this process, a token budget of 1 (every
    row runs alone, not through serve.batch, which needs a running replica); `dtype`: teacher.model.dtype."""
    from hylo.pipeline.config import to_dict
    from hylo.pipeline.teacher.config import TeacherFaultConfig, TeacherModelConfig, TeacherPoolConfig
    from hylo.pipeline.teacher.serve import TeacherDeployment

    model = TeacherModelConfig(path=str(model_dir), logits_chunk_tokens=chunk_tokens, dtype=dtype)
    return TeacherDeployment.func_or_class(to_dict(model), to_dict(TeacherPoolConfig(max_batch_tokens=1)),
                                           to_dict(TeacherFaultConfig()))


class _Response:
    """A Serve response of a `LocalHandle` call: runs the replica's coroutine here."""

    def __init__(self, coro, log: list) -> None:
        self.coro, self.log = coro, log

    def result(self, timeout_s=None):
        out = asyncio.run(self.coro)
        # a request for a group's ranges answers a list of records (top-k) or tensors (hidden states) per row
        self.log.extend(rec.shape[0] if isinstance(rec, torch.Tensor) else rec["logprobs"].shape[0]
                        for o in out for rec in (o if isinstance(o, list) else [o]))
        return out

    def cancel(self) -> None:
        self.coro.close()


class _Done:
    """A Serve response whose value is already there."""

    def __init__(self, value) -> None:
        self.value = value

    def result(self, timeout_s=None):
        return self.value


class _Stream:
    def __init__(self, agen, log: list) -> None:
        self.agen, self.log = agen, log

    async def __anext__(self):
        chunk = await self.agen.__anext__()
        self.log.append(chunk.shape[0])
        return chunk

    def cancel(self) -> None:
        pass


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class LocalHandle:
    """The Serve handle's calls, made on a replica object in this process; logs each request's arguments and
    the tokens each answer carries (what would cross the wire)."""

    def __init__(self, replica) -> None:
        self.replica = replica
        self.requests: list = []
        self.tokens_back: list[int] = []
        self.topk, self.stream, self.hidden = _Method(self._topk), _Method(self._stream), _Method(self._hidden)
        self.head_info = _Method(lambda: _Done(replica.head_info()))

    def options(self, **kw):
        return self

    def _topk(self, *args, **kw):
        self.requests.append(("topk", args[1:], kw))
        return _Response(self.replica.topk(*args, **kw), self.tokens_back)

    def _hidden(self, *args, **kw):
        self.requests.append(("hidden", args[1:], kw))
        return _Response(self.replica.hidden(*args, **kw), self.tokens_back)

    def _stream(self, *args, **kw):
        self.requests.append(("stream", args[1:], kw))
        return _Stream(self.replica.stream(*args, **kw), self.tokens_back)
