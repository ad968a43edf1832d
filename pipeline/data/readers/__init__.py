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

Modules: `records` (a raw row -> record or reject reason), `json_stream` (JSON lines and streamed JSON
arrays), `arrow` (Parquet, save_to_disk, hub), `raw` (what they yield); this package resolves a source's
files and streams them (`iter_source`). `SourceSpec` and `SourceError` are in pipeline/data/config.py.

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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hylo.assets import AssetError, expand_asset
from hylo.pipeline.data.config import CONTAINERS, SCHEMAS, SourceError, SourceSpec
from hylo.pipeline.data.readers.arrow import _hf_disk_files, _iter_hf_arrow, _iter_hub, _iter_parquet
from hylo.pipeline.data.readers.json_stream import CHUNK_CHARS, MAX_RECORD_CHARS, _iter_json, _iter_jsonl
from hylo.pipeline.data.readers.raw import RawItem
from hylo.pipeline.data.readers.records import (
    RAW_CHARS,
    REPAIR_KINDS,
    ROLE_ALIASES,
    EmptySourceError,
    Message,
    Record,
    Reject,
    _clean,
    _raw,
    is_reject,
    normalize_record,
    validate_messages,
)

_FILE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet", ".json.gz", ".jsonl.gz", ".ndjson.gz")


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


__all__ = [
    "CHUNK_CHARS", "CONTAINERS", "MAX_RECORD_CHARS", "RAW_CHARS", "REPAIR_KINDS", "ROLE_ALIASES", "SCHEMAS",
    "EmptySourceError", "Message", "Record", "Reject", "SourceError", "SourceSpec", "is_reject", "iter_raw",
    "iter_records", "iter_source", "normalize_record", "read_source", "resolve_files", "validate_messages",
]
