"""The demo's choice of evaluation suites and its options (the demo itself runs in `make demo`, not here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hylo.pipeline import demo
from hylo.pipeline.config import ConfigError


def make(tmp_path: Path, *flags: str) -> demo.Demo:
    d = demo.Demo(demo.demo_config(["--run-dir", str(tmp_path / "run"), "--quiet", *flags]))
    d.base = Path("/models/smollm2")
    d.commands = []

    def fake_sh(name, cmd, env=None, ray=False):
        d.commands.append((name, cmd))
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        suites = cmd[cmd.index("--suite") + 1].split(",")
        (out / "results.json").write_text(json.dumps({s: {"seconds": 1.0} for s in suites}))
        return ""

    d.sh = fake_sh
    return d


def sets(cmd: list[str]) -> dict[str, str]:
    return dict(cmd[i + 1].split("=", 1) for i, tok in enumerate(cmd) if tok == "--set")


def test_default_demo_evaluates_what_a_135m_model_shows(tmp_path):
    d = make(tmp_path)
    assert d.final_suites() == ["kl", "kvcache", "samples"]
    d.evaluate("stage2", tmp_path / "model", d.final_suites())
    name, cmd = d.commands[-1]
    assert name == "eval_stage2" and cmd[cmd.index("--suite") + 1] == "kl,kvcache,samples"
    s = sets(cmd)
    assert s["kvcache.lengths"] == "[512,1024,2048]" and s["kl.max_rows"] == "8"
    assert "--update-card" in cmd  # the evaluated model's card gets the results
    # the base answers once, beside the converted model
    assert s["samples.base"] == "False"
    d.evaluate("converted", tmp_path / "model", ["kl", "samples"])
    assert sets(d.commands[-1][1])["samples.base"] == "True"
    assert not any(k.startswith("retrieval.") for k in s)


def test_full_eval_adds_retrieval_and_longer_contexts(tmp_path):
    d = make(tmp_path, "--full-eval", "--retrieval-lengths", "[256,512]")
    assert d.final_suites() == ["kl", "retrieval", "kvcache", "samples"]
    d.evaluate("stage2", tmp_path / "model", d.final_suites())
    s = sets(d.commands[-1][1])
    assert s["retrieval.lengths"] == "[256,512]" and s["kvcache.lengths"] == "[1024,2048,4096]"
    # an explicit --kv-lengths wins in both modes
    d2 = make(tmp_path, "--kv-lengths", "[128,256]")
    d2.evaluate("stage2", tmp_path / "model", d2.final_suites())
    assert sets(d2.commands[-1][1])["kvcache.lengths"] == "[128,256]"


@pytest.mark.parametrize("first,then,reruns", [([], ["--full-eval"], True), (["--full-eval"], [], False),
                                               ([], [], False)])
def test_a_finished_eval_is_redone_only_when_it_lacks_a_requested_suite(tmp_path, first, then, reruns):
    d = make(tmp_path, *first)
    suites = d.final_suites()
    d.step("eval_stage2", d.eval_outputs("stage2", suites), lambda: d.evaluate("stage2", tmp_path / "m", suites))
    again = make(tmp_path, *then)
    suites = again.final_suites()
    again.step("eval_stage2", again.eval_outputs("stage2", suites),
               lambda: again.evaluate("stage2", tmp_path / "m", suites))
    assert len(again.commands) == (1 if reruns else 0)
    results = json.loads((tmp_path / "run" / "eval" / "stage2" / "results.json").read_text())
    assert ("retrieval" in results) == bool(first or then)


def test_options_come_from_a_config_file_set_overrides_and_flags(tmp_path, capsys):
    f = tmp_path / "demo.yaml"
    f.write_text("steps: 4\nheldout_rows: 16\nkv_lengths: [128]\nseq_len: 1024\n")
    cfg = demo.demo_config(["--config", str(f), "--set", "steps=5", "--set", "seq_len=256", "--steps", "6"])
    # the file, then --set, then the shorthand flags
    assert (cfg.steps, cfg.heldout_rows, cfg.seq_len, cfg.kv_lengths) == (6, 16, 256, [128])
    assert cfg.run_dir == "runs/demo" and cfg.full_eval is False and cfg.placement_seeds == [0]
    with pytest.raises(ConfigError, match="command line: heldout_rows=0: must be >= 1"):
        demo.demo_config(["--set", "heldout_rows=0"])
    with pytest.raises(ConfigError, match="unknown key.*stepz.*valid keys: .*steps"):
        demo.demo_config(["--set", "stepz=3"])
    with pytest.raises(SystemExit) as e:
        demo.demo_config(["--full-eval", "--placement-seeds", "0", "1", "--print-config"])
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["full_eval"] is True and printed["placement_seeds"] == [0, 1]
    assert printed["ray"] == {"address": None, "num_cpus": None}


def test_the_report_shows_every_models_answers_as_they_came_out(tmp_path):
    def res(answers, base=None):
        samples = {"model": [{"prompt": p, "answer": a} for p, a in answers]}
        if base:
            samples["base"] = [{"prompt": p, "answer": a} for p, a in base]
        return {"samples": samples}

    prompts = ["What is the capital of France?", "Two plus two?"]
    info = {"eval_converted": res(zip(prompts, ["islandscape", ""]), base=zip(prompts, ["Paris.", "4"])),
            "eval_stage1": res(zip(prompts, ["The capital", "2 | 2"])),
            "eval_stage2": res(zip(prompts, ["The capital of the capital", "four\nfour"]))}
    got = demo.sample_answers(info)
    assert got == [(prompts[0], {"base": "Paris.", "converted": "islandscape", "stage 1": "The capital",
                                 "stage 2": "The capital of the capital"}),
                   (prompts[1], {"base": "4", "converted": "", "stage 1": "2 | 2", "stage 2": "four\nfour"})]
    assert demo._md_cell("2 | 2") == "2 \\| 2" and demo._md_cell("") == "(empty)"


def test_the_report_says_what_its_few_steps_can_and_cannot_show():
    """The demo's 8 + 8 CPU steps move the KL but leave the answers broken ("The capital of the capital of ..."):
    the report says so with the run's own figures, the tokens each stage trained on among them."""
    assert demo.demo_batch() == 2  # configs/demo-smollm2.yaml's train.global_batch_sequences
    note = demo.steps_note(8, 2, 512, {"converted": 3.9969, "stage1": 3.1688, "stage2": 2.1147})
    assert note.startswith("What 8 + 8 steps can show: each stage trains on 16 packed rows of 512 tokens (8,192 tokens")
    assert "(4.00 -> 3.17 -> 2.11)" in note and "cannot show: quality" in note and "524,288" in note


def _kv_final() -> dict:
    """An evaluation's kvcache results as `pipeline/eval/kvcache.py` writes them: the hybrid's growing part is
    0.396 of the base per token, its fixed GDN state raises the ratio of the cache in all at short contexts."""
    base = [{"context": n, "total_bytes": 46080 * n} for n in (512, 1024)]
    model = [{"context": n, "total_bytes": 0.396 * 46080 * n + 2_400_000} for n in (512, 1024)]
    per_length = [{"context": b["context"], "measured_ratio": 0.396,
                   "measured_ratio_total": m["total_bytes"] / b["total_bytes"]} for b, m in zip(base, model)]
    return {"kvcache": {"base": base, "model": model, "comparison": {"per_length": per_length}}}


def test_the_kv_rows_say_what_they_measure_and_the_plotted_ratio_is_in_the_table():
    """Before, one row per length read "measured KV bytes/token ratio 0.396" (the growing part only) while the
    plot drew the cache in all (ratio 0.50 at 512 tokens). Now each row names its measure, and the rows of the
    cache in all carry the ratio of the plotted lines."""
    final = _kv_final()
    rows = dict(demo.kv_rows(final))
    (xs, base), (_, model) = demo.kv_series(final).values()
    assert xs == [512, 1024] and len(rows) == 4
    for n, b, m in zip(xs, base, model):
        (growing,) = [v for k, v in rows.items() if f"at {n} tokens" in k and "per token" in k]
        (in_all,) = [v for k, v in rows.items() if f"at {n} tokens" in k and "as plotted" in k]
        assert growing == "0.396" and in_all == f"{m / b:.3f}" != growing
    note = demo.kv_ratio_note({"n_mla": 15, "n_linear": 15, "kv_cache_ratio": 15 * 304 / (30 * 384),
                               "mla_values_per_token": 304, "kv_lora_rank": 256, "qk_rope_head_dim": 48})
    assert "15 x 304 / (30 x 384) = 0.396" in note and "3.9-7.8 %" in note


@pytest.mark.slow  # matplotlib's first import in a fresh home runs fc-list to find the fonts
def test_every_axis_of_every_demo_plot_is_labelled():
    """Before, the loss curves' y axes (and the KL bars' x axis) had no label. The KV plot draws `kv_series`,
    whose ratios the table's rows of the cache in all carry."""
    import matplotlib.pyplot as plt

    figs = demo.demo_figures({"converted": 4.0, "stage1": 3.0, "stage2": 2.0}, _kv_final(),
                             {1: {"loss": 1.0}, 2: {"loss": 0.5}}, {1: {"loss": 2.0}})
    assert sorted(figs) == ["kl_per_stage.png", "kv_cache_vs_context.png", "loss_curves.png"]
    try:
        for name, fig in figs.items():
            for ax in fig.axes:
                assert ax.get_xlabel() and ax.get_ylabel(), (name, ax.get_title())
        kv = figs["kv_cache_vs_context.png"].axes[0]
        assert "in all" in kv.get_ylabel()
        assert [list(line.get_ydata()) for line in kv.get_lines()] == [
            [y / 2**20 for y in ys] for _, ys in demo.kv_series(_kv_final()).values()]
    finally:
        plt.close("all")
