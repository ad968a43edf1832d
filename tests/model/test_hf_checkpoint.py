"""Saved checkpoints for the Hugging Face ecosystem: model code beside the weights (AutoModel with
trust_remote_code where this project is not installed), one source of truth for the config, sharded
safetensors, and the generated model card."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hylo.card import CARD_JSON, add_eval_results, load_card
from hylo.config import HybridConfigError
from hylo.io import load_hylo, save_hylo
from hylo.modeling import HyLoForCausalLM
from hylo.upcycle import upcycle

from tests.helpers.common import one_thread  # noqa: F401  (autouse: one intra-op thread)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(93)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=256,
                      initializer_range=0.4, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    d = tmp_path_factory.mktemp("base") / "tiny-llama"
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    return d


def convert(base_dir: Path, out: Path, linear_type: str = "gdn", **save_kw) -> HyLoForCausalLM:
    base = LlamaForCausalLM.from_pretrained(base_dir).eval()
    model = upcycle(base, mla_layers=[0], kv_lora_rank=16, qk_rope_head_dim=8, linear_type=linear_type).eval()
    save_hylo(model, out, tokenizer_from=base_dir, **save_kw)
    return model


def convert_qwen3_qk_norm(out: Path, tokenizer_from: Path) -> HyLoForCausalLM:
    """A Qwen3 base: its MLA layer keeps the per-head q/k norms (mla_qk_norm), the cache their key 1/RMS."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=256,
                      initializer_range=0.4, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    base = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model = upcycle(base, mla_layers=[0], kv_lora_rank=16, qk_rope_head_dim=8).eval()
    assert model.config.mla_qk_norm
    save_hylo(model, out, tokenizer_from=tokenizer_from)
    return model


REMOTE_SCRIPT = r"""
import json, sys, importlib.util
# the project is installed in editable mode here: drop its finder so that it cannot be imported at all
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
assert all(importlib.util.find_spec(m) is None for m in ("hylo", "kernels", "pipeline")), "project importable"
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {}
for d in sys.argv[1:]:
    try:
        AutoModelForCausalLM.from_pretrained(d)
        plain = "loaded"
    except Exception as e:
        plain = f"{type(e).__name__}: {e}"
    model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok("w5 w6 w7 w8 w9", return_tensors="pt", add_special_tokens=False).input_ids
    gen = model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=2)
    out[d] = {"plain": plain, "class": type(model).__module__ + "." + type(model).__name__,
              "generated": gen.tolist(), "logits": model(ids).logits[0, -1].tolist()}
out["project_modules"] = sorted(m for m in sys.modules if m.split(".")[0] in ("hylo", "kernels", "pipeline"))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_automodel_loads_with_trust_remote_code_where_the_project_is_not_installed(base_dir, tmp_path):
    models = {kind: convert(base_dir, tmp_path / kind, kind) for kind in ("gdn", "mamba2")}
    models["qk-norm"] = convert_qwen3_qk_norm(tmp_path / "qk-norm", base_dir)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-I", "-c", REMOTE_SCRIPT, *(str(tmp_path / k) for k in models)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout[proc.stdout.index("RESULT ") + 7:])
    assert res["project_modules"] == []
    ids = torch.tensor([[8, 9, 10, 11, 12]])
    for kind, model in models.items():
        got = res[str(tmp_path / kind)]
        assert "trust_remote_code" in got["plain"] or "custom code" in got["plain"]
        assert got["class"].startswith("transformers_modules.") and got["class"].endswith("modeling_hylo.HyLoForCausalLM")
        assert got["generated"] == model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=2).tolist()
        with torch.no_grad():
            ref = model(ids).logits[0, -1]
        torch.testing.assert_close(torch.tensor(got["logits"]), ref, rtol=1e-5, atol=1e-5)


def test_saved_directory_holds_code_config_and_card(base_dir, tmp_path):
    convert(base_dir, tmp_path / "hy")
    files = {p.name for p in (tmp_path / "hy").iterdir()}
    assert {"config.json", "hybrid_config.json", "modeling_hylo.py", "configuration_hylo.py", "README.md", CARD_JSON,
            "tokenizer.json", "model.safetensors"} <= files
    cfg = json.loads((tmp_path / "hy" / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_hylo.HyLoForCausalLM"
    assert cfg["model_type"] == "hylo" and cfg["architectures"] == ["HyLoForCausalLM"]
    # no absolute project import survives outside the converter-only lazy ones
    for name in files:
        if name.endswith(".py"):
            text = (tmp_path / "hy" / name).read_text()
            assert not re.search(r"^\s*(from|import) (kernels|hylo\.(layers|cache|config|modeling))\b", text, re.M), name
    # in-process, where the project is imported, transformers prefers the registered class either way
    for trust in (None, True):
        assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "hy", trust_remote_code=trust)) is HyLoForCausalLM


def test_large_models_are_saved_in_shards(base_dir, tmp_path):
    model = convert(base_dir, tmp_path / "hy", max_shard_size="60KB")
    shards = sorted(p.name for p in (tmp_path / "hy").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "hy" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "hy" / "model.safetensors").exists()
    back = load_hylo(tmp_path / "hy")
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "hy", trust_remote_code=True)
    assert all(torch.equal(remote.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("edit", ["hybrid_config.json", "config.json"])
def test_config_files_that_disagree_are_refused_by_every_loader(base_dir, tmp_path, edit):
    convert(base_dir, tmp_path / "hy")
    path = tmp_path / "hy" / edit
    data = json.loads(path.read_text())
    data["max_position_embeddings"] = 4096
    data["eos_token_id"] = 7
    path.write_text(json.dumps(data))
    msg = r"config.json and hybrid_config.json disagree \(eos_token_id: .*max_position_embeddings: config.json (256|4096)"
    with pytest.raises(HybridConfigError, match=msg):
        load_hylo(tmp_path / "hy")
    with pytest.raises(HybridConfigError, match=msg):
        HyLoForCausalLM.from_pretrained(tmp_path / "hy")
    with pytest.raises(HybridConfigError, match=msg):
        AutoModelForCausalLM.from_pretrained(tmp_path / "hy", trust_remote_code=True)
    # the same edit in both files is a consistent checkpoint again
    other = tmp_path / "hy" / ("config.json" if edit != "config.json" else "hybrid_config.json")
    data2 = json.loads(other.read_text())
    data2.update(max_position_embeddings=4096, eos_token_id=7)
    other.write_text(json.dumps(data2))
    m = load_hylo(tmp_path / "hy")
    assert m.config.max_position_embeddings == 4096 and m.config.eos_token_id == 7
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hy").config.max_position_embeddings == 4096


def test_model_card_follows_the_checkpoint_from_conversion_to_evaluation(base_dir, tmp_path):
    model = convert(base_dir, tmp_path / "converted")
    card = load_card(tmp_path / "converted")
    assert card["base"]["path"] == str(base_dir) and card["base"]["model_type"] == "llama"
    assert [s["step"] for s in card["history"]] == ["convert"]
    md = (tmp_path / "converted" / "README.md").read_text()
    assert "# HyLo hybrid of tiny-llama" in md and "| MLA layers | 0 |" in md and "| gdn layers | 1, 2 |" in md
    # KV cache: 1 MLA layer x (16 + 8) values vs 3 layers x 2 x 2 heads x 16 dims = 12.5 %
    assert "| KV cache vs base | 384 bytes/token: 12.5 % |" in md
    # a training run's consolidated model: <run>/model, the run's stage config beside it
    run = tmp_path / "run"
    run.mkdir()
    (run / "config_stage2.json").write_text(json.dumps({
        "stage": 2, "data": {"path": "/data/stage2", "seq_len": 512}, "optim": {"lr": 1e-4},
        "train": {"global_batch_sequences": 8, "total_steps": 100},
        "teacher": {"source": "serve", "k": 64, "model": {"path": "/models/teacher"}}}))
    save_hylo(model, run / "model", tokenizer_from=tmp_path / "converted")
    card = load_card(run / "model")
    assert card["base"]["path"] == str(base_dir) and card["teacher"] == "/models/teacher"
    assert [s["step"] for s in card["history"]] == ["convert", "stage2"]
    assert card["history"][1]["recipe"]["lr"] == 1e-4 and card["history"][1]["source"] == str(tmp_path / "converted")
    md = (run / "model" / "README.md").read_text()
    # README.md names the teacher and the source by their directories, never their paths (the record keeps them)
    assert "* Teacher: `teacher`." in md and "stage2 from `converted`" in md and "teacher_top_k 64" in md
    assert "/models/teacher" not in md and str(tmp_path) not in md
    add_eval_results(run / "model", model.config, {"kl": {"kl": 0.25, "ppl": 3.5}}, "runs/eval/results.json")
    md = (run / "model" / "README.md").read_text()
    assert "| kl | kl | 0.25 |" in md and "From `hylo eval`" in md
    assert load_card(run / "model")["eval"]["source"] == "runs/eval/results.json"
    # evaluation results belong to one checkpoint: a model trained from it starts without them
    save_hylo(model, tmp_path / "next", tokenizer_from=run / "model")
    assert "eval" not in load_card(tmp_path / "next") and len(load_card(tmp_path / "next")["history"]) == 3


def test_bundler_refuses_an_import_it_cannot_rewrite(tmp_path, monkeypatch):
    import hylo.remote_code as rc

    bad = tmp_path / "hylo" / "modeling.py"
    bad.parent.mkdir()
    bad.write_text("import hylo.layers.mla\n")
    monkeypatch.setattr(rc, "ROOTS", ("hylo.modeling",))
    monkeypatch.setattr(rc, "_source_file", lambda module: bad)
    with pytest.raises(rc.RemoteCodeError, match=r"modeling.py: write project imports as `from hylo.x import y`"):
        rc.bundle_sources()


def test_eval_loads_a_checkpoint_by_its_config_json_alone(base_dir, tmp_path):
    from hylo.pipeline.eval.decode import is_hylo, load_model

    model = convert(base_dir, tmp_path / "hy")
    (tmp_path / "hy" / "hybrid_config.json").unlink()
    back = load_model(tmp_path / "hy", device="cpu")
    assert is_hylo(back) and back.config.mla_layers == model.config.mla_layers
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
