"""A saved checkpoint as the Hub and stock transformers see it: the model card's metadata (read back with
huggingface_hub, offline), what the card says the model was made from, and a tokenizer that loads with
transformers' own classes, without a prompt or a warning."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import LlamaConfig, LlamaForCausalLM

from hylo.card import add_eval_results
from hylo.config import HybridConfig
from hylo.io import save_hylo
from hylo.upcycle import upcycle

REPO = Path(__file__).resolve().parents[2]


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "Paris"] + [f"w{i}" for i in range(92)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_base(d: Path, name_or_path: str | None = None, card_license: str | None = None) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=96, max_position_embeddings=128)
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    if name_or_path is not None:
        data = json.loads((d / "config.json").read_text())
        data["_name_or_path"] = name_or_path
        (d / "config.json").write_text(json.dumps(data))
    if card_license is not None:
        (d / "README.md").write_text(f"---\nlicense: {card_license}\n---\n# a base\n")
    return d


def convert(base: Path, out: Path) -> None:
    model = upcycle(LlamaForCausalLM.from_pretrained(base).eval(), mla_layers=[0], kv_lora_rank=8,
                    qk_rope_head_dim=4).eval()
    save_hylo(model, out, tokenizer_from=base)


def train_run(converted: Path, run: Path, data: dict) -> Path:
    """A stage-1 run's consolidated model: its card takes the recipe from the run's stage config."""
    run.mkdir(parents=True)
    (run / "config_stage1.json").write_text(json.dumps({"stage": 1, "data": data, "optim": {"lr": 1e-4},
                                                        "train": {"total_steps": 2}}))
    from hylo.io import load_hylo

    save_hylo(load_hylo(converted), run / "model", tokenizer_from=converted)
    return run / "model"


def test_card_metadata_reads_back_with_base_model_license_and_eval_results(tmp_path):
    base = tiny_base(tmp_path / "tiny-llama", name_or_path="someorg/tiny-llama", card_license="llama3.2")
    convert(base, tmp_path / "hylo-tiny")
    cfg = HybridConfig.from_pretrained(tmp_path / "hylo-tiny")
    add_eval_results(tmp_path / "hylo-tiny", cfg, {"kl": {"kl": 0.25, "ppl": 9.5},
                                                   "lm_eval": {"arc_easy acc": 0.5}}, "eval/results.json")
    card = ModelCard.load(tmp_path / "hylo-tiny" / "README.md")
    assert card.data.base_model == "someorg/tiny-llama"
    assert card.data.license == "llama3.2"
    got = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert got == {("kl", "kl"): 0.25, ("kl", "ppl"): 9.5, ("arc_easy", "acc"): 0.5}
    assert card.data.model_name == "hylo-tiny"
    # never a local path as the base model
    assert str(tmp_path) not in card.content.split("---")[1]


def test_an_asset_base_gets_its_hub_id_and_license_from_the_registry(tmp_path):
    base = tiny_base(tmp_path / "smollm2-135m-instruct")  # an asset directory is named after its asset
    convert(base, tmp_path / "converted")
    card = ModelCard.load(tmp_path / "converted" / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.license == "apache-2.0"


def test_a_synthetic_run_does_not_claim_its_configured_data(tmp_path):
    base = tiny_base(tmp_path / "smollm2-135m-instruct")
    convert(base, tmp_path / "converted")
    model = train_run(tmp_path / "converted", tmp_path / "stage1",
                      {"source": "synthetic", "path": "runs/demo/data/stage1", "synthetic": {"rows": 8, "vocab_size": 96}})
    text = (model / "README.md").read_text()
    assert "runs/demo/data/stage1" not in text
    assert "synthetic rows (8 random rows" in text
    # only the base's own training data (its card's, through the registry)
    assert ModelCard.load(model / "README.md").data.datasets == ["HuggingFaceTB/smol-smoltalk"]


def test_prepared_data_names_its_datasets_and_their_terms(tmp_path):
    base = tiny_base(tmp_path / "smollm2-135m-instruct")
    convert(base, tmp_path / "converted")
    data = tmp_path / "data" / "stage1"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text(json.dumps({"mixture": {"sources": {"sharegpt": {"read": 3}, "mine": {}}}}))
    model = train_run(tmp_path / "converted", tmp_path / "stage1", {"source": "parquet", "path": str(data)})
    card = ModelCard.load(model / "README.md")
    assert card.data.datasets == ["HuggingFaceTB/smol-smoltalk", "anon8231489123/ShareGPT_Vicuna_unfiltered"]
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "OpenAI's terms of use" in card.content and "`mine` (local data)" in card.content


def _sections(card: ModelCard) -> list[str]:
    return [line[3:] for line in card.content.splitlines() if line.startswith("## ")]


def test_a_converted_card_as_a_hub_user_reads_it(tmp_path):
    """The model card: no local path anywhere in README.md, a snippet that names the model, an intended-use section,
    a converted-only model says it is untrained, and `datasets` holds the base's training data."""
    base = tiny_base(tmp_path / "smollm2-135m-instruct")
    out = tmp_path / "hylo-tiny"
    convert(base, out)
    text = (out / "README.md").read_text()
    card = ModelCard.load(out / "README.md")
    assert _sections(card) == ["Architecture", "How it was made", "License", "Intended use and limitations", "Use"]
    assert str(tmp_path) not in text and str(Path.home()) not in text and "PATH" not in text
    assert "model_id = 'hylo-tiny'" in text and "from_pretrained(model_id" in text
    assert "**Converted, not trained.**" in text and "converted only: not trained yet" in text
    assert card.data.datasets == ["HuggingFaceTB/smol-smoltalk"]
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # the record keeps where it came from
    assert json.loads((out / "hylo_card.json").read_text())["base"]["path"] == str(base)


def test_a_trained_card_states_its_budget_and_names_its_sources_not_their_paths(tmp_path):
    base = tiny_base(tmp_path / "smollm2-135m-instruct")
    convert(base, tmp_path / "converted")
    data = tmp_path / "data" / "stage1"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text(json.dumps({"mixture": {"sources": {"sharegpt": {"read": 3}}}}))
    model = train_run(tmp_path / "converted", tmp_path / "stage1", {"source": "parquet", "path": str(data),
                                                                   "seq_len": 64})
    text = (model / "README.md").read_text()
    assert "Converted, not trained" not in text and "stage 1: 2 steps" in text
    assert str(tmp_path) not in text and "from `converted`" in text and "data sharegpt" in text
    assert "model_id = 'stage1'" in text  # a run's model/ is named after its run
    assert "Intended use and limitations" in _sections(ModelCard.load(model / "README.md"))


def test_results_on_a_limit_subset_say_so_and_sample_len_is_no_metric(tmp_path):
    from hylo.pipeline.eval.run import card_metrics, lm_eval_samples

    base = tiny_base(tmp_path / "tiny-llama", name_or_path="someorg/tiny-llama")
    convert(base, tmp_path / "hylo-tiny")
    res = {"lm_eval": {"results": {"arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": 0.1,
                                                "acc_norm,none": 0.25, "sample_len": 5}}}}
    metrics = card_metrics(res)
    assert metrics == {"lm_eval": {"arc_easy acc": 0.5, "arc_easy acc_norm": 0.25}}
    add_eval_results(tmp_path / "hylo-tiny", HybridConfig.from_pretrained(tmp_path / "hylo-tiny"), metrics,
                     "x/results.json", limit=5.0, samples=lm_eval_samples(res))
    card = ModelCard.load(tmp_path / "hylo-tiny" / "README.md")
    names = {r.metric_type: r.metric_name for r in card.data.eval_results}
    assert names == {"acc": "acc (--limit 5)", "acc_norm": "acc_norm (--limit 5)"}
    assert "`--limit 5`): a subset" in card.content and "arc_easy 5" in card.content
    assert "sample_len" not in card.content


# ------------------------------------------------------------------------------------------- tokenizer
def _snippet(text: str, what: str) -> str:
    """The line of a Python snippet that loads the tokenizer, exactly as written."""
    lines = [line.strip() for line in text.splitlines() if what in line and "from_pretrained(" in line]
    assert lines, f"no {what} line"
    return lines[0]


def _run_quietly(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python with stdin closed (a prompt would read EOF and fail) and the project's
    registration absent (only transformers)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_VERBOSITY")}
    return subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env=env, cwd="/", timeout=120)


@pytest.mark.slow
def test_the_documented_tokenizer_lines_load_without_prompt_or_warning(tmp_path):
    base = tiny_base(tmp_path / "tiny-llama")
    # a base whose tokenizer config names no class and points at custom code that is not copied
    tc = json.loads((base / "tokenizer_config.json").read_text())
    tc.pop("tokenizer_class", None)
    tc["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizerFast"]}
    (base / "tokenizer_config.json").write_text(json.dumps(tc))
    out = tmp_path / "model"
    convert(base, out)
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert "auto_map" not in saved and saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    readme = _snippet((REPO / "docs" / "huggingface.md").read_text(), "AutoTokenizer")
    card = _snippet((out / "README.md").read_text(), "AutoTokenizer")
    for line in (readme.replace('"runs/demo/stage2/model"', "PATH"), card,
                 "tok = PreTrainedTokenizerFast.from_pretrained(PATH)"):
        code = (f"from transformers import AutoTokenizer, PreTrainedTokenizerFast\nPATH = model_id = {str(out)!r}\n"
                f"{line}\nprint(tok('Paris').input_ids)")
        res = _run_quietly(code)
        assert res.returncode == 0, f"{line}: {res.stderr[-800:]}"
        assert res.stdout.strip().endswith("[3]"), res.stdout
        noise = [w for w in ("custom code", "[y/N]", "model of type", "Warning", "warn")
                 if re.search(re.escape(w), res.stderr, re.I)]
        assert not noise, f"{line}: {noise}: {res.stderr[-800:]}"
