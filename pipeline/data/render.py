"""Chat template rendering + tokenisation with a per-token assistant mask.

Legend: L = tokens of one document, S = assistant character spans of one document.

Design choices:
* The text is the tokenizer's own `apply_chat_template(messages, tokenize=False)`, tokenised once
  without added special tokens (the template already writes BOS/markers), exactly as
  `apply_chat_template(tokenize=True)` does.
* Assistant spans are found in characters, then mapped to tokens through the fast tokenizer's
  offsets. Two ways to find the spans:
  - "generation": templates with `{% generation %}` markers; the spans come from
    `apply_chat_template(..., return_assistant_tokens_mask=True)`'s own machinery.
  - "prefix": any template that renders conversations prefix-stably (ChatML, Llama 3, ...). For
    assistant turn i the span is `render(m[:i+1])` minus `render(m[:i], add_generation_prompt=True)`:
    the reply plus the template's end-of-turn marker, without the role header. Trailing whitespace
    after the marker is template glue and is left out. Both prefixes are checked to be prefixes of
    the full text; a template that rewrites history (e.g. drops past reasoning) fails the check and
    the record is rejected with that reason instead of getting a wrong mask.
  - "final": only the final assistant reply carries loss (found the "prefix" way for that one turn);
    earlier replies are context. For templates that rewrite history, such as Qwen3's, which drops
    `<think>` blocks and the empty think header from every assistant turn but the last.
  - "prefix_or_final": "prefix" when the conversation renders prefix-stably, else "final" (each
    such document is counted): every reply trains where the template allows it.
  "auto" picks "generation" when the template has markers, else "prefix".
* Template variables beyond the special tokens (`template_kwargs`, e.g. Llama 3's `date_string`)
  are part of the renderer's fingerprint. Without `date_string`, Llama 3.x templates write today's
  date (`strftime_now`) into every system header: the same config then gives other tokens tomorrow,
  so `date_dependent` flags such a template.
* A token is an assistant token when any of its characters lies in a span (a token straddling
  header and reply must be predicted to produce the reply).
* Every failure is per record: it becomes a reject with a reason, never an exception for the batch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from hylo.pipeline.data.config import MASK_METHODS


class RenderError(ValueError):
    """A record cannot be rendered; the message is the reject reason."""


@dataclass
class Encoded:
    """One rendered + tokenised conversation: input_ids [L] int32, assistant_mask [L] bool."""

    doc_id: str
    input_ids: np.ndarray
    assistant_mask: np.ndarray
    # Only the final assistant reply is masked in (mask method "final", or the fallback of "prefix_or_final").
    final_only: bool = False


@dataclass
class Rejected:
    doc_id: str
    reason: str


def token_table(tokenizer_json: str | dict[str, Any]) -> dict[int, str]:
    """id -> token of a tokenizer.json (its vocabulary and its added tokens): what decides which token an id
    stands for, whatever else (normaliser, template) the files say."""
    data = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
    vocab = (data.get("model") or {}).get("vocab")
    out: dict[int, str] = {}
    if isinstance(vocab, dict):
        out = {int(i): str(t) for t, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        out = {i: str(v[0] if isinstance(v, list) else v) for i, v in enumerate(vocab)}
    for tok in data.get("added_tokens") or []:
        if isinstance(tok, dict) and "id" in tok:
            out[int(tok["id"])] = str(tok.get("content"))
    return out


def token_table_hash(table: dict[int, str]) -> str:
    """Fingerprint of a `token_table` (the data manifest records the one its rows were tokenized with)."""
    return "tokens-" + hashlib.sha256(json.dumps(sorted(table.items()), ensure_ascii=False).encode()).hexdigest()[:16]


def tokenizer_hash(renderer: ChatRenderer) -> str:
    """Fingerprint of what decides the tokens: vocab/merges/normaliser, chat template, special tokens."""
    spec = renderer.spec()
    h = hashlib.sha256()
    h.update(spec["tokenizer_json"].encode())
    h.update(spec["chat_template"].encode())
    h.update(json.dumps(spec["template_kwargs"], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _validate_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RenderError("messages: expected a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RenderError(f"messages[{i}]: expected an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise RenderError(f"messages[{i}].role: missing or not a string")
        if not isinstance(content, str):
            raise RenderError(f"messages[{i}].content: not a string ({type(content).__name__})")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RenderError(f"messages[{i}].content: undecodable text ({e.reason} at {e.start})") from None
    if not any(m["role"] == "assistant" for m in messages):
        raise RenderError("no assistant turn")
    return messages


def tokens_in_spans(offsets_L2: np.ndarray, spans_S2: np.ndarray) -> np.ndarray:
    """assistant_mask [L]: token [a, b) overlaps some span [s, e) (spans sorted, disjoint)."""
    if len(spans_S2) == 0 or len(offsets_L2) == 0:
        return np.zeros(len(offsets_L2), dtype=np.bool_)
    tok_start, tok_end = offsets_L2[:, 0], offsets_L2[:, 1]
    # The last span starting before the token ends is the only one that can overlap it.
    j = np.searchsorted(spans_S2[:, 0], tok_end, side="left") - 1
    ok = j >= 0
    jj = np.clip(j, 0, None)
    return ok & (spans_S2[jj, 1] > tok_start) & (tok_end > tok_start)


def spans_to_token_mask(enc: Any, spans_S2: np.ndarray) -> np.ndarray:
    """assistant_mask [L] of a `tokenizers.Encoding`, by the overlap rule of `tokens_in_spans`.

    Each span needs only the tokens holding its first and last character (`char_to_token`), which
    avoids converting every token's offsets; a character no token covers (a normaliser dropped it)
    falls back to the offsets.
    """
    mask = np.zeros(len(enc.ids), dtype=np.bool_)
    for s, e in spans_S2.tolist():
        a, b = enc.char_to_token(s), enc.char_to_token(e - 1)
        if a is None or b is None:
            return tokens_in_spans(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2), spans_S2)
        mask[a : b + 1] = True
    return mask


class ChatRenderer:
    """Renders + tokenises records `{"doc_id" | "id", "messages": [{"role", "content"}]}` in batches.

    Holds a `tokenizers.Tokenizer`, the chat template and the template's keyword arguments (the
    special tokens), i.e. exactly what `apply_chat_template` uses, without loading transformers'
    tokenizer classes (Ray actors start faster; `spec()` / `from_spec()` carry it to them).
    """

    def __init__(self, backend: Any, chat_template: str, template_kwargs: dict[str, Any],
                 mask_method: str = "auto") -> None:
        if mask_method not in MASK_METHODS:
            raise ValueError(f"mask_method {mask_method!r} is not one of {MASK_METHODS}")
        if not chat_template:
            raise ValueError("the tokenizer has no chat template")
        self._backend = backend
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs)
        has_markers = re.search(r"\{%-?\s*generation\s*-?%\}", chat_template) is not None
        if mask_method == "auto":
            mask_method = "generation" if has_markers else "prefix"
        if mask_method == "generation" and not has_markers:
            raise ValueError("mask_method 'generation' needs {% generation %} markers in the chat template")
        self.mask_method = mask_method
        # The template reads the clock unless the caller fixes the date (Llama 3.x: `date_string`).
        self.date_dependent = "strftime_now" in chat_template and "date_string" not in self.template_kwargs
        # The prefix method renders each conversation 2k+1 times; calling transformers' compiled
        # template directly skips its per-call message copying (messages here are already plain
        # role/content strings, so the text is the same: tests compare with apply_chat_template).
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template  # lazy: transformers

            self._compiled = _compile_jinja_template(chat_template)
        except ImportError:
            self._compiled = None

    @classmethod
    def from_hf(cls, tokenizer: Any, mask_method: str = "auto",
                template_kwargs: dict[str, Any] | None = None) -> ChatRenderer:
        """From a transformers fast tokenizer (the same template and special tokens it would use), plus
        extra template variables (e.g. `date_string`)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("a fast tokenizer (backed by `tokenizers`, with character offsets) is required")
        template = tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        return cls(backend, template or "", {**tokenizer.special_tokens_map, **(template_kwargs or {})},
                   mask_method)

    @classmethod
    def from_pretrained(cls, path: str, mask_method: str = "auto",
                        template_kwargs: dict[str, Any] | None = None) -> ChatRenderer:
        from transformers import AutoTokenizer  # lazy: transformers

        return cls.from_hf(AutoTokenizer.from_pretrained(path), mask_method, template_kwargs)

    def spec(self) -> dict[str, Any]:
        """Plain-data description (tokenizer JSON, template, kwargs) to rebuild this renderer elsewhere."""
        return {"tokenizer_json": self._backend.to_str(), "chat_template": self.chat_template,
                "template_kwargs": self.template_kwargs, "mask_method": self.mask_method}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ChatRenderer:
        from tokenizers import Tokenizer  # lazy: tokenizers

        return cls(Tokenizer.from_str(spec["tokenizer_json"]), spec["chat_template"],
                   spec["template_kwargs"], spec["mask_method"])

    # -- text and spans ----------------------------------------------------------------------
    def _render_raw(self, messages: list[dict[str, str]], gen: bool, masks: bool) -> tuple[str, Any]:
        from transformers.utils.chat_template_utils import render_jinja_template  # lazy: transformers

        try:
            texts, indices = render_jinja_template(
                conversations=[messages], chat_template=self.chat_template, add_generation_prompt=gen,
                return_assistant_tokens_mask=masks, **self.template_kwargs,
            )
        except Exception as e:
            # Templates raise (e.g. "roles must alternate") through jinja; the message is the reason.
            raise RenderError(f"chat template failed: {type(e).__name__}: {e}") from None
        return texts[0], indices[0] if masks else None

    def _render(self, messages: list[dict[str, str]], gen: bool = False) -> str:
        if self._compiled is None:
            return self._render_raw(messages, gen, False)[0]
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=gen, **self.template_kwargs)
        except Exception as e:
            raise RenderError(f"chat template failed: {type(e).__name__}: {e}") from None

    def render(self, messages: list[dict[str, str]]) -> tuple[str, np.ndarray]:
        """Full text and assistant character spans [S, 2] (int64, sorted, disjoint)."""
        text, spans, _ = self.render_spans(messages)
        return text, spans

    def render_spans(self, messages: list[dict[str, str]]) -> tuple[str, np.ndarray, bool]:
        """(full text, assistant character spans [S, 2], whether only the final reply is masked in)."""
        messages = _validate_messages(messages)
        if self.mask_method == "generation":
            text, indices = self._render_raw(messages, False, True)
            spans = sorted((int(s), int(e)) for s, e in indices if e > s)
            return text, np.asarray(spans, dtype=np.int64).reshape(-1, 2), False
        text = self._render(messages)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        final_only = self.mask_method == "final"
        if not final_only:
            try:
                return text, self._prefix_spans(messages, text, turns), False
            except RenderError:
                if self.mask_method != "prefix_or_final" or len(turns) < 2:
                    raise
                final_only = True
        return text, self._prefix_spans(messages, text, turns[-1:]), True

    def _prefix_spans(self, messages: list[dict[str, str]], text: str, turns: list[int]) -> np.ndarray:
        spans = []
        for i in turns:
            before = self._render(messages[:i], gen=True) if i else ""
            upto = self._render(messages[: i + 1])
            if not (text.startswith(upto) and upto.startswith(before)):
                raise RenderError(
                    f"chat template is not prefix-stable at messages[{i}]; cannot locate the assistant reply"
                )
            s, e = len(before), len(upto.rstrip())
            if e > s:
                spans.append((s, e))
        return np.asarray(spans, dtype=np.int64).reshape(-1, 2)

    # -- batches -----------------------------------------------------------------------------
    def encode_batch(self, records: list[dict[str, Any]]) -> list[Encoded | Rejected]:
        """Render + tokenise; one result per record, in order (Encoded or Rejected with a reason)."""
        out: list[Encoded | Rejected | None] = [None] * len(records)
        texts, spans, where = [], [], []
        for k, rec in enumerate(records):
            doc_id = str(rec.get("doc_id") or rec.get("id") or "")
            try:
                if not doc_id:
                    raise RenderError("record has no id")
                text, sp, final_only = self.render_spans(rec.get("messages"))
                if len(sp) == 0:
                    raise RenderError("assistant replies render to no text")
            except RenderError as e:
                out[k] = Rejected(doc_id, str(e))
                continue
            texts.append(text)
            spans.append(sp)
            where.append((k, doc_id, final_only))
        if texts:
            encs = self._backend.encode_batch(texts, add_special_tokens=False)
            for (k, doc_id, final_only), enc, sp in zip(where, encs, spans):
                ids = np.asarray(enc.ids, dtype=np.int32)
                mask = spans_to_token_mask(enc, sp)
                if not mask.any():
                    out[k] = Rejected(doc_id, "no assistant tokens after tokenisation")
                else:
                    out[k] = Encoded(doc_id, ids, mask, final_only)
        return out  # type: ignore[return-value]
