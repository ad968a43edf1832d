"""The `hylo` command (one sub-command per job) and the error contract of every job: bad input -> one
`error: ...` line on stderr and exit status 2.

    hylo convert --dry-run --base-config path/to/config.json --mla-layers even
    hylo stage1 --config demo-smollm2.yaml --print-config

`COMMANDS` is the one dispatch table: `hylo NAME ARGS` calls the same `main(argv)` as `python jobs/NAME.py
ARGS` (the file `ray job submit -- python jobs/stage2.py` runs), so both take the same flags and config
(`--config`, `--set`, `--print-config`).

A job's main is wrapped by `job_main`:

    from hylo.pipeline.cli import job_main

    @job_main
    def main(argv: list[str] | None = None) -> int:
        ...

    if __name__ == "__main__":
        sys.exit(main())

Design choices:
* Bad input is the project's own error classes for configs, data, checkpoints, caches and assets
  (`INPUT_ERRORS`, named by module and class so this module imports none of them: an exception of a
  module that was never imported cannot occur), plus OSErrors about a path (missing, permission denied,
  read-only file system, disk full, ...). Their messages already name the file, record and field.
* They are found also when wrapped: Ray Train's WorkerGroupError carries each worker's exception, a
  RayTaskError its `cause`, `raise ... from e` its `__cause__`. A worker's data error thus still ends
  as one line and exit status 2.
* Anything else is a bug: it keeps its traceback and exit status 1.
* A bad flag (argparse) is the same one line, `error: argument --x: ... (see <prog> --help)`, exit 2,
  instead of argparse's usage block; an unknown one names the closest valid flag ("did you mean").
  Parsers are built with `allow_abbrev=False`: a prefix of a flag (`--mla-layer`) is an error, not that
  flag, so a typo never silently means something.
* Every numeric flag has a range, checked as it is parsed (`bounded_int` / `bounded_float`, their bounds named
  below: `MAX_COUNT`, `MAX_TIMEOUT_S`, ...): a huge count or a nan timeout is the flag's one line, never work
  that grows without bound.
* Ctrl-C (KeyboardInterrupt) prints one line, `interrupted (Ctrl-C)`, and exits with status 130 (128 +
  SIGINT, what a shell reports for it), after the job's own cleanup (run lock, Ray) ran.
* A job that starts child processes or writes temporary files (`@job_main(stops=True)`) runs under the
  signal rule of hylo/stopping.py: SIGTERM or SIGINT ends its children and removes its temporary files,
  then one line, `hylo NAME: stopped by SIGTERM; ended 1 child, removed ...`, and exit status 143 / 130.
* What a job logs (progress, status) goes through hylo/logs.py: a level, a timestamp and the rank on each
  line, on stderr; `--log-level` (every command) or HYLO_LOG_LEVEL sets the level. `job_main` sets the
  logger up before the job's main runs. The `error: ...` line, `interrupted (Ctrl-C)` and a job's report are
  no log lines: they are printed as they are.
* A message is printed on one line (a multi-line message is joined), after everything else the job
  printed (Ray is disconnected first, so its streamed worker logs end before it): `tail -1` of a log
  shows it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import importlib
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import yaml

from hylo import __version__, logs
from hylo.rules import suggest
from hylo.stopping import stopping
from hylo.yaml_limits import YamlShapeError, check_yaml_shape


class BadArgument(ValueError):
    """A command-line flag has a value the job cannot use (the message names the flag)."""


# (module, class) of every error that means "the input is wrong", not "the code is wrong".
INPUT_ERRORS: tuple[tuple[str, str], ...] = (
    ("hylo.pipeline.cli", "BadArgument"),
    ("hylo.pipeline.config", "ConfigError"),
    ("hylo.pipeline.data.readers", "SourceError"),
    ("hylo.pipeline.data.rowfile", "DataFormatError"),
    ("hylo.pipeline.data.prepare", "PrepareError"),
    ("hylo.kernels.varlen", "BoundaryError"),
    ("hylo.pipeline.data.rows", "PackedRowError"),
    ("hylo.pipeline.train.checkpoint.layout", "CheckpointError"),
    ("hylo.pipeline.train.storage", "StorageError"),
    ("hylo.pipeline.train.nonfinite", "NonFiniteError"),
    ("hylo.pipeline.teacher.cache", "CacheMismatchError"),
    ("hylo.pipeline.teacher.cache", "CacheFormatError"),
    ("hylo.pipeline.eval.decode", "EvalError"),
    ("hylo.pipeline.placement.rows", "PlacementError"),
    ("hylo.config", "HybridConfigError"),
    ("hylo.upcycle", "UpcycleError"),
    ("hylo.assets", "AssetError"),
    ("hylo.weight_files", "WeightsFileError"),
    ("hylo.outputs", "OutputConflictError"),
    ("hylo.io", "CheckpointMismatchError"),
    ("hylo.released.layout", "ReleasedLayoutError"),
    ("hylo.model_files", "ModelFileError"),
    ("hylo.pipeline.ray_init", "RayStartupError"),
    ("hylo.logs", "LogLevelError"),
    ("hylo.pipeline.serve", "ServeError"),
    ("hylo.serving.widen", "ServingShapeError"),
)
# OSError subclasses the project raises with its own message (errno unset) for a path problem.
PATH_ERROR_TYPES = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
PATH_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                         errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP,
                         errno.EFBIG, errno.ENOTEMPTY})
# How a Rust std::io::Error shows inside an extension's exception message ("... (os error 28)", or its
# Debug form "Os { code: 28, ... }").
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")
ROOT = Path(__file__).resolve().parents[1]


def _input_classes() -> tuple[type, ...]:
    found = []
    for module, name in INPUT_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _where_raised(e: BaseException) -> str | None:
    """`file:line (function)` of the innermost frame of this repository's code in `e`'s traceback."""
    where = None
    for fs in traceback.extract_tb(e.__traceback__):
        try:
            rel = Path(fs.filename).resolve().relative_to(ROOT)
        except ValueError:
            continue
        where = f"{rel}:{fs.lineno} ({fs.name})"
    return where


# Local names under which the frames of a failed write usually hold the file they write.
_PATH_LOCALS = ("filename", "file", "path", "tmp", "save_directory", "out", "out_dir", "directory")


def _file_in_traceback(tb: Any) -> str | None:
    """The file a failed read or write was working on, from the innermost frame that holds one."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        scopes = [frame.f_locals]
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "__dict__"):
            scopes.append(vars(owner))
        for scope in scopes:
            for name in _PATH_LOCALS:
                value = scope.get(name)
                if isinstance(value, str | os.PathLike) and os.sep in os.fspath(value):
                    return os.fspath(value)
    return None


def _os_error_message(e: OSError) -> str:
    if e.filename is None:
        if e.errno is None:
            return str(e)
        reason = e.strerror or os.strerror(e.errno)
        target = _file_in_traceback(e.__traceback__)
        if target:
            return f"{target}: {reason}"
        where = _where_raised(e)
        return reason + (f" (while writing or reading in {where})" if where else "")
    text = f"{e.filename}: {e.strerror or os.strerror(e.errno or 0)}"
    return text + (f" -> {e.filename2}" if e.filename2 else "")


def input_error_message(e: BaseException, _depth: int = 0) -> str | None:
    """The one-line message if `e` (or an exception it wraps) is bad input, else None (a bug)."""
    if _depth > 8 or e is None:
        return None
    if isinstance(e, _input_classes()):
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException) and cause is not e:
            # RayTaskError(as_instanceof_cause): the message holds the remote traceback; its cause is clean
            return input_error_message(cause, _depth + 1) or _one_line(str(cause))
        return _one_line(str(e))
    if isinstance(e, OSError) and ((isinstance(e, PATH_ERROR_TYPES) and e.errno is None) or e.errno in PATH_ERRNOS):
        return _one_line(_os_error_message(e) if e.errno is not None else str(e))
    rust = _RUST_OS_ERROR.search(str(e))
    code = int(rust.group(1) or rust.group(2)) if rust else None
    if code in PATH_ERRNOS:
        # an I/O error inside a Rust extension (safetensors, tokenizers): same errno, no file name
        return _os_error_message(OSError(code, os.strerror(code)).with_traceback(e.__traceback__))
    failures = getattr(e, "worker_failures", None)
    if isinstance(failures, dict):
        for rank, err in sorted(failures.items(), key=lambda kv: str(kv[0])):
            msg = input_error_message(err, _depth + 1) if isinstance(err, BaseException) else None
            if msg:
                return f"worker {rank}: {msg}"
    for attr in ("controller_failure", "cause"):
        inner = getattr(e, attr, None)
        if isinstance(inner, BaseException) and inner is not e:
            msg = input_error_message(inner, _depth + 1)
            if msg:
                return msg
    for inner in (e.__cause__, e.__context__):
        if inner is not None and inner is not e:
            msg = input_error_message(inner, _depth + 1)
            if msg:
                return msg
    return None


def report_error(message: str) -> None:
    """Print `error: <message>` (on one line) on stderr, after everything the job printed so far."""
    sys.stdout.flush()
    print(f"error: {_one_line(message)}", file=sys.stderr, flush=True)


def _stop_ray_logs() -> None:
    """Disconnect from Ray (if the job started or joined it) so its streamed worker logs end before the
    `error:` line, which then is the last line of the output."""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - a failing shutdown must not hide the input error
        pass


def _option_hint(parser: argparse.ArgumentParser, message: str) -> str:
    """"; did you mean --x?" for the first unknown flag of an `unrecognized arguments:` message."""
    if not message.startswith("unrecognized arguments:"):
        return ""

    flags = [t.split("=", 1)[0] for t in message.split(":", 1)[1].split() if t.startswith("--")]
    options = [o for o in parser._option_string_actions if o.startswith("--")]
    return suggest(flags[0], options).replace("'", "") if flags else ""


def _argparse_error(parser: argparse.ArgumentParser, message: str) -> None:
    report_error(f"{_one_line(message)}{_option_hint(parser, message)} (see {parser.prog} --help)")
    raise SystemExit(2)


@contextlib.contextmanager
def _one_line_argparse_errors() -> Iterator[None]:
    """While a job's main runs, argparse reports a bad flag as one `error:` line (exit status 2)."""
    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _argparse_error  # type: ignore[assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved  # type: ignore[method-assign]


# The exit status of a job stopped by Ctrl-C: 128 + SIGINT, as a shell reports a process SIGINT ended.
INTERRUPTED_EXIT = 130


def report_interrupt() -> int:
    """Ctrl-C: one line on stderr (after Ray's streamed logs end); returns the exit status, 130."""
    _stop_ray_logs()
    sys.stdout.flush()
    print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT


def command_name(fn: Callable[..., Any]) -> str:
    """`hylo NAME` of the job whose main is `fn` (hylo.jobs.kernels_check -> hylo kernels-check)."""
    module = fn.__module__
    name = Path(sys.argv[0]).stem if module == "__main__" else module.rsplit(".", 1)[-1]
    return f"hylo {name.replace('_', '-')}"


def leave(rc: int | None) -> NoReturn:
    """`sys.exit(rc)`, except in a rank that torchrun started (`TORCHELASTIC_RUN_ID` set): that process ends
    without the interpreter's teardown (`os._exit`, after flushing its output).

    By then the rank's run is over: the session closed (a barrier, the process group destroyed), every file
    written atomically and closed. What teardown would still do is destroy the C++ threads of process groups
    that Python objects (DeepSpeed's engine) still hold, and that aborted finished ranks now and then:
    `terminate called without an active exception`, SIGABRT, and torchrun fails the whole job (docs/testing.md)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if rc is None else int(rc))
    sys.exit(rc)


def job_main(fn: Callable[..., int | None] | None = None, *, stops: bool = False) -> Any:
    """Wrap a job's `main(argv)`: bad input -> `error: ...` on stderr and 2; Ctrl-C -> one line and 130; a bug
    keeps its traceback. `@job_main(stops=True)`: a job that starts child processes or writes temporary
    files runs under the signal rule of hylo/stopping.py (SIGTERM / SIGINT end its children and remove its
    temporary files; one line `hylo NAME: stopped by SIGTERM; ...`, exit status 143 / 130)."""
    if fn is None:
        return functools.partial(job_main, stops=stops)

    @functools.wraps(fn)
    def main(*args: Any, **kwargs: Any) -> int:
        try:
            # the log's format and level (HYLO_LOG_LEVEL; --log-level sets it again as it is parsed)
            logs.setup()
            with _one_line_argparse_errors():
                if stops:
                    with stopping(command_name(fn)):
                        rc = fn(*args, **kwargs)
                else:
                    rc = fn(*args, **kwargs)
        except KeyboardInterrupt:
            return report_interrupt()
        except SystemExit:
            raise
        except Exception as e:
            message = input_error_message(e)
            if message is None:
                raise
            _stop_ray_logs()
            report_error(message)
            return 2
        return 0 if rc is None else rc

    return main


# sub-command -> (module holding the job's `main(argv)`, one line for `hylo --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("hylo.jobs.convert", "convert a Llama / Qwen3 checkpoint into a HyLo hybrid; import/export the released layout"),
    "decontaminate": ("hylo.jobs.decontaminate", "remove chat records that overlap evaluation benchmarks (n-gram matching)"),
    "prepare-data": ("hylo.jobs.prepare_data", "tokenise and pack a chat mixture into training rows (Ray Data)"),
    "teacher-cache": ("hylo.jobs.teacher_cache", "write the teacher's top-k logits over packed rows (offline KL targets)"),
    "stage1": ("hylo.jobs.stage1", "stage 1: layer-wise distillation from the base (Enhanced-ILD, Ray Train)"),
    "stage2": ("hylo.jobs.stage2", "stage 2: end-to-end KL distillation from the teacher (Ray Train)"),
    "eval": ("hylo.jobs.eval", "evaluate a checkpoint: KL / perplexity, retrieval, KV cache, lm-evaluation-harness"),
    "place-layers": ("hylo.jobs.place_layers", "choose which layers keep full attention (MLA) by measurement"),
    "estimate": ("hylo.jobs.estimate", "memory per GPU and FLOPs of one training step of a config, on fake tensors"),
    "kernels-check": ("hylo.jobs.kernels_check", "compile every Triton kernel of a config's step for each target GPU (no GPU needed)"),
    "rehearse": ("hylo.jobs.rehearse", "rehearse a recipe's Ray topology on simulated GPU nodes (CPU, tiny models)"),
    "serve": ("hylo.jobs.serve", "serve a HyLo checkpoint with vLLM's OpenAI-compatible server (its own environment)"),
    "demo": ("hylo.jobs.demo", "the whole recipe on SmolLM2-135M-Instruct and ShareGPT, on local Ray, on CPU"),
    "fetch-assets": ("hylo.jobs.fetch_assets", "fetch the offline assets (model, ShareGPT, HumanEval) into the cache"),
    "configs": ("hylo.jobs.configs", "list the shipped config files, print one or copy one out to edit"),
    "clean": ("hylo.jobs.clean", "remove what a killed job left beside its output directory (.OUT.tmp-*)"),
}
# Commands that are not jobs: they take no --config / --set / --print-config.
NOT_JOBS = ("configs", "clean")


def hylo_help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: hylo COMMAND [ARGS ...]   (hylo COMMAND --help for its options)", "",
             "Upcycle a pretrained Transformer into a HyLo hybrid (MLA + Gated DeltaNet / Mamba-2) and distil it.",
             f"Every command but {' and '.join(NOT_JOBS)} takes --config FILE (or the name of a shipped config:",
             "`hylo configs` lists them), --set KEY=VALUE and --print-config. Every command takes",
             f"--log-level {{{','.join(logs.LEVELS)}}} (or ${logs.ENV}). A relative path, in a config",
             "or a flag, is relative to the current directory. In a checkout, `python jobs/NAME.py` is",
             "`hylo NAME` (dashes as underscores).", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def hylo_main(argv: list[str] | None = None) -> int:
    """The `hylo` console script: `hylo COMMAND ARGS` runs that job's `main(ARGS)`. `hylo` alone prints the usage
    on stderr and returns 2; `hylo --help` prints it on stdout and returns 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        # no command: the usage on stderr and exit status 2, as argparse does for a missing argument
        print(hylo_help(), file=sys.stderr)
        print("\nhylo: error: a command is required", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(hylo_help())
        return 0
    if argv[0] == "--version":
        print(f"hylo {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        report_error(f"unknown command {name!r}{suggest(name, COMMANDS) or ';'} the commands are "
                     f"{', '.join(COMMANDS)} (see hylo --help)")
        return 2
    saved = sys.argv
    # argparse names the program after argv[0]: the help and errors then read `hylo NAME ...`
    sys.argv = [f"hylo {name}", *rest]
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return module.main(rest)
    except KeyboardInterrupt:  # while importing the job (torch, Ray): main's own wrapper is not running yet
        return report_interrupt()
    finally:
        sys.argv = saved


def check_finite_args(args: argparse.Namespace) -> None:
    """Every float flag must be a finite number (a bare argparse float accepts nan and inf)."""
    for name, value in vars(args).items():
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise BadArgument(f"--{name.replace('_', '-')}={v}: must be a finite number")


def writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Create output directory `path` (and parents) now and check it can be written, so a read-only or
    missing output location fails before the work, not after it. `what` names the option in the error."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadArgument(f"{what}={os.fspath(path)}: cannot create it ({e.strerror or e})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
        raise BadArgument(f"{what}={os.fspath(path)}: not writable "
                          f"({os.strerror(errno.EROFS if read_only else errno.EACCES)})")
    return p


# The upper bounds of numeric flags that no config rule bounds (every numeric flag of every job has one, checked
# as the flag is parsed: `bounded_int` / `bounded_float`; docs/troubleshooting.md lists them).
# A timeout: a week, in seconds.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# Counts of records, rows, steps, examples, tokens: beyond any run this project makes, and an int32.
MAX_COUNT = 2**31 - 1
# Nodes of a (simulated) cluster, and the GPUs and CPUs one node declares.
MAX_NODES = 1024
MAX_GPUS_PER_NODE = 64
MAX_CPUS_PER_NODE = 4096
# The world size a per-GPU figure divides by (65,536 GPUs is beyond any training cluster); also the largest
# sequence-parallel group.
MAX_WORLD_SIZE = 1 << 16
# Words of a decontamination n-gram; few-shot examples and prompts per batch of an lm-eval task.
MAX_NGRAM = 256
MAX_FEWSHOT = 1024
MAX_BATCH = 1 << 16


def _bound_text(low: float, high: float, low_open: bool = False) -> str:
    return f"{'(' if low_open else '['}{low:g}, {high:g}]"


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """argparse `type=` for an integer flag in [low, high]: a value outside is the flag's one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def bounded_float(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """argparse `type=` for a finite number flag in [low, high] (`low_open`: (low, high]); nan and inf are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"must be a finite number in {_bound_text(low, high, low_open)}, "
                                             f"got {text}")
        return value

    parse.__name__ = f"number in {_bound_text(low, high, low_open)}"
    return parse


def positive_finite_float(high: float) -> Callable[[str], float]:
    """argparse `type=` for a size or a timeout: a finite number in (0, high]."""
    return bounded_float(0.0, high, low_open=True)


def int_list(text: str) -> list[int]:
    """argparse `type=` for a YAML list of integers in [1, MAX_COUNT], e.g. [256,512]."""
    try:
        check_yaml_shape(text)
        value = yaml.safe_load(text)
    except (yaml.YAMLError, YamlShapeError):
        value = None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise argparse.ArgumentTypeError(f"expected a list of integers such as [256,512], got {text!r}")
    if not value or not all(1 <= v <= MAX_COUNT for v in value):
        raise argparse.ArgumentTypeError(f"expected a non-empty list of integers in [1, {MAX_COUNT:,}], got {text!r}")
    return value
