"""What the tests of the README's and docs' commands share (tests/e2e/test_quickstart.py,
tests/e2e/test_checkout_block.py): the bash blocks of a section, the job a command runs, running a command
made small, a clean environment."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from hylo.logs import message_of
from hylo.pipeline.job_output import RAY_PREFIX, strip_ansi

REPO = Path(__file__).resolve().parents[2]
SMALLEST = {
    "prepare-data": ["--set", "packing.max_len=128", "--set", "packing.window=64",
                     "--set", 'mixture.sources=[{name: sharegpt, path: "asset:sharegpt", limit: 40}]'],
    # one worker, one step of one 128-token row
    "stage1": ["--set", "ray.num_workers=1", "--set", "train.global_batch_sequences=1", "--set", "train.total_steps=1",
               "--set", "checkpoint.every_steps=1", "--set", "checkpoint.delete_after_consolidate=true",
               "--set", "model.activation_checkpointing=false"],
    "eval": ["--set", "kl.max_rows=1", "--set", "kvcache.lengths=[64]", "--set", "kvcache.decode_tokens=2"],
}
SMALLEST["stage2"] = SMALLEST["stage1"]
DEMO_SMALLEST = ["--steps", "1", "--records", "40", "--heldout", "8", "--heldout-rows", "1", "--seq-len", "128",
                 "--kv-lengths", "[64]"]


def readme_blocks(title: str) -> list[list[str]]:
    """The commands (a line with its `\\` continuations, comments dropped) of each bash block of section
    `title`, block by block: a `## title` of the README or a `# title` / `## title` of a docs/ page (up to its
    next `##`)."""
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        found = re.search(rf"^##? {re.escape(title)}\n", path.read_text(), re.M)
        if found:
            break
    assert found, f"no section {title!r} in README.md or docs/*.md"
    body = found.string[found.end():].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", body, re.S)
    assert blocks, f"section {title!r} of {path.name} has no bash block"
    out = []
    for block in blocks:
        lines = [shlex.join(shlex.split(line, comments=True)) for line in block.replace("\\\n", " ").splitlines()]
        out.append([line for line in lines if line])
    return out


def job_of(argv: list[str]) -> str | None:
    """`hylo NAME ...` / `python jobs/NAME.py ...` -> NAME (with dashes), else None."""
    if argv[0] == "hylo" and len(argv) > 1:
        return argv[1]
    m = re.fullmatch(r"jobs/(\w+)\.py", argv[1]) if len(argv) > 1 and Path(argv[0]).name.startswith("python") else None
    return m.group(1).replace("_", "-") if m else None


def run(cmd: str, cwd: Path, env: dict[str, str], python: str | None = None, timeout: int = 900) -> str:
    """Run README command `cmd` in `cwd`, made small (SMALLEST, DEMO_SMALLEST); its output. `python`: the
    interpreter a `python ...` line runs."""
    argv = shlex.split(cmd)
    job = job_of(argv)
    if "--help" not in argv and "--print-config" not in argv:
        argv += DEMO_SMALLEST if job == "demo" else SMALLEST.get(job or "", [])
    if argv[0] == "python" and python:
        argv[0] = python
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{shlex.join(argv)}` in {cwd}: exit {proc.returncode}\n{out[-4000:]}"
    return out


def clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONUNBUFFERED": "1", **more}


def printed_once(out: str, pattern: str, at_least_once: bool = True) -> None:
    """No line of `out` that matches `pattern` is there twice (Ray Train's print patch doubled every line a training
    worker printed), and, with `at_least_once`, one is. A job's output gets its workers' lines through Ray's log
    forwarding, on Ray's own time: check it with `at_least_once=False`, and what the workers printed
    (tests/helpers/ray_logs.py) for the lines being there."""
    # each line as its process wrote it: without Ray's "(Worker pid=N)", nor the log line's time, level, rank
    lines = [message_of(RAY_PREFIX.sub("", strip_ansi(ln), count=1)) for ln in out.splitlines()
             if re.search(pattern, ln)]
    assert (lines or not at_least_once) and len(lines) == len(set(lines)), f"{pattern}: {lines}"
