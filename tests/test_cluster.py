"""Cluster files and documented job commands.

* Every YAML under cluster/ goes through what `ray up` does before it touches a machine:
  `prepare_config` (defaults for the provider) and `validate_config` (Ray's own JSON schema,
  ray/autoscaler/ray-schema.json, plus its consistency checks).
* The MI300X and CUDA files declare what the ROCm/CUDA runtime and Ray need (device flags, the
  accelerator resource under Ray's own name, ROCR_VISIBLE_DEVICES unset, shared storage, token auth).
* Every command in README.md and docs/*.md code blocks that runs `python jobs/X.py` (directly or
  after `ray job submit ... --`) must name an existing job whose argument parser accepts its flags;
  a documented job that does not exist is a failure, not a skip.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAMLS = sorted((REPO / "cluster").glob("*.yaml"))
DOC_FILES = sorted([*REPO.glob("README.md"), *(REPO / "docs").glob("*.md")])


# ------------------------------------------------------------------------------------------ schema
def ray_validate(config: dict) -> dict:
    """What `ray up` runs on a cluster file before contacting any node; returns the filled config."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def load_yaml(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path}: top level must be a mapping"
    return data


def test_cluster_files_present():
    names = {p.name for p in CLUSTER_YAMLS}
    assert {"mi300x.yaml", "h100.yaml"} <= names, f"cluster/ has {sorted(names)}"


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=[p.name for p in CLUSTER_YAMLS])
def test_cluster_yaml_passes_ray_schema(path: Path):
    prepared = ray_validate(load_yaml(path))
    # the local provider keeps every listed worker: min == max == number of worker IPs
    node = prepared["available_node_types"][prepared["head_node_type"]]
    n_workers = len(prepared["provider"]["worker_ips"])
    assert node["min_workers"] == node["max_workers"] == n_workers


def test_ray_schema_rejects_a_bad_cluster_file():
    import jsonschema

    good = load_yaml(REPO / "cluster" / "mi300x.yaml")
    typo = copy.deepcopy(good)
    typo["docker"]["run_option"] = typo["docker"].pop("run_options")
    with pytest.raises(jsonschema.ValidationError, match="run_option"):
        ray_validate(typo)
    wrong_type = copy.deepcopy(good)
    wrong_type["idle_timeout_minutes"] = "never"
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'number'"):
        ray_validate(wrong_type)


def _start_commands(cfg: dict) -> dict[str, str]:
    return {k: " ".join(cfg[k]) for k in ("head_start_ray_commands", "worker_start_ray_commands")}


def _declared_resources(cmd: str) -> dict:
    m = re.search(r"--resources='([^']*)'", cmd)
    assert m, f"no --resources='{{...}}' in: {cmd}"
    return json.loads(m.group(1))


def test_mi300x_declares_rocm_runtime_and_ray_gpu_handling():
    from ray.util.accelerators import AMD_INSTINCT_MI300x

    cfg = load_yaml(REPO / "cluster" / "mi300x.yaml")
    assert cfg["provider"]["type"] == "local"
    assert cfg["provider"]["head_ip"] and cfg["provider"]["worker_ips"]
    opts = cfg["docker"]["run_options"]
    for flag in ("--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--ipc=host"):
        assert flag in opts, f"mi300x.yaml docker.run_options lacks {flag}"
    shm = [o for o in opts if o.startswith("--shm-size=")]
    assert shm and int(re.match(r"--shm-size=(\d+)g", shm[0]).group(1)) >= 64
    assert any(o.startswith("--volume=/mnt/") for o in opts), "no shared storage volume"
    for name, cmd in _start_commands(cfg).items():
        # Ray raises at worker start when ROCR_VISIBLE_DEVICES is set (it manages HIP_VISIBLE_DEVICES)
        assert "unset ROCR_VISIBLE_DEVICES" in cmd, name
        assert cmd.index("unset ROCR_VISIBLE_DEVICES") < cmd.index("ray start"), name
        assert "HIP_VISIBLE_DEVICES=" not in cmd, f"{name}: Ray sets HIP_VISIBLE_DEVICES per worker"
        assert "--num-gpus=8" in cmd, name
        assert _declared_resources(cmd) == {f"accelerator_type:{AMD_INSTINCT_MI300x}": 1}, name
        assert "RAY_AUTH_MODE=token" in cmd, name
    assert "--dashboard-host=127.0.0.1" in cfg["head_start_ray_commands"][-1]
    assert "~/.ray/auth_token" in cfg["file_mounts"]


def test_ray_rejects_rocr_visible_devices_as_the_yaml_assumes(monkeypatch):
    """The reason for the `unset`: Ray's AMD manager refuses ROCR_VISIBLE_DEVICES alone."""
    from ray._private.accelerators.amd_gpu import AMDGPUAcceleratorManager

    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match="HIP_VISIBLE_DEVICES"):
        AMDGPUAcceleratorManager.get_visible_accelerator_ids_env_var()
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES")
    assert AMDGPUAcceleratorManager.get_visible_accelerator_ids_env_var() == "HIP_VISIBLE_DEVICES"


def test_h100_declares_cuda_runtime():
    from ray.util.accelerators import NVIDIA_H100

    cfg = load_yaml(REPO / "cluster" / "h100.yaml")
    opts = cfg["docker"]["run_options"]
    assert "--gpus=all" in opts and "--ipc=host" in opts
    for name, cmd in _start_commands(cfg).items():
        assert "--num-gpus=8" in cmd, name
        assert _declared_resources(cmd) == {f"accelerator_type:{NVIDIA_H100}": 1}, name


@pytest.mark.parametrize("name,base", [("Dockerfile.rocm", "rocm/pytorch:"), ("Dockerfile.cuda", "pytorch/pytorch:")])
def test_dockerfiles_build_from_the_repo(name: str, base: str):
    text = (REPO / "cluster" / name).read_text()
    assert re.search(rf"^ARG BASE_IMAGE={re.escape(base)}\S+$", text, re.M), f"{name}: base image not {base}*"
    # every COPY source (other than optional globs) exists in the repository
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                if "*" not in src:
                    assert (REPO / src).exists(), f"{name}: COPY source {src} is missing"
    assert "deepspeed" in text and "flash-linear-attention" in text
    # the image named by the cluster file is the one this Dockerfile builds
    tag = re.search(r"-t (\S+) \.", text).group(1)
    yaml_name = {"Dockerfile.rocm": "mi300x.yaml", "Dockerfile.cuda": "h100.yaml"}[name]
    assert load_yaml(REPO / "cluster" / yaml_name)["docker"]["image"] == tag


# ------------------------------------------------------------------------------------ doc commands
@dataclass(frozen=True)
class DocCommand:
    doc: str
    line: int
    job: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: python {self.job} {' '.join(self.argv)}"


_FENCE = re.compile(r"^```")


def _code_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, block text) of every fenced code block."""
    blocks, cur, start = [], None, 0
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.strip()):
            if cur is None:
                cur, start = [], i + 1
            else:
                blocks.append((start, "\n".join(cur)))
                cur = None
        elif cur is not None:
            cur.append(line)
    return blocks


def _logical_lines(block: str, first: int) -> list[tuple[int, str]]:
    out, buf, at = [], "", first
    for i, line in enumerate(block.splitlines()):
        if not buf:
            at = first + i
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        out.append((at, buf + stripped))
        buf = ""
    if buf:
        out.append((at, buf))
    return out


def parse_doc_commands(doc: str, text: str) -> list[DocCommand]:
    """Commands running `python jobs/X.py` in the code blocks of one Markdown file."""
    found = []
    for first, block in _code_blocks(text):
        for line_no, line in _logical_lines(block, first):
            line = re.sub(r"^\s*\$\s+", "", line)
            if "python" not in line or "jobs/" not in line:
                continue
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError as e:
                raise AssertionError(f"{doc}:{line_no}: cannot split command ({e}): {line}") from None
            # a line may chain commands; each segment is checked separately
            segments, cur = [], []
            for tok in tokens:
                if tok in ("&&", "||", ";", "|"):
                    segments.append(cur)
                    cur = []
                else:
                    cur.append(tok)
            segments.append(cur)
            for seg in segments:
                for j, tok in enumerate(seg[:-1]):
                    if re.fullmatch(r"python3?", Path(tok).name) and re.fullmatch(r"jobs/\w+\.py", seg[j + 1]):
                        found.append(DocCommand(doc, line_no, seg[j + 1], tuple(seg[j + 2:])))
                        break
    return found


def collect_doc_commands() -> list[DocCommand]:
    cmds = []
    for path in DOC_FILES:
        cmds += parse_doc_commands(str(path.relative_to(REPO)), path.read_text())
    return cmds


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def parse_with_job(job: str, argv: list[str]) -> argparse.Namespace:
    """Run jobs/<job>'s own argument parsing on argv and stop right after it (nothing else runs).

    ArgumentParser.parse_args is wrapped so that the first top-level parse returns control here;
    argparse errors surface as AssertionError with argparse's message.
    """
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        ns = original(self, args, namespace)
        raise _Parsed(ns)

    err = io.StringIO()
    old_argv = sys.argv
    sys.argv = [str(REPO / job), *argv]
    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(REPO / job), run_name="__main__")
    except _Parsed as p:
        return p.namespace
    except SystemExit as e:
        if e.code == 0 and ("-h" in argv or "--help" in argv):
            return argparse.Namespace()
        raise AssertionError(f"{job} rejected {argv}: exit {e.code}: {err.getvalue().strip()}") from None
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = old_argv
    raise AssertionError(f"{job} finished without parsing its command line")


def test_doc_command_parser_finds_commands_in_fenced_blocks():
    text = (
        "Intro `python jobs/ignored.py` inline is prose.\n"
        "```bash\n"
        "$ python jobs/convert.py --base smollm2-135m-instruct \\\n"
        "    --out runs/x --mla-layers even   # comment\n"
        "RAY_AUTH_MODE=disabled ray start --head && ray job submit --working-dir . -- "
        "python jobs/eval.py --model runs/x --suite kl\n"
        "```\n"
    )
    cmds = parse_doc_commands("doc.md", text)
    assert [(c.job, c.argv, c.line) for c in cmds] == [
        ("jobs/convert.py", ("--base", "smollm2-135m-instruct", "--out", "runs/x", "--mla-layers", "even"), 3),
        ("jobs/eval.py", ("--model", "runs/x", "--suite", "kl"), 5),
    ]


def test_parse_with_job_reports_unknown_flags():
    ns = parse_with_job("jobs/convert.py", ["--base", "b", "--out", "o", "--mla-layers", "0,2"])
    assert ns.mla_layers == "0,2"
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-flag"):
        parse_with_job("jobs/convert.py", ["--no-such-flag"])


def test_documented_job_commands_parse():
    cmds = collect_doc_commands()
    assert DOC_FILES, "no README.md or docs/*.md to check"
    assert cmds, f"no `python jobs/...` commands found in {[str(p.relative_to(REPO)) for p in DOC_FILES]}"
    missing = sorted({f"{c.job} (documented at {c.doc}:{c.line})" for c in cmds if not (REPO / c.job).is_file()})
    assert not missing, "documented job files do not exist: " + "; ".join(missing)
    failures = []
    for c in cmds:
        try:
            ns = parse_with_job(c.job, list(c.argv))
        except AssertionError as e:
            failures.append(f"{c}\n    {e}")
            continue
        cfg = getattr(ns, "config", None)
        if isinstance(cfg, str) and not re.search(r"[<>$]", cfg) and not (REPO / cfg).is_file():
            failures.append(f"{c}\n    --config {cfg} does not exist in the repository")
    assert not failures, "documented commands that do not parse:\n" + "\n".join(failures)
