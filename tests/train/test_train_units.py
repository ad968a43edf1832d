"""Training pieces that run in one process in seconds: config, batch arithmetic, schedule, rows,
checkpoint files and compatibility, metrics sinks, the stage-2 loss terms, the streamed-logits adapter and
the stage-1 pieces (base-layer capture, ILD distance)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.reader import ShardRows
from hylo.pipeline.data.rowfile import DataFormatError
from hylo.pipeline.data.rows import PackedRow, PackedRowError, check_row
from hylo.pipeline.train.checkpoint.deepspeed_io import capture_rng, restore_rng
from hylo.pipeline.train.checkpoint.layout import (
    FORMAT_VERSION,
    STATE_FILE,
    delete_checkpoints,
    finalize_checkpoint,
    is_complete,
    latest_checkpoint,
    save_tensors_atomic,
    write_json_atomic,
    write_rank_files,
)
from hylo.pipeline.train.checkpoint.resume import check_compatible
from hylo.pipeline.train.config import (
    DataSection,
    Stage1Config,
    Stage2Config,
    SyntheticData,
    breaking_diff,
    breaking_hash,
    config_from_dict,
    config_to_dict,
    load_stage_config,
)
from hylo.pipeline.train.deepspeed_cfg import build_deepspeed_config
from hylo.pipeline.train.loop import cosine_with_warmup
from hylo.pipeline.train.metrics import MetricsWriter, read_metrics
from hylo.pipeline.train.row_sources import SyntheticRows, open_rows
from hylo.pipeline.train.worker import row_to_device

from tests.helpers.common import assert_topk_matches
from tests.helpers.logs import messages


# ------------------------------------------------------------------------------------ config
def test_stage_defaults_follow_the_recipe():
    s1, s2 = Stage1Config(), Stage2Config()
    # the rows' length is the dataset's (its manifest's max_len): the training stages leave seq_len unset
    assert (s1.data.seq_len, s1.optim.lr, s1.data.split) == (None, 2e-4, "stage1")
    assert (s2.data.seq_len, s2.optim.lr, s2.data.split) == (None, 4e-5, "stage2")
    assert (s2.train.global_batch_sequences, s2.train.epochs, s2.optim.warmup_ratio) == (8, 1.0, 0.01)
    assert (s2.kd.kl_weight, s2.kd.ce_weight) == (1.0, 0.0)


def test_yaml_stage_sections_merge_over_shared(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("optim: {lr: 1.0e-3}\nray: {name: demo}\nstage1: {optim: {lr: 5.0e-4}}\n"
                 "stage2: {kd: {ce_weight: 0.5}}\n")
    s1 = load_stage_config(1, p)
    s2 = load_stage_config(2, p, ["train.max_steps=3"])
    assert s1.optim.lr == 5e-4 and s1.ray.name == "demo"
    assert s2.optim.lr == 1e-3 and s2.kd.ce_weight == 0.5 and s2.train.max_steps == 3
    assert config_from_dict(config_to_dict(s2)) == s2


@pytest.mark.parametrize("text,needle", [
    ("optim: {lrr: 1}", "optim.lrr"),
    ("stage2: {kd: {kl: 1}}", "kd.kl"),
    ("teacher: {source: hub}", "teacher.source"),
    ("deepspeed: {offload_param: nvme}", "deepspeed.offload_param"),
    # checked when the config loads, before Ray starts (not when the workers build DeepSpeed's config)
    ("deepspeed: {zero_stage: 2, offload_param: cpu}", "deepspeed.offload_param='cpu': needs deepspeed.zero_stage=3"),
], ids=["unknown-key", "unknown-in-stage-section", "bad-teacher-source", "bad-offload", "offload-param-below-zero-3"])
def test_bad_config_names_the_key(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_stage_config(2, p)


def test_breaking_diff_ignores_runtime_knobs():
    a = config_to_dict(Stage2Config())
    b = config_to_dict(load_stage_config(2, None, ["ray.address=auto", "checkpoint.every_steps=7",
                                                   "metrics.log_every=5", "train.max_steps=2"]))
    assert breaking_diff(a, b) == []
    c = config_to_dict(load_stage_config(2, None, ["optim.lr=1e-3", "ray.num_workers=4"]))
    diffs = breaking_diff(a, c)
    assert any(d.startswith("optim.lr") for d in diffs) and any(d.startswith("ray.num_workers") for d in diffs)
    assert breaking_hash(config_from_dict(a)) != breaking_hash(config_from_dict(c))


# ------------------------------------------------------------------------------------ batch + schedule
def test_grad_accum_reaches_global_batch_or_explains():
    assert load_stage_config(2, None, ["train.global_batch_sequences=8", "ray.num_workers=2"]).grad_accum == 4
    with pytest.raises(ConfigError, match=r"global_batch_sequences=6: must be a multiple of ray.num_workers \(4\)"):
        load_stage_config(2, None, ["train.global_batch_sequences=6", "ray.num_workers=4"])
    ds = build_deepspeed_config(Stage2Config(), world_size=2, dtype=torch.bfloat16)
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] and "optimizer" not in ds
    off = build_deepspeed_config(load_stage_config(2, None, ["deepspeed.offload_optimizer=cpu",
                                                            "deepspeed.offload_param=cpu"]), 8, torch.float32)
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert off["zero_optimization"]["offload_param"]["device"] == "cpu" and not off["bf16"]["enabled"]


def test_cosine_schedule_warms_up_then_decays_to_min():
    f = cosine_with_warmup(total_steps=100, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert [round(f(s), 3) for s in range(3)] == [0.1, 0.2, 0.3]
    assert f(9) == 1.0 and f(10) == 1.0
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


# ------------------------------------------------------------------------------------ rows
def _data(rows=10, seq_len=64) -> DataSection:
    return DataSection(source="synthetic", seq_len=seq_len,
                       synthetic=SyntheticData(rows=rows, vocab_size=50, min_doc_len=5, max_doc_len=30))


def test_synthetic_rows_follow_the_contract_and_shard_by_stride():
    r0, r1 = open_rows(_data(), 0, 0, 2), open_rows(_data(), 0, 1, 2)
    a = [r0.next_row() for _ in range(6)]
    b = [r1.next_row() for _ in range(6)]
    for row in a + b:
        assert isinstance(row, PackedRow) and row.num_tokens == 64 and row.host == tuple(row.cu_seqlens.tolist())
    assert [r.key for r in a] == ["syn-0", "syn-2", "syn-4", "syn-6", "syn-8", "syn-0"]
    assert [r.key for r in b][:2] == ["syn-1", "syn-3"] and a[5].epoch == 1 and a[4].epoch == 0


def test_seek_reproduces_exactly_the_same_rows():
    full = open_rows(_data(), 7, 1, 2)
    rows = [full.next_row() for _ in range(5)]
    resumed = open_rows(_data(), 7, 1, 2)
    resumed.seek(3)
    for want in rows[3:]:
        got = resumed.next_row()
        assert got.key == want.key
        assert torch.equal(got.input_ids, want.input_ids)


def _write_split(tmp_path, n_rows=6, split="stage2", max_len=32):
    from hylo.pipeline.data.shards import write_manifest

    from tests.helpers.teacher import make_packed_row, write_packed_parquet

    rows = [make_packed_row([10, 12], vocab_size=50, seed=i, pad=10) for i in range(n_rows)]
    for r in rows:
        r["doc_ids"][-1] = ""
    write_packed_parquet(tmp_path / "shard-00000.parquet", rows)
    write_manifest(tmp_path, {"split": split, "max_len": max_len, "config_hash": "abc",
                              "shards": [{"file": "shard-00000.parquet", "rows": n_rows}]})
    return rows


def test_parquet_rows_read_the_prepared_split(tmp_path):
    rows = _write_split(tmp_path)
    data = DataSection(source="parquet", path=str(tmp_path), split="stage2", seq_len=32)
    r1 = open_rows(data, 0, 1, 2)
    assert isinstance(r1.source, ShardRows) and r1.global_rows == 6 and r1.fingerprint == "abc"
    got = [r1.next_row() for _ in range(4)]
    assert [g.key for g in got] == ["1", "3", "5", "1"]
    assert np.array_equal(got[1].input_ids, rows[3]["input_ids"]) and got[1].doc_ids[-1] == ""


@pytest.mark.parametrize("split,seq_len,needle", [("stage1", 32, "'stage2' split"),
                                                  ("stage2", 64, "packed to max_len=32 .*data.seq_len=64")],
                         ids=["wrong-split", "wrong-seq-len"])
def test_parquet_rows_refuse_mismatched_data(tmp_path, split, seq_len, needle):
    _write_split(tmp_path)
    with pytest.raises(DataFormatError, match=needle):
        open_rows(DataSection(source="parquet", path=str(tmp_path), split=split, seq_len=seq_len), 0, 0, 1)


def test_parquet_rows_take_their_length_from_the_manifest(tmp_path):
    # data.seq_len unset: the manifest's max_len (the data job's packing.max_len) is the rows' length bound
    _write_split(tmp_path, max_len=32)
    rows = open_rows(DataSection(source="parquet", path=str(tmp_path), split="stage2"), 0, 0, 1)
    assert rows.source.max_len == 32 and rows.next_row().num_tokens == 32
    # set to the same number, it is a check that passes
    same = open_rows(DataSection(source="parquet", path=str(tmp_path), split="stage2", seq_len=32), 0, 0, 1)
    assert same.next_row().num_tokens == 32


def test_synthetic_rows_need_data_seq_len():
    with pytest.raises(ConfigError, match="data.seq_len is not set: synthetic rows need a length"):
        open_rows(DataSection(source="synthetic"), 0, 0, 1)


def test_a_row_longer_than_the_manifest_allows_names_the_manifest(tmp_path):
    _write_split(tmp_path, max_len=16)
    rows = open_rows(DataSection(source="parquet", path=str(tmp_path), split="stage2"), 0, 0, 1)
    with pytest.raises(PackedRowError, match=r"row 0: 32 tokens, more than max_len=16 \(packing.max_len of "
                                             r".*manifest.json\)"):
        rows.next_row()


def test_a_row_longer_than_the_config_allows_names_data_seq_len(tmp_path):
    # a manifest without its length (written by hand): data.seq_len is the bound
    _write_split(tmp_path, max_len=None)
    rows = open_rows(DataSection(source="parquet", path=str(tmp_path), split="stage2", seq_len=16), 0, 0, 1)
    with pytest.raises(PackedRowError, match=r"row 0: 32 tokens, more than max_len=16 \(data.seq_len\)"):
        rows.next_row()


def test_bad_row_is_named():
    row = dict(SyntheticRows(_data(), 0).raw(0))
    row["loss_mask"][row["cu_seqlens"][1] - 1] = 1
    with pytest.raises(PackedRowError, match="row 17.*last token"):
        check_row(row, "row 17")


def test_row_to_device_is_the_same_packed_row_with_its_host_boundaries():
    row = open_rows(_data(), 0, 0, 1).next_row()
    d = row_to_device(row, torch.device("cpu"))
    assert isinstance(d, PackedRow) and d.host is row.host and (d.key, d.epoch, d.row_id) == (row.key, row.epoch,
                                                                                              row.row_id)
    for name in ("input_ids", "cu_seqlens", "position_ids", "loss_mask"):
        assert torch.equal(getattr(d, name), getattr(row, name)) and getattr(d, name).dtype == getattr(row, name).dtype
    bounds = d.bounds()
    assert bounds.host is row.host and torch.equal(bounds.positions, row.position_ids)
    with pytest.raises(ValueError, match="a training row needs a loss_mask"):
        row_to_device(dataclasses.replace(row, loss_mask=None), torch.device("cpu"))


# ------------------------------------------------------------------------------------ checkpoint files
def _fake_checkpoint(d, cfg, world=2, step=4):
    for r in range(world):
        write_json_atomic(d / "ranks" / f"rank_{r}.json", {"step": step})
    write_json_atomic(d / STATE_FILE, {
        "format_version": FORMAT_VERSION, "stage": cfg.stage, "step": step, "world_size": world,
        "config": config_to_dict(cfg), "breaking_hash": breaking_hash(cfg), "data_fingerprint": "fp1"})
    for r in range(world):
        write_rank_files(d, r, world, shared=True)
    finalize_checkpoint(d, step, world)


def _run_with_mixed_checkpoints(run: Path) -> None:
    """step 4 complete, step 8 missing rank 1's state, a scratch .tmp-step_00000012."""
    cfg = Stage2Config()
    _fake_checkpoint(run / "step_00000004", cfg, step=4)
    _fake_checkpoint(run / "step_00000008", cfg, step=8)
    (run / "step_00000008" / "ranks" / "rank_1.json").unlink()
    (run / ".tmp-step_00000012").mkdir()


def test_latest_checkpoint_skips_incomplete(tmp_path):
    _run_with_mixed_checkpoints(tmp_path)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    assert not is_complete(tmp_path / "step_00000008")


def test_delete_checkpoints_removes_complete_partial_and_scratch_only(tmp_path):
    _run_with_mixed_checkpoints(tmp_path)
    for keep in ("model", "tensorboard", "step_notes"):
        (tmp_path / keep).mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    n, freed = delete_checkpoints(tmp_path)
    assert n == 3 and freed > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "model", "step_notes", "tensorboard"]
    assert delete_checkpoints(tmp_path / "missing") == (0, 0)


def test_resume_refuses_breaking_changes(tmp_path):
    cfg = load_stage_config(2, None, ["ray.num_workers=2"])
    _fake_checkpoint(tmp_path, cfg)
    check_compatible(tmp_path, load_stage_config(2, None, ["ray.num_workers=2", "ray.address=auto"]), 2, "fp1")
    with pytest.raises(ConfigError, match=r"optim\.lr: 4e-05 -> 0\.001"):
        check_compatible(tmp_path, load_stage_config(2, None, ["ray.num_workers=2", "optim.lr=1e-3"]), 2)
    with pytest.raises(ConfigError, match="written by 2 workers, this run has 4"):
        check_compatible(tmp_path, cfg, 4)
    with pytest.raises(ConfigError, match="training data changed"):
        check_compatible(tmp_path, cfg, 2, "fp2")
    with pytest.raises(ConfigError, match="stage 2 checkpoint"):
        check_compatible(tmp_path, Stage1Config(), 2)


def test_rng_state_round_trips(tmp_path):
    import random

    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    meta, tensors = capture_rng()
    save_tensors_atomic(tmp_path / "rng.safetensors", tensors)
    write_json_atomic(tmp_path / "rng.json", meta)
    want = (torch.rand(3), np.random.rand(3), random.random())
    from safetensors.torch import load_file

    restore_rng(json.loads((tmp_path / "rng.json").read_text()), load_file(str(tmp_path / "rng.safetensors")))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


# ------------------------------------------------------------------------------------ metrics
def test_metrics_writer_jsonl_tensorboard_and_progress(tmp_path, capsys):
    w = MetricsWriter(tmp_path, total_steps=4, log_every=1)
    rec = {"stage": 2, "loss": 1.5, "kl": 1.5, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 100.0,
           "mem_peak_mib": 10.0}
    for step, loss in [(1, 3.0), (2, 2.0), (2, 1.0), (3, 0.5)]:
        w.write({**rec, "step": step, "loss": loss})
    w.close()
    got = read_metrics(tmp_path)
    assert list(got) == [1, 2, 3] and got[2]["loss"] == 1.0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    out = messages(capsys.readouterr().err, "INFO")  # progress lines are log lines
    assert out[0].startswith("[stage2] step 1/4 (25%) | loss 3.0000") and "ETA" in out[-1]


# ------------------------------------------------------------------------------------ stage 2 pieces
class _Hidden(torch.nn.Module):
    """A stand-in student for `KDStudent`: its final hidden states are a parameter, its LM head a Linear."""

    def __init__(self, h_TD: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.h = torch.nn.Parameter(h_TD.clone())
        self.lm_head = torch.nn.Linear(h_TD.shape[1], vocab, bias=False, dtype=h_TD.dtype)

    def model(self, input_ids, position_ids, cu_seqlens, shard=None):
        from types import SimpleNamespace

        return SimpleNamespace(last_hidden_state=self.h[None])


def _kd_case(*overrides: str, seed: int = 0, scale: float = 1.0):
    """KDStudent (kd settings from the config system) on one fixed packed row, fp64, with a teacher as
    hidden states + LM head; returns the student, (kl, ce) and what the formulas need."""
    from hylo.pipeline.train.stage2 import KDStudent

    cfg = load_stage_config(2, None, ["deepspeed.zero_stage=0", *overrides])
    g = torch.Generator().manual_seed(seed)
    T, D, D_t, V = 37, 16, 24, 50
    student = _Hidden(torch.randn(T, D, generator=g, dtype=torch.float64) * scale, V)
    with torch.no_grad():
        student.lm_head.weight.copy_(torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5)
    h_t, w_t = torch.randn(T, D_t, generator=g, dtype=torch.float64) * scale, torch.randn(V, D_t, generator=g,
                                                                                          dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.3
    row = check_row({"input_ids": ids, "cu_seqlens": [0, T], "loss_mask": mask})
    kl, ce = KDStudent(student, cfg)(row.input_ids, row.bounds(), row.loss_mask,
                                     {"teacher_hidden": h_t, "teacher_weight": w_t})
    # the label of token t is token t + 1
    return student, cfg.kd, kl, ce, (h_t @ w_t.t(), {"loss_mask": mask, "labels": torch.roll(ids, -1)})


def test_kd_kl_precision_reaches_both_fused_terms(monkeypatch):
    from hylo.pipeline.train import stage2

    seen = []
    for name in ("fused_linear_kl_div", "fused_linear_cross_entropy"):
        original = getattr(stage2, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            seen.append((_name, kwargs["precision"]))
            return _original(*args, **kwargs)

        monkeypatch.setattr(stage2, name, spy)
    _kd_case("kd.kl_precision=fast", "kd.ce_weight=0.5")
    assert seen == [("fused_linear_kl_div", "fast"), ("fused_linear_cross_entropy", "fast")]


def test_stage2_loss_terms_are_the_formulas_kl_at_t_and_ce():
    # the KL and CE terms of KDStudent (one home: hylo.kernels.fused_kl) against the maths written out:
    # KL_T = sum over loss tokens of sum_v p_v (log p_v - log q_v), p = softmax(t / T), q = softmax(s / T),
    # no T^2; CE = sum over loss tokens of -log softmax(s)[label] (the former chunked_ce_sum's formula)
    student, kd, kl, ce, (t_logits, b) = _kd_case("kd.temperature=2.0", "kd.ce_weight=0.5")
    assert kd.temperature == 2.0 and kd.ce_weight == 0.5
    m = b["loss_mask"]
    s = student.h @ student.lm_head.weight.t()
    logq, logp = torch.log_softmax(s / 2.0, -1), torch.log_softmax(t_logits / 2.0, -1)
    want_kl = (logp.exp() * (logp - logq)).sum(-1)[m].sum()
    want_ce = F.cross_entropy(s[m], b["labels"][m], reduction="sum")
    assert float(kl.detach()) == pytest.approx(float(want_kl.detach()), rel=1e-10)
    assert float(ce.detach()) == pytest.approx(float(want_ce.detach()), rel=1e-10)
    params = [student.h, student.lm_head.weight]
    got = torch.autograd.grad(kd.kl_weight * kl + kd.ce_weight * ce, params)
    want = torch.autograd.grad(kd.kl_weight * want_kl + kd.ce_weight * want_ce, params)
    for g_got, g_want in zip(got, want):
        assert torch.allclose(g_got, g_want, rtol=1e-9, atol=1e-12)


def test_kd_temperature_is_not_multiplied_by_t_squared():
    # the decided convention (pipeline/train/config.KDSection.temperature): no T^2, so on soft logits the
    # gradient at T = 2 is about a quarter of T = 1's (with Hinton's T^2 it would be about the same)
    norms = {}
    for temp in (1.0, 2.0):
        student, _, kl, _, _ = _kd_case(f"kd.temperature={temp}", scale=0.1)
        grads = torch.autograd.grad(kl, [student.h, student.lm_head.weight])
        norms[temp] = float(torch.cat([g.flatten() for g in grads]).norm())
    assert norms[2.0] / norms[1.0] == pytest.approx(0.25, rel=0.02)


def test_streamed_logits_serve_any_increasing_windows():
    from hylo.pipeline.teacher.protocol import StreamedLogits

    full = torch.arange(50 * 3, dtype=torch.float32).reshape(50, 3)
    fn = StreamedLogits(iter(full.split(7)), torch.device("cpu"))
    for i, j in [(0, 16), (16, 20), (32, 48), (48, 50)]:
        assert torch.equal(fn(i, j), full[i:j])


# ------------------------------------------------------------------------------------ stage 1 pieces
def test_base_layer_targets_capture_inputs_outputs_and_attention():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hylo.pipeline.train.stage1 import BaseLayerTargets

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    b = row_to_device(open_rows(_data(seq_len=40), 0, 0, 1).next_row(), torch.device("cpu"))
    x, y, a = BaseLayerTargets(base)(b)
    assert len(x) == len(y) == len(a) == 3
    for i, layer in enumerate(base.model.layers):
        if i + 1 < 3:
            assert torch.equal(x[i + 1], y[i])
        # y = x + a + mlp(norm(x + a)): the captured attention output is the layer's mixer output.
        h = x[i] + a[i]
        assert torch.allclose(y[i], h + layer.mlp(layer.post_attention_layernorm(h)), atol=1e-5)
    # Documents are isolated: each document's layer-2 input equals that of the document run alone.
    assert len(b.host) > 2
    for s, e in b.documents():
        alone = base.model(input_ids=b.input_ids[None, s:e], use_cache=False, output_hidden_states=True)
        assert torch.allclose(x[2][:, s:e], alone.hidden_states[2], atol=1e-5)


@pytest.mark.parametrize("squared", [False, True], ids=["l2", "l2-squared"])
def test_ild_distance_and_padding_mask(squared):
    from hylo.pipeline.train.stage1 import token_distance

    x = torch.zeros(1, 3, 4)
    y = torch.tensor([[[3.0, 4.0, 0, 0], [0, 0, 0, 0], [1.0, 0, 0, 0]]])
    d = token_distance(x, y, squared)
    want = torch.tensor([25.0, 0.0, 1.0]) if squared else torch.tensor([5.0, 0.0, 1.0])
    assert torch.allclose(d, want, atol=1e-3)
    row = check_row({"input_ids": np.zeros(6, np.int64), "cu_seqlens": np.array([0, 2, 4, 6]),
                     "doc_ids": ["a", "b", ""]})
    assert row.real_tokens().tolist() == [1, 1, 1, 1, 0, 0]


# ------------------------------------------------------------------------------------ shipped configs
def _base(name):
    from transformers import LlamaConfig, Qwen3Config

    if name == "llama1b":
        return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0)
    if name == "llama3b":
        return LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                           num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0)
    return Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936)


@pytest.mark.parametrize("path,base,n_mla,ratio", [
    ("configs/llama-3.2-1b-8mla8gdn-64k.yaml", "llama1b", 8, 0.078),
    ("configs/llama-3.2-3b-14mla14gdn-64k.yaml", "llama3b", 14, 0.047),
    # Qwen: the card's 3.9 % (latent + roped key) plus 8 key 1/RMS values per MLA layer for its kept q/k norms
    ("configs/qwen3-1.7b-7mla21gdn-64k.yaml", "qwen1.7b", 7, 7 * (256 + 64 + 8) / (28 * 2 * 8 * 128)),
], ids=["llama1b-8mla8gdn", "llama3b-14mla14gdn", "qwen1.7b-7mla21gdn"])
def test_published_recipes_as_configured(path, base, n_mla, ratio):
    from pathlib import Path

    from hylo.upcycle import hybrid_config_from_base, kv_summary

    p = Path(__file__).resolve().parents[2] / path
    s1, s2 = load_stage_config(1, p), load_stage_config(2, p)
    hcfg = hybrid_config_from_base(_base(base), s1.model.convert)
    assert len(hcfg.mla_layers) == n_mla and hcfg.gdn_head_dim == 256 and hcfg.gdn_expand_v == 2.0
    assert kv_summary(_base(base), hcfg)["kv_cache_ratio"] == pytest.approx(ratio, abs=1e-3)
    assert (s1.data.seq_len, s1.optim.lr, s1.data.split) == (2048, 2e-4, "stage1")
    # stage 1 trains every parameter of every decoder layer, as published (and better on the demo model)
    assert s1.ild.trainable == "all"
    assert (s2.data.seq_len, s2.optim.lr, s2.train.global_batch_sequences) == (65536, 4e-5, 8)
    assert (s2.kd.kl_weight, s2.kd.ce_weight, s2.optim.warmup_ratio, s2.train.epochs) == (1.0, 0.0, 0.01, 1.0)
    # stage 2: 4 training workers beside 4 teacher replicas (the Serve pool) on one 8-GPU node
    assert s2.ray.use_gpu and s2.ray.num_workers == 4 and s2.grad_accum == 2
    assert s2.model.student == f"{s1.ray.storage_path}/{s1.ray.name}/model"
    assert build_deepspeed_config(s2, 8, torch.bfloat16)["bf16"]["enabled"]


def test_demo_config_loads_for_both_stages():
    from pathlib import Path

    p = Path(__file__).resolve().parents[2] / "configs" / "demo-smollm2.yaml"
    s1, s2 = load_stage_config(1, p), load_stage_config(2, p)
    assert s1.model.convert and s1.model.student is None and s2.model.student == "runs/demo/stage1/model"
    assert s1.ray.num_workers == s2.ray.num_workers == 2 and s2.teacher.source == "inprocess"


@pytest.mark.slow
def test_teacher_sources_give_the_same_targets(tmp_path):
    """In-process top-k, the offline cache and the Serve pool (a fake handle) agree row by row."""
    from types import SimpleNamespace

    from hylo.pipeline.data.rows import check_row
    from hylo.pipeline.teacher.cache import compute_shard, finalize_cache, prepare_cache
    from hylo.pipeline.teacher.client import TeacherClient
    from hylo.pipeline.teacher.config import CacheTeacherSection, TeacherCacheConfig, TeacherModelConfig
    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec
    from hylo.pipeline.teacher.sources import open_teacher
    from hylo.pipeline.train.config import TeacherSection

    from tests.helpers.teacher import save_tiny_llama

    model_dir = save_tiny_llama(tmp_path / "teacher", vocab_size=50)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    _write_split(data_dir)
    tm, cpu = TeacherModel(model_dir), torch.device("cpu")
    stream = open_rows(DataSection(source="parquet", path=str(data_dir), split="stage2", seq_len=32), 0, 0, 1)
    batch = [check_row(stream.next_row()) for _ in range(3)]
    model_cfg = TeacherModelConfig(path=str(model_dir))
    cache_cfg = TeacherCacheConfig(data=str(data_dir), out=str(tmp_path / "cache"), rows_per_shard=2,
                                   teacher=CacheTeacherSection(k=8, model=model_cfg))
    header, plan, todo = prepare_cache(cache_cfg)
    for p in todo:
        compute_shard(tm, cache_cfg.data, cache_cfg.out, header, p)
    assert finalize_cache(cache_cfg.out, plan)

    class Done:
        def __init__(self, rec):
            self.rec = rec

        def result(self, timeout_s=None):
            return [{"logprobs": self.rec.logprobs, "indices": self.rec.indices, "tail_logmass": self.rec.tail_logmass}]

    pool = SimpleNamespace(topk=SimpleNamespace(remote=lambda row, k, dtype: Done(tm.topk(row, k, dtype))))
    teachers = {
        "inprocess": open_teacher(TeacherSection(k=8, model=model_cfg), 50),
        "offline": open_teacher(TeacherSection(source="offline", k=8, cache_path=cache_cfg.out), 50, str(data_dir)),
        "serve": BoundTeacher(TeacherClient(pool, dtype="float16"), TargetSpec(8, "topk")),
    }
    got = {name: list(t.targets(batch, cpu)) for name, t in teachers.items()}
    for i in range(len(batch)):
        ref = got["inprocess"][i]["teacher_topk"]
        assert ref.logprobs.shape == (batch[i].num_tokens, 8)
        # Three different computations (batched cache, pool, in-process): compare each with the
        # teacher's own log-probabilities within tolerances, never bit for bit.
        ref_TV = torch.log_softmax(tm.logits(batch[i]).float(), dim=-1)
        for name in ("inprocess", "offline", "serve"):
            assert_topk_matches(ref_TV, got[name][i]["teacher_topk"], 8, "float16")
    exact = next(open_teacher(TeacherSection(model=model_cfg), 50).targets(batch, cpu))
    assert set(exact) == {"teacher_hidden", "teacher_weight"} and exact["teacher_hidden"].shape == (32, 32)
    with pytest.raises(ConfigError, match="teacher vocabulary 50 != student vocabulary 64"):
        open_teacher(TeacherSection(model=model_cfg), 64)


def test_stale_build_lock_is_removed_fresh_one_kept(tmp_path, monkeypatch):
    import os
    import threading
    import time

    from hylo.pipeline.train.loop import watch_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - 600
    os.utime(stale, (old, old))
    stop = threading.Event()
    t = threading.Thread(target=watch_stale_build_locks, args=(stop, 300.0, 0.01))
    t.start()
    time.sleep(0.2)
    stop.set()
    t.join()
    assert not stale.exists() and fresh.exists()


# ------------------------------------------------------------------------------------ what stage 1 trains
def _expected_trainable(name: str, trainable: str) -> bool:
    """ild.trainable as documented: all = every parameter of every decoder layer (mixer, MLP, both norms)."""
    if not name.startswith("model.layers."):
        return False  # embeddings, final norm, LM head: never
    return {"mixers": ".mixer." in name, "mixers+mlp": ".mixer." in name or ".mlp." in name,
            "all": True}[trainable]


@pytest.fixture(scope="module")
def tiny_pair():
    """A random 2-layer Llama and its HyLo conversion (MLA on layer 0, GDN on layer 1), in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hylo.upcycle import upcycle

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    student = upcycle(base, mla_layers="even", kv_lora_rank=16, gdn_head_dim=8, gdn_num_heads=4)
    return base, student.state_dict(), student


@pytest.mark.parametrize("trainable", ["mixers", "mixers+mlp", "all"])
def test_ild_trainable_decides_which_parameters_get_gradients_and_change(tiny_pair, trainable):
    from hylo.pipeline.train.stage1 import BaseLayerTargets, ILDStudent, trainable_parameters

    torch.manual_seed(0)
    cfg = load_stage_config(1, None, [f"ild.trainable={trainable}", "model.activation_checkpointing=false"])
    base, state, student = tiny_pair
    student.load_state_dict(state)  # the module-scoped student, as converted (another case may have trained it)
    student.zero_grad(set_to_none=True)
    names = {id(p): n for n, p in student.named_parameters()}
    params = trainable_parameters(student, cfg.ild.trainable)
    want = {n for n, _ in student.named_parameters() if _expected_trainable(n, trainable)}
    assert {names[id(p)] for p in params} == want
    assert any(".input_layernorm." in n for n in want) == (trainable == "all")
    assert any(".mlp." in n for n in want) == (trainable != "mixers")
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    row = open_rows(_data(seq_len=48, rows=4), 0, 0, 1).next_row()
    b = row_to_device(row, torch.device("cpu"))
    x, y, a = BaseLayerTargets(base)(b)
    d_out, d_mix = ILDStudent(student, cfg)(b.position_ids[None], b.cu_seqlens, x, y, a, row.real_tokens())
    (d_out + d_mix).backward()
    got_grad = {n for n, p in student.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got_grad == want
    torch.optim.SGD(params, lr=1e-2).step()
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert changed == want


def test_a_run_checkpointed_with_data_seq_len_resumes_without_it(tmp_path):
    # data.seq_len was required before the manifest became the rows' length: an old checkpoint holds it
    keys = ["ray.num_workers=2", "data.split=stage2"]
    _fake_checkpoint(tmp_path, load_stage_config(2, None, [*keys, "data.seq_len=512"]))
    check_compatible(tmp_path, load_stage_config(2, None, keys), 2, "fp1")
    # the data itself is what must not change
    with pytest.raises(ConfigError, match="the training data changed"):
        check_compatible(tmp_path, load_stage_config(2, None, keys), 2, "fp2")


def test_ild_trainable_and_its_old_key_train_mlp_an_unknown_key():
    assert load_stage_config(1, None).ild.trainable == "all"  # Enhanced-ILD as published
    with pytest.raises(ConfigError, match=r"command line: unknown key\(s\) ild.train_mlp in ILDSection; did you mean "
                                          r"'ild.trainable'\?"):
        load_stage_config(1, None, ["ild.train_mlp=true"])
    with pytest.raises(ConfigError, match="ild.trainable.*must be one of mixers, mixers\\+mlp, all"):
        load_stage_config(1, None, ["ild.trainable=everything"])
