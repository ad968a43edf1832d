"""jobs/convert.py: dry-run accounting from a config.json alone, and a real SmolLM2 conversion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))

import convert  # noqa: E402


def _run(argv: list[str], capsys) -> tuple[int, dict | None, str]:
    rc = convert.main(argv)
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if rc == 0 else None), cap.err


LLAMA_3B = {
    "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
    "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
}
LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
}


@pytest.mark.parametrize("cfg,rope,ratio", [(LLAMA_3B, 64, 0.047), (LLAMA_1B, 32, 0.078)], ids=["3B", "1B"])
def test_dry_run_reproduces_published_ratios(tmp_path, capsys, cfg, rope, ratio):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, summary, _ = _run(["--dry-run", "--base-config", str(path), "--mla-layers", "even", "--kv-lora-rank", "128",
                           "--qk-rope-head-dim", str(rope)], capsys)
    assert rc == 0
    assert round(summary["kv_cache_ratio"], 3) == ratio
    assert summary["n_mla"] == cfg["num_hidden_layers"] // 2
    assert summary["base_kv_bytes_per_token"] == cfg["num_hidden_layers"] * 2 * 8 * cfg["head_dim"] * 2
    assert summary["hybrid_parameters"] > 0 and summary["base_parameters"] > 0


def test_dry_run_errors(tmp_path, capsys):
    rc, _, err = _run(["--dry-run", "--base-config", str(tmp_path / "missing.json")], capsys)
    assert rc == 2 and "does not exist" in err
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_1B, "model_type": "gpt_neox"}))
    rc, _, err = _run(["--dry-run", "--base-config", str(path)], capsys)
    assert rc == 2 and "'gpt_neox' is not supported" in err
    path.write_text(json.dumps(LLAMA_1B))
    rc, _, err = _run(["--dry-run", "--base-config", str(path), "--mla-layers", "0,16"], capsys)
    assert rc == 2 and "out of range" in err


@pytest.mark.slow
def test_real_smollm2_convert_reload_generate(tmp_path):
    """Convert SmolLM2-135M-Instruct with MLA on even layers; reload; greedy generate gives text."""
    from transformers import AutoTokenizer

    from hylo.assets import fetch_asset
    from hylo.io import load_hylo

    base = fetch_asset("smollm2-135m-instruct")
    out = tmp_path / "hylo"
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "convert.py"), "--base", str(base), "--out", str(out),
                           "--mla-layers", "even"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # libraries may log to stdout before the summary (DeepSpeed's accelerator notice): take the JSON block
    text = proc.stdout
    summary = json.loads(text if text.startswith("{") else text[text.index("\n{") + 1 :])
    assert summary["n_mla"] == 15 and summary["n_linear"] == 15
    # defaults for SmolLM2: kv_lora_rank 256, 3 rope-key blocks of 16 -> 15 * (256 + 48) / (30 * 2 * 3 * 64)
    assert summary["kv_cache_ratio"] == pytest.approx(15 * 304 / 11520)
    model = load_hylo(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    # the untrained conversion may pick EOS first; -1 (no such token) makes it decode all 12 steps
    gen = model.generate(ids, max_new_tokens=12, eos_token_id=-1)
    text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
    assert gen.shape[1] == ids.shape[1] + 12 and len(text) > 0
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("args,needle", [
    (["--kv-lora-rank", "4096"], "--kv-lora-rank) = 4096 is larger than the hidden size 2048"),
    (["--mla-layers", "all", "--kv-lora-rank", "2040"], "more per token than the attention"),
    (["--q-lora-rank", "4096"], "--q-lora-rank) = 4096 is larger than the hidden size"),
    (["--gdn-num-heads", "0"], "--gdn-num-heads"),
    (["--gdn-head-dim", "-8"], "--gdn-head-dim"),
    (["--max-position-embeddings", "0"], "--max-position-embeddings"),
    (["--q-lora-rank", "0"], "--q-lora-rank"),
    (["--gdn-expand-v", "0"], "--gdn-expand-v"),
], ids=["kv-rank-gt-hidden", "mla-caches-more", "q-rank-gt-hidden", "gdn-heads-0", "gdn-head-dim-neg",
        "max-pos-0", "q-rank-0", "expand-v-0"])
def test_impossible_shapes_are_refused_naming_the_option(tmp_path, capsys, args, needle):
    """Issue 12: these were silently replaced by defaults or produced a hybrid caching more than its base."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_1B))
    rc, _, err = _run(["--dry-run", "--base-config", str(path), *args], capsys)
    assert rc == 2, err
    assert err.startswith("error:") and needle in err, err
