"""The version lock (`constraints.txt`): what `make install`, CI and both cluster images install.

    python cluster/constraints.py            # check: exit 1 and list the differences when out of date
    python cluster/constraints.py --write    # rewrite constraints.txt from this environment (`make constraints`)
    python cluster/constraints.py --check-index   # resolve the lock with torch on PyPI alone (`make lock-check`)

The lock holds one `name==version` line for every package that pyproject.toml's dependencies and its
`dev` and `gpu` extras pull in (transitively, markers and extras evaluated for this interpreter),
at the version installed here: the environment `make test` passed in. Two exceptions:

* torch (and what only torch pulls in) is not pinned: `make install` keeps the torch that is present
  (installing torch==2.13.0 when there is none) and the images keep their base image's ROCm or CUDA
  build. Triton is pinned at the version PyPI's torch 2.13.0 pins itself (3.7.1), so that the lock
  installs beside the CUDA torch a user's machine gets from PyPI; the CPU build pins no Triton. The
  Dockerfiles drop the triton lines (`IMAGE_OWNED`) because the base image's torch fixes its own.
* A package of an extra that is not installed here (the `gpu` extra's liger-kernel: CUDA machines
  only) keeps the pin written by hand below the `# not installed on the CPU machines` line;
  `--write` carries it over and refuses to drop one.

tests/jobs/test_cluster.py checks that the lock covers the dependencies, matches what is installed, and is
what the Makefile and both Dockerfiles install with. The serving environment (vLLM) has locks of its own,
resolved with `uv_compile` below: cluster/serve_lock.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "constraints.txt"
# Extras the lock covers (`make install` installs `dev`; Dockerfile.cuda installs `gpu`).
EXTRAS = ("dev", "gpu")
# Provided by the environment: never pinned, not followed.
ENVIRONMENT_OWNED = ("torch", "torchvision", "torchaudio")
# In the lock for the CPU install, dropped by the Dockerfiles (the base image's torch fixes them).
IMAGE_OWNED = ("triton", "pytorch-triton-rocm")
HAND_PINNED_HEADER = "# not installed on the CPU machines (CI, the demo); pinned by hand:"
# The torch the README and `make install` name; `--check-index` resolves the lock beside it.
TORCH = "torch==2.13.0"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*(?:#.*)?$")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str

    @property
    def key(self) -> str:
        return canonicalize_name(self.name)

    def line(self) -> str:
        return f"{self.name}=={self.version}"


def project_requirements(pyproject: Path = REPO / "pyproject.toml", extras: tuple[str, ...] = EXTRAS
                         ) -> list[Requirement]:
    """pyproject.toml's dependencies plus those of `extras`."""
    proj = tomllib.loads(pyproject.read_text())["project"]
    reqs = [Requirement(r) for r in proj.get("dependencies", [])]
    optional = proj.get("optional-dependencies", {})
    for extra in extras:
        reqs += [Requirement(r) for r in optional.get(extra, [])]
    return reqs


def _applies(req: Requirement, extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    env = default_environment()
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def resolve_installed(roots: list[Requirement]) -> tuple[dict[str, Pin], list[Requirement]]:
    """Installed version of every package the roots need (transitively); and the roots not installed."""
    pins: dict[str, Pin] = {}
    missing: list[Requirement] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[Requirement, bool]] = [(r, True) for r in roots if _applies(r, frozenset())]
    while todo:
        req, is_root = todo.pop()
        key = canonicalize_name(req.name)
        if key in ENVIRONMENT_OWNED:
            continue
        extras = frozenset(canonicalize_name(e) for e in req.extras)
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            if is_root:
                missing.append(req)
                continue
            raise SystemExit(f"error: {req.name} (needed by the project's dependencies) is not installed; "
                             f"run `make install` first") from None
        pins[key] = Pin(dist.metadata["Name"], dist.version)
        for spec in dist.requires or []:
            child = Requirement(spec)
            if _applies(child, extras):
                todo.append((child, False))
    return pins, missing


def read_lock(path: Path = LOCK) -> tuple[dict[str, Pin], dict[str, Pin]]:
    """(generated pins, hand pins) of a lock file; raises ValueError on a line that is not `name==version`."""
    generated: dict[str, Pin] = {}
    hand: dict[str, Pin] = {}
    target = generated
    for i, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line == HAND_PINNED_HEADER:
            target = hand
            continue
        if not line or line.startswith("#"):
            continue
        m = _PIN.match(line)
        if not m:
            raise ValueError(f"{path}:{i}: not a `name==version` pin: {raw!r}")
        pin = Pin(m.group(1), m.group(2))
        if pin.key in generated or pin.key in hand:
            raise ValueError(f"{path}:{i}: {pin.name} is pinned twice")
        target[pin.key] = pin
    return generated, hand


def render_lock(pins: dict[str, Pin], hand: dict[str, Pin]) -> str:
    head = [
        "# Version lock of hylo-pipeline: `pip install -c constraints.txt ...` (make install, CI, both images).",
        "# Generated by `make constraints` (python cluster/constraints.py --write) from the environment the",
        "# tests passed in; tests/jobs/test_cluster.py fails when it drifts from what is installed.",
        "# torch is not pinned: torch==2.13.0 (PyPI's, or its CPU build), the base image's ROCm/CUDA build in",
        "# the images, which also drop the triton lines (their torch fixes its Triton). triton is the version",
        "# PyPI's torch 2.13.0 pins (`python cluster/constraints.py --check-index` resolves the lock on PyPI).",
    ]
    body = [p.line() for p in sorted(pins.values(), key=lambda p: p.key)]
    tail = ["", HAND_PINNED_HEADER, *(p.line() for p in sorted(hand.values(), key=lambda p: p.key))] if hand else []
    return "\n".join([*head, *body, *tail]) + "\n"


def build_lock(path: Path = LOCK) -> str:
    pins, missing = resolve_installed(project_requirements())
    _, hand = read_lock(path) if path.is_file() else ({}, {})
    unpinned = [r for r in missing if canonicalize_name(r.name) not in hand]
    if unpinned:
        raise SystemExit("error: not installed here and not pinned by hand in constraints.txt: "
                         + ", ".join(str(r) for r in unpinned))
    keep = {canonicalize_name(r.name) for r in missing}
    return render_lock(pins, {k: v for k, v in hand.items() if k in keep})


def uv_compile(requirements: list[str], options: list[str]) -> tuple[int, str, dict[str, tuple[str, str]]]:
    """`uv pip compile` of `requirements` (lines of a requirements file) on PyPI alone, with `options` added.

    uv's resolver (a dev dependency) with no configuration file (`--no-config`) and no `UV_*` variable, so no
    local index or wheel folder (uv reads no pip configuration). uv reads each wheel's metadata alone, where
    pip 23's `install --dry-run` downloaded every wheel, torch's CUDA libraries among them (60 CPU-seconds and
    minutes of transfer, against 3). Returns (exit status, the resolver's reason when it failed, else "",
    {package: (version, the index it came from)}).
    """
    import importlib.util
    import os
    import subprocess
    import tempfile

    if importlib.util.find_spec("uv") is None:
        return 1, "uv is not installed (the dev extra: pip install -c constraints.txt -e '.[dev]')", {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    with tempfile.TemporaryDirectory() as tmp:
        req_file = Path(tmp) / "requirements.in"
        req_file.write_text("\n".join(requirements) + "\n")
        # --system-certs: the machine's certificate store (a proxy's own CA), as pip uses
        cmd = [sys.executable, "-m", "uv", "pip", "compile", "--no-config", "--system-certs", "--quiet",
               "--no-header", "--no-annotate", "--emit-index-annotation", *options, str(req_file)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        why = [line.strip() for line in (proc.stderr + proc.stdout).splitlines()
               if "requirements are unsatisfiable" in line or "depends on" in line or "error" in line]
        return proc.returncode, "\n".join(why[-12:]) or proc.stderr[-2000:], {}
    chosen: dict[str, tuple[str, str]] = {}
    name = ""
    for line in proc.stdout.splitlines():
        pin = re.match(r"([A-Za-z0-9._-]+)==(\S+)", line)
        if pin:
            name = canonicalize_name(pin.group(1))
            chosen[name] = (pin.group(2), "")
        elif line.strip().startswith("# from ") and name:
            chosen[name] = (chosen[name][0], line.strip().removeprefix("# from "))
    return 0, "", chosen


def outside_pypi(chosen: dict[str, tuple[str, str]]) -> list[str]:
    """The packages of a `uv_compile` result that came from anywhere but an https index (a local one)."""
    return sorted(k for k, (_, index) in chosen.items() if not index.startswith("https://"))


def check_index(lock: Path = LOCK, torch: str = TORCH, requirements: list[str] | None = None) -> tuple[bool, str]:
    """Resolve `torch` and the project's dependencies (runtime, dev, gpu) under the lock on PyPI alone.

    `uv_compile` for this interpreter; the requirements are pyproject.toml's (no build of the project;
    `requirements` replaces them). Returns (ok, a short account): the versions of torch and triton the
    resolver chose, or its reason it could not resolve.
    """
    reqs = requirements if requirements is not None else [
        str(r) for r in project_requirements() if canonicalize_name(r.name) not in ENVIRONMENT_OWNED]
    status, why, chosen = uv_compile([torch, *reqs], ["--python", sys.executable, "-c", str(lock)])
    if status != 0:
        return False, why
    local = outside_pypi(chosen)
    if local:
        return False, f"resolved from outside the default index: {', '.join(local)}"
    versions = ", ".join(f"{k} {chosen[k][0]}" for k in ("torch", "triton") if k in chosen)
    return True, f"{len(chosen)} packages resolve on the default index alone ({versions})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite constraints.txt from this environment")
    ap.add_argument("--check-index", action="store_true",
                    help=f"resolve the lock with {TORCH} on PyPI alone (needs PyPI; about 20 s)")
    args = ap.parse_args(argv)
    if args.check_index:
        ok, account = check_index()
        print(f"{LOCK.name}: {account}" if ok else f"error: {LOCK.name} does not resolve with {TORCH} on PyPI "
              f"alone:\n{account}", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    text = build_lock()
    if args.write:
        tmp = LOCK.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(LOCK)
        print(f"wrote {LOCK} ({sum(1 for line in text.splitlines() if _PIN.match(line))} pins)")
        return 0
    current = LOCK.read_text() if LOCK.is_file() else ""
    if current == text:
        print(f"{LOCK.name} matches this environment")
        return 0
    import difflib

    sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                               str(LOCK.name), "this environment"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
