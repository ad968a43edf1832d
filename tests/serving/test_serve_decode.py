"""bench/serve_decode.py (gpu-check's case 7): its arithmetic in this environment (no vLLM), and its --tiny run through
vLLM's real CPU engine in the serving environment, whose own KV cache figures check that arithmetic."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.models import LLAMA_1B, LLAMA_3B
from tests.helpers.serving import serve_python

REPO = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("serve_decode", REPO / "bench" / "serve_decode.py")
    mod = sys.modules["serve_decode"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sd = load_bench()


# ------------------------------------------------------------------------------------ the arithmetic
def test_kv_bytes_per_token_of_the_recipes_and_their_bases():
    from hylo.serving.widths import CPU_WIDTHS, GPU_WIDTHS

    for pair, base, mla_layers, rope in (("1b", LLAMA_1B, 8, 32), ("3b", LLAMA_3B, 14, 64)):
        hylo, llama = sd.pair_configs(pair, tiny=False)
        assert llama.num_hidden_layers == base["num_hidden_layers"] and llama.head_dim == base["head_dim"]
        assert sd.llama_kv_bytes_per_token(llama) == 2 * base["num_hidden_layers"] * base["num_key_value_heads"] * \
            base["head_dim"] * 2
        assert len(hylo.mla_layers) == mla_layers and hylo.qk_rope_head_dim == rope
        # latent 128 + rope: served at 320 on a GPU (the narrowest vLLM's MLA takes), 576 on a CPU
        native = mla_layers * (128 + rope) * 2
        assert sd.hylo_kv_bytes_per_token(hylo, GPU_WIDTHS) == (native, mla_layers * 320 * 2)
        assert sd.hylo_kv_bytes_per_token(hylo, CPU_WIDTHS) == (native, mla_layers * 576 * 2)


def test_recurrent_state_per_sequence_counts_every_linear_layer():
    hylo, _ = sd.pair_configs("1b", tiny=False)
    H, K, V = hylo.gdn_num_heads, hylo.gdn_head_dim, hylo.gdn_value_dim
    assert (H, K, V, hylo.gdn_conv_size) == (6, 256, 512, 4)
    one = (H * (2 * K + V) * 3 + H * K * V) * 2  # conv inputs over 3 tokens + the state, bf16
    assert sd.recurrent_state_bytes(hylo) == 8 * one
    assert sd.recurrent_state_bytes(hylo, dtype_bytes=4) == 16 * one
    # Mamba-2 layers: conv over [x | B | C], state H x P x N
    m2 = hylo.__class__(**{**hylo.to_dict(), "linear_type": "mamba2"})
    Hm, P, N, G = m2.mamba2_dims
    assert sd.recurrent_state_bytes(m2) == 8 * ((Hm * P + 2 * G * N) * 3 + Hm * P * N) * 2


def test_computed_concurrency_at_64k():
    from hylo.serving.widths import GPU_WIDTHS

    hylo, llama = sd.pair_configs("1b", tiny=False)
    memory = 10 << 30
    c = sd.computed_pair(hylo, llama, 65536, GPU_WIDTHS, memory_bytes=memory)
    state = sd.recurrent_state_bytes(hylo)
    assert c["bytes_per_sequence"] == {"hylo_served": 65536 * 5120 + state, "hylo_native": 65536 * 2560 + state,
                                       "llama": 65536 * 32768}
    assert c["sequences"]["llama"] == sd.sequences_that_fit(memory, 65536, 32768) == memory // (65536 * 32768)
    assert c["sequences"]["hylo_served"] == memory // (65536 * 5120 + state)
    assert c["ratio_served"] == pytest.approx(65536 * 32768 / (65536 * 5120 + state))
    assert c["mla_width"] == {"native": 160, "served": 320} and c["note"] == "computed, not measured"


def test_the_largest_batch_and_what_limits_it():
    assert sd.max_batch(190.7, 512) == (190, "kv_cache")
    assert sd.max_batch(3.0, 512) == (3, "kv_cache")  # an exact fit is a whole sequence
    assert sd.max_batch(1500.2, 512) == (512, "max_num_seqs")
    assert sd.max_batch(190.7, 512, cap=64) == (64, "--max-batch")


def test_decode_rates_from_engine_steps():
    # (time after the step, output tokens so far, sequences with a token): 2 sequences, the second's first token
    # at t=3, then 3 steps of 2 tokens in 1.5 s
    steps = [(2.0, 1, 1), (3.0, 3, 2), (3.5, 5, 2), (4.0, 7, 2), (4.5, 9, 2)]
    fig = sd.decode_figures(steps, batch=2, start=1.0)
    assert fig["output_tokens_per_s"] == pytest.approx(9 / 3.5) and fig["prefill_seconds"] == pytest.approx(2.0)
    assert fig["decode_tokens_per_s"] == pytest.approx(6 / 1.5) and fig["decode_mean_batch"] == pytest.approx(2)


def test_targets_are_not_measured_until_both_models_ran():
    report = {"contexts": [65536], "models": {"hylo_1b": {"kind": "hylo", "pair": "1b",
                                                           "capacity": {"sequences": {"65536": 180}}}}}
    sd.compare(report)
    assert report["targets"] == {"concurrency_at_least_5x": "not measured", "batch1_decode_no_slower": "not measured"}
    report["models"]["llama_3.2_1b"] = {"kind": "llama", "pair": "1b", "capacity": {"sequences": {"65536": 30}}}
    report["models"]["hylo_1b"]["runs"] = {"ctx65536": {"batch1": {"decode_tokens_per_s": 90.0}}}
    report["models"]["llama_3.2_1b"]["runs"] = {"ctx65536": {"batch1": {"decode_tokens_per_s": 100.0}}}
    sd.compare(report)
    assert report["measured"]["1b"]["sequences"]["ratio"] == 6.0
    assert report["targets"] == {"concurrency_at_least_5x": "met: 6.00x", "batch1_decode_no_slower": "NOT met: 0.90x"}


def test_without_vllm_it_says_so_in_one_line_and_prints_the_computed_figures(tmp_path, capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM imports here: the --tiny run is tests/serving's slow test")
    assert sd.main(["--tiny", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "serve_decode.json").read_text())
    assert report["ok"] is True and report["models"] == {}
    assert report["skipped"].startswith("vLLM does not import here") and sd.SERVE_LOCK in report["skipped"]
    assert report["skipped"] in printed and (tmp_path / "serve_decode.md").read_text() in printed
    assert printed.count("computed, not measured") == 3  # 1B and 3B at 64K, and the tiny pair
    assert report["computed"]["1b"]["ratio_served"] > 5  # the target, as the bytes put it


# ------------------------------------------------------------------------------------ vLLM's CPU engine
@pytest.mark.slow
def test_tiny_run_through_vllm(tmp_path):
    """--tiny in the serving environment: every figure of both tiny models present and positive, and the engine's
    KV bytes per token and recurrent state per sequence equal to the arithmetic."""
    proc = subprocess.run([serve_python(), "bench/serve_decode.py", "--tiny", "--out", str(tmp_path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "serve_decode.json").read_text())
    assert "skipped" not in report and list(report["models"]) == ["hylo_tiny", "llama_tiny"]
    contexts = [str(c) for c in report["contexts"]]
    for name, m in report["models"].items():
        assert m["done"] and not m.get("errors"), (name, m)
        cap = m["capacity"]
        assert cap["num_blocks"] > 0 and all(cap["sequences"][c] >= 1 for c in contexts)
        # the concurrency at other lengths comes from vLLM's own function: at the engine's length it is its figure
        assert cap["concurrency"][str(cap["max_model_len"])] == pytest.approx(cap["engine_max_concurrency"])
        for c in contexts:
            b1, mb = m["runs"][f"ctx{c}"]["batch1"], m["runs"][f"ctx{c}"]["max_batch"]
            assert b1["batch"] == 1 and b1["decode_mean_batch"] == pytest.approx(1)
            assert mb["batch"] == min(cap["sequences"][c], report["settings"]["max_num_seqs"]) > 1
            for fig in (b1, mb):
                assert fig["output_tokens"] == fig["batch"] * report["new_tokens"]
                assert all(fig[k] > 0 and math.isfinite(fig[k]) for k in
                           ("output_tokens_per_s", "decode_tokens_per_s", "prefill_seconds")), fig
    computed = report["computed"]["tiny"]
    hylo, llama = report["models"]["hylo_tiny"], report["models"]["llama_tiny"]
    assert hylo["capacity"]["kv_bytes_per_token"] == hylo["kv_bytes_per_token"]["served"] == \
        computed["kv_bytes_per_token"]["hylo_served"]
    assert hylo["capacity"]["state_bytes_per_sequence"] == computed["hylo_state_bytes_per_sequence"] > 0
    assert llama["capacity"]["kv_bytes_per_token"] == computed["kv_bytes_per_token"]["llama"]
    assert llama["capacity"]["state_bytes_per_sequence"] == 0
    assert report["measured"]["tiny"]["sequences"]["ratio"] > 0 and "computed, not measured" in proc.stdout
