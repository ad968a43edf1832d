"""What the Serve pool's teacher costs per row in each form: the bytes it sends the trainer, and for the
hidden-state form the LM head the trainer holds and multiplies by.

Legend: T tokens of a row, H' teacher hidden size, V vocabulary, k top-k width, b bytes of a value.

    logits  T x V x b           full-vocabulary logits, streamed chunk by chunk (b: the teacher's dtype)
    hidden  T x H' x b          final hidden states (the teacher's dtype); the trainer holds the LM head
                                [V, H'] (V x H' x b bytes, per training worker) and runs its product in the
                                fused KL's forward: 2 x T x V x H' FLOPs a row, chunk by chunk
    topk    T x (k x (b_k + 4) + 4)  log-probabilities (teacher.client.dtype, b_k), int32 indices, fp32 tail

The measured counterpart (the bytes that arrive through a real pool) is tests/teacher/test_teacher_serve.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORMS = ("logits", "hidden", "topk")


@dataclass(frozen=True)
class TeacherWire:
    """The Serve pool's teacher per row of T tokens, in each form."""

    tokens: int
    hidden_size: int
    vocab_size: int
    k: int
    value_bytes: int
    topk_bytes: int

    def bytes(self, form: str) -> int:
        """Bytes on the wire per row in `form` (one of FORMS)."""
        T = self.tokens
        if form == "logits":
            return T * self.vocab_size * self.value_bytes
        if form == "hidden":
            return T * self.hidden_size * self.value_bytes
        if form == "topk":
            return T * (self.k * (self.topk_bytes + 4) + 4)
        raise ValueError(f"teacher wire: form {form!r} is not one of {', '.join(FORMS)}")

    @property
    def head_bytes(self) -> int:
        """The LM head [V, H'] each training worker holds in the hidden-state form."""
        return self.vocab_size * self.hidden_size * self.value_bytes

    @property
    def head_flops(self) -> int:
        """The head's product on the training GPU per row in the hidden-state form (the fused KL's forward)."""
        return 2 * self.tokens * self.vocab_size * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "k": self.k, "bytes": {f: self.bytes(f) for f in FORMS},
                "head_bytes": self.head_bytes, "head_flops": self.head_flops}


def teacher_wire(t: Any, teacher_config: Any, tokens: int) -> TeacherWire:
    """The wire of stage 2's `teacher` section `t` (a Serve pool) at the teacher's transformers config, for rows of
    `tokens`."""
    import torch  # lazy: torch

    text = teacher_config.get_text_config() if hasattr(teacher_config, "get_text_config") else teacher_config

    def size(name: str) -> int:
        return torch.empty((), dtype=getattr(torch, name)).element_size()

    return TeacherWire(tokens, int(text.hidden_size), int(text.vocab_size), t.k, size(t.model.dtype),
                       size(t.client.dtype))


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def format_wire(w: TeacherWire, form: str, dtype: str, topk_dtype: str) -> str:
    """The per-row table `hylo estimate` and `hylo rehearse` print for a Serve pool teacher (`form`: the run's;
    the top-k line at the run's k, else 64)."""
    k = w.k or 64
    topk = TeacherWire(w.tokens, w.hidden_size, w.vocab_size, k, w.value_bytes, w.topk_bytes)
    rows = [("logits", f"{w.tokens:,} x {w.vocab_size:,} {dtype}", w.bytes("logits")),
            ("hidden", f"{w.tokens:,} x {w.hidden_size:,} {dtype}", w.bytes("hidden")),
            (f"top-{k}", f"{w.tokens:,} x ({k} x ({topk_dtype} + int32) + fp32)", topk.bytes("topk"))]
    run = {"logits": "logits", "hidden": "hidden", "topk": f"top-{k}"}[form]
    out = [f"teacher pool on the wire per row of {w.tokens:,} tokens (teacher.k, teacher.exact_form):"]
    for name, what, n in rows:
        out.append(f"  {name:<7} {_size(n):>10}  {what}{'   <- this run' if name == run else ''}")
    out.append(f"  hidden: the trainer holds the LM head ({w.vocab_size:,} x {w.hidden_size:,} {dtype}, "
               f"{_size(w.head_bytes)} per worker) and runs its product in the fused KL: "
               f"{w.head_flops / 1e12:,.1f} TFLOP a row")
    return "\n".join(out)
