"""Source readers: each format normalises to one record shape; each kind of bad input is one reject."""

from __future__ import annotations

import gzip
import json
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hylo.pipeline.data import readers
from hylo.pipeline.data.readers import (
    SourceError,
    SourceSpec,
    is_reject,
    iter_records,
    iter_source,
    json_stream,
    read_source,
)


def sg(i: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns]}


GOOD_SHAREGPT = [
    sg(0, ("human", "Hi there"), ("gpt", "Hello!")),
    sg(1, ("system", "Be brief."), ("user", "2+2?"), ("chatgpt", "4"), ("human", "and 3+3?"), ("bing", "6")),
    sg(2, ("human", "Name a bird"), ("bard", "Robin"), ("human", "thanks")),
]


def write_json_array(path: Path, items: list, indent: int | None = 2) -> Path:
    path.write_text(json.dumps(items, indent=indent, ensure_ascii=False))
    return path


def test_sharegpt_roles_mapped_and_ids_kept(tmp_path):
    recs, rej = read_source(SourceSpec("sg", str(write_json_array(tmp_path / "a.json", GOOD_SHAREGPT))))
    assert rej == []
    assert [r["id"] for r in recs] == ["c0", "c1", "c2"]
    assert {r["source"] for r in recs} == {"sg"}
    assert [m["role"] for m in recs[1]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert recs[1]["messages"][4] == {"role": "assistant", "content": "6"}
    # A trailing user turn is kept (it carries no loss later).
    assert recs[2]["messages"][-1] == {"role": "user", "content": "thanks"}


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20], ids=lambda c: f"chunk{c}")
def test_truncated_last_record_is_a_reject_not_a_crash(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", chunk)
    text = json.dumps(GOOD_SHAREGPT + [sg(3, ("human", "cut here"), ("gpt", "a long answer"))], indent=2)
    cut = text[: text.index("a long ans")]
    (tmp_path / "cut.json").write_text(cut)
    items = list(iter_source(SourceSpec("sg", str(tmp_path / "cut.json"))))
    assert [i["id"] for i in items[:3]] == ["c0", "c1", "c2"]
    assert len(items) == 4 and is_reject(items[3])
    assert items[3]["record"] == 3 and items[3]["reason"].startswith("truncated record at end of file")
    assert '"c3"' in items[3]["raw"]


@pytest.mark.parametrize("chunk", [5, 1 << 20], ids=lambda c: f"chunk{c}")
def test_broken_record_mid_array_does_not_lose_the_rest(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", chunk)
    good = [json.dumps(x) for x in GOOD_SHAREGPT]
    # Missing comma between keys, and a bare broken token.
    text = "[" + good[0] + ', {"id": "bad" "conversations": [{"from": "human", "value": "x}"}]}, nul, ' + \
        ", ".join(good[1:]) + "]"
    (tmp_path / "b.json").write_text(text)
    items = list(iter_source(SourceSpec("sg", str(tmp_path / "b.json"))))
    assert [i.get("id") for i in items if not is_reject(i)] == ["c0", "c1", "c2"]
    rej = [i for i in items if is_reject(i)]
    assert [r["record"] for r in rej] == [1, 2]
    assert all(r["reason"].startswith("invalid JSON") for r in rej)
    assert '"bad"' in rej[0]["raw"]


def test_array_without_closing_bracket_is_reported(tmp_path):
    (tmp_path / "c.json").write_text("[" + json.dumps(GOOD_SHAREGPT[0]) + ",\n")
    items = list(iter_source(SourceSpec("sg", str(tmp_path / "c.json"))))
    assert items[0]["id"] == "c0"
    assert is_reject(items[1]) and "closing ']'" in items[1]["reason"]


def msg(role, content):
    return {"role": role, "content": content}


OK = [msg("user", "q"), msg("assistant", "a")]

# (id, jsonl line (str) or object, expected reason fragment)
BAD_RECORDS = [
    ("invalid-json", '{"messages": [', "invalid JSON on line"),
    ("not-an-object", "[1, 2]", "record is not an object"),
    ("no-known-field", {"text": "hello"}, "no 'conversations', 'messages'"),
    ("messages-not-list", {"messages": "hi"}, "conversation is not a list"),
    ("empty-conversation", {"messages": []}, "empty conversation"),
    ("turn-not-object", {"messages": ["hi", "there"]}, "turn 0 is not an object"),
    ("missing-role", {"messages": [{"content": "q"}, msg("assistant", "a")]}, "turn 0: missing role"),
    ("unknown-role", {"messages": [msg("user", "q"), msg("tool", "a")]}, "turn 1: unknown role 'tool'"),
    ("missing-content", {"messages": [msg("user", "q"), {"role": "assistant"}]}, "turn 1: missing content"),
    ("empty-content", {"messages": [msg("user", "  \n"), msg("assistant", "a")]}, "turn 0: empty content"),
    ("non-string-content", {"messages": [msg("user", "q"), msg("assistant", 42)]},
     "turn 1: content is not a string (int)"),
    ("list-content", {"messages": [msg("user", [{"type": "text", "text": "q"}]), msg("assistant", "a")]},
     "turn 0: content is not a string (list)"),
    ("lone-surrogate", '{"messages": [{"role": "user", "content": "bad \\ud800 text"}, '
                       '{"role": "assistant", "content": "a"}]}', "turn 0: undecodable text"),
    ("assistant-first", {"messages": [msg("assistant", "a"), msg("user", "q")]},
     "broken alternation: turn 0 is 'assistant'"),
    ("double-user", {"messages": [msg("user", "q"), msg("user", "q2"), msg("assistant", "a")]},
     "broken alternation: turn 1 is 'user'"),
    ("system-mid", {"messages": OK + [msg("system", "s"), msg("assistant", "a")]},
     "system turn after the start (turn 2)"),
    ("system-only", {"messages": [msg("system", "s")]}, "no user/assistant turns"),
    ("no-assistant", {"messages": [msg("user", "q")]}, "no assistant turn"),
    ("prompt-missing-response", {"prompt": "q"}, "missing field 'response'"),
    ("prompt-not-string", {"prompt": None, "response": "a"}, "turn 0: content is not a string (NoneType)"),
]


# What the default (repairing) reader still rejects among BAD_RECORDS, and why; the others it keeps.
REPAIRED_REASONS = {
    "empty-content": "only assistant turns (a continuation part with no user turn)",
    "assistant-first": "no assistant turn",
    "double-user": None,
}


@pytest.mark.parametrize("line,reason", [b[1:] for b in BAD_RECORDS], ids=[b[0] for b in BAD_RECORDS])
def test_each_bad_record_kind_is_one_reject_with_reason(tmp_path, line, reason):
    """Strict mode (repair off): every kind of broken record is one reject with its reason."""
    bad = line if isinstance(line, str) else json.dumps(line)
    lines = [json.dumps({"id": "g0", "messages": OK}), bad, json.dumps({"id": "g1", "messages": OK})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    recs, rej = read_source(SourceSpec("src", str(tmp_path / "d.jsonl"), repair=False))
    assert [r["id"] for r in recs] == ["g0", "g1"]
    assert len(rej) == 1, rej
    r = rej[0]
    assert reason in r["reason"]
    assert r["source"] == "src" and r["file"].endswith("d.jsonl") and r["record"] == 1
    assert r["raw"] and len(r["raw"]) <= readers.RAW_CHARS and r["lost"] == 1
    json.dumps(r)  # every reject is serialisable as is


@pytest.mark.parametrize("name", sorted(REPAIRED_REASONS))
def test_repairing_reader_keeps_what_it_can_and_names_the_rest(tmp_path, name):
    line = dict((b[0], b[1]) for b in BAD_RECORDS)[name]
    (tmp_path / "d.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({"id": "g", "messages": OK}) + "\n")
    recs, rej = read_source(SourceSpec("src", str(tmp_path / "d.jsonl")))
    want = REPAIRED_REASONS[name]
    if want is None:
        assert len(recs) == 2 and rej == []
    else:
        assert len(recs) == 1 and [r["reason"] for r in rej] == [want]


def test_invalid_utf8_bytes_reject_only_that_line(tmp_path):
    good = json.dumps({"id": "g", "messages": OK}).encode()
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9 \xff"}, {"role": "assistant", "content": "a"}]}'
    (tmp_path / "u.jsonl").write_bytes(good + b"\n" + bad + b"\n" + good + b"\n")
    recs, rej = read_source(SourceSpec("u", str(tmp_path / "u.jsonl")))
    assert len(recs) == 2 and len(rej) == 1
    assert "undecodable text" in rej[0]["reason"]
    # The raw excerpt stays valid UTF-8 (bytes shown escaped), so rejects files never break.
    rej[0]["raw"].encode("utf-8")


def test_allow_assistant_first_option(tmp_path):
    p = write_json_array(tmp_path / "s.json", [sg(0, ("gpt", "...continued"), ("human", "ok"), ("gpt", "end"))])
    assert len(read_source(SourceSpec("s", str(p), repair=False, allow_empty=True))[1]) == 1
    # Repaired by default: the continuation's leading assistant turn is dropped, and counted.
    recs, _ = read_source(SourceSpec("s", str(p)))
    assert recs[0]["messages"] == [msg("user", "ok"), msg("assistant", "end")]
    assert recs[0]["repairs"] == ["dropped_leading_assistant"]
    recs, rej = read_source(SourceSpec("s", str(p), allow_assistant_first=True))
    assert rej == [] and [m["role"] for m in recs[0]["messages"]] == ["assistant", "user", "assistant"]
    assert "repairs" not in recs[0]


def test_parquet_messages_and_prompt_response_columns(tmp_path):
    pq.write_table(pa.Table.from_pylist([
        {"uid": 7, "messages": OK},
        {"uid": 8, "messages": [msg("user", "q")]},
    ]), tmp_path / "m.parquet")
    recs, rej = read_source(SourceSpec("m", str(tmp_path / "m.parquet"), schema="messages", id_field="uid"))
    assert [r["id"] for r in recs] == ["7"] and recs[0]["messages"] == OK
    assert rej[0]["id"] == "8" and rej[0]["reason"] == "no assistant turn"

    pq.write_table(pa.Table.from_pylist([
        {"question": "What is 2+2?", "answer": "4", "sys": "Be brief."},
        {"question": "Hi", "answer": "Hello", "sys": None},
    ]), tmp_path / "pr.parquet")
    spec = SourceSpec("pr", str(tmp_path / "pr.parquet"), schema="prompt_response",
                      prompt_field="question", response_field="answer", system_field="sys")
    recs, rej = read_source(spec)
    assert rej == []
    assert recs[0]["messages"] == [msg("system", "Be brief."), msg("user", "What is 2+2?"), msg("assistant", "4")]
    assert recs[1]["messages"] == [msg("user", "Hi"), msg("assistant", "Hello")]
    # No id column: ids are unique and name the file and row.
    assert recs[1]["id"] == "pr/pr.parquet#1"


def test_corrupt_parquet_is_a_file_level_reject(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    recs, rej = read_source(SourceSpec("x", str(tmp_path / "x.parquet"), allow_empty=True))
    assert recs == [] and rej[0]["record"] == -1 and "unreadable Parquet" in rej[0]["reason"]
    assert rej[0]["lost"] is None


def _save_to_disk_like(d: Path, rows: list[dict], n_files: int = 2) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC stream shards + state.json."""
    d.mkdir(parents=True)
    files = []
    per = (len(rows) + n_files - 1) // n_files
    for i in range(n_files):
        name = f"data-{i:05d}-of-{n_files:05d}.arrow"
        table = pa.Table.from_pylist(rows[i * per:(i + 1) * per])
        with pa.OSFile(str(d / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        files.append({"filename": name})
    (d / "state.json").write_text(json.dumps({"_data_files": files, "_split": None}))
    (d / "dataset_info.json").write_text("{}")


def test_hf_save_to_disk_dataset_and_dict(tmp_path):
    rows = [{"id": f"h{i}", "messages": OK} for i in range(5)]
    _save_to_disk_like(tmp_path / "ds", rows)
    recs, rej = read_source(SourceSpec("hf", str(tmp_path / "ds")))
    assert rej == [] and [r["id"] for r in recs] == [f"h{i}" for i in range(5)]

    _save_to_disk_like(tmp_path / "dd" / "train", rows[:2], n_files=1)
    _save_to_disk_like(tmp_path / "dd" / "test", rows[2:], n_files=1)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    recs, _ = read_source(SourceSpec("hf", str(tmp_path / "dd"), split="test"))
    assert [r["id"] for r in recs] == ["h2", "h3", "h4"]
    with pytest.raises(SourceError, match=r"split 'validation' not in .*splits: \['train', 'test'\]"):
        read_source(SourceSpec("hf", str(tmp_path / "dd"), split="validation"))


def test_gzip_jsonl_directory_and_glob(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "z", "messages": OK}) + "\n")
    (d / "a.jsonl").write_text(json.dumps({"id": "y", "messages": OK}) + "\n")
    (d / "notes.txt").write_text("ignored")
    assert [r["id"] for r in read_source(SourceSpec("d", str(d)))[0]] == ["y", "z"]
    assert [r["id"] for r in read_source(SourceSpec("d", str(d / "*.gz")))[0]] == ["z"]


def test_limit_and_iter_records_callback(tmp_path):
    lines = [json.dumps({"id": str(i), "messages": OK if i % 2 else []}) for i in range(10)]
    (tmp_path / "l.jsonl").write_text("\n".join(lines))
    rejects: list = []
    recs = list(iter_records(SourceSpec("l", str(tmp_path / "l.jsonl"), limit=6), rejects.append))
    assert [r["id"] for r in recs] == ["1", "3", "5"] and [r["id"] for r in rejects] == ["0", "2", "4"]


def test_source_errors_name_the_source(tmp_path, monkeypatch):
    with pytest.raises(SourceError, match="source 'gone': path .*missing.json does not exist"):
        read_source(SourceSpec("gone", str(tmp_path / "missing.json")))
    with pytest.raises(SourceError, match="schema 'chatml' not in"):
        SourceSpec("s", "x", schema="chatml")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no readable files"):
        read_source(SourceSpec("e", str(tmp_path / "empty")))
    # Hub names need `datasets`; without it, a clear error instead of an ImportError.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(SourceError, match="needs the `datasets` package"):
        read_source(SourceSpec("hub", "hub:allenai/ai2_arc"))


def test_hub_source_goes_through_load_dataset(monkeypatch):
    calls = {}

    def load_dataset(name, subset, split, streaming):
        calls.update(name=name, subset=subset, split=split, streaming=streaming)
        return iter([{"id": "x", "prompt": "q", "response": "a"}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    recs, rej = read_source(SourceSpec("h", "hub:org/ds", subset="cfg", split="test"))
    assert calls == {"name": "org/ds", "subset": "cfg", "split": "test", "streaming": True}
    assert recs == [{"id": "x", "source": "h", "messages": [msg("user", "q"), msg("assistant", "a")]}]


@pytest.mark.slow
def test_real_sharegpt_recovers_every_complete_conversation():
    from hylo.assets import fetch_asset

    path = fetch_asset("sharegpt", progress=False)
    parsed = rejected_json = 0
    last = None
    for item in iter_source(SourceSpec("sharegpt", str(path), allow_assistant_first=True)):
        last = item
        if is_reject(item) and item["reason"].startswith(("truncated", "invalid JSON")):
            rejected_json += 1
        else:
            parsed += 1
    # docs/data.md: 17,671 complete conversations, then one cut mid-record.
    assert parsed == 17_671 and rejected_json == 1
    assert is_reject(last) and last["record"] == 17_671 and last["reason"].startswith("truncated")


def test_json_file_of_pretty_printed_objects(tmp_path):
    objs = [{"id": "p0", "messages": OK}, {"id": "p1", "messages": []}, {"id": "p2", "messages": OK}]
    (tmp_path / "pp.json").write_text("\n".join(json.dumps(o, indent=2) for o in objs))
    recs, rej = read_source(SourceSpec("pp", str(tmp_path / "pp.json")))
    assert [r["id"] for r in recs] == ["p0", "p2"] and [(r["record"], r["reason"]) for r in rej] == [
        (1, "empty conversation")]
    # One line per object in a .json file: read as JSON lines (bad line -> its line number).
    (tmp_path / "l.json").write_text(json.dumps(objs[0]) + "\n{oops\n" + json.dumps(objs[2]) + "\n")
    recs, rej = read_source(SourceSpec("l", str(tmp_path / "l.json")))
    assert [r["id"] for r in recs] == ["p0", "p2"] and "invalid JSON on line 2" in rej[0]["reason"]


def test_asset_path_and_unknown_asset():
    with pytest.raises(SourceError, match="source 'x': unknown asset 'nope'"):
        read_source(SourceSpec("x", "asset:nope"))
    # The HumanEval asset is JSON lines of problems (a `prompt`, no `response`): every row a clear reject.
    recs, rej = read_source(SourceSpec("he", "asset:humaneval", limit=3, allow_empty=True))
    assert recs == [] and len(rej) == 3 and rej[0]["file"].endswith("HumanEval.jsonl.gz")
    assert rej[0]["reason"] == "missing field 'response'" and rej[0]["id"] is None
    # Without allow_empty a source that gives nothing usable is an error naming it and the first reason.
    with pytest.raises(readers.EmptySourceError, match="source 'he': no usable record .*missing field 'response'"):
        read_source(SourceSpec("he", "asset:humaneval", limit=3))


# ------------------------------------------------------------------ damage stays local, every loss counted
def _corrupt_row_group(path: Path, rg: int) -> None:
    """Overwrite the first data page header of row group `rg` with garbage (a real partial-write/bitrot)."""
    col = pq.ParquetFile(path).metadata.row_group(rg).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * 64)


def test_corrupt_parquet_row_group_loses_only_that_group(tmp_path):
    rows = [{"id": f"r{i}", "messages": [msg("user", f"q{i}"), msg("assistant", f"a{i}")]} for i in range(60)]
    path = tmp_path / "six.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10, compression="none")
    _corrupt_row_group(path, 2)
    recs, rej = read_source(SourceSpec("p", str(path)))
    assert [r["id"] for r in recs] == [f"r{i}" for i in range(60) if not 20 <= i < 30]
    assert len(rej) == 1 and rej[0]["lost"] == 10 and rej[0]["record"] == 20
    assert rej[0]["file"] == str(path) and "row group 2 (rows 20..29 of 60)" in rej[0]["reason"]


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
@pytest.mark.parametrize("chunk", [64, 1 << 20], ids=lambda c: f"chunk{c}")
def test_oversized_record_is_skipped_and_the_rest_read(tmp_path, monkeypatch, fmt, chunk):
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", chunk)
    monkeypatch.setattr(json_stream, "MAX_RECORD_CHARS", 1000)
    # Brackets, quotes and escapes inside the big record's strings must not confuse the skipping.
    big_text = 'x ] } [ { \\" \\\\ "' * 200
    objs = [{"id": "a", "messages": OK}, {"id": "big", "messages": [msg("user", big_text), msg("assistant", "a")]},
            {"id": "b", "messages": OK}, {"id": "c", "messages": OK}]
    p = tmp_path / f"o.{fmt}"
    p.write_text(json.dumps(objs, indent=1) if fmt == "json" else "\n".join(map(json.dumps, objs)) + "\n")
    recs, rej = read_source(SourceSpec("o", str(p)))
    assert [r["id"] for r in recs] == ["a", "b", "c"]
    assert len(rej) == 1 and rej[0]["record"] == 1 and rej[0]["lost"] == 1
    assert "record longer than 1000 characters" in rej[0]["reason"] and '"big"' in rej[0]["raw"]


@pytest.mark.parametrize("content", ["", "[]", "  \n", "[\n  ]"], ids=["0-bytes", "empty-array", "blank", "array-ws"])
def test_empty_source_is_an_error_unless_allowed(tmp_path, content):
    p = tmp_path / "e.json"
    p.write_text(content)
    with pytest.raises(readers.EmptySourceError, match=r"source 'e': no usable record in .*e\.json \(1 reject"):
        read_source(SourceSpec("e", str(p)))
    recs, rej = read_source(SourceSpec("e", str(p), allow_empty=True))
    assert recs == [] and len(rej) == 1 and rej[0]["record"] == -1
    assert rej[0]["reason"].startswith(("empty file (0 bytes)", "file holds no records"))


def test_empty_file_among_good_ones_is_a_named_reject(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"id": "y", "messages": OK}) + "\n")
    (d / "b.jsonl").write_text("")
    recs, rej = read_source(SourceSpec("d", str(d)))
    assert [r["id"] for r in recs] == ["y"]
    assert [(Path(r["file"]).name, r["reason"]) for r in rej] == [("b.jsonl", "empty file (0 bytes)")]


def test_real_sharegpt_keeps_98_percent_with_counted_repairs():
    """With its repairs the reader keeps over 98 % of the real ShareGPT file's 17,671 complete conversations;
    every repair is counted by kind and every reject by reason."""
    from collections import Counter

    from hylo.assets import fetch_asset

    kept, repairs, reasons = 0, Counter(), Counter()
    for item in iter_source(SourceSpec("sharegpt", str(fetch_asset("sharegpt", progress=False)))):
        if is_reject(item):
            reasons[item["reason"].split(" (")[0]] += 1
        else:
            kept += 1
            repairs.update(item.get("repairs", []))
    assert kept == 17_390 and kept / 17_671 > 0.98
    assert repairs == {"dropped_leading_assistant": 6227, "dropped_empty_turn": 68, "merged_same_role": 52,
                       "role_alias": 11}
    assert reasons == {"only assistant turns": 150, "empty conversation": 126, "no assistant turn": 5,
                       "truncated record at end of file": 1}


def test_each_repair_kind_is_applied_and_listed(tmp_path):
    conv = [("bard", "lead-in"), ("human", "q1"), ("human", "q1 more"), ("gpt", " "), ("model", "a1"),
            ("chatgpt", "a1 more"), ("human", "q2"), ("gpt", "a2")]
    p = write_json_array(tmp_path / "r.json", [sg(0, *conv)])
    (rec,), rej = read_source(SourceSpec("r", str(p)))
    assert rej == [] and rec["messages"] == [msg("user", "q1\n\nq1 more"), msg("assistant", "a1\n\na1 more"),
                                             msg("user", "q2"), msg("assistant", "a2")]
    assert rec["repairs"] == ["dropped_empty_turn", "dropped_leading_assistant", "merged_same_role", "role_alias"]
    # The same record is a reject in strict mode, with the first problem named.
    _, rej = read_source(SourceSpec("r", str(p), repair=False, allow_empty=True))
    assert [r["reason"] for r in rej] == ["turn 3: empty content"]
