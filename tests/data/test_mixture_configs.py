"""The shipped data recipe (configs/data_{llama3,qwen3}_stage{1,2}.yaml) on small local files laid out
like the public SFT sets and evaluation suites (tests/helpers/data.py), with tiny tokenizers that
carry Llama-3-like and Qwen3-like chat templates."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import yaml

from hylo.pipeline.config import from_dict, to_dict
from hylo.pipeline.data.config import PrepareDataConfig
from hylo.pipeline.data.readers import SourceSpec, read_source
from hylo.pipeline.data.render import ChatRenderer, RenderError
from hylo.pipeline.ray_init import ray_running

from tests.helpers.data import (
    EVAL_SUITES,
    save_tiny_chat_tokenizer,
    write_eval_suites,
    write_public_sft_samples,
)

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("llama3", "qwen3")


def _tree(family: str, stage: str, root: Path | None = None) -> dict:
    text = (ROOT / "configs" / f"data_{family}_{stage}.yaml").read_text()
    if root is not None:
        text = text.replace("/mnt/hylo/", f"{root}/")
    return yaml.safe_load(text)


def _cfg(family: str, stage: str, root: Path | None = None) -> PrepareDataConfig:
    return from_dict(PrepareDataConfig, _tree(family, stage, root))


def test_stage_configs_share_one_mixture_and_one_decontamination():
    cfgs = {(f, s): to_dict(_cfg(f, s)) for f in FAMILIES for s in ("stage1", "stage2")}
    ref = cfgs["llama3", "stage1"]
    for (f, s), c in cfgs.items():
        # Same records in both stages and both families (only tokenisation and packing differ).
        assert c["mixture"] == ref["mixture"] and c["decontam"] == ref["decontam"], (f, s)
        assert c["split"] == s and c["mixture"]["stage2"] == "all" and c["mixture"]["stage1_fraction"] == 0.2
        assert c["tokenize"] == cfgs[f, "stage1"]["tokenize"]
        assert c["packing"]["max_len"] == {"stage1": 2048, "stage2": 65536}[s]
    names = [s["name"] for s in ref["mixture"]["sources"]]
    assert names == ["sftdatasetv3", "openmathinstruct2", "openthoughts", "openr1_math", "chatqa2_long_sft"]
    # Every evaluation suite (hylo.pipeline.data.decontam.SUITES) that has fixed items, from a local file.
    assert [b["name"] for b in ref["decontam"]["benchmarks"]] == list(EVAL_SUITES)
    assert all(b["path"].startswith("/mnt/hylo/evals/") for b in ref["decontam"]["benchmarks"])


@pytest.mark.parametrize("recipe,family", [("llama-3.2-1b-8mla8gdn-64k", "llama3"),
                                           ("llama-3.2-3b-14mla14gdn-64k", "llama3"),
                                           ("qwen3-1.7b-7mla21gdn-64k", "qwen3")])
def test_data_configs_write_what_each_recipe_reads(recipe, family):
    r = yaml.safe_load((ROOT / "configs" / f"{recipe}.yaml").read_text())
    base = r["model"]["base"]
    for stage in ("stage1", "stage2"):
        data, cfg = r[stage]["data"], _cfg(family, stage)
        assert (data["path"], data["split"], data["seq_len"]) == (cfg.output.dir, cfg.split, cfg.packing.max_len)
        # Rows are tokenised by the student base's own family (Llama-3.2-1B/3B share one tokenizer).
        tok = cfg.tokenize.tokenizer
        assert Path(tok).name.split("-")[0] == Path(base).name.split("-")[0], (tok, base)


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    root = tmp_path_factory.mktemp("hylo")
    files = write_public_sft_samples(root, n=12)
    return root, files


def _source(cfg: PrepareDataConfig, name: str) -> SourceSpec:
    return next(s for s in cfg.mixture.sources if s.name == name)


def test_public_layouts_read_as_chat_records(public):
    root, files = public
    cfg = _cfg("llama3", "stage2", root)
    got = {s.name: read_source(s) for s in cfg.mixture.sources}
    assert {n: len(r) for n, (r, _) in got.items()} == dict.fromkeys(files, 12)
    assert all(rej == [] for _, rej in got.values())

    sft = got["sftdatasetv3"][0]
    assert sft[0]["messages"][0] == {"role": "system", "content": "You are helpful."}
    assert [m["role"] for m in sft[2]["messages"]] == ["user", "assistant"] * 3

    omi = got["openmathinstruct2"][0][3]["messages"]
    assert [m["role"] for m in omi] == ["user", "assistant"] and omi[0]["content"].startswith("Problem 3:")

    ot = got["openthoughts"][0][0]["messages"]
    assert ot[0]["role"] == "system" and ot[0]["content"].startswith("Your role as an assistant")
    reply = ot[2]["content"]
    assert reply.startswith("<think>\n") and "\n</think>\n\n" in reply and reply.endswith("\\boxed{0}")
    assert "<|begin_of" not in reply and "<|end_of" not in reply

    r1 = got["openr1_math"][0]
    assert r1[5]["id"] == "uuid-0-0005" and r1[5]["messages"][1]["content"].startswith("<think>\n")

    cq = got["chatqa2_long_sft"][0]
    raw = json.loads(files["chatqa2_long_sft"].read_text())
    for rec, src in zip(cq, raw):
        sys_turn, *turns = rec["messages"]
        assert sys_turn["role"] == "system" and sys_turn["content"].endswith("\n\n" + src["document"])
        assert sys_turn["content"].startswith("Answer the user's questions from the document below.")
        assert turns[:-1] == src["messages"] and turns[-1] == {"role": "assistant", "content": src["answers"][0]}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    return {f: AutoTokenizer.from_pretrained(save_tiny_chat_tokenizer(d / f, f)) for f in FAMILIES}


TWO_TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
             {"role": "user", "content": "and?"}, {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"}]


def _masked(tok, enc) -> str:
    return tok.decode(enc.input_ids[enc.assistant_mask])


def test_llama3_template_date_is_fixed_by_the_config(tokenizers):
    tok = tokenizers["llama3"]
    kwargs = _cfg("llama3", "stage1").tokenize.chat_template_kwargs
    fixed = ChatRenderer.from_hf(tok, "prefix", kwargs)
    text, _ = fixed.render(TWO_TURNS)
    assert "Today Date: 26 Jul 2024" in text and not fixed.date_dependent
    clock = ChatRenderer.from_hf(tok, "prefix")
    assert clock.date_dependent and "Today Date: 26 Jul 2024" not in clock.render(TWO_TURNS)[0]
    (enc,) = fixed.encode_batch([{"id": "x", "messages": TWO_TURNS}])
    assert _masked(tok, enc) == "<think>\nr1\n</think>\n\nA1<|eot_id|><think>\nr2\n</think>\n\nA2<|eot_id|>"


def test_qwen3_history_rewriting_falls_back_to_the_final_reply(tokenizers):
    tok = tokenizers["qwen3"]
    strict = ChatRenderer.from_hf(tok, "prefix")
    with pytest.raises(RenderError, match=r"not prefix-stable at messages\[1\]"):
        strict.render(TWO_TURNS)
    method = _cfg("qwen3", "stage2").tokenize.mask_method
    r = ChatRenderer.from_hf(tok, method)
    multi, single = r.encode_batch([{"id": "m", "messages": TWO_TURNS}, {"id": "s", "messages": TWO_TURNS[:2]}])
    assert multi.final_only and _masked(tok, multi) == "<think>\nr2\n</think>\n\nA2<|im_end|>"
    # The rendered history has no <think> block (Qwen3 drops it); the final reply keeps it.
    assert "r1" not in tok.decode(multi.input_ids) and "A1" in tok.decode(multi.input_ids)
    assert not single.final_only and _masked(tok, single) == "<think>\nr1\n</think>\n\nA1<|im_end|>"
    # mask_method "final" always masks the final reply only, even where every reply could be found.
    (final,) = ChatRenderer.from_hf(tokenizers["llama3"], "final").encode_batch([{"id": "f", "messages": TWO_TURNS}])
    assert final.final_only and _masked(tokenizers["llama3"], final) == "<think>\nr2\n</think>\n\nA2<|eot_id|>"


def test_export_benchmarks_writes_one_file_per_suite(tmp_path, monkeypatch):
    from hylo.jobs.decontaminate import main

    calls = []

    def load_dataset(name, subset, split):
        calls.append((name, subset, split))
        return [{"question": f"{name} {subset} {split}", "choices": ["a", "b"]}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert main(["--export-benchmarks", str(tmp_path), "--benchmark", "gsm8k", "--benchmark", "mmlu"]) == 0
    assert calls == [("openai/gsm8k", "main", "test"), ("cais/mmlu", "all", "test")]
    rows = [json.loads(x) for x in (tmp_path / "mmlu.jsonl").read_text().splitlines()]
    assert rows == [{"question": "cais/mmlu all test", "choices": ["a", "b"]}]
    assert main(["--export-benchmarks", str(tmp_path), "--benchmark", "humaneval"]) == 2


# ------------------------------------------------------------------------- end to end (local Ray)
LEAK_GSM8K = 0
LEAK_MMLU = 2


@pytest.fixture(scope="module")
def recipe_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("mnt")
    suites = write_eval_suites(root)
    leaks = {"sftdatasetv3": suites["gsm8k"][LEAK_GSM8K]["question"],
             "openmathinstruct2": suites["mmlu"][LEAK_MMLU]["question"]}
    # Sizes so that the configs' weights (0.05, 0.5) still leave a few records of every set.
    write_public_sft_samples(root, n=30, leaks=leaks, sizes={"sftdatasetv3": 400, "openmathinstruct2": 60})
    for fam, model in (("llama3", "Llama-3.2-1B-Instruct"), ("qwen3", "Qwen3-1.7B")):
        save_tiny_chat_tokenizer(root / "models" / model, fam)
    return root, leaks


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    with ray_running(None, 2, log_to_driver=False):
        yield ray


def _run(root: Path, family: str, stage: str) -> tuple[dict, Path]:
    from hylo.pipeline.data.prepare import prepare

    tree = _tree(family, stage, root)
    tree.update(ray={"address": None}, progress=False)
    tree["tokenize"].update(num_actors=2, batch_size=16)
    tree["decontam"]["scanner"] = "local"
    cfg = from_dict(PrepareDataConfig, tree)
    return prepare(cfg), Path(cfg.output.dir)


def _docs(out: Path) -> tuple[set[str], list[np.ndarray]]:
    from hylo.pipeline.data.packing import PAD_DOC_ID
    from hylo.pipeline.data.reader import RowReader

    docs, rows = set(), []
    for r in RowReader(out):
        docs |= {d.split("@")[0] for d in r.doc_ids if d != PAD_DOC_ID}
        rows.append(r.input_ids.numpy())
    return docs, rows


@pytest.mark.slow
def test_recipe_end_to_end_both_stages_and_both_families(ray_local, recipe_root):
    from transformers import AutoTokenizer

    root, leaks = recipe_root
    rep1, out1 = _run(root, "llama3", "stage1")
    rep2, out2 = _run(root, "llama3", "stage2")
    repq, outq = _run(root, "qwen3", "stage2")
    assert out1 == root / "data" / "stage1" and out2 == root / "data" / "stage2" and outq == root / "data/qwen3/stage2"
    d1, rows1 = _docs(out1)
    d2, rows2 = _docs(out2)
    dq, _ = _docs(outq)
    # Stage 1 is a ~20 % sample of the mixture; stage 2 is all of it (the same records in both families).
    assert d1 < d2 and d2 == dq and 0.08 < len(d1) / len(d2) < 0.35
    assert {d.split(":")[0] for d in d2} == {s.name for s in _cfg("llama3", "stage2").mixture.sources}
    assert all(len(r) == 2048 for r in rows1) and all(len(r) == 65536 for r in rows2)
    # Decontamination: decided on the whole mixture, so both stages removed the same records, and no
    # leaked benchmark text is left in any row.
    removed = {p: [json.loads(x) for x in (p / "removed.jsonl").read_text().splitlines()] for p in (out1, out2, outq)}
    assert removed[out1] == removed[out2] and len(removed[out2]) >= 2
    assert {r["source"] for r in removed[out2]} == {"sftdatasetv3", "openmathinstruct2"}
    assert {m["suite"] for r in removed[out2] for m in r["matches"]} == {"gsm8k", "mmlu"}
    assert not {r["doc_id"] for r in removed[out2]} & d2
    tok = AutoTokenizer.from_pretrained(root / "models" / "Llama-3.2-1B-Instruct")
    text = "".join(tok.decode(r) for r in rows2)
    assert all(leak not in text for leak in leaks.values()) and "Today Date: 26 Jul 2024" in text
    assert rep2["counts"]["decontaminated"] == len(removed[out2]) == rep2["decontam"]["documents_dropped"]
    # Qwen3: multi-turn conversations train on their final reply; its tokens differ from Llama's.
    assert repq["counts"]["final_turn_only"] > 0 and rep2["counts"]["final_turn_only"] == 0
    assert repq["tokenizer_hash"] != rep2["tokenizer_hash"]
    # The report counts every source and every decision.
    for rep in (rep1, rep2, repq):
        assert rep["counts"]["read_rejects"] == 0 and rep["warnings"] == []
        assert all(s["read"] > 0 and s["out"] > 0 for s in rep["mixture"]["sources"].values())
