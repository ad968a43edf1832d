"""Layer placement search: swapped-layer KL, Ray scoring, proxy, ranking, and the job's proxy-only path."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.eval.kl import check_eval_row, evaluate_kl, scored_tokens
from hylo.pipeline.placement import (
    PlaceLayers,
    PlacementError,
    choose,
    compare_markdown,
    compare_summary,
    layer_inputs,
    load_rows,
    placement_config,
    proxy_scores,
    ranks,
    score_layers,
    spearman,
    swapped_kl,
    teacher_hidden,
)

ROOT = Path(__file__).resolve().parents[2]
N_LAYERS = 4


def make_row(vocab: int, doc_lens: list[int], seed: int, pad: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = doc_lens + ([pad] if pad else [])
    t = sum(lens)
    ids = torch.randint(3, vocab, (t,), generator=g)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    mask = torch.rand(t, generator=g) < 0.8
    mask[cu[1:].long() - 1] = False
    if pad:
        mask[t - pad:] = False
    pos = torch.cat([torch.arange(n) for n in lens])
    return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "loss_mask": mask,
            "doc_ids": [f"d{i}" for i in range(len(doc_lens))] + ([""] if pad else [])}


def as_row(r: dict, where: str = "row") -> PackedRow:
    return check_eval_row(r, where)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hylo.io import save_hylo
    from hylo.upcycle import load_base_model, upcycle

    from tests.helpers.teacher import save_tiny_llama

    root = tmp_path_factory.mktemp("place")
    base_dir = save_tiny_llama(root / "base", vocab_size=96, hidden_size=32, layers=N_LAYERS, seed=1)
    base = load_base_model(base_dir).eval()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    kw = dict(kv_lora_rank=16, gdn_head_dim=8, gdn_num_heads=4, calibration_ids=ids)
    linear = upcycle(base, mla_layers="none", **kw).eval()
    # full rank (2 KV heads x (nope + v) = 2 x (4 + 8) = 24) and every RoPE pair kept: MLA == attention
    mla = upcycle(base, mla_layers="all", **{**kw, "kv_lora_rank": 24, "qk_rope_head_dim": 8}).eval()
    save_hylo(linear, root / "linear")
    save_hylo(mla, root / "mla")
    rows = [make_row(96, [20, 13], seed=2), make_row(96, [31], seed=3, pad=5)]
    return {"root": root, "base_dir": base_dir, "base": base, "linear": linear, "mla": mla, "rows": rows}


def test_swapped_kl_equals_the_full_forward_of_the_mixed_model(models):
    # The search's shortcut (reuse the all-linear student's hidden states before layer i) must give the
    # KL of the student that really has MLA at layer i, computed the ordinary way.
    base, linear, mla = models["base"], models["linear"], models["mla"]
    rows = [as_row(r, f"row {k}") for k, r in enumerate(models["rows"])]
    teacher = teacher_hidden(base, rows)
    wt = base.get_output_embeddings().weight
    inputs = [layer_inputs(linear, r) for r in rows]
    eval_rows = [(f"row {k}", r) for k, r in enumerate(rows)]
    got_linear = swapped_kl(linear, mla, None, [x[0] for x in inputs], rows, teacher, wt)
    assert got_linear == pytest.approx(evaluate_kl(linear, eval_rows, teacher=base).kl, rel=1e-5)
    kls = []
    for i in range(N_LAYERS):
        mixed = copy.deepcopy(linear)
        mixed.model.layers[i] = copy.deepcopy(mla.model.layers[i])
        want = evaluate_kl(mixed, eval_rows, teacher=base).kl
        got = swapped_kl(linear, mla, i, [x[i] for x in inputs], rows, teacher, wt)
        assert got == pytest.approx(want, rel=1e-5)
        kls.append(got)
    assert len({round(k, 6) for k in kls}) == N_LAYERS  # every layer gives its own score


@pytest.mark.slow
def test_score_layers_through_ray_tasks(models):
    from hylo.pipeline.ray_init import ray_running

    rows = [as_row(r) for r in models["rows"]]
    with ray_running(None, 2):
        res = score_layers(models["root"] / "linear", models["root"] / "mla", models["base"], rows, progress=False)
    linear, mla, base = models["linear"], models["mla"], models["base"]
    teacher = teacher_hidden(base, rows)
    wt = base.get_output_embeddings().weight
    inputs = [layer_inputs(linear, r) for r in rows]
    for i in range(N_LAYERS):
        want = swapped_kl(linear, mla, i, [x[i] for x in inputs], rows, teacher, wt)
        assert res["kl_swap"][i] == pytest.approx(want, rel=1e-5)
        assert res["drop"][i] == pytest.approx(res["kl_all_linear"] - want, rel=1e-5, abs=1e-7)
    # the full-rank all-MLA student is the base model itself
    assert res["kl_all_mla"] < 1e-6 < res["kl_all_linear"]
    assert res["tokens"] == sum(int(r.loss_mask.sum()) for r in rows)


def test_score_layers_rejects_wrong_students(models):
    rows = [as_row(models["rows"][0])]
    with pytest.raises(PlacementError, match="all-linear"):
        score_layers(models["root"] / "mla", models["root"] / "linear", models["base"], rows, progress=False)


def test_proxy_at_init(models):
    rows = [as_row(r) for r in models["rows"]]
    p = proxy_scores(models["base"], models["linear"], models["mla"], rows)
    assert set(p) >= {"linear_error", "linear_error_rel", "error_gap", "mla_error", "attention_norm"}
    lin, mla_err, attn = map(np.array, (p["linear_error"], p["mla_error"], p["attention_norm"]))
    assert lin.shape == (N_LAYERS,)
    # the full-rank MLA mixer reproduces the base attention; the linear block does not
    assert (mla_err < 1e-3 * attn).all() and (lin > 1e-2 * attn).all()
    np.testing.assert_allclose(p["error_gap"], lin - mla_err, rtol=1e-12)
    np.testing.assert_allclose(p["linear_error_rel"], lin / attn, rtol=1e-12)


def test_proxy_ignores_the_padding_segment(models):
    row_real = as_row(models["rows"][1])
    assert row_real.doc_ids[-1] == "" and row_real.real_tokens()[-5:].tolist() == [0.0] * 5
    # the same tokens with no padding document: every token counts
    row = dataclasses.replace(row_real, doc_ids=None)
    p_all = proxy_scores(models["base"], models["linear"], models["mla"], [row])
    p_real = proxy_scores(models["base"], models["linear"], models["mla"], [row_real])
    assert p_all["linear_error"] != pytest.approx(p_real["linear_error"])


def test_spearman_ranks_and_choose():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    a = rng.normal(size=30)
    b = a + rng.normal(scale=0.5, size=30)
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    tied = [1.0, 2.0, 2.0, 3.0, 0.5]
    assert spearman(tied, [5, 4, 3, 2, 1]) == pytest.approx(spearmanr(tied, [5, 4, 3, 2, 1]).statistic, abs=1e-12)
    assert ranks([3.0, 1.0, 1.0]).tolist() == [2.0, 0.5, 0.5]
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert choose([0.1, 0.5, -0.2, 0.5, 0.3], 3) == [1, 3, 4]
    assert choose([0.0, 0.0, 0.0], 2) == [0, 1]
    with pytest.raises(PlacementError, match="n_mla=6"):
        choose([1, 2, 3], 6)


def test_load_rows_marks_padding_and_rejects_non_packed_dirs(tmp_path):
    from hylo.pipeline.data.shards import ShardWriter, write_manifest

    rows = [make_row(96, [9, 7], seed=5), make_row(96, [10], seed=6, pad=6)]
    writer = ShardWriter(tmp_path / "packed", rows_per_shard=1, row_group_rows=1)
    for r in rows:
        writer.add({k: (v.numpy() if torch.is_tensor(v) else v) for k, v in r.items()})
    write_manifest(tmp_path / "packed", {"shards": writer.finish()})
    got = load_rows(tmp_path / "packed", max_rows=5)
    assert len(got) == 2 and len(load_rows(tmp_path / "packed", max_rows=1)) == 1
    assert all(isinstance(r, PackedRow) for r in got)
    assert got[0].real_tokens().tolist() == [1.0] * 16
    assert got[1].real_tokens().tolist() == [1.0] * 10 + [0.0] * 6
    assert torch.equal(scored_tokens(got[1]), rows[1]["loss_mask"].nonzero().squeeze(-1))
    with pytest.raises(PlacementError, match="no manifest.json"):
        load_rows(tmp_path, max_rows=1)


@pytest.mark.slow
def test_place_layers_job_proxy_only(models, tmp_path):
    # The job end to end on the cheap path: converts both students, writes the proxy and the placement.
    from hylo.pipeline.data.shards import ShardWriter, write_manifest

    data = tmp_path / "heldout"
    writer = ShardWriter(data, rows_per_shard=2, row_group_rows=1)
    for r in models["rows"]:
        writer.add({k: (v.numpy() if torch.is_tensor(v) else v) for k, v in r.items()})
    write_manifest(data, {"shards": writer.finish()})
    cmd = [sys.executable, "jobs/place_layers.py", "--base", str(models["base_dir"]), "--n-mla", "2",
           "--run-dir", str(tmp_path / "run"), "--heldout-data", str(data),
           "--kv-lora-rank", "16", "--proxy-only", "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert res["method"].startswith("proxy") and len(res["mla_layers"]) == 2
    assert res["mla_layers"] == choose(res["proxy"]["error_gap"], 2)
    # a second run reuses every finished step
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "already done" in again.stderr
    bad_cmd = [str(tmp_path) if c == str(data) else c for c in cmd]
    bad = subprocess.run(bad_cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "heldout rows" in bad.stderr and "not a packed-data directory" in bad.stderr


def _cmp_row(name: str, seed: int, kl: float) -> dict:
    return {"placement": name, "spec": name, "seed": seed, "mla_layers": [0, 2], "kv_cache_ratio": 0.5, "kl": kl,
            "tokens": 100}


def test_compare_summary_pairs_by_seed():
    rows = [_cmp_row("searched", 0, 2.0), _cmp_row("even", 0, 2.5), _cmp_row("searched", 1, 3.0),
            _cmp_row("even", 1, 2.9), _cmp_row("searched", 2, 2.2), _cmp_row("even", 2, 2.6),
            _cmp_row("odd", 1, 4.0)]
    got = {s["placement"]: s for s in compare_summary(rows)}
    assert list(got) == ["searched", "even", "odd"]
    assert got["searched"]["mean"] == pytest.approx(np.mean([2.0, 3.0, 2.2]))
    assert got["searched"]["std"] == pytest.approx(np.std([2.0, 3.0, 2.2], ddof=1))
    assert got["searched"]["gap_to_searched"] is None and got["searched"]["searched_lower"] is None
    assert got["even"]["gaps"] == pytest.approx([0.5, -0.1, 0.4])
    assert got["even"]["gap_to_searched"] == pytest.approx(0.8 / 3) and got["even"]["searched_lower"] == 2
    # a placement that ran only some seeds is paired on those only; one seed has no spread
    assert got["odd"]["gaps"] == pytest.approx([1.0]) and got["odd"]["std"] == 0.0
    with pytest.raises(PlacementError, match="two runs with seed 0"):
        compare_summary(rows + [_cmp_row("even", 0, 1.0)])


def test_compare_markdown_one_and_several_seeds():
    one = [_cmp_row("searched", 0, 2.0), _cmp_row("even", 0, 2.5)]
    md = "\n".join(compare_markdown(one, compare_summary(one), 8))
    assert "| even | 0,2 | 0.500 | 2.5000 |" in md and "seed" not in md
    three = one + [_cmp_row("searched", 1, 3.0), _cmp_row("even", 1, 2.9)]
    md = "\n".join(compare_markdown(three, compare_summary(three), 8))
    assert "seeds 0, 1" in md and "| KL seed 0 | KL seed 1 |" in md
    assert "| even | 0,2 | 0.500 | 2.5000 | 2.9000 | 2.7000 +- 0.2828 | +0.2000 (+0.500, -0.100) | 1 of 2 |" in md


def test_compare_runs_take_the_seed(tmp_path, monkeypatch):
    # Every seed gets its own runs: convert --seed s, train.seed=s in both stages, its own tag and eval.
    data = tmp_path / "data"
    for split in ("stage1", "stage2", "heldout"):
        (data / "data" / split).mkdir(parents=True)
        (data / "data" / split / "manifest.json").write_text("{}")
    job = PlaceLayers(placement_config(
        ["--n-mla", "2", "--data-from", str(data), "--run-dir", str(tmp_path / "run"), "--compare", "even",
         "--compare-seeds", "0", "3", "--quiet"]))
    job.base_dir = "BASE"
    calls: list[list[str]] = []

    def fake_sh(name, cmd, env=None, ray=False):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1]) if "--out" in cmd else None
        if cmd[2] == "hylo.jobs.convert":
            (out / "hybrid_config.json").parent.mkdir(parents=True, exist_ok=True)
            (out / "hybrid_config.json").write_text("{}")
            return json.dumps({"mla_layers": [0, 2], "kv_cache_ratio": 0.5})
        if cmd[2] == "hylo.jobs.eval":
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps({"kl": {"kl": 1.0 + len(calls), "tokens": 10}}))
            return ""
        run = Path(next(c.split("=", 1)[1] for c in cmd if c.startswith("ray.storage_path=")))
        name_ = next(c.split("=", 1)[1] for c in cmd if c.startswith("ray.name="))
        (run / name_ / "model").mkdir(parents=True, exist_ok=True)
        (run / name_ / "model" / "hybrid_config.json").write_text("{}")
        return ""

    monkeypatch.setattr(job, "sh", fake_sh)
    r0 = job.compare_one("even", "even", 4, 0)
    r3 = job.compare_one("even", "even", 4, 3)
    assert (r0["seed"], r3["seed"]) == (0, 3) and r0["kl"] != r3["kl"]
    conv = [c for c in calls if c[2] == "hylo.jobs.convert"]
    assert [c[c.index("--seed") + 1] for c in conv] == ["0", "3"]
    assert conv[1][conv[1].index("--out") + 1].endswith("cmp_even_seed3/converted")
    trains = [c for c in calls if c[2].startswith("hylo.jobs.stage")]
    assert [c[-1] for c in trains] == ["train.seed=0", "train.seed=0", "train.seed=3", "train.seed=3"]
    # finished seeds are reused: no new job runs
    n = len(calls)
    assert job.compare_one("even", "even", 4, 3) == r3 and len(calls) == n


def test_options_come_from_a_config_file_set_overrides_and_flags(tmp_path):
    from hylo.pipeline.config import ConfigError

    f = tmp_path / "search.yaml"
    f.write_text("n_mla: 4\ncompare: [even]\ncompare_seeds: [0, 1]\ntrain_set: [a.b=1]\n")
    cfg = placement_config(["--config", str(f), "--set", "compare_steps=3", "--n-mla", "6", "--num-cpus", "2",
                            "--train-set", "c.d=2"])
    assert (cfg.n_mla, cfg.compare, cfg.compare_seeds, cfg.compare_steps) == (6, ["even"], [0, 1], 3)
    assert cfg.train_set == ["c.d=2"] and cfg.ray.num_cpus == 2 and cfg.train_config == "demo-smollm2.yaml"
    with pytest.raises(ConfigError, match="command line: proxy='x': must be one of linear_error"):
        placement_config(["--set", "proxy=x"])
    with pytest.raises(PlacementError, match="n_mla is not set"):
        PlaceLayers(placement_config(["--run-dir", str(tmp_path / "run")]))
