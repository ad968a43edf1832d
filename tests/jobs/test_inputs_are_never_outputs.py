"""No input is ever an output (issue 61): every job knows the files it reads from its config's path fields
(`hylo.pipeline.paths.job_inputs`: the config file, model folders, data, caches, the teacher), and the one check
of every output the user names (`hylo.outputs.check_not_an_input`) refuses a path that is one of them, lies
inside one (a file of a model folder it reads) or holds one, `--force` or not, before any work. And one rule for
a symbolic link at an output path, dangling or not: followed, the link kept (`hylo.ownership.output_target`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from hylo.ownership import write_record
from hylo.pipeline.config import config_file_of, field_rules, shipped_config
from hylo.pipeline.paths import job_inputs, resolve_paths
from hylo.pipeline.train.config import load_stage_config

from tests.helpers.cli import job_config_roots, run_hylo_split, walk_fields
from tests.helpers.models import tiny_student, tiny_teacher


def _tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()[:12]
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def converted(tmp_path: Path) -> Path:
    """A stage-2 config whose student is a folder of this project's (its record lists config.json, as a
    `hylo convert` output's does), its teacher an in-process Llama; returns the config file."""
    tiny_student().save_pretrained(tmp_path / "student")
    write_record(tmp_path / "student", [p.name for p in (tmp_path / "student").iterdir()])
    tiny_teacher().save_pretrained(tmp_path / "teacher")
    cfg = {"model": {"student": str(tmp_path / "student")}, "ray": {"num_workers": 1},
           "data": {"source": "synthetic", "seq_len": 64},
           "teacher": {"source": "inprocess", "k": 0, "model": {"path": str(tmp_path / "teacher"), "dtype": "float32"}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_job_inputs_are_every_path_field_of_the_config_but_its_outputs(converted, tmp_path):
    """What a stage reads, from its config's declarations: the config file, then every path field that is not an
    output (ray.storage_path and ray.kernel_cache are written, not read); an asset name as its cached folder."""
    for d in ("data", "cache", "tok"):
        (tmp_path / d).mkdir()
    cfg = resolve_paths(load_stage_config(2, converted, [f"data.path={tmp_path / 'data'}",
                                                         f"teacher.cache_path={tmp_path / 'cache'}",
                                                         f"teacher.model.tokenizer={tmp_path / 'tok'}",
                                                         "model.base=smollm2-135m-instruct"]))
    assert config_file_of(cfg) == converted
    found = dict(job_inputs(cfg))
    assert found.pop("--config") == converted
    assert found.pop("model.base").name == "smollm2-135m-instruct"  # the asset's folder in the cache
    assert found == {"model.student": tmp_path / "student", "data.path": tmp_path / "data",
                     "teacher.model.path": tmp_path / "teacher", "teacher.model.tokenizer": tmp_path / "tok",
                     "teacher.cache_path": tmp_path / "cache"}


def test_every_path_a_job_writes_is_declared_an_output():
    """A path field is an input unless its rule says the job writes it (OUTPUT_PATH): these, and only these, of
    every job's config (a new output field must say so, or every job would refuse to write it)."""
    outputs = {f"{job}:{dotted}" for job, cls in job_config_roots().items()
               for dotted, owner, name, _, _ in walk_fields(cls)
               if (rule := field_rules(owner).get(name)) is not None and rule.path and rule.output}
    assert outputs == {
        "stage1:ray.storage_path", "stage1:ray.kernel_cache", "stage2:ray.storage_path", "stage2:ray.kernel_cache",
        "prepare_data:output.dir", "decontaminate:out", "teacher_cache:out", "eval:out", "eval:lm_eval.output_path",
        "demo:run_dir", "place_layers:run_dir", "convert:out"}


@pytest.mark.parametrize("where", ["student-config", "student-folder", "teacher-file", "config"])
def test_estimate_json_is_never_a_file_the_estimate_reads(converted, where):
    """Issue 61: `hylo estimate --json <model.student>/config.json` exited 0 and replaced the converted student's
    config.json (a file its record lists counted as ours to replace); the next estimate failed with a traceback.
    Now it is refused in one line before the estimator is imported, --force or not, the student untouched."""
    root = converted.parent
    target = {"student-config": root / "student" / "config.json", "student-folder": root / "student" / "est.json",
              "teacher-file": root / "teacher" / "config.json", "config": converted}[where]
    key = {"student-config": "model.student", "student-folder": "model.student", "teacher-file": "teacher.model.path",
           "config": "--config"}[where]
    before = {d: _tree(root / d) for d in ("student", "teacher")}, converted.read_text()
    for force in ([], ["--force"]):
        rc, out, err = run_hylo_split(["estimate", "--config", str(converted), "--json", str(target), *force])
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        how = "is the input" if where == "config" else "lies inside the input"
        assert err.startswith(f"error: --json {target} {how} {key} "), err
        assert "--force never lets an output replace an input" in err, err
    assert ({d: _tree(root / d) for d in ("student", "teacher")}, converted.read_text()) == before


def test_kernels_check_out_is_never_inside_the_student_it_compiles_for(converted):
    root = converted.parent
    before = _tree(root / "student")
    rc, out, err = run_hylo_split(["kernels-check", "--config", str(converted), "--out", str(root / "student")])
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --out {root / 'student' / 'kernels_check.json'} lies inside the input "
                          f"model.student {root / 'student'}"), err
    rc, out, err = run_hylo_split(["kernels-check", "--config", str(converted), "--out", str(root / "o"),
                                   "--warm-cache", str(root / "teacher" / "kc")])
    assert rc == 2 and err.startswith(f"error: --warm-cache {root / 'teacher' / 'kc'} lies inside the input "
                                      f"teacher.model.path"), err
    assert _tree(root / "student") == before and not (root / "o").exists() and not (root / "teacher" / "kc").exists()


def test_configs_cp_never_writes_over_the_shipped_config_it_copies():
    src = shipped_config("demo-smollm2")
    before = src.read_bytes()
    rc, _, err = run_hylo_split(["configs", "cp", "demo-smollm2", str(src), "--force"])
    assert rc == 2 and err.startswith(f"error: DEST {src} is the input the shipped config {src}"), err
    assert src.read_bytes() == before


def test_configs_cp_and_estimate_json_follow_a_dangling_link_and_keep_it(converted, tmp_path, monkeypatch):
    """Issue 61: `hylo configs cp` replaced a user's dangling link without --force, `estimate --json` refused any
    link. One rule now: the link is followed, dangling or not, and what it points to is written; the link stays."""
    link = tmp_path / "mine.yaml"
    link.symlink_to(tmp_path / "elsewhere.yaml")
    rc, out, err = run_hylo_split(["configs", "cp", "demo-smollm2", str(link)])
    assert rc == 0 and out == f"copied demo-smollm2.yaml to {link} (a link to {tmp_path / 'elsewhere.yaml'})\n", err
    assert link.is_symlink() and (tmp_path / "elsewhere.yaml").read_bytes() == shipped_config("demo-smollm2").read_bytes()
    rc, _, err = run_hylo_split(["configs", "cp", "demo-smollm2", str(link)])  # now the user's file: not without --force
    assert rc == 2 and "(a link to" in err and "exists and this project did not write it" in err, err
    # estimate --json: its check follows a dangling link the same way (stopped where the estimate would start)
    from hylo.pipeline.estimate import cli

    monkeypatch.setattr(cli, "estimate_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("the estimate")))
    report = tmp_path / "est.json"
    report.symlink_to(tmp_path / "reports" / "est.json")
    (tmp_path / "reports").mkdir()
    with pytest.raises(RuntimeError, match="the estimate"):
        cli.main(["--config", str(converted), "--json", str(report)])
    assert report.is_symlink() and not (tmp_path / "reports" / "est.json").exists()
