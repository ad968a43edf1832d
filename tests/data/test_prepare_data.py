"""prepare_data end to end on local Ray (real SmolLM2 tokenizer), shards + manifest, RowReader resume."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hylo.ownership import ForeignOutputError, write_record
from hylo.pipeline.config import load_config
from hylo.pipeline.data.config import PrepareDataConfig
from hylo.pipeline.data.mixture import split_of
from hylo.pipeline.data.packing import PAD_DOC_ID, BestFitPacker, Document, label_aligned_mask
from hylo.pipeline.data.prepare import prepare
from hylo.pipeline.data.reader import RowReader
from hylo.pipeline.data.render import ChatRenderer
from hylo.pipeline.data.rowfile import DataFormatError
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.data.shards import MANIFEST, ShardWriter, read_manifest, write_manifest
from hylo.pipeline.ray_init import ray_running


def _conv(i: int, turns: int) -> list[dict]:
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}.{t}: " + "why? " * (3 + (i * 7 + t) % 40)})
        msgs.append({"role": "assistant", "content": f"Answer {i}.{t}: " + "because. " * (2 + (i * 5 + t) % 60)})
    return msgs


# Each planted bad record and a piece of the reason it must be rejected with.
BAD_LINES = {
    "bad-json": ("{oops", "invalid JSON"),
    "bad-role": (json.dumps({"id": "bad-role", "messages": [{"role": "wizard", "content": "x"}]}), "unknown role"),
    # An empty reply is dropped (a repair), which leaves nothing to learn.
    "bad-empty": (json.dumps({"id": "bad-empty", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}), "no assistant turn"),
    "bad-system-mid": (json.dumps({"id": "bad-system-mid", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}]}), "system turn after the start"),
    "bad-type": (json.dumps({"id": "bad-type", "messages": [
        {"role": "user", "content": ["q"]}, {"role": "assistant", "content": "a"}]}), "not a string"),
    "bad-surrogate": ('{"id": "bad-surrogate", "messages": [{"role": "user", "content": "q \\ud800"}, '
                      '{"role": "assistant", "content": "a"}]}', "undecodable"),
    "bad-no-assistant": (json.dumps({"id": "bad-no-assistant", "messages": [{"role": "user", "content": "q"}]}),
                         "no assistant turn"),
}


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    with ray_running(None, 2, log_to_driver=False):
        yield ray


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    lines = [json.dumps({"id": f"c{i}", "messages": _conv(i, 1 + i % 4)}) for i in range(120)]
    for k, (line, _) in enumerate(BAD_LINES.values()):
        lines.insert(10 * k + 5, line)
    (d / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return d / "chat.jsonl"


def _cfg(source, out, *extra: str) -> PrepareDataConfig:
    return load_config(PrepareDataConfig, None, [
        f"mixture.sources=[{{name: chat, path: '{source}'}}]", "split=stage2", "mixture.seed=1",
        "mixture.stage1_fraction=0.3",
        "packing.max_len=512", "packing.window=16", "packing.max_open_rows=4",
        "tokenize.batch_size=16", "output.rows_per_shard=8", "progress=false", f"output.dir={out}", *extra,
    ])


def _rows(d) -> list[PackedRow]:
    return list(RowReader(d))


@pytest.fixture(scope="module")
def prepared(ray_local, source, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "stage2"
    report = prepare(_cfg(source, out))
    return out, report


@pytest.mark.slow
def test_prepare_writes_valid_rows_with_every_document_whole(prepared, source):
    out, report = prepared
    from hylo.assets import fetch_asset

    renderer = ChatRenderer.from_pretrained(str(fetch_asset("smollm2-135m-instruct", progress=False)))
    recs = [json.loads(l) for l in source.read_text().splitlines() if l.startswith('{"id": "c')]
    # Stage 2 reads the whole mixture (mixture.stage2: all, the default).
    good = {f"chat:{r['id']}": r for r in recs}
    rows = _rows(out)
    c = report["counts"]
    assert c["documents"] == len(good) == 120 and c["rows"] == len(rows)
    assert read_manifest(out)["counts"]["efficiency"] == pytest.approx(c["tokens_packed"] / (512 * len(rows)))
    seen: dict[str, list] = {}
    for r in rows:
        # checked by the reader against the manifest's max_len
        assert isinstance(r, PackedRow) and read_manifest(out)["max_len"] == 512 and r.num_tokens == 512
        cu = r.host
        for j, did in enumerate(r.doc_ids):
            if did != PAD_DOC_ID:
                seen.setdefault(did.split("@")[0], []).append((did, r.input_ids[cu[j]:cu[j + 1]].numpy(),
                                                               r.loss_mask[cu[j]:cu[j + 1]].numpy()))
    assert set(seen) == set(good)
    for did, parts in seen.items():
        parts.sort(key=lambda p: int(p[0].split("@")[1]) if "@" in p[0] else 0)
        (enc,) = renderer.encode_batch([{**good[did], "doc_id": did}])
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), enc.input_ids)
        want = label_aligned_mask(enc.assistant_mask)
        if len(parts) > 1:
            assert c["docs_split"] > 0
            for p in parts:
                want[sum(len(q[1]) for q in parts[: parts.index(p) + 1]) - 1] = False
        np.testing.assert_array_equal(np.concatenate([p[2] for p in parts]), want)


@pytest.mark.slow
def test_every_bad_record_is_in_the_rejects_file_with_its_reason(prepared):
    out, report = prepared
    rejects = [json.loads(l) for l in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == len(BAD_LINES) == report["counts"]["read_rejects"]
    by_id = {(r.get("id") or "bad-json"): r for r in rejects}
    for name, (_, reason) in BAD_LINES.items():
        assert reason in by_id[name]["reason"], (name, by_id[name]["reason"])
        assert by_id[name]["source"] == "chat" and by_id[name]["stage"] == "read"
    md = (out / "report.md").read_text()
    assert "system turn after the start" in md and "packing efficiency" in md


@pytest.mark.slow
def test_same_seed_same_rows_whatever_the_pool_size(prepared, source, tmp_path):
    out, _ = prepared
    report = prepare(_cfg(source, tmp_path / "again", "tokenize.num_actors=1", "tokenize.batch_size=5"))
    a, b = _rows(out), _rows(tmp_path / "again")
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.doc_ids == rb.doc_ids
        np.testing.assert_array_equal(ra.input_ids.numpy(), rb.input_ids.numpy())
        np.testing.assert_array_equal(ra.loss_mask.numpy(), rb.loss_mask.numpy())
    assert report["config_hash"] == read_manifest(out)["config_hash"]
    # Without overwrite an existing output is refused, not clobbered.
    with pytest.raises(FileExistsError, match="overwrite"):
        prepare(_cfg(source, tmp_path / "again"))


@pytest.mark.slow
def test_stage1_is_a_sample_of_stage2_or_disjoint_from_it(prepared, source, tmp_path):
    out2, _ = prepared
    prepare(_cfg(source, tmp_path / "stage1", "split=stage1"))
    prepare(_cfg(source, tmp_path / "rest", "mixture.stage2=rest"))
    ids = {split: {d.split("@")[0] for r in _rows(d_) for d in r.doc_ids if d != PAD_DOC_ID}
           for split, d_ in (("stage1", tmp_path / "stage1"), ("stage2", out2), ("rest", tmp_path / "rest"))}
    want1 = {f"chat:c{i}" for i in range(120) if split_of("chat", f"c{i}", 0.3, "hylo-split-v1") == "stage1"}
    assert ids["stage1"] == want1 and 20 < len(want1) < 60
    # Default: stage 2 is the whole mixture; mixture.stage2=rest: the records stage 1 does not read.
    assert ids["stage1"] < ids["stage2"] and len(ids["stage2"]) == 120
    assert not ids["stage1"] & ids["rest"] and ids["stage1"] | ids["rest"] == ids["stage2"]


@pytest.mark.slow
def test_the_reader_gives_the_prepared_shards_rows_in_manifest_order(prepared):
    # what pyarrow itself reads from each shard, in the manifest's order, is what the one reader yields
    import pyarrow.parquet as pq

    out, report = prepared
    want = []
    for shard in read_manifest(out)["shards"]:
        want += pq.read_table(out / shard["file"], columns=["doc_ids", "input_ids"]).to_pylist()
    got = _rows(out)
    assert len(got) == len(want) == report["counts"]["rows"]
    assert [list(r.doc_ids) for r in got] == [w["doc_ids"] for w in want]
    assert [r.input_ids.tolist() for r in got] == [w["input_ids"] for w in want]


def test_cli_rejects_bad_config(tmp_path, capsys):
    from hylo.jobs.prepare_data import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("packing: {max_lenn: 10}\n")
    assert main(["--config", str(cfg)]) == 2
    assert "max_lenn" in capsys.readouterr().err
    missing = tmp_path / "nope.jsonl"
    assert main(["--set", f"mixture.sources=[{{name: a, path: '{missing}'}}]",
                 "--set", f"output.dir={tmp_path / 'out'}"]) == 2
    assert "source 'a': path" in capsys.readouterr().err and not (tmp_path / "out" / MANIFEST).exists()


# ---------------------------------------------------------------------------- RowReader (no Ray)
def _write_shards(d, n_docs=90, max_len=64, rows_per_shard=5, rg=2):
    rng = np.random.default_rng(0)
    packer = BestFitPacker(max_len, window=8, max_open_rows=3)
    docs = []
    for i in range(n_docs):
        L = int(rng.integers(3, 40))
        docs.append(Document(f"d{i}", rng.integers(0, 1000, L).astype(np.int32), rng.random(L) < 0.5))
    w = ShardWriter(d, rows_per_shard, rg)
    rows = list(packer.add_many(docs))
    for r in rows:
        w.add(r)
    write_manifest(d, {"config_hash": "x", "shards": w.finish()})
    return rows


@pytest.mark.parametrize("world", [1, 3], ids=["W1", "W3"])
def test_row_reader_partitions_ranks_and_resumes_exactly(tmp_path, world):
    rows = _write_shards(tmp_path)
    per_rank = len(rows) // world
    got = {}
    for rank in range(world):
        reader = RowReader(tmp_path, rank, world)
        assert len(reader) == per_rank
        got[rank] = [list(r.doc_ids) for r in reader]
        assert reader.position == per_rank
    flat = [got[r][i] for i in range(per_rank) for r in range(world)]
    assert flat == [r["doc_ids"] for r in rows[: per_rank * world]]
    # Stop after k rows, save the position, resume in a fresh reader: the same rows follow.
    for k in (0, 1, per_rank // 2, per_rank - 1):
        first = RowReader(tmp_path, world - 1, world)
        it = iter(first)
        head = [list(next(it).doc_ids) for _ in range(k)]
        pos = first.state()["position"]
        tail = [list(r.doc_ids) for r in RowReader(tmp_path, world - 1, world, start=pos)]
        assert head + tail == got[world - 1]


def test_row_reader_gives_checked_rows_of_the_contract(tmp_path):
    import torch

    rows = _write_shards(tmp_path)
    row = next(iter(RowReader(tmp_path)))
    assert isinstance(row, PackedRow) and row.key == "0" and row.epoch == 0
    assert row.input_ids.dtype == torch.int64 and row.position_ids.dtype == torch.int64
    assert row.cu_seqlens.dtype == torch.int32 and row.loss_mask.dtype == torch.bool
    assert int(row.cu_seqlens[-1]) == row.input_ids.shape[0] == 64
    # the host boundaries travel with the row
    assert row.host == tuple(rows[0]["cu_seqlens"].tolist())
    np.testing.assert_array_equal(row.input_ids.numpy(), rows[0]["input_ids"])
    assert list(row.doc_ids) == rows[0]["doc_ids"]


def test_row_reader_names_missing_or_inconsistent_files(tmp_path):
    with pytest.raises(DataFormatError, match="manifest.json not found"):
        RowReader(tmp_path)
    _write_shards(tmp_path)
    with pytest.raises(ValueError, match="start 999"):
        RowReader(tmp_path, start=999)
    m = json.loads((tmp_path / MANIFEST).read_text())
    m["shards"][1]["rows"] += 1
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    reader = RowReader(tmp_path)
    with pytest.raises(DataFormatError, match="shard-00001.parquet: has 5 rows, manifest says 6"):
        list(reader)
    shutil.move(tmp_path / "shard-00001.parquet", tmp_path / "moved.parquet")
    with pytest.raises(DataFormatError, match="shard-00001.parquet: listed in .* but missing"):
        list(RowReader(tmp_path))
    (tmp_path / MANIFEST).write_text('{"format": "something-else"}')
    with pytest.raises(DataFormatError, match="format"):
        RowReader(tmp_path)


# ------------------------------------------------------- a failed run never costs the old dataset
def _fake_stream(fail_after: int | None = None):
    """Stands in for the Ray tokenise stage (tested above with Ray): one token per character."""
    def stream(records, renderer_spec, tcfg, packer, run, on_document=None):
        for k, rec in enumerate(records):
            if fail_after is not None and k == fail_after:
                raise RuntimeError("worker died")
            text = "".join(m["content"] for m in rec["messages"])
            doc = Document(rec["doc_id"], np.arange(len(text), dtype=np.int32) % 50, np.ones(len(text), bool))
            run.documents += 1
            run.doc_tokens += len(text)
            yield from packer.add(doc)
        yield from packer.flush()
    return stream


@pytest.fixture
def no_ray(monkeypatch):
    import hylo.pipeline.data.prepare as ds

    monkeypatch.setattr(ds, "init_ray", lambda *a, **k: None)
    return ds


def _snapshot(d) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture
def old_dataset(tmp_path):
    """A dataset an earlier prepare run wrote: its shards, manifest and report, and its record."""
    out = tmp_path / "stage2"
    _write_shards(out)
    (out / "report.md").write_text("old report\n")
    write_record(out, [p.name for p in out.iterdir()])
    return out


@pytest.mark.parametrize("bad", ["source-path", "tokenizer", "benchmark", "mid-run"])
def test_overwrite_failure_leaves_the_old_dataset_untouched(old_dataset, source, tmp_path, no_ray, monkeypatch, bad):
    before = _snapshot(old_dataset)
    extra = ["output.overwrite=true"]
    if bad == "source-path":
        cfg = _cfg(tmp_path / "typo.jsonl", old_dataset, *extra)
        err = "source 'chat': path .*typo.jsonl does not exist"
    elif bad == "tokenizer":
        cfg = _cfg(source, old_dataset, *extra, f"tokenize.tokenizer={tmp_path / 'no-tokenizer'}")
        err = "neither a directory nor an asset"
    elif bad == "benchmark":
        cfg = _cfg(source, old_dataset, *extra,
                   f"decontam.benchmarks=[{{name: gsm8k, path: '{tmp_path / 'gsm8k.jsonl'}'}}]")
        err = "source 'gsm8k': path .*gsm8k.jsonl does not exist"
    else:
        monkeypatch.setattr(no_ray, "stream_packed_rows", _fake_stream(fail_after=30))
        cfg = _cfg(source, old_dataset, *extra)
        err = "worker died"
    with pytest.raises(Exception, match=err):
        prepare(cfg)
    assert _snapshot(old_dataset) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_overwrite_success_swaps_in_the_new_dataset(old_dataset, source, tmp_path, no_ray, monkeypatch):
    monkeypatch.setattr(no_ray, "stream_packed_rows", _fake_stream())
    old_shards = {p.name for p in old_dataset.glob("shard-*.parquet")}
    report = prepare(_cfg(source, old_dataset, "output.overwrite=true", "output.rows_per_shard=1000"))
    assert {p.name for p in old_dataset.glob("shard-*.parquet")} == {"shard-00000.parquet"} != old_shards
    assert read_manifest(old_dataset)["config_hash"] == report["config_hash"]
    assert (old_dataset / "report.md").read_text() != "old report\n" and (old_dataset / "rejects.jsonl").is_file()
    assert len(_rows(old_dataset)) == report["counts"]["rows"] > 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_directory_that_is_not_a_dataset_is_never_replaced(source, tmp_path, no_ray):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(ForeignOutputError, match=r"holds 1 entry this project did not write \(thesis.tex; it has "
                                                 r"no .hylo-output.json"):
        prepare(_cfg(source, home, "output.overwrite=true"))
    assert (home / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("overwrite", [False, True], ids=["no-overwrite", "overwrite"])
def test_dataset_like_names_without_a_record_are_never_replaced(source, tmp_path, no_ray, monkeypatch, overwrite):
    """output.dir holding only dataset-like names (report.md, report.json, shard-*.parquet, even a manifest.json of
    the dataset format) and no record is a user's directory, overwrite or not: it is refused untouched. Only what
    a record of ours proves ours goes."""
    monkeypatch.setattr(no_ray, "stream_packed_rows", _fake_stream())
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("report.md", "report.json", "shard-00000.parquet"):
        (out / name).write_text(f"the user's {name}")
    (out / "manifest.json").write_text(json.dumps({"format": "hylo-packed-rows/1", "shards": [
        {"file": "shard-00000.parquet", "rows": 1}]}))
    before = _snapshot(out)
    extra = ["output.overwrite=true"] if overwrite else []
    with pytest.raises(ForeignOutputError, match=r"holds 4 entries this project did not write \(manifest.json, "
                                                 r"report.json, report.md, shard-00000.parquet; it has no "
                                                 r".hylo-output.json, and a directory is never taken for an earlier "
                                                 r"output by the names it holds\)"):
        prepare(_cfg(source, out, *extra))
    assert _snapshot(out) == before


def test_overwrite_replaces_what_the_manifest_lists_and_refuses_anything_else(old_dataset, source, tmp_path, no_ray,
                                                                             monkeypatch):
    """A dataset of ours is replaced with output.overwrite=true; a file the user put into it, or a report of ours
    the user edited, is named and the dataset is left whole."""
    monkeypatch.setattr(no_ray, "stream_packed_rows", _fake_stream())
    (old_dataset / "notes.txt").write_text("my notes")
    before = _snapshot(old_dataset)
    with pytest.raises(ForeignOutputError, match=r"notes.txt \(not in its record\)"):
        prepare(_cfg(source, old_dataset, "output.overwrite=true"))
    assert _snapshot(old_dataset) == before
    (old_dataset / "notes.txt").unlink()
    (old_dataset / "report.md").write_text("my edits to the report\n")
    with pytest.raises(ForeignOutputError, match=r"report.md \(changed since this project wrote it"):
        prepare(_cfg(source, old_dataset, "output.overwrite=true"))
    (old_dataset / "report.md").write_text("old report\n")
    prepare(_cfg(source, old_dataset, "output.overwrite=true"))
    assert (old_dataset / ".hylo-output.json").is_file() and not (old_dataset / "notes.txt").exists()
    # the new dataset is ours by its record as well: replaced again
    cfg = _cfg(source, old_dataset, "output.overwrite=true", "output.rows_per_shard=1000")
    prepare(cfg)
    assert sorted(p.name for p in old_dataset.glob("shard-*")) == ["shard-00000.parquet"]
    # the manifest records which token each id stands for (training checks its student's tokenizer against it)
    from hylo.pipeline.data.prepare import resolve_tokenizer
    from hylo.pipeline.data.render import token_table, token_table_hash

    tok = resolve_tokenizer(cfg.tokenize.tokenizer) / "tokenizer.json"
    assert read_manifest(old_dataset)["token_table"] == token_table_hash(token_table(tok.read_text()))


def test_empty_source_fails_the_job_and_allow_empty_warns(source, tmp_path, no_ray, monkeypatch, capsys):
    from hylo.jobs.prepare_data import main

    monkeypatch.setattr(no_ray, "stream_packed_rows", _fake_stream())
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    srcs = f"mixture.sources=[{{name: chat, path: '{source}'}}, {{name: nothing, path: '{empty}'}}]"
    args = ["--set", srcs, "--set", f"output.dir={tmp_path / 'out'}", "--set", "progress=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: source 'nothing': no usable record") and "empty.json" in err
    assert not (tmp_path / "out").exists()
    srcs_ok = srcs.replace("path: '" + str(empty) + "'", "path: '" + str(empty) + "', allow_empty: true")
    assert main(["--set", srcs_ok, *args[2:]]) == 0
    assert "warning: source 'nothing' contributed no records" in capsys.readouterr().err
    m = read_manifest(tmp_path / "out")
    assert m["warnings"] == ["source 'nothing' contributed no records (allow_empty is set)"]
    assert m["read_losses"][-1]["file"] == str(empty) and m["mixture"]["sources"]["nothing"]["read"] == 0
    # Every source rejected -> nothing to write, no manifest.
    assert main(["--set", f"mixture.sources=[{{name: nothing, path: '{empty}', allow_empty: true}}]",
                 "--set", f"output.dir={tmp_path / 'out2'}", "--set", "progress=false"]) == 2
    assert "split of the mixture is empty" in capsys.readouterr().err and not (tmp_path / "out2").exists()


def test_read_losses_are_counted_in_the_manifest(tmp_path, no_ray, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(no_ray, "stream_packed_rows", _fake_stream())
    rows = [{"id": f"r{i}", "messages": _conv(i, 1)} for i in range(60)]
    src = tmp_path / "six.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src, row_group_size=10, compression="none")
    col = pq.ParquetFile(src).metadata.row_group(4).column(0)
    with open(src, "r+b") as f:
        f.seek(col.dictionary_page_offset or col.data_page_offset)
        f.write(b"\xff" * 64)
    report = prepare(_cfg(src, tmp_path / "out", "split=all"))
    s = report["mixture"]["sources"]["chat"]
    assert s["read"] == 50 and s["rejected"] == 1 and s["records_lost"] == 10
    assert report["counts"]["records_lost"] == 10
    assert report["read_losses"] == [{"file": str(src), "rejects": 1, "records_lost": 10, "unknown_losses": 0}]
    (rej,) = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert rej["record"] == 40 and rej["lost"] == 10 and "row group 4" in rej["reason"]
    assert "| six.parquet" not in (tmp_path / "out" / "report.md").read_text()
    assert f"| {src} | 1 | 10 | 0 |" in (tmp_path / "out" / "report.md").read_text()


def test_row_reader_names_an_unreadable_row_group(tmp_path):
    _write_shards(tmp_path, rows_per_shard=6, rg=2)
    import pyarrow.parquet as pq

    shard = tmp_path / "shard-00001.parquet"
    col = pq.ParquetFile(shard).metadata.row_group(1).column(0)
    with open(shard, "r+b") as f:
        f.seek(col.dictionary_page_offset or col.data_page_offset)
        f.write(b"\xff" * 64)
    reader = RowReader(tmp_path)
    got = [reader.read(g).doc_ids for g in range(8)]
    assert len(got) == 8
    with pytest.raises(DataFormatError, match=r"shard-00001.parquet: row group 1 \(rows 2..3 of the shard\) is "
                                              r"unreadable .*rerun jobs/prepare_data.py"):
        reader.read(8)


# ------------------------------------------------------------------------ the manifest's config hash
def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def test_the_rows_hash_covers_every_key_but_the_declared_unhashed_ones():
    """A new config key changes the manifest's hash unless it is declared not to change the rows."""
    import copy

    from hylo.pipeline.config import to_dict
    from hylo.pipeline.data.config import UNHASHED_KEYS
    from hylo.pipeline.data.prepare import rows_config_hash

    cfg = load_config(PrepareDataConfig, overrides=['mixture.sources=[{name: a, path: x.jsonl}]'])
    base = rows_config_hash(cfg)
    leaves = _leaves(to_dict(cfg))
    assert {k for k in leaves if k.startswith("tokenize.")} > {"tokenize.num_actors", "tokenize.batch_size"}
    for key in leaves:
        changed = copy.deepcopy(cfg)
        *parents, last = key.split(".")
        node = changed
        for p in parents:
            node = getattr(node, p)
        setattr(node, last, ["<changed>"])
        unhashed = any(key == u or key.startswith(u + ".") for u in UNHASHED_KEYS)
        assert (rows_config_hash(changed) == base) == unhashed, key


def test_the_rows_hash_of_existing_datasets_is_unchanged():
    """Datasets already prepared keep their fingerprint: the hash is that of the mapping it has always hashed."""
    from hylo.pipeline.config import config_hash, to_dict
    from hylo.pipeline.data.prepare import rows_config_hash

    cfg = load_config(PrepareDataConfig, overrides=[
        'mixture.sources=[{name: a, path: x.jsonl, weight: 2}]', "packing.max_len=4096",
        "tokenize.mask_method=prefix", "tokenize.chat_template_kwargs={date_string: 1 Jan 2024}",
        "ray.num_cpus=7", "tokenize.num_actors=5", "output.dir=elsewhere"])
    d = to_dict(cfg)
    tok = d["tokenize"]
    assert rows_config_hash(cfg) == config_hash({
        "split": d["split"], "mixture": d["mixture"], "packing": d["packing"], "tokenizer": tok["tokenizer"],
        "mask_method": tok["mask_method"], "chat_template_kwargs": tok["chat_template_kwargs"],
        "decontam": d["decontam"]})


def test_no_more_tokenizer_actors_than_blocks():
    """An actor beyond the number of blocks gets no record yet starts a Ray worker and loads the tokenizer (the
    demo's 8 held-out records started two): at most one actor per `batch_size` records, at least one."""
    from hylo.pipeline.data.streaming import actor_count

    assert [actor_count(n, 2, 64) for n in (0, 8, 64, 65, 1000)] == [1, 1, 1, 2, 2]
    assert actor_count(1000, 5, 100) == 5 and actor_count(250, 5, 100) == 3
