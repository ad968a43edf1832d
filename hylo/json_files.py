"""JSON read with errors that name the file: `read_json(path, error)`, `loads_json(text, where, error)`.

Invalid JSON, bytes that are not UTF-8 and nesting past `MAX_JSON_DEPTH` raise the caller's error class naming
the file. A file is read through `hylo.bounded_read.read_bounded`: what is not a regular file (a directory, a
FIFO, a device, a socket) is refused saying what it is, and at most `MAX_JSON_BYTES` (or the caller's bound) is
read before parsing; the limit is in the error. A leaf: it imports only the leaf hylo/bounded_read.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from hylo.bounded_read import read_bounded, size_text

# Nesting levels of a JSON file a job reads (a model's config.json or tokenizer.json nests at most 6, a chat
# record 4); a YAML config's bound is the same (hylo/yaml_limits.py).
MAX_JSON_DEPTH = 64
# Bytes of a JSON file read at most (a model's tokenizer.json is 2-35 MB, a manifest or a record far less).
MAX_JSON_BYTES = 64 << 20
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_too_deep(text: str) -> int | None:
    """The line where JSON `text` nests deeper than `MAX_JSON_DEPTH` levels, else None: one scan of the brackets
    outside strings, no recursion (json.loads of a file 200,000 levels deep ends in a RecursionError)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return None
    bare = _JSON_STRING.sub('""', text)  # brackets inside strings do not nest (a string holds no newline)
    depth = 0
    for m in _JSON_BRACKET.finditer(bare):
        if m.group() in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return bare.count("\n", 0, m.start()) + 1
        else:
            depth -= 1
    return None


def loads_json(text: str | bytes, where: str, error: type[Exception] = ValueError) -> Any:
    """`json.loads(text)` of the file (or record) `where`, its depth bounded first: invalid JSON, bytes that are
    not UTF-8 or nesting past `MAX_JSON_DEPTH` raise `error("<where>...")`. Every reader of a user's JSON file
    uses it (through `read_json`)."""
    try:
        if isinstance(text, bytes | bytearray):
            text = text.decode("utf-8")
        line = json_too_deep(text)
        if line is not None:
            raise error(f"{where} line {line}: nested more than {MAX_JSON_DEPTH} levels deep")
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{where}: not valid JSON ({e})") from None


def read_json(path: str | os.PathLike | Any, error: type[Exception] = ValueError, mapping: bool = False,
              max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value of file `path` (a path, or any object with `read_text()` such as a storage
    location). A file that is not valid JSON or not UTF-8 raises `error("<path>: not valid JSON (...)")`,
    and with `mapping` one whose top level is not an object raises `error` too. A missing file raises
    FileNotFoundError: what its absence means is the caller's to say. What is not a regular file, or holds more
    than `max_bytes`, raises `error` saying so (`read_bounded`); its depth is bounded (`loads_json`)."""
    src = path if hasattr(path, "read_text") and not isinstance(path, Path) else Path(path)
    if getattr(src, "is_local", False) and hasattr(src, "local"):
        src = src.local()  # a storage location on this machine: its file, read bounded
    try:
        if isinstance(src, Path):
            text: str | bytes = read_bounded(src, max_bytes, error, "JSON file")
        elif hasattr(src, "iter_chunks"):  # an object store: read in chunks, at most max_bytes
            chunks, got = [], 0
            for chunk in src.iter_chunks():
                chunks.append(chunk)
                got += len(chunk)
                if got > max_bytes:
                    raise error(f"JSON file {src} holds more than {size_text(max_bytes)}; a JSON file is read only "
                                f"up to {size_text(max_bytes)}: nothing was parsed")
            text = b"".join(chunks)
        else:
            text = src.read_text()
    except UnicodeDecodeError as e:
        raise error(f"{src}: not valid JSON ({e})") from None
    data = loads_json(text, str(src), error)
    if mapping and not isinstance(data, dict):
        raise error(f"{src}: the top level must be an object")
    return data
