"""JSON read with errors that name the file: `read_json(path, error)`, `loads_json(text, where, error)`.

Invalid JSON, bytes that are not UTF-8 and nesting past `MAX_JSON_DEPTH` raise the caller's error class naming
the file. A leaf: it imports nothing of the project (configs use it).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

# Nesting levels of a JSON file a job reads (a model's config.json or tokenizer.json nests at most 6, a chat
# record 4); a YAML config's bound is the same (hylo/yaml_limits.py).
MAX_JSON_DEPTH = 64
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


def read_json(path: str | os.PathLike | Any, error: type[Exception] = ValueError, mapping: bool = False) -> Any:
    """The JSON value of file `path` (a path, or any object with `read_text()` such as a storage
    location). A file that is not valid JSON or not UTF-8 raises `error("<path>: not valid JSON (...)")`,
    and with `mapping` one whose top level is not an object raises `error` too. A missing file raises
    FileNotFoundError: what its absence means is the caller's to say. Its depth is bounded (`loads_json`)."""
    src = path if hasattr(path, "read_text") else Path(path)
    try:
        text = src.read_bytes() if isinstance(src, Path) else src.read_text()
    except UnicodeDecodeError as e:
        raise error(f"{src}: not valid JSON ({e})") from None
    data = loads_json(text, str(src), error)
    if mapping and not isinstance(data, dict):
        raise error(f"{src}: the top level must be an object")
    return data
