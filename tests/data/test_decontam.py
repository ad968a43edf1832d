"""Decontamination: planted contamination found in every disguise, look-alikes kept, fast == reference."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from hylo.outputs import OutputConflictError
from hylo.ownership import OUTPUT_RECORD, ForeignOutputError, recorded_entries
from hylo.pipeline.data.decontam import (
    BenchmarkIndex,
    BenchmarkSpec,
    DecontamJobConfig,
    FastScanner,
    Item,
    MatchConfig,
    load_benchmark,
    read_jsonl,
    reference_scan,
    run_decontamination,
)
from hylo.pipeline.data.normalize import _NON_WORD, fold_many, normalize_words, normalize_words_plain
from hylo.pipeline.data.readers import SourceSpec, read_source
from hylo.pipeline.ray_init import ray_running

REPO = Path(__file__).resolve().parents[2]

LONG = {
    "q1": "A farmer has seventeen sheep and all but nine run away into the hills; how many sheep does the farmer have left now",
    "q2": "Compute the sum of all even Fibonacci numbers below four million and explain each step of the derivation carefully",
    "q3": "Return a list containing the running maximum of the input integers, computed from the leftmost element to the current one",
    "q4": "Which gas do green plants absorb from the atmosphere during photosynthesis in order to produce glucose and oxygen molecules",
}
SHORT = {"s1": "Name the longest river flowing through Egypt"}  # 7 words: whole-item match
TINY = {"t1": "Photosynthesis chlorophyll"}  # 2 words: exact-turn match only
FILLER = ("Thanks for the help earlier, I have another question about my garden and the weather this week, "
          "since the tomatoes are growing slowly and the soil seems dry most mornings.")


def conv(rid: str, *turns: str) -> dict:
    roles = ["user", "assistant"]
    return {"id": rid, "messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def planted_mixture() -> tuple[list[dict], dict[str, str]]:
    """Records and, for the contaminated ones, the item id each must be matched to."""
    q3_respaced = "  Return a list\tcontaining the running-maximum\n\nof the INPUT integers ,computed from the " \
                  "left-most element... to the current one"
    # Split "leftmost" -> "left-most" changes the words: only the n-grams before it match; still found.
    long_conv = [FILLER] * 7 + [f"Sure. {FILLER} As the classic puzzle says: {LONG['q4']}? The answer is CO2."] + \
        [FILLER] * 4
    recs = [
        conv("exact", LONG["q1"], "Nine."),
        conv("recased", "please solve: " + LONG["q2"].upper(), "4613732"),
        conv("respaced", q3_respaced, "def f(xs): ..."),
        conv("embedded", *long_conv),
        conv("short", f"Quick quiz for you: {SHORT['s1']}? Take your time.", "The Nile."),
        conv("tiny", "photosynthesis, chlorophyll!", "Yes?"),
        conv("fullwidth", "ＡＦＡＲＭＥＲ " + LONG["q1"][2:].replace(" ", "\u3000"), "nine"),
        # Clean look-alikes: every 12 words one word changed; shuffled; the tiny item inside a sentence;
        # the short item missing one word; unrelated chat.
        conv("lookalike-changed", "A farmer has seventeen sheep and every but nine run away into the hills; how "
             "many sheep did the farmer have left now", "Nine."),
        conv("lookalike-shuffled", " ".join(sorted(LONG["q2"].split())), "ok"),
        conv("lookalike-tiny-in-sentence", "Photosynthesis chlorophyll is a phrase I saw in my biology notes", "ok"),
        conv("lookalike-short", "Name the longest river through Egypt", "The Nile."),
        conv("clean", FILLER, "Water them in the evening."),
    ]
    want = {"exact": "q1", "recased": "q2", "respaced": "q3", "embedded": "q4", "short": "s1", "tiny": "t1",
            "fullwidth": "q1"}
    return recs, want


def write_benchmark(path: Path) -> Path:
    rows = [{"qid": k, "question": v} for k, v in {**LONG, **SHORT, **TINY}.items()]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    return path


def job_cfg(tmp_path: Path, recs: list[dict], scanner: str = "local", **match) -> DecontamJobConfig:
    return DecontamJobConfig(
        inputs=[SourceSpec("mix", str(write_jsonl(tmp_path / "mix.jsonl", recs)))],
        benchmarks=[BenchmarkSpec("toy", str(write_benchmark(tmp_path / "bench.jsonl")), ["question"], "qid")],
        match=MatchConfig(**match), out=str(tmp_path / "out"), scanner=scanner, progress=False,
    )


def removed_items(out: Path) -> dict[str, set[str]]:
    return {r["id"]: {m["item_id"] for m in r["matches"]} for r in read_jsonl(out / "removed.jsonl")}


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    with ray_running(None, 2, log_to_driver=False):
        yield ray


# ------------------------------------------------------------------------------ normalisation


@pytest.mark.parametrize("text", [
    "Has_Close_Elements(numbers: List[float]) -> bool",
    "  re-spaced\t\ttext\n\nwith   PUNCTUATION!!! and 123 numbers_4 ",
    "tabs\tand\rcarriage\vreturns\f...",
    "",
    "???",
], ids=["code", "spacing", "control-ws", "empty", "punct-only"])
def test_ascii_fast_path_equals_regex_path(text):
    assert normalize_words(text) == _NON_WORD.sub(" ", text.lower()).split()


def test_fast_normalisations_equal_the_plain_one():
    rng = random.Random(0)
    pool = [chr(c) for c in [*range(128), 0xE9, 0x130, 0x1C5, 0xFB01, 0xBD, 0x3000, 0xFF21, 0x4E2D, 0x1F600, 0x301,
                             0x307, 0x2014, 0x201C, 0xA0, 0x10400, 0xD55C, 0x663, 0xB2, 0xDF, 0x2028, 0x85]]
    texts = ["".join(rng.choice(pool) for _ in range(rng.randint(0, 40))) for _ in range(400)]
    texts += ["plain ASCII, with_under_scores & (punct)!", ""]
    for t in texts:
        assert normalize_words(t) == normalize_words_plain(t), t
    # fold_many: one buffer, each text after a " \n " marker, same words per text.
    buf = fold_many(texts)
    assert [seg.split() for seg in buf.split(b"\n")[1:]] == [
        [w.encode() for w in normalize_words_plain(t)] for t in texts]


def test_nfkc_and_unicode_words():
    assert normalize_words("ＦＵＬＬ\u3000ｗｉｄｔｈ") == ["full", "width"]
    assert normalize_words("Ça VA? naïve—café") == ["ça", "va", "naïve", "café"]
    assert normalize_words("ﬁne ½") == ["fine", "1", "2"]


# -------------------------------------------------------------------------------- matching


@pytest.mark.parametrize("scanner", ["local", "reference"])
def test_every_planted_record_found_and_lookalikes_kept(tmp_path, scanner):
    recs, want = planted_mixture()
    summary = run_decontamination(job_cfg(tmp_path, recs, scanner))
    got = removed_items(tmp_path / "out")
    assert got == {rid: {item} for rid, item in want.items()}
    clean_ids = [r["id"] for r in read_jsonl(tmp_path / "out" / "clean.jsonl")]
    assert clean_ids == [r["id"] for r in recs if r["id"] not in want]
    assert summary["documents_dropped"] == len(want) and summary["documents_out"] == len(recs) - len(want)
    # The embedded item is located in its turn; the short and tiny items by their own kinds.
    by_id = {r["id"]: r for r in read_jsonl(tmp_path / "out" / "removed.jsonl")}
    assert {m["turn"] for m in by_id["embedded"]["matches"]} == {7}
    assert {m["kind"] for m in by_id["short"]["matches"]} == {"short"}
    assert {m["kind"] for m in by_id["tiny"]["matches"]} == {"exact"}


def test_reports_per_suite(tmp_path):
    recs, want = planted_mixture()
    run_decontamination(job_cfg(tmp_path, recs))
    rep = json.loads((tmp_path / "out" / "reports" / "toy.json").read_text())
    assert rep["documents_matched"] == len(want) and rep["items_matched"] == 6
    assert rep["index"]["items"] == 6 and rep["index"]["items_indexed"] == 6
    assert {m["item_id"] for m in rep["matched_items"]} == {"q1", "q2", "q3", "q4", "s1", "t1"}
    md = (tmp_path / "out" / "reports" / "toy.md").read_text()
    assert "# Decontamination report: toy" in md and "| q1 | 2 |" in md


def _random_docs(rng: random.Random, vocab: list[str], n: int) -> list[list[str]]:
    docs = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(1, 4)):
            k = rng.randint(0, 40)
            words = [rng.choice(vocab) for _ in range(k)]
            seps = [rng.choice([" ", "  ", ", ", "\n", "-", "_"]) for _ in range(k)]
            turns.append("".join(w + s for w, s in zip(words, seps)) or "?!")
        docs.append(turns)
    return docs


@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_fast_scan_equals_reference_hit_for_hit(seed):
    rng = random.Random(seed)
    vocab = ["alpha", "Épsilon", "ZETA", "42"]
    items = [Item("s", f"i{k}", [normalize_words(" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 8))))])
             for k in range(60)]
    index = BenchmarkIndex.build(items, MatchConfig(ngram=4, short_min_words=2, min_content_words=0,
                                                    max_item_df=1000))
    assert {e.kind for e in index.entries} == {"ngram", "short", "exact"}
    docs = _random_docs(rng, vocab + ["other"], 80)
    fast = FastScanner(index, seed=seed).scan(docs)
    ref = reference_scan(index, docs, "set")
    as_set = lambda h: set(zip(*(a.tolist() for a in h)))
    assert len(as_set(ref)) > 50
    assert as_set(fast) == as_set(ref) == as_set(reference_scan(index, docs, "probe"))


def _project_prose() -> list[str]:
    """Real text: the paragraphs of the README, docs/ and the project's module docstrings (prose, code,
    tables, Unicode), in a fixed order."""
    import ast

    texts = [p.read_text(encoding="utf-8") for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]]
    for path in sorted(p for folder in ("hylo", "kernels", "pipeline") for p in (REPO / folder).rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc:
            texts.append(doc)
    return [p.strip() for t in texts for p in t.split("\n\n") if p.strip()]


def _disguise(rng: random.Random, text: str) -> str:
    """What copies of an item look like in a chat dump: recased, re-spaced, NFD-decomposed, full-width spaces."""
    import unicodedata

    kind = rng.randrange(5)
    if kind == 1:
        return text.upper()
    if kind == 2:
        return text.replace(" ", rng.choice(["  ", "\t", " \n "]))
    if kind == 3:
        return unicodedata.normalize("NFD", text)
    if kind == 4:
        return text.replace(" ", "\u3000")
    return text


def test_fast_and_reference_scanners_find_the_same_matches_in_real_text():
    rng = random.Random(7)
    paras = _project_prose()
    long_paras = [p for p in paras if len(p.split()) >= 30]
    assert len(paras) > 300 and len(long_paras) > 80
    # Items quoted from the text: long passages (13-grams), short ones (whole-item) and headings (exact).
    items = []
    for k, p in enumerate(rng.sample(long_paras, 80)):
        words = p.split()
        n = rng.choice([rng.randint(14, 30), rng.randint(5, 12), rng.randint(2, 4)])
        lo = rng.randrange(len(words) - n + 1)
        if segs := normalize_words(" ".join(words[lo:lo + n])):
            items.append(Item("real", f"i{k}", [segs]))
    items += [Item("real", f"h{k}", [normalize_words(p)]) for k, p in enumerate(paras) if p.startswith("## ")][:10]
    index = BenchmarkIndex.build(items, MatchConfig())
    assert {e.kind for e in index.entries} == {"ngram", "short", "exact"}
    # Documents: runs of 1-6 paragraphs as turns, some disguised, some with a quoted item dropped in.
    docs, i = [], 0
    while i < len(paras):
        n = rng.randint(1, 6)
        turns = [_disguise(rng, p) for p in paras[i:i + n]]
        if rng.random() < 0.2:
            quoted = " ".join(rng.choice(long_paras).split()[:40])
            turns.append(_disguise(rng, f"As the docs put it: {quoted}. Why?"))
        docs.append(turns)
        i += n
    fast = FastScanner(index).scan(docs)
    hits = lambda h: sorted(zip(*(a.tolist() for a in h)))
    ref = hits(reference_scan(index, docs, "set"))
    # Tolerance none: the same hits (document, entry, turn, word offset), each once.
    assert hits(fast) == ref == hits(reference_scan(index, docs, "probe"))
    kinds = {index.entries[e].kind for _, e, _, _ in ref}
    assert len(ref) > 100 and kinds == {"ngram", "short", "exact"}, (len(ref), kinds)
    # Disguised copies are among the hits (both scanners fold case, spacing and Unicode forms alike).
    assert any(not docs[d][t].isascii() or docs[d][t].isupper() for d, _, t, _ in ref)


def test_hash_collisions_are_verified_away(monkeypatch):
    from hylo.pipeline.data.decontam import fast

    items = [Item("s", "i0", [["aa", "bb", "cc"]])]
    index = BenchmarkIndex.build(items, MatchConfig(ngram=3, short_min_words=2, min_content_words=0))
    sc = FastScanner(index)
    # Simulate 64-bit word-hash collisions: zz/yy/xx hash like aa/bb/cc. Only the word check can tell.
    real = fast._word_hashes
    fake_h, true_h = real(b"zz yy xx")[2], real(b"aa bb cc")[2]

    def colliding(buf):
        starts, ends, h = real(buf)
        for f, t in zip(fake_h, true_h):
            h = np.where(h == f, t, h)
        return starts, ends, h

    monkeypatch.setattr(fast, "_word_hashes", colliding)
    d, e, t, s = sc.scan([["aa bb cc", "zz yy xx"]])
    assert list(zip(d.tolist(), t.tolist())) == [(0, 0)]
    # Without the word check the colliding turn would have matched: the simulation does collide.
    sc.entry_words = [[b"zz", b"yy", b"xx"]]
    assert sc.scan([["aa bb cc", "zz yy xx"]])[2].tolist() == [1]


# ------------------------------------------------------------------------------ boilerplate


def test_boilerplate_spared_but_whole_item_leaks_caught(tmp_path):
    boiler = "This program is free software you can redistribute it and or modify it under the terms"
    unique = "compute the determinant of the given square matrix using gaussian elimination with partial pivoting"
    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"id": "lic", "text": boiler + " " + unique}) + "\n")
    recs = [conv(f"boiler{i}", f"Header of file {i}: {boiler}. Then my own code {i}.", "ok") for i in range(6)]
    recs += [conv(f"leak{i}", boiler + " " + unique, "ok") for i in range(6)]
    recs += [conv("half", unique, "ok")]
    cfg = DecontamJobConfig(
        inputs=[SourceSpec("mix", str(write_jsonl(tmp_path / "m.jsonl", recs)))],
        benchmarks=[BenchmarkSpec("lic", str(bench), ["text"])],
        match=MatchConfig(boilerplate_docs=5), out=str(tmp_path / "out"), scanner="local", progress=False,
    )
    run_decontamination(cfg)
    assert set(removed_items(tmp_path / "out")) == {f"leak{i}" for i in range(6)} | {"half"}
    rep = json.loads((tmp_path / "out" / "reports" / "lic.json").read_text())
    ignored = {b["ngram"]: b for b in rep["boilerplate_ignored"]}
    assert "this program is free software you can redistribute it and or modify it" in ignored
    assert all(b["documents"] >= 5 for b in ignored.values())
    assert ignored["this program is free software you can redistribute it and or modify it"]["documents_spared"] == 6
    # With the rule off, every boilerplate copy counts as contamination.
    cfg.match.boilerplate_docs = 0
    run_decontamination(cfg)
    assert len(removed_items(tmp_path / "out")) == 13


def test_template_and_low_content_ngrams_not_indexed():
    template = "answer the following question with a single word and explain nothing else at all please"
    items = [Item("s", f"i{k}", [normalize_words(f"{template} topic{k} fact{k}")]) for k in range(8)]
    items.append(Item("s", "stop", [normalize_words("the of and to in a is that for it as with was on at")]))
    index = BenchmarkIndex.build(items, MatchConfig(max_item_df=5))
    st = index.suite_stats["s"]
    assert st["template_dropped"] > 0 and st["low_content_dropped"] > 0
    words = {e.words for e in index.entries}
    assert tuple(normalize_words(template)[:13]) not in words
    # What is left is item-specific: every entry holds that item's own topic word and one item only.
    assert index.entries and all(len(e.words) == 13 and len(e.items) == 1 and
                                 f"topic{e.items[0]}" in e.words for e in index.entries)
    hits = FastScanner(index).scan([[f"{template} of my own"]])
    assert len(hits[0]) == 0


# ------------------------------------------------------------------------------------- cut mode


def test_cut_mode_removes_only_the_matched_span(tmp_path):
    recs, want = planted_mixture()
    recs.append(conv("only-item", LONG["q2"], "answer"))
    summary = run_decontamination(job_cfg(tmp_path, recs, mode="cut"))
    clean = {r["id"]: r for r in read_jsonl(tmp_path / "out" / "clean.jsonl")}
    removed = {r["id"]: r for r in read_jsonl(tmp_path / "out" / "removed.jsonl")}
    # Embedded: the item sentence is cut, the filler around it and the other turns stay.
    turn7 = clean["embedded"]["messages"][7]["content"]
    assert "photosynthesis" not in turn7.lower() and turn7.startswith("Sure. Thanks") and "CO2" in turn7
    assert clean["embedded"]["messages"][6]["content"] == FILLER
    assert clean["recased"]["messages"][0]["content"].strip() == "please solve:"
    assert removed["embedded"]["action"] == "cut"
    # A turn that would be left empty (the whole turn was the item) drops the record instead.
    assert "only-item" not in clean and removed["only-item"]["action"] == "drop"
    assert "exact" not in clean and removed["exact"]["action"] == "drop"
    assert summary["documents_cut"] + summary["documents_dropped"] == len(want) + 1
    # Cut records still pass the reader's validation when read back.
    back, rej = read_source(SourceSpec("back", str(tmp_path / "out" / "clean.jsonl")))
    assert rej == [] and len(back) == len(clean)


# ------------------------------------------------------------------------------ ray + job + io


@pytest.mark.slow
def test_ray_scan_matches_local_and_parquet_output(tmp_path, local_ray):
    recs, want = planted_mixture()
    recs = recs * 3
    for i, r in enumerate(recs):
        r = dict(r)
        recs[i] = {**r, "id": f"{r['id']}~{i // 12}"}
    cfg = job_cfg(tmp_path, recs, scanner="ray")
    cfg.batch_size = 8
    cfg.output_format = "parquet"
    summary = run_decontamination(cfg)
    got = removed_items(tmp_path / "out")
    assert got == {f"{rid}~{k}": {item} for rid, item in want.items() for k in range(3)}
    back, rej = read_source(SourceSpec("p", str(tmp_path / "out" / "clean.parquet")))
    assert rej == [] and len(back) == summary["documents_out"] == len(recs) - 3 * len(want)


def test_job_cli_and_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "jobs"))
    import decontaminate

    recs, want = planted_mixture()
    mix = write_jsonl(tmp_path / "mix.jsonl", recs)
    bench = write_benchmark(tmp_path / "bench.jsonl")
    rc = decontaminate.main(["--input", f"m={mix}", "--benchmark", f"toy={bench}:question@qid",
                             "--out", str(tmp_path / "o"), "--scanner", "local", "--mode", "cut",
                             "--set", "progress=false"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["flags"]["mode"] == "cut" and summary["suites"]["toy"]["documents_matched"] == len(want)

    assert decontaminate.main(["--input", str(mix), "--benchmark", "nosuch", "--out", str(tmp_path / "x")]) == 2
    assert "benchmark 'nosuch'" in capsys.readouterr().err
    assert decontaminate.main(["--input", str(mix), "--benchmark", "toy=nofields", "--out", str(tmp_path)]) == 2
    assert "NAME=PATH:FIELD" in capsys.readouterr().err
    assert decontaminate.main(["--input", str(mix), "--benchmark", f"toy={bench}:nope", "--out",
                               str(tmp_path / "y"), "--scanner", "local"]) == 2
    assert "no item has text in fields ['nope']" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert decontaminate.main(["--input", str(mix), "--benchmark", "gsm8k", "--out", str(tmp_path / "z"),
                               "--scanner", "local"]) == 2
    assert "needs the `datasets` package" in capsys.readouterr().err
    assert decontaminate.main(["--input", str(mix), "--set", "match.mode=trim", "--out", str(tmp_path)]) == 2
    assert "match.mode='trim'" in capsys.readouterr().err


def test_humaneval_builtin_and_registry():
    items, skipped = load_benchmark(BenchmarkSpec("humaneval"))
    assert len(items) == 164 and skipped == {} and items[0].id == "HumanEval/0"
    assert items[0].segments[0][:4] == ["from", "typing", "import", "list"]


# ---------------------------------------------------------------------- the output directory (ours, or refused)
@pytest.mark.parametrize("where", ["input", "holds_input", "inside_benchmark_dir"])
def test_out_over_an_input_is_refused_before_any_work(tmp_path, where):
    (tmp_path / "d").mkdir()
    cfg = job_cfg(tmp_path / "d", [conv("a", FILLER, "ok")])
    bench_dir = tmp_path / "d" / "benches"
    bench_dir.mkdir()
    cfg.benchmarks[0].path = str(Path(cfg.benchmarks[0].path).rename(bench_dir / "bench.jsonl"))
    out = {"input": Path(cfg.inputs[0].path), "holds_input": tmp_path / "d", "inside_benchmark_dir": bench_dir}[where]
    cfg.out = str(out)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(OutputConflictError, match=f"out {out} (is|holds|lies inside) the input --(input|benchmark)"):
        run_decontamination(cfg)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_out_of_the_user_is_refused_and_own_output_replaced(tmp_path, capsys):
    cfg = job_cfg(tmp_path, [conv("a", FILLER, "ok"), conv("b", "Quick: " + LONG["q1"], "Nine.")])
    out = Path(cfg.out)
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ForeignOutputError, match=r"out .*/out holds 1 entry .*notes.txt"):
        run_decontamination(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "notes.txt").unlink()
    run_decontamination(cfg)
    assert recorded_entries(out) == {"clean.jsonl", "removed.jsonl", "rejects.jsonl", "reports", "summary.json"}
    # a rerun in another format replaces its own output: the old clean.jsonl goes with it
    cfg.output_format = "parquet"
    run_decontamination(cfg)
    assert sorted(p.name for p in out.iterdir()) == sorted([OUTPUT_RECORD, "clean.parquet", "removed.jsonl",
                                                            "rejects.jsonl", "reports", "summary.json"])
    assert not list(tmp_path.glob(".out.*"))


@pytest.mark.slow
def test_output_of_a_killed_run_is_swept_and_an_old_one_replaced(tmp_path):
    import os
    import socket
    import subprocess

    cfg = job_cfg(tmp_path, [conv("a", FILLER, "ok")])
    out = Path(cfg.out)
    run_decontamination(cfg)
    proc = subprocess.Popen(["true"])
    proc.wait()
    killed = tmp_path / f".out.tmp-{proc.pid}-0123abcd"
    killed.mkdir()
    (killed / OUTPUT_RECORD).write_text(json.dumps({"written_by": "hylo-pipeline", "staging": True, "pid": proc.pid,
                                                    "host": socket.gethostname(), "entries": []}))
    (killed / "clean.jsonl").write_text("half\n")
    live = tmp_path / f".out.tmp-{os.getpid()}-0123abcd"
    live.mkdir()
    run_decontamination(cfg)
    assert not killed.exists() and live.is_dir()
    assert (out / OUTPUT_RECORD).is_file()
    # without its record an output is no longer ours, whatever its summary.json says (issue 61: no name-based rule)
    (out / OUTPUT_RECORD).unlink()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ForeignOutputError, match=r"out .*/out holds \d+ entries this project did not write \(.*"
                                                 r"summary.json.*; it has no .hylo-output.json"):
        run_decontamination(cfg)
    assert sorted(p.name for p in out.iterdir()) == before


def test_export_benchmarks_never_overwrites_a_file_of_the_user(tmp_path, monkeypatch, capsys):
    import types

    from hylo.jobs import decontaminate

    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda path, subset, split: [{"question": f"{path} {split}"}]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    d = tmp_path / "evals"
    d.mkdir()
    (d / "gsm8k.jsonl").write_text("my own gsm8k\n")
    assert decontaminate.main(["--export-benchmarks", str(d), "--benchmark", "gsm8k"]) == 2
    err = capsys.readouterr().err
    assert f"--export-benchmarks {d} holds gsm8k.jsonl, which this project did not write" in err
    assert (d / "gsm8k.jsonl").read_text() == "my own gsm8k\n"
    (d / "gsm8k.jsonl").unlink()
    for _ in range(2):  # a rerun overwrites its own export
        assert decontaminate.main(["--export-benchmarks", str(d), "--benchmark", "gsm8k"]) == 0
    assert json.loads((d / "gsm8k.jsonl").read_text())["question"].startswith("openai/gsm8k")


def test_job_refuses_out_holding_its_input_in_one_line(tmp_path, capsys):
    from hylo.jobs import decontaminate

    (tmp_path / "in").mkdir()
    mix = write_jsonl(tmp_path / "in" / "mix.jsonl", [conv("a", FILLER, "ok")])
    bench = write_benchmark(tmp_path / "bench.jsonl")
    rc = decontaminate.main(["--input", f"m={mix}", "--benchmark", f"toy={bench}:question@qid", "--scanner", "local",
                             "--out", str(tmp_path / "in"), "--set", "progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"out {tmp_path / 'in'} holds the input --input m {mix}" in err[0]
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["mix.jsonl"]
