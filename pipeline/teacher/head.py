"""The teacher's LM head on the trainer, for the Serve pool's hidden-state form (`exact_form: hidden`).

Legend: V vocabulary, H' teacher hidden size.

The pool's replicas send each row's final hidden states [T, H'] (after the final norm, as `TeacherModel.hidden`
gives them); the fused KL multiplies them by the teacher's LM head [V, H'] chunk by chunk, as it does for the
in-process teacher. The head is read here once per training worker, from the teacher's checkpoint:

* `find_head(dir)`: where the head lies, from the safetensors headers alone (no torch, no weights read): the
  tensor `lm_head.weight`, or, for a teacher whose config ties its embeddings (SmolLM2, Llama-3.2, Qwen3 up to
  4B), `model.embed_tokens.weight`; its shape must be [vocab_size, hidden_size] of config.json. A reason string
  when it cannot be read (a .bin checkpoint, another layout): `exact_form: auto` then picks logits.
* `load_head(model_cfg)`: that tensor, in the teacher's dtype (`teacher.model.dtype`, the cast the replica's
  `from_pretrained` makes), every value finite.
* `head_digest(weight)`: sha256 of its shape, dtype and bytes. Each replica reports its own (`head_info`); the
  client compares them before the first row (`TeacherClient.check_head`): a pool that runs other weights, or the
  same weights in another dtype, is refused, naming both.

Importing this module loads no torch (the config check uses `find_head`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hylo.json_files import read_json

if TYPE_CHECKING:
    import torch

HEAD_KEY = "lm_head.weight"
TIED_KEY = "model.embed_tokens.weight"


class HeadError(ValueError):
    """The teacher's LM head cannot be read, or is not the pool's: one line naming the file and why."""


@dataclass(frozen=True)
class HeadTensor:
    """Where the teacher's LM head lies: file, tensor name, shape [V, H'] and stored dtype (safetensors' name)."""

    file: Path
    key: str
    shape: tuple[int, int]
    dtype: str


def _checkpoint_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, HeadError, mapping=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HeadError(f"{index}: no weight_map")
        return sorted({d / str(f) for f in weight_map.values()})
    return sorted(d.glob("*.safetensors"))


def find_head(model_dir: str | Path) -> HeadTensor | str:
    """The head's tensor in the teacher checkpoint `model_dir` (safetensors headers only), or why it cannot be
    read there."""
    from safetensors import safe_open  # lazy: a small library, no torch with framework "np"

    d = Path(model_dir)
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        return f"{d} has no config.json"
    cfg = read_json(cfg_file, HeadError, mapping=True)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    if not isinstance(vocab, int) or not isinstance(hidden, int):
        return f"{cfg_file} gives no integer vocab_size and hidden_size"
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    files = _checkpoint_files(d)
    if not files:
        return f"{d} has no .safetensors weights (the head is read with safetensors)"
    found: dict[str, tuple[Path, Any]] = {}
    for f in files:
        if not f.is_file():
            return f"{f} (named by the index) is missing"
        with safe_open(f, framework="np") as st:
            for key in (HEAD_KEY, TIED_KEY):
                if key not in found and key in st.keys():  # noqa: SIM118 (a safe_open handle is no mapping)
                    sl = st.get_slice(key)
                    found[key] = (f, (tuple(sl.get_shape()), sl.get_dtype()))
    key = HEAD_KEY if HEAD_KEY in found else TIED_KEY if tied and TIED_KEY in found else None
    if key is None:
        want = f"{HEAD_KEY} (or {TIED_KEY}, its embeddings being tied)" if tied else HEAD_KEY
        return f"{d}: no tensor {want} in {', '.join(f.name for f in files)}"
    f, (shape, dtype) = found[key]
    if shape != (vocab, hidden):
        return f"{f}: {key} has shape {list(shape)}, config.json says [vocab_size {vocab}, hidden_size {hidden}]"
    return HeadTensor(f, key, (vocab, hidden), dtype)


def load_head(model_dir: str | Path, dtype: torch.dtype) -> torch.Tensor:
    """The teacher's LM head [V, H'] of checkpoint `model_dir`, in `dtype`, on the host; HeadError if it cannot be
    read or holds a NaN / inf."""
    import torch  # lazy: torch
    from safetensors import safe_open  # lazy: safetensors

    where = find_head(model_dir)
    if isinstance(where, str):
        raise HeadError(f"the teacher's LM head (exact_form: hidden): {where}")
    with safe_open(where.file, framework="pt", device="cpu") as st:
        w = st.get_tensor(where.key)
    bad = int((~torch.isfinite(w)).sum())
    if bad:
        raise HeadError(f"{where.file}: {where.key} (the teacher's LM head) holds {bad} NaN / inf values")
    return w.to(dtype).contiguous()


def head_digest(weight: torch.Tensor) -> str:
    """sha256 over the head's shape, dtype and bytes (on the host): equal on two sides only for the same weights
    in the same dtype."""
    import torch  # lazy: torch

    w = weight.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{list(w.shape)}:{str(w.dtype).removeprefix('torch.')}".encode())
    h.update(w.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:32]


def head_info(weight: torch.Tensor) -> dict[str, Any]:
    """What a replica reports of its head, and the trainer compares with its own (`check_same_head`)."""
    return {"vocab_size": int(weight.shape[0]), "hidden_size": int(weight.shape[1]),
            "dtype": str(weight.dtype).removeprefix("torch."), "digest": head_digest(weight)}


def check_same_head(mine: dict[str, Any], pool: dict[str, Any], where: str) -> None:
    """HeadError unless the pool's replica reports the head the trainer loaded from `where`."""
    if mine == pool:
        return
    diff = ", ".join(f"{k} {pool.get(k)!r} on the replica, {v!r} here" for k, v in mine.items() if pool.get(k) != v)
    raise HeadError(f"the teacher pool's LM head is not the one read from {where} (teacher.model.path, "
                    f"teacher.model.dtype): {diff}; the pool must run the checkpoint and dtype the trainer reads "
                    f"(or set teacher.exact_form: logits)")
