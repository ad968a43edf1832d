"""JSON containers, streamed: JSON lines (a bad line is one reject) and JSON arrays or value sequences
(json.JSONDecoder.raw_decode over a sliding buffer; a broken, oversized or truncated record is one reject
and the records after it are still read).

ijson (PyPI, yajl2_c) was measured against this reader (bench/json_reader_vs_ijson.py): ~1.5x faster on
ShareGPT and the same on a valid or truncated array, but it stops at the first broken record or invalid
UTF-8 byte (the rest of the file lost) and builds every record whole, a single 3 MiB string included,
before anything can check its size: not kept."""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

from hylo.pipeline.data.readers.raw import RawItem
from hylo.pipeline.data.readers.records import RAW_CHARS

CHUNK_CHARS = 1 << 20
# A record still incomplete after this many characters is given up on (reported, not buffered forever).
MAX_RECORD_CHARS = 64 << 20


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
