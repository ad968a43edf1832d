"""Every example command of every `hylo NAME --help`, the README and docs/*.md runs (so none goes stale).

An example is a line (with its `\\` continuations) that runs `python jobs/NAME.py ...` or `hylo NAME ...`:
in the help text (the job's docstring; not its `usage:` line), or in a fenced code block of a Markdown file.
Each one is run in-process through `hylo` (the same `main(argv)` as the job file) at no cost: with
`--print-config` appended, which resolves the whole config (the file, every flag, every `--set` key) and
exits before any work, or as it is when it is `--help`; `hylo configs` (no config) as it is, in a temporary
directory. Parsed only: `decontaminate --export-benchmarks` (downloads, no config) and an example with a
`<placeholder>`. Optional parts written `[--flag ...]` are left out; `$PWD` is the repository.
What every example prints with `--print-config` loads back (`--config` of that file prints the same).
tests/e2e/test_quickstart.py runs the README's quick start and "Running the stages" (docs/stages.md) for real.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hylo.pipeline.cli import COMMANDS, NOT_JOBS

from tests.helpers.cli import run_hylo, run_hylo_split

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "pipeline" / "train" / "README.md"]
JOB_FILES = {module.split(".")[-1]: name for name, (module, _) in COMMANDS.items()}
_FENCE = re.compile(r"^\s*```")
# `[--flag ...]`: an optional part of a usage line
_OPTIONAL = re.compile(r"\s\[-[^\[\]]*(\[[^\[\]]*\][^\[\]]*)*\]")


@dataclass(frozen=True)
class Example:
    where: str
    command: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: hylo {self.command} {shlex.join(self.argv)}"


def _joined_lines(lines: list[str]) -> list[tuple[int, str]]:
    out, buf, at = [], "", 0
    for i, line in enumerate(lines):
        if not buf:
            at = i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((at, buf + line))
        buf = ""
    return out


def examples_in(where: str, lines: list[str]) -> list[Example]:
    """The example commands among `lines` (one text: a code block or a help text)."""
    found = []
    for i, line in _joined_lines(lines):
        line = _OPTIONAL.sub("", re.sub(r"^\s*\$\s+", "", line))
        if line.lstrip().startswith("usage:"):
            continue
        if "jobs/" not in line and not re.search(r"(^|\s)hylo\s+[a-z]", line):
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as e:
            raise AssertionError(f"{where}+{i}: cannot split {line!r}: {e}") from None
        for j, tok in enumerate(tokens):
            m = re.fullmatch(r"jobs/(\w+)\.py", tok)
            if m and j and re.fullmatch(r"python3?|torchrun|--", Path(tokens[j - 1]).name) is None \
                    and not tokens[j - 1].startswith("--nproc"):
                continue
            if m and m.group(1) in JOB_FILES:
                name = JOB_FILES[m.group(1)]
            elif tok == "hylo" and j + 1 < len(tokens) and tokens[j + 1] in COMMANDS:
                name, j = tokens[j + 1], j + 1
            else:
                continue
            argv = []
            for t in tokens[j + 1:]:
                if t in ("&&", "||", ";", "|"):
                    break
                argv.append(t)
            found.append(Example(f"{where}+{i}", name, tuple(argv)))
            break
    return found


def doc_examples() -> list[Example]:
    found = []
    for path in DOCS:
        block: list[str] | None = None
        start = 0
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _FENCE.match(line):
                if block is None:
                    block, start = [], n + 1
                else:
                    found += [Example(f"{path.relative_to(REPO)}:{start + int(e.where.rsplit('+', 1)[1])}",
                                      e.command, e.argv) for e in examples_in("", block)]
                    block = None
            elif block is not None:
                block.append(line)
    return found


def help_text(name: str) -> str:
    rc, text = run_hylo([name, "--help"])
    assert rc == 0, f"hylo {name} --help: exit {rc}\n{text}"
    return text


def help_examples() -> list[Example]:
    found = []
    for name in COMMANDS:
        text = help_text(name)
        found += examples_in(f"hylo {name} --help", text.splitlines())
        # an option's help that suggests an override (`e.g. --set KEY=VALUE`), tried on the defaults
        found += [Example(f"hylo {name} --help (option)", name, ("--set", kv))
                  for kv in re.findall(r"e\.g\. --set ([a-z_][\w.]*=[^\s;,)]+)", " ".join(text.split()))]
    return found


class _Parsed(Exception):
    pass


def parse_only(argv: list[str]) -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        rc, text = run_hylo(argv)
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"exit {rc} before its arguments were parsed: {text.strip()[-400:]}")


def _parse_only(ex: Example) -> bool:
    return any(re.search(r"<\w+>", a) for a in ex.argv) or ("--export-benchmarks" in ex.argv and "--help" not in ex.argv)


def run_example(ex: Example, scratch: Path | None = None) -> str:
    """Run `ex` (see the module docstring); what it printed on stdout."""
    argv = [ex.command, *ex.argv]
    if _parse_only(ex):
        parse_only(argv)
        return ""
    if ex.command in NOT_JOBS:
        with contextlib.chdir(scratch or Path.cwd()):
            rc, out, err = run_hylo_split(argv)
    else:
        if "--help" not in ex.argv and "-h" not in ex.argv and "--print-config" not in ex.argv:
            argv.append("--print-config")
        rc, out, err = run_hylo_split(argv)
    assert rc == 0, f"exit {rc}: {(out + err).strip()[-600:]}"
    return out


def check_round_trip(command: str, printed: str, where: Path) -> None:
    """`printed` (a --print-config output) saved as a file and loaded with --config prints the same."""
    where.write_text(printed)
    rc, again, err = run_hylo_split([command, "--config", str(where), "--print-config"])
    assert rc == 0, f"--config of its own --print-config: exit {rc}: {err.strip()[-600:]}"
    assert yaml.safe_load(again) == yaml.safe_load(printed), f"--print-config of {where} differs from the file"


def test_the_extractor_finds_examples_and_leaves_out_optional_parts():
    lines = ["Intro", "    python jobs/stage1.py --config c.yaml [--set a.b=c ...] [--resume [PATH]]",
             "    hylo convert --dry-run --base-config x.json \\", "        --mla-layers even   # comment",
             "    ray job submit --working-dir . -- python jobs/eval.py --model m", "    make demo"]
    found = examples_in("t", lines)
    assert [(e.command, e.argv) for e in found] == [
        ("stage1", ("--config", "c.yaml")),
        ("convert", ("--dry-run", "--base-config", "x.json", "--mla-layers", "even")),
        ("eval", ("--model", "m")),
    ]


def test_a_stale_example_fails():
    with pytest.raises(AssertionError, match="optim.lr|train"):
        run_example(Example("t", "stage1", ("--config", "configs/demo-smollm2.yaml", "--set", "train.lr=1e-4")))
    with pytest.raises(AssertionError, match="no-such-flag"):
        run_example(Example("t", "fetch-assets", ("--no-such-flag",)))


def test_every_help_lists_examples_and_keeps_their_line_breaks():
    for name in COMMANDS:
        text = help_text(name)
        assert examples_in(name, text.splitlines()), f"hylo {name} --help shows no example command"
        # a `\` line continuation is kept as written (a non-raw docstring would join the lines)
        assert not re.search(r"\S {3,}--", text.split("options:")[0]), f"hylo {name} --help: examples collapsed"


def test_hylo_help_lists_every_command_on_one_line():
    rc, text = run_hylo(["--help"])
    assert rc == 0
    for name in COMMANDS:
        assert re.search(rf"^  {re.escape(name)}\s+\S", text, re.M), f"{name} missing from hylo --help"
    rc, text = run_hylo(["no-such-command"])
    assert rc == 2 and "unknown command" in text


def test_a_print_config_that_does_not_load_back_fails(tmp_path):
    with pytest.raises(AssertionError, match="unknown key"):
        check_round_trip("stage1", "stage: 1\nsteps: 3\n", tmp_path / "x.yaml")
    with pytest.raises(AssertionError, match="differs"):
        check_round_trip("demo", "steps: 3\nforce: true\nquiet: true\n", tmp_path / "y.yaml")


def test_the_default_config_of_every_job_round_trips(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in COMMANDS:
        if name in NOT_JOBS:
            continue
        rc, printed, err = run_hylo_split([name, "--print-config"])
        assert rc == 0, f"hylo {name} --print-config: exit {rc}: {err[-400:]}"
        check_round_trip(name, printed, tmp_path / f"{name}.yaml")


@pytest.mark.slow
def test_every_documented_and_help_example_runs_and_its_config_round_trips(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PWD", str(REPO))
    examples = help_examples() + doc_examples()
    assert len({e.command for e in examples}) == len(COMMANDS), "some command has no example anywhere"
    failures = []
    for i, ex in enumerate(examples):
        scratch = tmp_path / f"ex{i}"
        scratch.mkdir()
        try:
            printed = run_example(ex, scratch)
            if ex.command not in NOT_JOBS and not _parse_only(ex) and "--help" not in ex.argv and printed:
                check_round_trip(ex.command, printed, scratch / "printed.yaml")
        except AssertionError as e:
            failures.append(f"{ex}\n    {e}")
    assert not failures, f"{len(failures)} of {len(examples)} examples fail:\n" + "\n".join(failures)
