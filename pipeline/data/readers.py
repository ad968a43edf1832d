"""Source readers: every chat dataset format -> one normalised record stream, bad input -> rejects.

API (one ordered stream per source; records and rejects interleaved in file order):

    spec = SourceSpec(name="sharegpt", path="/data/sharegpt.json")          # schema/container: auto
    for item in iter_source(spec):
        if is_reject(item): ...        # Reject: {"source", "file", "record", "id", "reason", "raw"}
        else: ...                      # Record: {"id", "source", "messages": [{"role", "content"}]}
    records, rejects = read_source(spec, limit=None)    # small data / tests
    for rec in iter_records(spec, on_reject=rejects.append): ...

Record: `id` str (the source's id field, else "<source>/<file>#<index>"), `source` = spec.name,
`messages` a list of {"role": "system"|"user"|"assistant", "content": str}: an optional leading system
turn, then user/assistant strictly alternating, starting with user (or assistant when
`allow_assistant_first`), with at least one assistant turn (a trailing user turn is kept; it simply
carries no loss); `repairs` (only when some were made) the kinds of repair applied, see below.
Reject: `file` path, `record` 0-based index of the record in that file (-1 for a file-level problem),
`id` when known, `reason` a short human sentence, `raw` the offending input truncated to RAW_CHARS,
`lost` how many records the reject stands for (1 for one bad record, the row count of an unreadable
Parquet row group, None when unknown, e.g. a file that cannot be opened at all).

Repairs (`SourceSpec.repair`, on by default), what real chat dumps need (measured on ShareGPT, where
they keep 99 % of the complete conversations instead of 63 %): empty turns are dropped
("dropped_empty_turn"), leading assistant turns of a conversation split into parts are dropped
("dropped_leading_assistant"; kept instead with `allow_assistant_first`), runs of turns of one role
are merged with a blank line ("merged_same_role"), rarer speaker names (chatgpt, bing, bard, model)
are mapped ("role_alias"). What cannot be repaired (no assistant turn left, an unknown role, a system
turn after the start, non-text content, undecodable text) is a reject.

Field mappings (per source, so public SFT sets read as they are published): `system_field` (a
record-level system prompt, any schema), `system_prompt` (default system turn), `context_field`
(a document appended to the system turn, e.g. ChatQA's `document`), `answer_field` (the final
assistant reply when the conversation ends with the user, e.g. ChatQA's `answers`; a list gives its
first text), `assistant_replace` (literal rewrites in assistant turns, e.g. reasoning markers).

Schemas (`SourceSpec.schema`, "auto" decides per record by which fields are present):
* sharegpt: `conversations` = [{"from": human|user|gpt|chatgpt|bing|bard|assistant|system, "value"}]
* messages: OpenAI-style `messages` = [{"role", "content"}] (same role aliases accepted)
* prompt_response: `prompt` / `response` (+ optional `system`) columns; names configurable
Containers (`SourceSpec.container`, "auto" decides by path):
* json: a JSON array streamed record by record (json.JSONDecoder.raw_decode over a sliding buffer,
  so a 125 MB file never becomes one Python object and a file cut mid-record yields every complete
  record plus one "truncated" reject); a .json file starting with "{" is read as JSON lines
* jsonl (.jsonl/.ndjson, optionally .gz): one record per line, a bad line is one reject
* parquet: pyarrow batches; hf_disk: a `datasets` save_to_disk directory (Arrow IPC streams, read
  with pyarrow, no `datasets` needed; DatasetDict -> `split`); hub: `datasets.load_dataset` in
  streaming mode, only when `datasets` is installed (clear error otherwise)
A directory path reads every supported file in it (sorted); a path with "*" is a sorted glob;
"asset:<name>" is an offline asset of `hylo.assets` (e.g. "asset:sharegpt").

Design choices: text is decoded with surrogateescape so one bad byte never stops a file; any text
still holding surrogates (bad bytes or lone "\\ud800" escapes) is rejected as undecodable, keeping the
stream valid UTF-8 for Arrow/Ray. A missing path or unknown option raises SourceError (a config
bug); anything wrong inside the data is a reject (never a crash, never silently dropped). Damage is
contained to the smallest unit that can be skipped: one JSON record (also one longer than
MAX_RECORD_CHARS, stepped over without buffering it), one JSONL line, one Parquet row group. A file
with no records is a reject; a source with no usable record at all raises EmptySourceError (a wrong
path or an empty download) unless `allow_empty` is set.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from hylo.pipeline.data.config import SourceError, SourceSpec

RAW_CHARS = 500
CHUNK_CHARS = 1 << 20
# A record still incomplete after this many characters is given up on (reported, not buffered forever).
MAX_RECORD_CHARS = 64 << 20

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
_FILE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet", ".json.gz", ".jsonl.gz", ".ndjson.gz")


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


# ---------------------------------------------------------------- raw row iterators per container
# Each yields (index, obj, None, 0) for a parsed row or (index, raw_text, reason, lost) for a loss:
# `lost` records stand behind it (1 for one record, a row group's row count, None when unknown).

RawItem = tuple[int, Any, str | None, int | None]


def _open_text(path: Path):
    raw = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    # newline="" keeps "\r" inside records as is (JSON text may legally hold raw CR in whitespace).
    return io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline="")


def _iter_jsonl(path: Path) -> Iterator[RawItem]:
    with _open_text(path) as f:
        idx = lineno = 0
        while True:
            # Bounded reads: a line longer than MAX_RECORD_CHARS is stepped over, never held whole.
            line = f.readline(MAX_RECORD_CHARS + 1)
            if not line:
                return
            lineno += 1
            if len(line) > MAX_RECORD_CHARS and line[-1] not in "\r\n":
                head = line[:RAW_CHARS]
                while (rest := f.readline(CHUNK_CHARS)) and rest[-1] not in "\r\n":
                    pass
                yield idx, head, (f"record longer than {MAX_RECORD_CHARS} characters on line {lineno}; "
                                  f"skipped"), 1
                idx += 1
                continue
            if not line.strip():
                continue
            try:
                yield idx, json.loads(line), None, 0
            except json.JSONDecodeError as e:
                yield idx, line, f"invalid JSON on line {lineno}: {e.msg} (column {e.colno})", 1
            except RecursionError:
                yield idx, line, f"invalid JSON on line {lineno}: nested too deeply", 1
            idx += 1


_WS_COMMA = re.compile(r"[\s,]*")
_WS = re.compile(r"\s*")
_SIGNIFICANT = re.compile(r'["\\{}\[\]]')
_TOKEN_END = re.compile(r"[,\]]")


class _ValueScan:
    """Finds the end of one JSON value by bracket/string tracking, fed buffer by buffer.

    Used only to step over a broken or oversized record so the records after it are still read;
    the state (depth, inside a string, a pending escape) carries over between buffers.
    """

    def __init__(self, first: str) -> None:
        # A bare broken token (e.g. `nul`, `1x`) ends at the next separator.
        self.bare = first not in '{["'
        self.depth, self.in_str, self.skip = 0, False, 0

    def feed(self, buf: str, i: int) -> int | None:
        """End index of the value in `buf` (scanning from i), or None if `buf` ends first."""
        if self.bare:
            m = _TOKEN_END.search(buf, i)
            return None if m is None else m.start()
        i += self.skip
        self.skip = 0
        while True:
            m = _SIGNIFICANT.search(buf, i)
            if m is None:
                return None
            c, i = m.group(), m.end()
            if self.in_str:
                if c == "\\":
                    if i >= len(buf):
                        self.skip = 1
                        return None
                    i += 1
                elif c == '"':
                    self.in_str = False
                    if self.depth == 0:
                        return i
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i


def _skip_value(buf: str, pos: int) -> int | None:
    """End of the value starting at `pos` if it lies inside `buf`, else None."""
    return _ValueScan(buf[pos]).feed(buf, pos)


def _iter_json_array(path: Path, array: bool = True) -> Iterator[RawItem]:
    """Stream the elements of a top-level JSON array (or, with array=False, of a sequence of
    concatenated JSON values such as pretty-printed objects), tolerating broken, oversized and
    truncated ones."""
    dec = json.JSONDecoder()
    with _open_text(path) as f:
        buf, pos, eof = f.read(CHUNK_CHARS), 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            chunk = f.read(CHUNK_CHARS)
            if not chunk:
                eof = True
                return False
            # Drop consumed text so the buffer holds about one chunk plus the current record.
            buf, pos = buf[pos:] + chunk, 0
            return True

        if not buf:
            eof = True
        pos = _WS.match(buf, 0).end()
        if array:
            if buf[pos:pos + 1] != "[":
                yield -1, buf[:RAW_CHARS], "not a JSON array (expected '[' at start of file)", None
                return
            pos += 1
        idx = 0
        while True:
            pos = _WS_COMMA.match(buf, pos).end()
            while pos >= len(buf) and more():
                pos = _WS_COMMA.match(buf, pos).end()
            if pos >= len(buf):
                if array:
                    yield -1, "", "file ends without the closing ']' of its JSON array", None
                return
            if array and buf[pos] == "]":
                return
            while True:
                try:
                    obj, end = dec.raw_decode(buf, pos)
                except (json.JSONDecodeError, RecursionError) as e:
                    msg = f"{e.msg} at char {e.pos - pos} of the record" if isinstance(
                        e, json.JSONDecodeError) else "nested too deeply"
                    # Brackets balanced inside the buffer -> the whole record is here and broken;
                    # otherwise it is only cut by the buffer's edge (read more) or by the file's end.
                    end = _skip_value(buf, pos)
                    if end is None:
                        if len(buf) - pos < MAX_RECORD_CHARS and more():
                            continue
                        if eof:
                            yield idx, buf[pos:pos + RAW_CHARS], f"truncated record at end of file ({msg})", 1
                            return
                        # Oversized: step over it chunk by chunk without buffering it, then go on.
                        head, scan = buf[pos:pos + RAW_CHARS], _ValueScan(buf[pos])
                        end = scan.feed(buf, pos)
                        while end is None:
                            pos = len(buf)
                            if not more():
                                yield idx, head, (f"truncated record at end of file (longer than "
                                                  f"{MAX_RECORD_CHARS} characters)"), 1
                                return
                            end = scan.feed(buf, 0)
                        yield idx, head, f"record longer than {MAX_RECORD_CHARS} characters; skipped", 1
                    else:
                        yield idx, buf[pos:pos + RAW_CHARS], f"invalid JSON: {msg}", 1
                    pos = end
                    break
                # A scalar cut at the buffer's edge may parse short ("12" of "123"): read more.
                if end >= len(buf) and more():
                    continue
                if end - pos > MAX_RECORD_CHARS:
                    # The same limit whether or not the record happened to fit in the buffer.
                    yield idx, buf[pos:pos + RAW_CHARS], f"record longer than {MAX_RECORD_CHARS} characters; skipped", 1
                else:
                    yield idx, obj, None, 0
                pos = end
                break
            idx += 1


def _iter_json(path: Path) -> Iterator[RawItem]:
    with _open_text(path) as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        first_line = next((ln for ln in f if ln.strip()), "")
    if head.startswith("["):
        return _iter_json_array(path)
    try:
        json.loads(first_line)
    except (json.JSONDecodeError, RecursionError):
        # Pretty-printed objects one after another (or one big object): a JSON value sequence.
        return _iter_json_array(path, array=False)
    # Objects one per line: a common mislabel of JSON lines, read line by line for exact errors.
    return _iter_jsonl(path)


def _iter_arrow_tables(batches: Iterable[Any], start: int = 0) -> Iterator[RawItem]:
    idx = start
    for batch in batches:
        for row in batch.to_pylist():
            yield idx, row, None, 0
            idx += 1


def _iter_parquet(path: Path) -> Iterator[RawItem]:
    """Row group by row group: a corrupt group is one reject standing for its rows, the rest is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
    except (pa.ArrowException, OSError) as e:
        yield -1, "", f"unreadable Parquet file: {' '.join(str(e).split())}", None
        return
    start = 0
    for rg in range(meta.num_row_groups):
        n = meta.row_group(rg).num_rows
        done = 0
        try:
            for batch in pf.iter_batches(batch_size=1024, row_groups=[rg]):
                for row in batch.to_pylist():
                    yield start + done, row, None, 0
                    done += 1
        except (pa.ArrowException, OSError) as e:
            yield start + done, "", (f"unreadable Parquet row group {rg} (rows {start + done}..{start + n - 1} "
                                     f"of {meta.num_rows}): {' '.join(str(e).split())}"), n - done
        start += n


def _arrow_batches(path: Path) -> Iterator[Any]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as src:
        try:
            reader = pa.ipc.open_stream(src)
        except pa.ArrowInvalid:
            src.seek(0)
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        yield from reader


def _hf_disk_files(root: Path, split: str, source: str) -> list[Path]:
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise SourceError(f"source {source!r}: split {split!r} not in {root} (splits: {splits})")
        root = root / split
    state = root / "state.json"
    if not state.is_file():
        raise SourceError(f"source {source!r}: {root} is not a datasets save_to_disk directory "
                          f"(no state.json or dataset_dict.json)")
    files = [root / d["filename"] for d in json.loads(state.read_text()).get("_data_files", [])]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise SourceError(f"source {source!r}: {root}/state.json lists missing files {missing}")
    return files


def _iter_hf_arrow(path: Path) -> Iterator[RawItem]:
    import pyarrow as pa

    # An Arrow IPC stream cannot be resynchronised after a corrupt batch: the rest of the file is lost
    # (count unknown), what came before it is kept.
    n = 0
    try:
        for item in _iter_arrow_tables(_arrow_batches(path)):
            yield item
            n += 1
    except (pa.ArrowException, OSError) as e:
        yield (n if n else -1), "", f"unreadable Arrow file after {n} rows: {' '.join(str(e).split())}", None


def _iter_hub(spec: SourceSpec) -> Iterator[RawItem]:
    try:
        import datasets
    except ImportError:
        raise SourceError(
            f"source {spec.name!r}: reading hub dataset {spec.path!r} needs the `datasets` package "
            f"(pip install datasets) and network access to the hub; or save it with save_to_disk and "
            f"point `path` at that directory"
        ) from None
    name = spec.path.removeprefix("hub:")
    ds = datasets.load_dataset(name, spec.subset, split=spec.split, streaming=True)
    for idx, row in enumerate(ds):
        yield idx, row, None, 0


def resolve_files(spec: SourceSpec) -> list[tuple[Path, str]]:
    """The (file, container) pairs a local source reads, in order. Raises SourceError if none."""
    p = Path(spec.path).expanduser()
    if "*" in spec.path:
        paths = [Path(q) for q in sorted(glob.glob(str(p), recursive=True))]
    elif p.is_dir():
        if spec.container in ("auto", "hf_disk") and (
            (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()
        ):
            return [(f, "hf_disk") for f in _hf_disk_files(p, spec.split, spec.name)]
        paths = sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(_FILE_SUFFIXES))
    elif p.is_file():
        paths = [p]
    else:
        raise SourceError(f"source {spec.name!r}: path {spec.path} does not exist")
    if not paths:
        raise SourceError(f"source {spec.name!r}: no readable files at {spec.path} "
                          f"(looked for {', '.join(_FILE_SUFFIXES)})")
    out = []
    for q in paths:
        kind = spec.container
        if kind == "auto":
            name = q.name.removesuffix(".gz")
            kind = ("parquet" if name.endswith(".parquet") else "jsonl"
                    if name.endswith((".jsonl", ".ndjson")) else "json" if name.endswith(".json")
                    else "hf_disk" if name.endswith(".arrow") else "")
            if not kind:
                raise SourceError(f"source {spec.name!r}: cannot tell the format of {q}; set container")
        out.append((q, kind))
    return out


_READERS: dict[str, Callable[[Path], Iterator[RawItem]]] = {
    "json": _iter_json,
    "jsonl": _iter_jsonl,
    "parquet": _iter_parquet,
    "hf_disk": _iter_hf_arrow,
}


def _is_hub(spec: SourceSpec) -> bool:
    return spec.container == "hub" or spec.path.startswith("hub:")


def _iter_items(spec: SourceSpec) -> Iterator[tuple[str, int, Any, str | None, int | None]]:
    """(file, index, row, parse_error or None, lost) for every raw row of a source, in order."""
    # An offline asset (hylo.assets: `asset:NAME`, or NAME where no such path exists), fetched on first use.
    from hylo.assets import AssetError, expand_asset

    try:
        spec = dataclasses.replace(spec, path=expand_asset(spec.path, progress=False))
    except AssetError as e:
        raise SourceError(f"source {spec.name!r}: {e}") from e
    if _is_hub(spec):
        for idx, obj, err, lost in _iter_hub(spec):
            yield spec.path, idx, obj, err, lost
        return
    for f, kind in resolve_files(spec):
        n = 0
        for idx, obj, err, lost in _READERS[kind](f):
            n += 1
            yield str(f), idx, obj, err, lost
        if n == 0:
            size = f.stat().st_size
            what = "empty file (0 bytes)" if size == 0 else f"file holds no records ({size} bytes)"
            yield str(f), -1, "", what, None


def iter_raw(spec: SourceSpec) -> Iterator[tuple[str, int, Any, str | None]]:
    """Raw rows of a source before normalisation: (file, index, row, parse_error or None).

    Used by iter_source and by anything that reads non-chat tables (e.g. benchmark items).
    """
    for fname, idx, obj, err, _ in _iter_items(spec):
        yield fname, idx, obj, err


def iter_source(spec: SourceSpec) -> Iterator[Record | Reject]:
    """Every record and reject of a source, in file order (see the module docstring).

    Raises EmptySourceError at the end when the source gave no record (unless `allow_empty`).
    """
    n = records = rejects = 0
    first_reason = ""
    short: dict[str, str] = {}
    for fname, idx, obj, parse_err, lost in _iter_items(spec):
        if spec.limit is not None and n >= spec.limit:
            break
        n += 1
        if parse_err is not None:
            rejects += 1
            first_reason = first_reason or parse_err
            yield {"source": spec.name, "file": fname, "record": idx, "id": None,
                   "reason": parse_err, "raw": _raw(obj), "lost": lost}
            continue
        if fname not in short:
            short[fname] = Path(fname).name
        rec, err = normalize_record(obj, spec, f"{spec.name}/{short[fname]}#{idx}")
        if err is not None:
            rejects += 1
            first_reason = first_reason or err
            rid = obj.get(spec.id_field) if isinstance(obj, dict) else None
            yield {"source": spec.name, "file": fname, "record": idx,
                   "id": None if rid is None else _clean(str(rid)), "reason": err, "raw": _raw(obj), "lost": 1}
        else:
            assert rec is not None
            records += 1
            yield rec
    if records == 0 and not spec.allow_empty:
        detail = f"{rejects} reject(s), the first: {first_reason}" if rejects else "nothing in it"
        raise EmptySourceError(f"source {spec.name!r}: no usable record in {spec.path} ({detail}); check the "
                               f"path and the field mapping, or set allow_empty: true on the source")


def iter_records(spec: SourceSpec, on_reject: Callable[[Reject], None]) -> Iterator[Record]:
    """Records only; each reject is handed to `on_reject` (e.g. a list's append or a file writer)."""
    for item in iter_source(spec):
        if is_reject(item):
            on_reject(item)  # type: ignore[arg-type]
        else:
            yield item  # type: ignore[misc]


def read_source(spec: SourceSpec) -> tuple[list[Record], list[Reject]]:
    records: list[Record] = []
    rejects: list[Reject] = []
    for item in iter_source(spec):
        (rejects if is_reject(item) else records).append(item)  # type: ignore[arg-type]
    return records, rejects
