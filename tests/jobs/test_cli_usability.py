"""What a user of the command line meets: shipped configs (`hylo configs`, `--config NAME`), "did you mean", no
abbreviated flags, Ctrl-C as one line and exit status 130, and every path of a config relative to the current
directory, made absolute once by every job (pipeline/paths.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hylo import logs
from hylo.pipeline.cli import COMMANDS, NOT_JOBS, job_main
from hylo.pipeline.config import ConfigError, field_rules, load_config, shipped_configs
from hylo.pipeline.paths import resolve_path, resolve_paths

from tests.helpers.cli import job_config_roots, run_hylo, run_hylo_split, walk_fields
from tests.helpers.logs import level_kept

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ shipped configs
def test_every_file_of_configs_is_shipped_and_found_by_import():
    on_disk = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    assert list(shipped_configs()) == on_disk and len(on_disk) >= 10


def test_hylo_configs_lists_shows_and_copies_without_overwriting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, text = run_hylo(["configs"])
    assert rc == 0
    for name in shipped_configs():
        assert re.search(rf"^{re.escape(name)}\s+\S", text, re.M), f"{name} not listed"
    rc, out, _ = run_hylo_split(["configs", "show", "demo-smollm2"])
    assert rc == 0 and out == (REPO / "configs" / "demo-smollm2.yaml").read_text()
    rc, _ = run_hylo(["configs", "cp", "demo-smollm2.yaml"])
    assert rc == 0 and (tmp_path / "demo-smollm2.yaml").read_text() == out
    (tmp_path / "demo-smollm2.yaml").write_text("# mine\n")
    rc, text = run_hylo(["configs", "cp", "demo-smollm2.yaml", "."])
    assert rc == 2 and "exists and this project did not write it" in text and "pass --force to replace it" in text
    assert (tmp_path / "demo-smollm2.yaml").read_text() == "# mine\n"
    rc, _ = run_hylo(["configs", "cp", "demo-smollm2.yaml", "mine.yaml"])
    assert rc == 0 and (tmp_path / "mine.yaml").read_text() == out
    rc, text = run_hylo(["configs", "cp", "demo-smollm", "x.yaml"])
    assert rc == 2 and "did you mean 'demo-smollm2.yaml'" in text and not (tmp_path / "x.yaml").exists()


def test_hylo_configs_shows_each_description_whole_and_wrapped(monkeypatch):
    """Before, the listing showed the first comment line only: the Qwen3 recipe's ended mid-sentence
    ("... MLA on layers 2, 6, ..., 26 (the centre"). Each description now ends a sentence, wrapped to the
    terminal's width under its name."""
    monkeypatch.setenv("COLUMNS", "100")
    rc, text = run_hylo(["configs"])
    assert rc == 0
    assert max(map(len, text.splitlines())) <= 100
    width = max(map(len, shipped_configs())) + 2
    entries = re.split(r"\n(?=\S)", text.strip())
    assert [e.split()[0] for e in entries] == list(shipped_configs())
    for entry in entries:
        description = " ".join(line[width:].strip() for line in entry.splitlines())
        assert description.endswith((".", ".)")), entry
    qwen = next(e for e in entries if e.startswith("qwen3-1.7b"))
    assert "(the centre of each 4-layer bin;" in " ".join(qwen.split()) and "Teacher: Qwen3-8B" in qwen


def test_config_by_name_from_another_directory_a_local_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_hylo_split(["stage2", "--config", "demo-smollm2.yaml", "--print-config"])
    assert rc == 0, err
    assert yaml.safe_load(out)["optim"]["lr"] == 1e-4  # the demo config's stage-2 section
    # the checkout's path does not exist here: the error names the shipped config of that name
    rc, text = run_hylo(["stage2", "--config", "configs/demo-smollm2.yaml", "--print-config"])
    assert rc == 2 and "the shipped config of that name is --config demo-smollm2.yaml" in text
    rc, text = run_hylo(["stage2", "--config", "demo-smolm2.yaml", "--print-config"])
    assert rc == 2 and "did you mean --config demo-smollm2.yaml?" in text
    (tmp_path / "demo-smollm2.yaml").write_text("optim: {lr: 0.5}\n")
    rc, out, err = run_hylo_split(["stage2", "--config", "demo-smollm2.yaml", "--print-config"])
    assert rc == 0 and yaml.safe_load(out)["optim"]["lr"] == 0.5, err


def test_hylo_alone_prints_its_usage_and_exits_2(monkeypatch, capsys):
    """`hylo` with no command exited 0 after printing the help, as if it had done something; now it is a usage
    error, as argparse's for a missing argument: the usage on stderr, exit status 2. `hylo --help` still prints it
    on stdout with status 0. The console script calls `hylo_main()`, which reads sys.argv."""
    from hylo.pipeline.cli import hylo_main

    monkeypatch.setattr(sys, "argv", ["hylo"])
    assert hylo_main() == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: hylo COMMAND") and "commands:" in err
    assert err.rstrip().endswith("hylo: error: a command is required"), err
    monkeypatch.setattr(sys, "argv", ["hylo", "--help"])
    assert hylo_main() == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: hylo COMMAND") and err == ""


# ------------------------------------------------------------------------------------ did you mean
@pytest.mark.parametrize("argv,hint", [
    (["stage1", "--set", "optim.learning_rate=1e-4", "--print-config"], "did you mean 'optim.lr'?"),
    (["eval", "--set", "kl.dta=x", "--print-config"], "did you mean 'kl.data'?"),
    (["convert", "--mla-layer", "even", "--print-config"], "did you mean --mla-layers?"),
    (["prepare-data", "--print-confg"], "did you mean --print-config?"),
    (["covert"], "did you mean 'convert'?"),
])
def test_an_unknown_key_option_or_command_names_the_closest(argv, hint):
    rc, text = run_hylo(argv)
    assert rc == 2 and hint in text, text
    assert text.strip().count("\n") == 0, text  # one line


def test_a_config_file_key_typo_names_the_closest_with_its_line(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("optim:\n  lr: 1.0e-4\n  weight_decy: 0.1\n")
    with pytest.raises(ConfigError, match=r"line 3: unknown key\(s\) optim.weight_decy .*did you mean 'optim.weight_decay'"):
        from hylo.pipeline.train.config import load_stage_config

        load_stage_config(1, f)


# ------------------------------------------------------------------------------------ no abbreviations
def _long_options(name: str) -> list[str]:
    rc, text = run_hylo([name, "--help"])
    assert rc == 0
    return sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]{4,})", text)) - {"--help"})


# ------------------------------------------------------------------------------------ --log-level
# A run of each command that parses its flags and does no work: a job's --print-config; the others' listing.
LEVEL_RUNS = {name: [name, "--print-config"] for name in COMMANDS if name not in NOT_JOBS}
LEVEL_RUNS |= {"configs": ["configs", "ls"], "clean": ["clean", "{tmp}"]}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_takes_log_level(name, tmp_path):
    """`hylo NAME --log-level LEVEL` (hylo/logs.py): listed in its help, set for the job and for the processes
    it starts (HYLO_LOG_LEVEL), and a level that is none is the flag's one error line."""
    assert set(LEVEL_RUNS) == set(COMMANDS)
    rc, help_text = run_hylo([name, "--help"])
    assert rc == 0 and "--log-level {debug,info,warning,error}" in help_text, help_text
    argv = [a.format(tmp=tmp_path) for a in LEVEL_RUNS[name]]
    with level_kept():
        rc, out, err = run_hylo_split([*argv[:1], "--log-level", "warning", *argv[1:]])
        assert rc == 0, err
        assert logs.current_level() == "warning" and os.environ[logs.ENV] == "warning"
        # after the sub-command's own arguments too (configs' sub-commands take it as well)
        rc, out, err = run_hylo_split([*argv, "--log-level", "error"])
        assert rc == 0 and logs.current_level() == "error", err
    rc, text = run_hylo([name, "--log-level", "loud"])
    assert rc == 2 and text == ("error: argument --log-level: 'loud' is not a log level; choose one of "
                                f"debug, info, warning, error (see hylo {name} --help)\n"), text


@pytest.mark.parametrize("name", [n for n in COMMANDS if n not in NOT_JOBS])
def test_no_job_takes_an_abbreviated_flag(name):
    options = _long_options(name)
    assert "--print-config" in options
    for opt in options:
        short = opt[:-1]
        if short in options or any(o != opt and o.startswith(short) for o in options):
            continue  # a prefix of two flags: ambiguous anyway
        rc, text = run_hylo([name, short, "x", "--print-config"])
        assert rc == 2 and "unrecognized arguments" in text and short in text, (name, short, text)
        break
    else:
        pytest.fail(f"hylo {name}: no flag to abbreviate")


def test_the_parsers_of_every_module_turn_abbreviations_off():
    """Every ArgumentParser of jobs/, pipeline/ and bench/ is built with allow_abbrev=False."""
    missing = []
    for folder in ("jobs", "pipeline", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            for m in re.finditer(r"ArgumentParser\(", text):
                depth, i = 1, m.end()
                while depth:
                    depth += {"(": 1, ")": -1}.get(text[i], 0)
                    i += 1
                if "allow_abbrev=False" not in text[m.end():i]:
                    missing.append(f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}")
    assert not missing, missing


# ------------------------------------------------------------------------------------ Ctrl-C
# The training stack: a command's --help and a job's --print-config import none of it.
HEAVY_MODULES = ("torch", "ray", "deepspeed", "transformers")


@pytest.mark.slow
def test_help_and_print_config_of_every_command_import_no_training_stack():
    """Before, `hylo stage2 --help` took 1.7 s (7 s on a busy machine) against 0.04 s for `hylo --help`: the job
    imported torch, Ray and DeepSpeed before it parsed its flags. One fresh interpreter (the test process has
    imported them already) runs every command's --help and every job's --print-config in turn."""
    code = f"""
import contextlib, io, json, sys
from hylo.pipeline.cli import COMMANDS, NOT_JOBS, hylo_main
runs = [[name, "--help"] for name in COMMANDS]
runs += [[name, "--print-config"] for name in COMMANDS if name not in NOT_JOBS]
found = {{}}
for argv in runs:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = hylo_main(argv)
        except SystemExit as e:
            rc = e.code
    assert rc in (0, None) and out.getvalue().strip(), (argv, rc, out.getvalue())
    found[" ".join(argv)] = [m for m in {HEAVY_MODULES!r} if m in sys.modules]
print(json.dumps(found))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == 2 * len(COMMANDS) - len(NOT_JOBS)
    # the first run that imported a heavy module is the one that did
    assert not any(found.values()), {argv: mods for argv, mods in found.items() if mods}


def test_ctrl_c_is_one_line_and_exit_status_130(capsys):
    @job_main
    def main(argv=None):
        raise KeyboardInterrupt

    assert main([]) == 130
    err = capsys.readouterr().err
    assert err == "interrupted (Ctrl-C)\n"


@pytest.mark.slow
def test_ctrl_c_during_a_real_conversion(tmp_path):
    """SIGINT to `python -m hylo.jobs.convert` while it converts: one line on stderr, exit status 130, and no
    output directory that looks complete, nor a temporary one. The signal is sent once the progress bar shows
    the first layers converting (not after a fixed sleep: on a fast machine the whole conversion ends within
    12 s)."""
    import threading

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "hylo.jobs.convert", "--base", "smollm2-135m-instruct", "--out",
                             str(out), "--mla-layers", "even"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    converting = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        while chunk := proc.stderr.read(1):
            seen.append(chunk)
            if chunk == "]" and "layer 1 (" in "".join(seen[-200:]):
                converting.set()
        converting.set()  # the stream ended: the process is gone, the asserts below say how

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    assert converting.wait(timeout=180), "no conversion progress within 180 s"
    assert proc.poll() is None, "".join(seen)[-2000:]
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=30)
    stderr = "".join(seen)
    assert proc.returncode == 130, stderr[-2000:]
    # the signal rule (hylo/stopping.py); a staging directory of the output, if one was made by then, is named
    removed = rf"; removed {re.escape(str(tmp_path))}/\.out\.tmp-\d+-\w+"
    assert re.fullmatch(rf"hylo convert: stopped by SIGINT \(Ctrl-C\)({removed})?", stderr.strip().splitlines()[-1]), \
        stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert not (out / "hybrid_config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


# ------------------------------------------------------------------------------------ other one-liners
def test_base_config_given_a_directory(tmp_path):
    rc, text = run_hylo(["convert", "--dry-run", "--base-config", str(tmp_path), "--mla-layers", "even"])
    assert rc == 2 and "is a directory without a config.json" in text
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
                                          '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
                                          '"vocab_size": 96, "max_position_embeddings": 256}')
    rc, text = run_hylo(["convert", "--dry-run", "--base-config", str(tmp_path), "--mla-layers", "even"])
    assert rc == 0 and '"mla_layers": [\n    0\n  ]' in text, text


def test_eval_names_missing_held_out_rows_before_loading_any_model(tmp_path):
    # the model does not exist: the error is about the data, found first, from the config alone
    rc, text = run_hylo(["eval", "--config", "eval_smoke.yaml", "--model", str(tmp_path / "nope"),
                         "--out", str(tmp_path / "o")])
    assert rc == 2 and "suite 'kl' needs --data DIR" in text, text


def test_fetch_assets_takes_a_config_and_print_config(tmp_path):
    f = tmp_path / "fa.yaml"
    f.write_text("names: [humaneval]\nverify: true\n")
    rc, out, err = run_hylo_split(["fetch-assets", "--config", str(f), "--cache-dir", "rel/cache", "--print-config"])
    assert rc == 0, err
    assert yaml.safe_load(out) == {"names": ["humaneval"], "cache_dir": "rel/cache", "verify": True, "quiet": False,
                                   "json": False}
    rc, text = run_hylo(["fetch-assets", "sharegtp", "--print-config"])
    assert rc == 2 and "unknown asset 'sharegtp'; did you mean 'sharegpt'?" in text, text


# ------------------------------------------------------------------------------------ paths
def test_resolve_path_rules(tmp_path):
    (tmp_path / "smollm2-135m-instruct").mkdir()
    assert resolve_path("runs/x", tmp_path) == str(tmp_path / "runs" / "x")
    assert resolve_path("./a/../b", tmp_path) == str(tmp_path / "b")
    assert resolve_path("/abs/p", tmp_path) == "/abs/p"
    assert resolve_path("~/p", tmp_path) == str(Path.home() / "p")
    for kept in ("s3://bucket/runs", "gs://b/x", "asset:sharegpt", "hub:openai/gsm8k", "", None):
        assert resolve_path(kept, tmp_path) == kept
    # a known asset name is the asset unless a path of that name exists (hylo/assets.py's one rule)
    assert resolve_path("sharegpt", tmp_path) == "sharegpt"
    assert resolve_path("smollm2-135m-instruct", tmp_path) == str(tmp_path / "smollm2-135m-instruct")


def _job_configs() -> dict[str, type]:

    from hylo.jobs.fetch_assets import FetchAssetsConfig

    return {**job_config_roots(), "fetch_assets": FetchAssetsConfig}


# Field names that hold a file or directory; every one carries the PATH rule.
_PATHISH = re.compile(r"^(path|dir|out|base|student|tokenizer|teacher|data|run_dir|base_config|from_released|"
                      r"to_released|.*_path|.*_dir|.*_data|data_from|teacher_cache)$")
NOT_PATHS = {
    "PlacementConfig.train_config": "a config: a file or a shipped config's name (pipeline/config.py config_file)",
    "MlflowSection.tracking_uri": "MLflow's own URI (`databricks`, `http://...`), resolved by MLflow",
}


def test_every_path_field_of_every_job_config_is_declared_a_path():

    missing = []
    for root in _job_configs().values():
        for _, cls, name, tp, _ in walk_fields(root):
            key = f"{cls.__name__}.{name}"
            rule = field_rules(cls).get(name)
            if (_PATHISH.match(name) and tp in (str,)) and not (rule is not None and rule.path) and key not in NOT_PATHS:
                missing.append(key)
    assert not missing, f"path fields without the PATH rule: {missing}"


def test_a_hub_source_path_is_left_alone(tmp_path):
    from hylo.pipeline.data.config import PrepareDataConfig

    cfg = load_config(PrepareDataConfig, None, [
        "mixture.sources=[{name: a, path: org/set, container: hub}, {name: b, path: data/b.jsonl}]"])
    out = resolve_paths(cfg, tmp_path)
    assert [s.path for s in out.mixture.sources] == ["org/set", str(tmp_path / "data" / "b.jsonl")]
    assert cfg.mixture.sources[1].path == "data/b.jsonl"  # a copy: the given config is unchanged


def _all_paths(obj, prefix="") -> dict[str, object]:
    """dotted key -> value of every PATH field under config object `obj`."""
    from hylo.pipeline.paths import path_fields

    out: dict[str, object] = {}
    if dataclasses.is_dataclass(obj):
        own = set(path_fields(obj))
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name in own:
                out[prefix + f.name] = v
            else:
                out.update(_all_paths(v, f"{prefix}{f.name}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_all_paths(v, f"{prefix[:-1]}[{i}]."))
    return out


# job -> (its argv with relative paths, where its work starts: (module, function) to stand in for)
JOB_RUNS = {
    "convert": (["--base", "rel/base", "--out", "rel/out"], ("hylo.pipeline.convert.job", "run")),
    "decontaminate": (["--input", "a=rel/in.jsonl", "--benchmark", "mine=rel/b.jsonl:q", "--out", "rel/dc"],
                      ("hylo.jobs.decontaminate", "run_decontamination")),
    "prepare-data": (["--set", "mixture.sources=[{name: a, path: rel/in.jsonl}]", "--set", "output.dir=rel/o",
                      "--set", "tokenize.tokenizer=rel/tok"], ("hylo.pipeline.data.prepare", "prepare")),
    "teacher-cache": (["--set", "data=rel/d", "--set", "out=rel/o", "--set", "teacher.model.path=rel/t"],
                      ("hylo.pipeline.teacher.cache", "prepare_cache")),
    "eval": (["--model", "rel/m", "--teacher", "rel/t", "--base", "rel/b", "--tokenizer", "rel/tok", "--data", "rel/d",
              "--out", "rel/o", "--set", "kl.teacher_cache=rel/c", "--set", "lm_eval.include_path=rel/i",
              "--set", "lm_eval.output_path=rel/lo"], ("hylo.jobs.eval", "check_model_files")),
    "place-layers": (["--n-mla", "2", "--base", "rel/b", "--data-from", "rel/demo", "--stage1-data", "rel/s1",
                      "--stage2-data", "rel/s2", "--heldout-data", "rel/h", "--run-dir", "rel/run"],
                     ("hylo.jobs.place_layers", "run_placement")),
    "demo": (["--run-dir", "rel/run"], ("hylo.jobs.demo", "run_demo")),
    "fetch-assets": (["humaneval", "--cache-dir", "rel/cache"], ("hylo.jobs.fetch_assets", "fetch_asset")),
    "stage1": (["--set", "model.base=rel/b", "--set", "model.student=rel/s", "--set", "data.path=rel/d",
                "--set", "ray.storage_path=rel/runs"], ("hylo.pipeline.train.driver", "check_run")),
    "stage2": (["--set", "model.student=rel/s", "--set", "data.path=rel/d", "--set", "ray.storage_path=rel/runs",
                "--set", "teacher.model.path=rel/t", "--set", "teacher.cache_path=rel/c"],
               ("hylo.pipeline.train.driver", "check_run")),
    "kernels-check": (["--out", "rel/o", "--set", "model.student=rel/s", "--set", "data.path=rel/d",
                       "--set", "teacher.model.path=rel/t"],
                      ("hylo.pipeline.estimate.shapes", "conversion_for_student")),
    "rehearse": (["--set", "model.student=rel/s", "--set", "data.path=rel/d",
                  "--set", "ray.storage_path=rel/runs", "--set", "teacher.model.path=rel/t"],
                 ("hylo.pipeline.rehearse", "rehearse")),
    "serve": (["rel/m"], ("hylo.jobs.serve", "serve")),
    "estimate": (["--tokens", "64", "--set", "model.student=rel/s", "--set", "data.path=rel/d",
                  "--set", "teacher.model.path=rel/t"],
                 ("hylo.pipeline.estimate.cli", "conversion_for_student")),
}


class _Stop(Exception):
    pass


@pytest.mark.parametrize("name", [n for n in COMMANDS if n not in NOT_JOBS])
def test_every_job_hands_its_work_absolute_paths(name, tmp_path, monkeypatch):
    """Each job, given relative paths (flags, --set), passes a config whose every path is absolute against the
    directory it runs in to the function that does its work."""
    import importlib

    assert name in JOB_RUNS, f"add hylo {name} to JOB_RUNS"
    argv, (module, fn) = JOB_RUNS[name]
    seen = []

    def stand_in(*args, **kwargs):
        seen.extend(a for a in [*args, *kwargs.values()] if dataclasses.is_dataclass(a))
        if name == "fetch-assets":
            seen.append(kwargs.get("cache_dir", args[1] if len(args) > 1 else None))
        raise _Stop

    monkeypatch.setattr(importlib.import_module(module), fn, stand_in)
    if name == "teacher-cache":  # it checks the teacher's weight files before its work
        monkeypatch.setattr("hylo.pipeline.teacher.model.resolve_model_path", lambda path: path)
        monkeypatch.setattr("hylo.pipeline.teacher.sources.base.check_weights_dir", lambda path: None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_Stop):
        from hylo.pipeline.cli import hylo_main

        hylo_main([name, *argv])
    if name == "fetch-assets":
        assert seen[-1] == str(tmp_path / "rel" / "cache")
        return
    (cfg,) = [c for c in seen if not isinstance(c, type)][:1]
    paths = _all_paths(cfg)
    given = {k: v for k, v in paths.items() if isinstance(v, str) and "rel/" in v}
    assert given, f"hylo {name}: none of the relative paths reached the work"
    for key, value in given.items():
        assert value.startswith(str(tmp_path / "rel")), (name, key, value)
    # nothing relative is left (defaults such as runs/... included), except assets, URIs and unset ones
    for key, value in paths.items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v and ":" not in v and not v.startswith("/"):
                from hylo.assets import ASSETS

                assert v in ASSETS, (name, key, v)


def test_without_lm_eval_installed_both_routes_say_which_extra_to_install(monkeypatch, capsys, tmp_path):
    import tomllib

    from hylo.pipeline.eval.lm_eval_adapter import cli

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("lm-eval") for d in extras["eval"])
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails as if it were not installed
    monkeypatch.setattr("hylo.pipeline.eval.lm_eval_adapter._REGISTERED", {})
    assert cli(["--tasks", "arc_easy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: lm-evaluation-harness is not installed") and "hylo-pipeline[eval]" in err
    assert err.count("\n") == 1
    rc, text = run_hylo(["eval", "--model", str(tmp_path / "m"), "--suite", "lm_eval", "--out", str(tmp_path / "o")])
    assert rc == 2 and "pip install 'hylo-pipeline[eval]'" in text and text.count("\n") == 1, text


def test_ctrl_c_while_ray_train_fits_is_a_keyboard_interrupt_in_the_main_thread():
    """Ray Train 2.60's fit() registers, when it runs in the main thread, a SIGINT handler that aborts the run
    and ends the driver with a bare exit status 1 (ray/train/v2/api/data_parallel_trainer.py,
    `_register_sigint_handler`; measured: a stage-1 run given SIGINT exited 1 with no message). The driver
    runs fit() in a thread of its own: Ctrl-C is then a KeyboardInterrupt in the main thread (job_main: one
    line, 130), and fit()'s own result or error comes back unchanged."""
    import threading

    from hylo.pipeline.train.driver import fit_interruptibly

    class Trainer:
        def __init__(self, result=None, error=None, wait=0.0):
            self.result, self.error, self.wait, self.thread = result, error, wait, None

        def fit(self):
            self.thread = threading.current_thread()
            time.sleep(self.wait)
            if self.error:
                raise self.error
            return self.result

    t = Trainer(result="done")
    assert fit_interruptibly(t) == "done" and t.thread is not threading.main_thread()
    with pytest.raises(ValueError, match="boom"):
        fit_interruptibly(Trainer(error=ValueError("boom")))
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        fit_interruptibly(Trainer(wait=30))
    assert time.time() - t0 < 5


def test_training_workers_print_each_line_once_on_a_local_ray_and_on_a_joined_cluster(monkeypatch, tmp_path):
    """Ray Train 2.60 patches print() in its workers to log each line and, whenever sys.stdout is not
    sys.__stdout__ (always, in a Ray worker: Ray wraps it in ray._private.utils.Unbuffered), print it too
    (ray/train/v2/_internal/logging/patch_print.py `redirected_print`): every line twice, measured under
    `ray job submit` and on a local Ray. The switch RAY_TRAIN_ENABLE_PRINT_PATCH=0 reaches every worker:
    a local Ray inherits it (project_env); for a cluster the job joined, the workers' runtime env has it.
    (tests/e2e/test_quickstart.py counts the printed step lines of real runs.)"""
    from hylo.pipeline.ray_init import project_env
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.driver import PRINT_PATCH, run_config
    from hylo.pipeline.train.storage import run_loc

    assert project_env()[PRINT_PATCH] == "0"
    cfg = load_stage_config(1, None, [f"ray.storage_path={tmp_path}"])
    monkeypatch.delenv(PRINT_PATCH, raising=False)  # a driver that joined a cluster (ray job submit)
    assert run_config(cfg, run_loc(cfg)).worker_runtime_env["env_vars"][PRINT_PATCH] == "0"
    monkeypatch.setenv(PRINT_PATCH, "0")  # a driver that started its local Ray (init_ray set project_env)
    assert PRINT_PATCH not in run_config(cfg, run_loc(cfg)).worker_runtime_env["env_vars"]


def test_a_torchrun_rank_leaves_without_the_interpreters_teardown(monkeypatch):
    """`cli.leave` (the stage jobs' exit): a rank torchrun started ends by os._exit with the job's status, so
    C++ threads of process groups still held are never destroyed by the interpreter's teardown (docs/testing.md);
    any other process exits as usual."""
    from hylo.pipeline import cli

    exits: list[int] = []

    def fake_exit(rc: int) -> None:
        exits.append(rc)
        raise SystemExit(rc)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    with pytest.raises(SystemExit):
        cli.leave(3)
    with pytest.raises(SystemExit):
        cli.leave(None)
    assert exits == [3, 0]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(SystemExit) as stopped:
        cli.leave(2)
    assert stopped.value.code == 2 and exits == [3, 0]
