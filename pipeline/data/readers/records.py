"""A raw row -> one normalised chat record, or the reason it is a reject (schemas, role aliases, repairs)."""

from __future__ import annotations

import json
from typing import Any, NotRequired, TypedDict

from hylo.pipeline.data.config import SourceError, SourceSpec

RAW_CHARS = 500
ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
}
# The usual spellings of ShareGPT and OpenAI-style data; mapping any other alias counts as a repair.
_PLAIN_ROLES = frozenset({"human", "user", "gpt", "assistant", "system"})
REPAIR_KINDS = ("dropped_empty_turn", "dropped_leading_assistant", "merged_same_role", "role_alias")

class EmptySourceError(SourceError):
    """A source gave no usable record (empty files, `[]`, every record rejected); names the source."""


class Message(TypedDict):
    role: str
    content: str


class Record(TypedDict):
    id: str
    source: str
    messages: list[Message]
    repairs: NotRequired[list[str]]


class Reject(TypedDict):
    source: str
    file: str
    record: int
    id: str | None
    reason: str
    raw: str
    lost: int | None


def is_reject(item: Record | Reject | dict[str, Any]) -> bool:
    return "reason" in item


def _clean(text: str) -> str:
    # Make a string safe for JSON/Arrow even when it holds surrogates (used for raw/ids only).
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _raw(obj: Any) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, default=repr)
    return _clean(text[:RAW_CHARS])


def _undecodable(text: str) -> bool:
    # ASCII text cannot hold surrogates; the check is one C scan for most text.
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def validate_messages(
    turns: Any, role_key: str = "role", content_key: str = "content", allow_assistant_first: bool = False,
    repair: bool = False,
) -> tuple[list[Message] | None, str | None]:
    """Normalise a list of turns; returns (messages, None) or (None, reason). See `clean_turns`."""
    msgs, err, _ = clean_turns(turns, role_key, content_key, allow_assistant_first, repair)
    return msgs, err


def clean_turns(
    turns: Any, role_key: str = "role", content_key: str = "content", allow_assistant_first: bool = False,
    repair: bool = False,
) -> tuple[list[Message] | None, str | None, list[str]]:
    """Normalise a list of turns: (messages, None, repairs) or (None, reason, repairs).

    Accepts `role_key`/`content_key` and, as fallbacks, ShareGPT's `from`/`value` or OpenAI's
    `role`/`content`, so mixed files work. With `repair`, the repairs of the module docstring are
    applied and listed (one entry per kind, in REPAIR_KINDS order); without, each is a reject.
    """
    if not isinstance(turns, list):
        return None, f"conversation is not a list ({type(turns).__name__})", []
    if not turns:
        return None, "empty conversation", []
    out: list[Message] = []
    done: set[str] = set()
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            return None, f"turn {i} is not an object ({type(t).__name__})", []
        role = t.get(role_key, t.get("role", t.get("from")))
        if role is None:
            return None, f"turn {i}: missing role", []
        key = role.strip().lower() if isinstance(role, str) else None
        if key not in ROLE_ALIASES:
            return None, f"turn {i}: unknown role {_raw(role)!r}", []
        if content_key in t:
            content = t[content_key]
        elif "content" in t or "value" in t:
            content = t.get("content", t.get("value"))
        else:
            return None, f"turn {i}: missing content", []
        if not isinstance(content, str):
            return None, f"turn {i}: content is not a string ({type(content).__name__})", []
        if _undecodable(content):
            return None, f"turn {i}: undecodable text (invalid UTF-8 or lone surrogate)", []
        # isspace() scans without copying the (possibly long) content, unlike strip().
        if not content or content.isspace():
            if not repair:
                return None, f"turn {i}: empty content", []
            done.add("dropped_empty_turn")
            continue
        if key not in _PLAIN_ROLES:
            done.add("role_alias")
        out.append({"role": ROLE_ALIASES[key], "content": content})
    if repair and out:
        if not allow_assistant_first and all(m["role"] in ("assistant", "system") for m in out):
            return None, "only assistant turns (a continuation part with no user turn)", []
        out = _repair_order(out, allow_assistant_first, done)
    repairs = [k for k in REPAIR_KINDS if k in done]
    if not out or (out[0]["role"] == "system" and len(out) == 1 and repairs):
        return None, f"no user/assistant turns left after repair ({', '.join(repairs)})", repairs
    err = _alternation_error(out, allow_assistant_first)
    return (None, err, repairs) if err else (out, None, repairs)


def _repair_order(msgs: list[Message], allow_assistant_first: bool, done: set[str]) -> list[Message]:
    """Drop leading assistant turns (unless allowed) and merge runs of one role; record what was done."""
    start = 1 if msgs[0]["role"] == "system" else 0
    body = msgs[start:]
    if not allow_assistant_first:
        k = 0
        while k < len(body) and body[k]["role"] == "assistant":
            k += 1
        if k:
            done.add("dropped_leading_assistant")
            body = body[k:]
    merged: list[Message] = []
    for m in body:
        if merged and merged[-1]["role"] == m["role"] and m["role"] != "system":
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
            done.add("merged_same_role")
        else:
            merged.append(m)
    return msgs[:start] + merged


def _alternation_error(msgs: list[Message], allow_assistant_first: bool) -> str | None:
    start = 1 if msgs[0]["role"] == "system" else 0
    body = msgs[start:]
    if not body:
        return "no user/assistant turns"
    for j, m in enumerate(body):
        if m["role"] == "system":
            return f"system turn after the start (turn {j + start})"
    first = 1 if allow_assistant_first and body[0]["role"] == "assistant" else 0
    for j, m in enumerate(body):
        want = "user" if (j + first) % 2 == 0 else "assistant"
        if m["role"] != want:
            return f"broken alternation: turn {j + start} is {m['role']!r}, expected {want!r}"
    if not any(m["role"] == "assistant" for m in body):
        return "no assistant turn"
    return None


def _first_text(value: Any) -> Any:
    """A field that may hold a list of alternatives (ChatQA's `answers`): its first string."""
    if isinstance(value, list | tuple):
        return next((v for v in value if isinstance(v, str) and v.strip()), value[0] if value else None)
    return value


def _optional_text(obj: dict, field: str | None) -> tuple[str | None, str | None]:
    """(text, None), (None, None) when absent/null/blank, or (None, reason) when not text."""
    if not field or obj.get(field) is None:
        return None, None
    v = _first_text(obj[field])
    if not isinstance(v, str):
        return None, f"field {field!r} is not a string ({type(v).__name__})"
    return (v, None) if v.strip() else (None, None)


def normalize_record(obj: Any, spec: SourceSpec, default_id: str) -> tuple[Record | None, str | None]:
    """One raw row -> (Record, None) or (None, reason), per `spec.schema` (auto: by fields present)."""
    if not isinstance(obj, dict):
        return None, f"record is not an object ({type(obj).__name__})"
    schema = spec.schema
    if schema == "auto":
        if spec.conversations_field in obj:
            schema = "sharegpt"
        elif spec.messages_field in obj:
            schema = "messages"
        elif spec.prompt_field in obj or spec.response_field in obj:
            schema = "prompt_response"
        else:
            keys = ", ".join(sorted(map(str, obj))[:10])
            return None, (f"no {spec.conversations_field!r}, {spec.messages_field!r} or "
                          f"{spec.prompt_field!r}/{spec.response_field!r} field (keys: {keys})")
    if schema in ("sharegpt", "messages"):
        fld, role_key, content_key = ((spec.conversations_field, "from", "value") if schema == "sharegpt"
                                      else (spec.messages_field, "role", "content"))
        if fld not in obj:
            return None, f"missing field {fld!r}"
        turns = obj[fld]
    else:
        for f in (spec.prompt_field, spec.response_field):
            if f not in obj:
                return None, f"missing field {f!r}"
        role_key, content_key = "role", "content"
        turns = [{"role": "user", "content": obj[spec.prompt_field]},
                 {"role": "assistant", "content": _first_text(obj[spec.response_field])}]
    # Record-level additions: the system turn (field, default prompt, context) and the final answer.
    system, err = _optional_text(obj, spec.system_field)
    context, err2 = _optional_text(obj, spec.context_field)
    answer, err3 = _optional_text(obj, spec.answer_field)
    if err or err2 or err3:
        return None, err or err2 or err3
    if spec.context_field and spec.context_field in obj and context is None:
        return None, f"field {spec.context_field!r} is empty"
    if isinstance(turns, list) and (system or spec.system_prompt or context or answer):
        turns = list(turns)
        head = turns[0] if turns and isinstance(turns[0], dict) else {}
        has_system = str(head.get(role_key, head.get("role", head.get("from", "")))).strip().lower() == "system"
        if has_system:
            # The conversation's own system turn wins over the default prompt; context goes after it.
            if context:
                sys_text = head.get(content_key, head.get("content", head.get("value")))
                if isinstance(sys_text, str):
                    turns[0] = {role_key: "system", content_key: sys_text + "\n\n" + context}
        else:
            parts = [x for x in (system or spec.system_prompt, context) if x]
            if parts:
                turns.insert(0, {role_key: "system", content_key: "\n\n".join(parts)})
        if answer:
            tail = turns[-1] if turns and isinstance(turns[-1], dict) else {}
            last = str(tail.get(role_key, tail.get("role", tail.get("from", "")))).strip().lower()
            if ROLE_ALIASES.get(last) == "user":
                turns.append({role_key: "assistant", content_key: answer})
    msgs, err, repairs = clean_turns(turns, role_key, content_key, spec.allow_assistant_first, spec.repair)
    if err is not None:
        return None, err
    assert msgs is not None
    if spec.assistant_replace:
        for m in msgs:
            if m["role"] == "assistant":
                text = m["content"]
                for old, new in spec.assistant_replace:
                    text = text.replace(old, new)
                m["content"] = text
        if any(m["role"] == "assistant" and (not m["content"] or m["content"].isspace()) for m in msgs):
            return None, "an assistant turn is empty after assistant_replace"
    rid = obj.get(spec.id_field)
    rid = default_id if rid is None or (isinstance(rid, str) and not rid) else _clean(str(rid))
    rec: Record = {"id": rid, "source": spec.name, "messages": msgs}
    if repairs:
        rec["repairs"] = repairs
    return rec, None
