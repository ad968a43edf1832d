"""Hostile but realistic input: YAML that expands or nests without end, and numbers no run can use. Each is one
`error:` line and exit status 2 before Ray starts (before: gigabytes of memory, a RecursionError traceback, a step
that never ends, or a failure inside the workers after retries)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hylo.pipeline.config import ConfigError, parse_yaml, read_config_file

from tests.helpers.cli import run_hylo
from tests.helpers.logs import messages
from tests.helpers.models import LLAMA_1B, tiny_student, tiny_teacher

# numpy's legacy np.random.seed (the training loop, lm-eval) takes 32 bits
SEED_MAX = 2**32 - 1

REPO = Path(__file__).resolve().parents[2]


def one_error_line(rc: int, text: str) -> str:
    assert rc == 2, text[-2000:]
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text[-2000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------- YAML
def alias_bomb() -> str:
    """Nine levels of nine aliases each: 9^9 (387 million) strings from a few hundred bytes."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_is_built():
    """In-process on the parser alone (no key -> line map: the old parser built it without expanding, so this
    is safe to run on a regression, and fails there by returning the mapping)."""
    with pytest.raises(ConfigError) as e:
        parse_yaml(alias_bomb(), "bomb.yaml")
    assert str(e.value) == ("bomb.yaml line 5: the aliases expand to more than 10,000 nodes (at alias *d); write the "
                            "values out or use fewer aliases")


@pytest.mark.slow
def test_an_alias_bomb_given_to_a_job_is_one_line_and_small(tmp_path):
    """`hylo stage1 --config bomb.yaml` in a child limited to 3 GiB of address space (before: the key -> line
    map expanded every alias and grew past 3 GB in 40 s; in the child that ends as a MemoryError traceback,
    exit status 1). Not in-process: a regression must not take the test runner's memory with it."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 500
    child = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        resource.setrlimit(resource.RLIMIT_CPU, (300, 300))
        from hylo.pipeline.cli import hylo_main
        sys.exit(hylo_main(["stage1", "--config", sys.argv[1], "--print-config"]))
    """)
    proc = subprocess.run([sys.executable, "-c", child, str(bomb)], capture_output=True, text=True, timeout=900)
    line = one_error_line(proc.returncode, proc.stdout + proc.stderr)
    assert line == (f"error: {bomb} line 5: the aliases expand to more than 10,000 nodes (at alias *d); write the "
                    "values out or use fewer aliases"), line


@pytest.mark.parametrize("text,needle", [
    ("train: &a {x: [*a]}\n", "line 1: alias *a refers to a node that contains it (a recursive alias)"),
    ("train: &a [1, *a]\n", "line 1: alias *a refers to a node that contains it (a recursive alias)"),
    ("ray: {}\ntrain:\n  seed: " + "[" * 5000 + "]" * 5000 + "\n", "line 3: nested more than 64 levels deep"),
    ("- " * 5000 + "x\n", "line 1: nested more than 64 levels deep"),
], ids=["recursive-mapping", "recursive-list", "5000-deep-flow-list", "5000-deep-block-list"])
def test_a_recursive_alias_or_a_deep_document_is_one_line(tmp_path, text, needle):
    """Before: a RecursionError traceback (the composer or the key -> line map recursed without end)."""
    p = tmp_path / "c.yaml"
    p.write_text(text)
    line = one_error_line(*run_hylo(["stage1", "--config", str(p), "--print-config"]))
    assert f"{p} {needle}" in line, line


def test_deep_values_of_a_flag_or_an_override_are_one_line_too():
    line = one_error_line(*run_hylo(["stage1", "--set", "train.seed=" + "[" * 5000 + "]" * 5000, "--print-config"]))
    assert "nested more than 64 levels deep" in line and "override" in line, line


def test_aliases_within_the_bound_still_work(tmp_path):
    """Anchors, aliases and merge keys as configs use them keep working; the key -> line map sees through them."""
    p = tmp_path / "c.yaml"
    p.write_text("base: &opt {lr: 1.0e-4, warmup_ratio: 0.1}\nlist: &l [" + ", ".join(["1"] * 100) + "]\n"
                 "again: [*l, *l, *l, *l, *l]\nmine:\n  <<: *opt\n  lr: 2.0e-4\n")
    tree, lines = read_config_file(p)
    assert tree["mine"] == {"lr": 2e-4, "warmup_ratio": 0.1} and len(tree["again"]) == 5
    assert lines["mine.lr"] == 6 and lines["again"] == 3 and "again[4][99]" in lines


# --------------------------------------------------------------------------------------------- numbers
def print_config(*sets: str) -> tuple[int, str]:
    return run_hylo(["stage2", "--config", "demo-smollm2.yaml", *[a for s in sets for a in ("--set", s)],
                     "--print-config"])


def test_a_global_batch_of_2_to_the_70_is_refused_with_the_arithmetic():
    """Before: accepted; the first step accumulated 2^70 / workers micro-batches and never ended."""
    line = one_error_line(*print_config("train.global_batch_sequences=1180591620717411303424"))
    assert line == ("error: command line: train.global_batch_sequences=1180591620717411303424: must be in "
                    "[1, 1048576] (1,048,576 = 4,096 packed rows per worker per optimiser step x 256 workers)"), line
    line = one_error_line(*print_config("train.global_batch_sequences=100000"))
    assert ("train.global_batch_sequences=100000: at most 8,192 = 4,096 micro-batches per worker x ray.num_workers "
            "(2); 100,000 / 2 = 50,000 packed rows per worker per optimiser step") in line, line
    rc, out = print_config("train.global_batch_sequences=8192")
    assert rc == 0 and yaml.safe_load(out)["train"]["global_batch_sequences"] == 8192


def test_a_seed_is_what_numpy_and_torch_both_take():
    """Before: train.seed=2^64 passed the config check and np.random.seed failed in every worker, retried."""
    import numpy as np
    import torch

    line = one_error_line(*print_config("train.seed=18446744073709551616"))
    assert line == "error: command line: train.seed=18446744073709551616: must be in [0, 4294967295]", line
    line = one_error_line(*print_config(f"train.seed={SEED_MAX + 1}"))
    assert "must be in [0, 4294967295]" in line
    rc, out = print_config(f"train.seed={SEED_MAX}")
    assert rc == 0 and yaml.safe_load(out)["train"]["seed"] == SEED_MAX
    # what the code seeds with the largest seed: the training loop, lm-eval, the converter's per-layer seeds
    np.random.seed(SEED_MAX)
    torch.manual_seed(SEED_MAX)
    torch.manual_seed(SEED_MAX * 100_003 + 1000)
    torch.Generator().manual_seed(SEED_MAX * 1_000_003 + (1 << 20))
    with pytest.raises(ValueError):
        np.random.seed(SEED_MAX + 1)
    for key in ("mixture.seed", "seed"):
        job = "prepare-data" if key == "mixture.seed" else "eval"
        rc, text = run_hylo([job, "--set", f"{key}={SEED_MAX + 1}", "--print-config"])
        assert "must be in [0, 4294967295]" in one_error_line(rc, text), (job, text)


def test_every_integer_setting_fits_64_bits():
    line = one_error_line(*print_config("checkpoint.every_steps=1180591620717411303424"))
    assert "checkpoint.every_steps=1180591620717411303424: must fit in a signed 64-bit integer" in line, line


def test_teacher_k_beyond_any_vocabulary_is_refused_at_load():
    """Before: teacher.k=10^9 passed the config check and failed in the workers after retries (exit 1)."""
    line = one_error_line(*print_config("teacher.k=1000000000"))
    assert line == ("error: command line: teacher.k=1000000000: must be in [0, 1048576] (no vocabulary is larger)"), line
    rc, text = run_hylo(["teacher-cache", "--set", "teacher.k=1000000000", "--print-config"])
    assert "teacher.k=1000000000: must be in [0, 1048576]" in one_error_line(rc, text)


def test_teacher_k_beyond_the_teachers_vocabulary_is_refused_before_ray(tmp_path):
    """Within the cap but over the teacher's own vocabulary: the stage's input check (before Ray) names the
    teacher's config.json."""
    from transformers import LlamaConfig

    from hylo.pipeline.teacher.sources import source_kind
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.inputs import _k_fits_the_vocabulary

    teacher = tmp_path / "teacher"
    LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(teacher)
    student = tmp_path / "student"
    student.mkdir()
    (student / "config.json").write_text(json.dumps({"vocab_size": 96}))

    def cfg(k: int):
        return load_stage_config(2, None, [f"model.student={student}", f"teacher.model.path={teacher}",
                                           f"teacher.k={k}", "data.source=synthetic", "data.seq_len=64"])

    with pytest.raises(ConfigError, match=rf"^teacher.k=97: more than the vocabulary of 96 tokens \({teacher}/config.json\)"):
        _k_fits_the_vocabulary(cfg(97), source_kind("inprocess"))
    _k_fits_the_vocabulary(cfg(96), source_kind("inprocess"))


# --------------------------------------------------------------------------------------------- convert
@pytest.fixture
def base_config(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_1B))
    return path


@pytest.mark.parametrize("args,want", [
    (["--seed", "100000000000000000000000"],
     "error: argument --seed: must be in [0, 4294967295], got 100000000000000000000000 (see hylo convert --help)"),
    (["--yarn-factor", "1e308"],
     "error: argument --yarn-factor: must be a finite number in [1, 1024], got 1e308 (see hylo convert --help)"),
    (["--mla-layers", "0,0"],
     "error: mla_layers (--mla-layers) = 0,0: layer 0 is listed more than once; list each MLA layer once"),
    (["--mla-layers", "3,5,3"],
     "error: mla_layers (--mla-layers) = 3,5,3: layer 3 is listed more than once; list each MLA layer once"),
    (["--mla-layers", "0,16"],
     "error: mla_layers (--mla-layers) = 0,16: mla layer index 16 is out of range; allowed: 0..15"),
], ids=["seed-1e23", "yarn-1e308", "mla-0-0", "mla-3-5-3", "mla-out-of-range"])
def test_convert_flags_out_of_range_name_the_flag_given(base_config, args, want):
    """Before: --seed 10^23 and --mla-layers 0,0 were accepted; --yarn-factor 1e308 named
    --yarn-original-max-position-embeddings, a flag the user never gave. A numeric flag's bound is checked as
    it is parsed (pipeline/cli.py bounded_int / bounded_float)."""
    line = one_error_line(*run_hylo(["convert", "--dry-run", "--base-config", str(base_config), *args]))
    assert line == want, line


def test_a_yarn_factor_that_leaves_no_original_window_names_the_factor(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_1B, "max_position_embeddings": 512}))
    line = one_error_line(*run_hylo(["convert", "--dry-run", "--base-config", str(path), "--yarn-factor", "1024"]))
    assert "yarn factor (--yarn-factor) = 1024.0 leaves an original window of 512 / 1024 < 1 position" in line, line
    assert "--yarn-original-max-position-embeddings" in line.split(" or ")[-1]


def test_a_placement_list_in_a_config_is_checked_the_same_way(tmp_path):
    from hylo.upcycle import UpcycleError, parse_placement

    with pytest.raises(UpcycleError, match=r"mla_layers \(--mla-layers\) = 2,2: layer 2 is listed more than once"):
        parse_placement([2, 2], 4)
    assert parse_placement([3, 1], 4) == [1, 3]


# --------------------------------------------------------------------------------------------- estimate
def test_estimate_refuses_tokens_it_cannot_finish(monkeypatch):
    """Before: `hylo estimate --tokens 10^12` ran the step on a 10^12-token row and never printed anything. The
    step is replaced here by one that fails the test if it is reached: in the module that calls it, imported first
    (patching only `step.estimate_step` while `cli` is first imported would bind the stand-in into `cli` for
    good, and a later test of the process would run it)."""
    from hylo.pipeline.estimate import cli

    def never(*args, **kwargs):
        raise AssertionError("the estimate ran")

    monkeypatch.setattr(cli, "estimate_step", never)
    line = one_error_line(*run_hylo(["estimate", "--config", "demo-smollm2", "--tokens", "1000000000000"]))
    assert line.startswith("error: --tokens=1000000000000: 1,000,000,000,000 tokens is more than the estimate can "
                           "run, at most 1,048,576 (2^20) a row: the step runs on fake tensors at about 3-4 ms of CPU "
                           "per token"), line
    line = one_error_line(*run_hylo(["estimate", "--config", "demo-smollm2", "--tokens", "1048576,1048576,8192"]))
    assert "2,105,344 tokens in all is more than the estimate can run in one call, at most 2,097,152" in line, line
    line = one_error_line(*run_hylo(["estimate", "--config", "demo-smollm2", "--world-size", str(1 << 70)]))
    assert "argument --world-size: must be in [1, 65536]" in line, line


def test_a_long_estimate_shows_its_progress(tmp_path, capsys):
    """Each phase of the measured step is announced on stderr, and the layer it is in (here at every layer)."""
    import torch

    from hylo.pipeline.estimate import Progress, estimate_step
    from hylo.pipeline.train.config import load_stage_config

    tiny_student().save_pretrained(tmp_path / "student")
    tiny_teacher().save_pretrained(tmp_path / "teacher")
    cfg = load_stage_config(2, None, [f"model.student={tmp_path / 'student'}", "train.global_batch_sequences=2",
                                      "data.source=synthetic", "data.seq_len=64", "teacher.k=0",
                                      f"teacher.model.path={tmp_path / 'teacher'}", "teacher.model.dtype=float32"])
    capsys.readouterr()
    estimate_step(cfg, 64, 1, torch.float32, gpu=False, progress=Progress("[estimate] 64 tokens (1/1)", every_s=0.0))
    err = messages(capsys.readouterr().err, "INFO")  # the progress lines are log lines
    for text in ("building the models", "warm-up step (64 tokens)", "measured step, teacher forward",
                 "measured step, student forward", "measured step, fused loss", "measured step, optimizer"):
        assert f"[estimate] 64 tokens (1/1): {text}" in err, err
    assert "[estimate] 64 tokens (1/1): measured step, student forward: student layer 4/4 (pass 1)" in err, err
    assert "[estimate] 64 tokens (1/1): measured step, teacher forward: teacher layer 3/3 (pass 1)" in err, err
    assert any(line.startswith("[estimate] 64 tokens (1/1): done in ") for line in err), err
    # the Serve pool's replica, priced after the step (minutes of a 64K run): its phase, its layers, its time
    from hylo.pipeline.estimate import estimate_teacher_replica

    serve = load_stage_config(2, None, [f"model.student={tmp_path / 'student'}", "train.global_batch_sequences=2",
                                        "data.source=synthetic", "data.seq_len=64", "teacher.source=serve",
                                        "teacher.k=8", f"teacher.model.path={tmp_path / 'teacher'}",
                                        "teacher.pool.max_batch_tokens=128"])
    estimate_teacher_replica(serve, 64, progress=Progress("[estimate] teacher replica, 64 tokens (1/1)", every_s=0.0,
                                                          what=""))
    err = messages(capsys.readouterr().err, "INFO")
    assert err[0] == "[estimate] teacher replica, 64 tokens (1/1): building the teacher; then its forward over 2 row(s) " \
                     "of 64 tokens", err
    assert "[estimate] teacher replica, 64 tokens (1/1): teacher forward" in err, err
    assert "[estimate] teacher replica, 64 tokens (1/1): teacher forward: teacher layer 3/3 (pass 1)" in err, err
    assert err[-1].startswith("[estimate] teacher replica, 64 tokens (1/1): done in "), err


def test_load_config_of_every_shipped_config_is_unchanged_by_the_bounds():
    """The bounds refuse nothing a shipped config holds (their --print-config output is the same as before)."""
    from hylo.pipeline.config import shipped_configs

    for name, path in shipped_configs().items():
        tree, _ = read_config_file(path)
        assert yaml.safe_load(path.read_text()) == tree, name


def test_an_lr_beyond_float32_is_refused_before_any_step():
    """optim.lr=1e39 crashed inside torch's Adam with a traceback (exit 1): it cannot be a float32. The config
    check names the setting instead; 1e30 (finite in float32) stays a valid, if absurd, setting that the
    non-finite guard stops at its first NaN step (tests/train/test_train_nonfinite.py)."""
    from hylo.pipeline.config import ConfigError, build_config
    from hylo.pipeline.train.config import OptimSection

    with pytest.raises(ConfigError, match=r"lr.*float32"):
        build_config(OptimSection, {"lr": 1e39}, "t.yaml")
    assert build_config(OptimSection, {"lr": 1e30}, "t.yaml").lr == 1e30
