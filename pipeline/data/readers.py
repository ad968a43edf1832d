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
carries no loss).
Reject: `file` path, `record` 0-based index of the record in that file (-1 for a file-level problem),
`id` when known, `reason` a short human sentence, `raw` the offending input truncated to RAW_CHARS.

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
bug); anything wrong inside the data is a reject (never a crash, never silently dropped).
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
from typing import Any, TypedDict

from pipeline.config import NONEMPTY, at_least, rules

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
    "assistant": "assistant",
    "system": "system",
}
SCHEMAS = ("auto", "sharegpt", "messages", "prompt_response")
CONTAINERS = ("auto", "json", "jsonl", "parquet", "hf_disk", "hub")
_FILE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet", ".json.gz", ".jsonl.gz", ".ndjson.gz")


class SourceError(ValueError):
    """A source cannot be opened at all (missing path, bad option, missing package); names the source."""


class Message(TypedDict):
    role: str
    content: str


class Record(TypedDict):
    id: str
    source: str
    messages: list[Message]


class Reject(TypedDict):
    source: str
    file: str
    record: int
    id: str | None
    reason: str
    raw: str


@dataclasses.dataclass
@rules(name=NONEMPTY, path=NONEMPTY, limit=at_least(1))
class SourceSpec:
    """Where a source lives and how to read it. Plain fields so it nests in any `pipeline.config` tree."""

    name: str
    path: str
    schema: str = "auto"
    container: str = "auto"
    # DatasetDict split (hf_disk) or hub split.
    split: str = "train"
    # Hub dataset configuration name (e.g. "ARC-Challenge").
    subset: str | None = None
    id_field: str = "id"
    conversations_field: str = "conversations"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_field: str | None = "system"
    # Accept a conversation whose first non-system turn is the assistant's (ShareGPT's split
    # conversations: ~6.3K of its 17.7K continue a previous part). Off: such records are rejects.
    allow_assistant_first: bool = False
    # Stop after this many items (records + rejects) per source; None = all.
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.schema not in SCHEMAS:
            raise SourceError(f"source {self.name!r}: schema {self.schema!r} not in {SCHEMAS}")
        if self.container not in CONTAINERS:
            raise SourceError(f"source {self.name!r}: container {self.container!r} not in {CONTAINERS}")


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
    turns: Any, role_key: str = "role", content_key: str = "content", allow_assistant_first: bool = False
) -> tuple[list[Message] | None, str | None]:
    """Normalise a list of turns; returns (messages, None) or (None, reason).

    Accepts `role_key`/`content_key` and, as fallbacks, ShareGPT's `from`/`value` or OpenAI's
    `role`/`content`, so mixed files work.
    """
    if not isinstance(turns, list):
        return None, f"conversation is not a list ({type(turns).__name__})"
    if not turns:
        return None, "empty conversation"
    out: list[Message] = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            return None, f"turn {i} is not an object ({type(t).__name__})"
        role = t.get(role_key, t.get("role", t.get("from")))
        if role is None:
            return None, f"turn {i}: missing role"
        if not isinstance(role, str) or role.strip().lower() not in ROLE_ALIASES:
            return None, f"turn {i}: unknown role {_raw(role)!r}"
        if content_key in t:
            content = t[content_key]
        elif "content" in t or "value" in t:
            content = t.get("content", t.get("value"))
        else:
            return None, f"turn {i}: missing content"
        if not isinstance(content, str):
            return None, f"turn {i}: content is not a string ({type(content).__name__})"
        if _undecodable(content):
            return None, f"turn {i}: undecodable text (invalid UTF-8 or lone surrogate)"
        # isspace() scans without copying the (possibly long) content, unlike strip().
        if not content or content.isspace():
            return None, f"turn {i}: empty content"
        out.append({"role": ROLE_ALIASES[role.strip().lower()], "content": content})
    err = _alternation_error(out, allow_assistant_first)
    return (None, err) if err else (out, None)


def _alternation_error(msgs: list[Message], allow_assistant_first: bool) -> str | None:
    start = 1 if msgs[0]["role"] == "system" else 0
    body = msgs[start:]
    if not body:
        return "no user/assistant turns"
    first = 1 if allow_assistant_first and body[0]["role"] == "assistant" else 0
    for j, m in enumerate(body):
        want = "user" if (j + first) % 2 == 0 else "assistant"
        if m["role"] != want:
            return f"broken alternation: turn {j + start} is {m['role']!r}, expected {want!r}"
    if not any(m["role"] == "assistant" for m in body):
        return "no assistant turn"
    return None


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
    if schema == "sharegpt":
        if spec.conversations_field not in obj:
            return None, f"missing field {spec.conversations_field!r}"
        msgs, err = validate_messages(obj[spec.conversations_field], "from", "value",
                                     spec.allow_assistant_first)
    elif schema == "messages":
        if spec.messages_field not in obj:
            return None, f"missing field {spec.messages_field!r}"
        msgs, err = validate_messages(obj[spec.messages_field], "role", "content",
                                     spec.allow_assistant_first)
    else:
        for f in (spec.prompt_field, spec.response_field):
            if f not in obj:
                return None, f"missing field {f!r}"
        turns = []
        system = obj.get(spec.system_field) if spec.system_field else None
        if system is not None and not (isinstance(system, str) and not system.strip()):
            turns.append({"role": "system", "content": system})
        turns += [{"role": "user", "content": obj[spec.prompt_field]},
                  {"role": "assistant", "content": obj[spec.response_field]}]
        msgs, err = validate_messages(turns)
    if err is not None:
        return None, err
    rid = obj.get(spec.id_field)
    rid = default_id if rid is None or (isinstance(rid, str) and not rid) else _clean(str(rid))
    assert msgs is not None
    return {"id": rid, "source": spec.name, "messages": msgs}, None


# ---------------------------------------------------------------- raw row iterators per container
# Each yields (index, obj, None) for a parsed row or (index, raw_text, reason) for an unparseable one.

RawItem = tuple[int, Any, str | None]


def _open_text(path: Path):
    raw = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    # newline="" keeps "\r" inside records as is (JSON text may legally hold raw CR in whitespace).
    return io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline="")


def _iter_jsonl(path: Path) -> Iterator[RawItem]:
    with _open_text(path) as f:
        idx = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield idx, json.loads(line), None
            except json.JSONDecodeError as e:
                yield idx, line, f"invalid JSON on line {lineno}: {e.msg} (column {e.colno})"
            except RecursionError:
                yield idx, line, f"invalid JSON on line {lineno}: nested too deeply"
            idx += 1


_WS_COMMA = re.compile(r"[\s,]*")
_WS = re.compile(r"\s*")
_SIGNIFICANT = re.compile(r'["\\{}\[\]]')
_TOKEN_END = re.compile(r"[,\]]")


def _skip_value(buf: str, pos: int) -> int | None:
    """End of the bracketed value starting at `pos`, by bracket/string tracking; None if not in buf.

    Used only to step over a syntactically broken record so the records after it are still read.
    """
    if buf[pos] not in "{[":
        # A bare broken token (e.g. `nul`, `1x`): it ends at the next separator.
        m = _TOKEN_END.search(buf, pos)
        return None if m is None else m.start()
    depth, in_str, i = 0, False, pos
    while True:
        m = _SIGNIFICANT.search(buf, i)
        if m is None:
            return None
        c, i = m.group(), m.end()
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return i


def _iter_json_array(path: Path, array: bool = True) -> Iterator[RawItem]:
    """Stream the elements of a top-level JSON array (or, with array=False, of a sequence of
    concatenated JSON values such as pretty-printed objects), tolerating broken and truncated ones."""
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
                yield -1, buf[:RAW_CHARS], "not a JSON array (expected '[' at start of file)"
                return
            pos += 1
        idx = 0
        while True:
            pos = _WS_COMMA.match(buf, pos).end()
            while pos >= len(buf) and more():
                pos = _WS_COMMA.match(buf, pos).end()
            if pos >= len(buf):
                if array:
                    yield -1, "", "file ends without the closing ']' of its JSON array"
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
                            yield idx, buf[pos:pos + RAW_CHARS], f"truncated record at end of file ({msg})"
                        else:
                            yield idx, buf[pos:pos + RAW_CHARS], (
                                f"record longer than {MAX_RECORD_CHARS} characters; rest of file skipped")
                        return
                    yield idx, buf[pos:pos + RAW_CHARS], f"invalid JSON: {msg}"
                    pos = end
                    break
                # A scalar cut at the buffer's edge may parse short ("12" of "123"): read more.
                if end >= len(buf) and more():
                    continue
                yield idx, obj, None
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


def _iter_arrow_tables(batches: Iterable[Any]) -> Iterator[RawItem]:
    idx = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield idx, row, None
            idx += 1


def _iter_parquet(path: Path) -> Iterator[RawItem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        yield from _iter_arrow_tables(pf.iter_batches(batch_size=1024))
    except (pa.ArrowException, OSError) as e:
        yield -1, "", f"unreadable Parquet file: {e}"


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

    try:
        yield from _iter_arrow_tables(_arrow_batches(path))
    except (pa.ArrowException, OSError) as e:
        yield -1, "", f"unreadable Arrow file: {e}"


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
        yield idx, row, None


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


def iter_raw(spec: SourceSpec) -> Iterator[tuple[str, int, Any, str | None]]:
    """Raw rows of a source before normalisation: (file, index, row, parse_error or None).

    Used by iter_source and by anything that reads non-chat tables (e.g. benchmark items).
    """
    if spec.path.startswith("asset:"):
        # An offline asset (hylo.assets), fetched into the cache on first use.
        from hylo.assets import AssetError, fetch_asset

        try:
            spec = dataclasses.replace(spec, path=str(fetch_asset(spec.path.removeprefix("asset:"),
                                                                  progress=False)))
        except AssetError as e:
            raise SourceError(f"source {spec.name!r}: {e}") from e
    if _is_hub(spec):
        files: list[tuple[str, Iterator[RawItem]]] = [(spec.path, _iter_hub(spec))]
    else:
        files = [(str(f), _READERS[kind](f)) for f, kind in resolve_files(spec)]
    for fname, rows in files:
        for idx, obj, parse_err in rows:
            yield fname, idx, obj, parse_err


def iter_source(spec: SourceSpec) -> Iterator[Record | Reject]:
    """Every record and reject of a source, in file order (see the module docstring)."""
    n = 0
    short: dict[str, str] = {}
    for fname, idx, obj, parse_err in iter_raw(spec):
        if spec.limit is not None and n >= spec.limit:
            return
        n += 1
        if parse_err is not None:
            yield {"source": spec.name, "file": fname, "record": idx, "id": None,
                   "reason": parse_err, "raw": _raw(obj)}
            continue
        if fname not in short:
            short[fname] = Path(fname).name
        rec, err = normalize_record(obj, spec, f"{spec.name}/{short[fname]}#{idx}")
        if err is not None:
            rid = obj.get(spec.id_field) if isinstance(obj, dict) else None
            yield {"source": spec.name, "file": fname, "record": idx,
                   "id": None if rid is None else _clean(str(rid)), "reason": err, "raw": _raw(obj)}
        else:
            assert rec is not None
            yield rec


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
