"""One logger for every job: a level, a timestamp and, in a rank of a distributed job, the rank (and the node
when the job spans nodes) on each line.

    from hylo.logs import get_logger

    logger = get_logger(__name__)           # a module's logger, under "hylo"
    logger.info(f"[train] resumed from {ckpt} at step {step}")
    logger.warning("[train] warning: ...")

What lines look like (a 2-rank stage-2 run under torchrun; docs/troubleshooting.md, "Logs"):

    2026-12-07 16:51:47.258 INFO [rank 1/2] [zero] rank 1: holds 14,232 of 28,464 parameters (50.0%, ...)
    2026-12-07 16:52:02.167 INFO [rank 0/2] [train] stage 2 done: step 12, loss 0.1277, model runs/ref/model
    2026-12-07 16:52:02.167 WARNING [rank 9/16 node 1 gpu-b] [train] warning: ...   (ranks on 2 nodes)
    2026-12-07 16:40:12.501 INFO [demo] === convert: ...                            (a process of no rank)

Design choices:
* A command's OUTPUT (reports, tables, JSON, `--print-config`, the one-line `error: ...` refusals) is printed
  on stdout (stderr for the refusals) as before; a LOG line (progress, status, what the job is doing) goes
  through this logger to stderr. `hylo convert ... | jq` then reads the JSON alone.
* The level comes from `--log-level` (every command has it: `add_log_level_flag`), else the environment
  variable HYLO_LOG_LEVEL, else info. `set_level` puts it into the environment, so the processes a job
  starts inherit it: the demo's steps, a local Ray's workers (Ray Train's workers, Serve's replicas, Ray
  Data's tasks). A job that joins a cluster hands it to its training workers and teacher replicas itself
  (their runtime env), and torchrun's ranks parse the same `--log-level` (or inherit the variable).
* The rank is read for every line, from the environment torchrun and Ray Train set in a rank (RANK,
  WORLD_SIZE; LOCAL_WORLD_SIZE, and GROUP_RANK / NODE_RANK for the node), else from Ray Train's context of the
  worker. A process of no rank (a driver, a Serve replica) shows none. The node (its rank, the host's name)
  shows when the job's ranks span more than one node (WORLD_SIZE > LOCAL_WORLD_SIZE).
* The libraries follow the level (`set_library_levels`): Ray (`ray`, also `ray.init(logging_level=...)`:
  pipeline/ray_init.py), DeepSpeed (`DeepSpeed`, its `deepspeed.utils.logger`, and its handler) and
  transformers. At info each keeps its own default (Ray info, DeepSpeed and transformers warning): the
  terminal of a run is as it was. At warning or error they are set there too; at debug, to debug. A library
  imported after the setup is set where the project imports it (`import_deepspeed`, `init_ray`); a filter on
  DeepSpeed's logger holds what it logs while it is imported; transformers reads TRANSFORMERS_VERBOSITY, which
  is set for it (unless the user set it).
* The handler writes to `sys.stderr` as it is at each line, so a redirected or captured stderr gets the lines.
  The "hylo" logger does not propagate: a root handler that Ray or a test installs prints no line twice.
* This module imports nothing of the project (a leaf: configs import it) and never imports Ray, DeepSpeed or
  transformers (`hylo --help` imports none of them): it touches their loggers by name, and their modules only
  once something else imported them.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
from typing import Any

# The environment variable a job's level travels in (to its children, workers, replicas and ranks).
ENV = "HYLO_LOG_LEVEL"
DEFAULT = "info"
LEVELS: dict[str, int] = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                          "error": logging.ERROR}
ROOT = "hylo"
# The libraries' loggers and the level each has by itself (what they keep at info).
LIBRARIES: dict[str, int] = {"ray": logging.INFO, "DeepSpeed": logging.WARNING,
                             "transformers": logging.WARNING}
TRANSFORMERS_ENV = "TRANSFORMERS_VERBOSITY"


class LogLevelError(ValueError):
    """HYLO_LOG_LEVEL holds no level (a bad `--log-level` is argparse's one-line error)."""


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (`__name__`): under "hylo", so the one setup covers it. The first call of a
    process gives "hylo" its handler, at HYLO_LOG_LEVEL's level (a process that runs no job's main: a Ray
    worker, Ray Data's actors); `setup` and `set_level` set it again."""
    if not _handler_of_root():
        _handler()
        try:
            logging.getLogger(ROOT).setLevel(LEVELS[env_level()])
        except LogLevelError:  # the job's setup names it; a worker logs at info
            logging.getLogger(ROOT).setLevel(LEVELS[DEFAULT])
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def parse_level(text: str) -> str:
    """A level's name (`debug`, `info`, `warning`, `error`; any case) as this module names it."""
    name = str(text).strip().lower()
    if name not in LEVELS:
        raise LogLevelError(f"{text!r} is not a log level; choose one of {', '.join(LEVELS)}")
    return name


def env_level() -> str:
    """The level HYLO_LOG_LEVEL names, else the default (info)."""
    value = os.environ.get(ENV)
    if not value:
        return DEFAULT
    try:
        return parse_level(value)
    except LogLevelError as e:
        raise LogLevelError(f"{ENV}={value}: not a log level; {str(e).split('; ', 1)[-1]}") from None


def current_level() -> str:
    """The level the "hylo" logger is at (its name)."""
    number = logging.getLogger(ROOT).getEffectiveLevel()
    return next((name for name, n in LEVELS.items() if n == number), DEFAULT)


# ------------------------------------------------------------------------------------ the rank of a line
def _env_rank() -> tuple[int, int, int | None, int | None] | None:
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_world = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE") else None
        node = env.get("GROUP_RANK") or env.get("NODE_RANK")  # torchrun's, Ray Train's
        return rank, world, local_world, int(node) if node else None
    except ValueError:
        return None


def _ray_train_rank() -> tuple[int, int, int | None, int | None] | None:
    """Ray Train's context of this worker (its training function runs), read only where Ray Train set it."""
    module = sys.modules.get("ray.train.v2._internal.execution.context")
    ctx = getattr(module, "_train_context", None)
    if ctx is None:
        return None
    try:
        return (int(ctx.get_world_rank()), int(ctx.get_world_size()), int(ctx.get_local_world_size()),
                int(ctx.get_node_rank()))
    except Exception:  # noqa: BLE001 - another Ray layout: the line goes without its rank
        return None


def rank_label() -> str:
    """"rank R/W" in a rank of a distributed job (torchrun, Ray Train), with "node N HOST" when its ranks
    span nodes; "" elsewhere."""
    found = _env_rank() or _ray_train_rank()
    if found is None:
        return ""
    rank, world, local_world, node = found
    label = f"rank {rank}/{world}"
    if local_world is not None and world > local_world:
        label += f" node {node if node is not None else '?'} {socket.gethostname()}"
    return label


# A line this logger wrote: time, level, the rank where there is one, the message.
LINE = re.compile(r"(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) "
                  r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                  r"(?:\[(?P<rank>rank \d+/\d+(?: node \S+ \S+)?)\] )?(?P<message>.*)")


def message_of(line: str) -> str:
    """The message of a line this logger wrote (its time, level and rank taken off); any other line as it is.
    For a program that reads a job's log lines (`hylo rehearse` reads the teacher pool's count)."""
    found = LINE.fullmatch(line.rstrip("\r\n"))
    return found.group("message") if found else line


class Formatter(logging.Formatter):
    """`2026-12-07 16:21:03.123 LEVEL [rank R/W] message`: local time to the millisecond, the rank where
    there is one (`rank_label`)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s.%(msecs)03d %(levelname)s %(rank)s%(message)s",
                         datefmt="%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        label = rank_label()
        record.rank = f"[{label}] " if label else ""
        return super().format(record)


class StderrHandler(logging.StreamHandler):
    """A handler that writes to `sys.stderr` as it is when a line is written (a capture, a redirect)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


# ------------------------------------------------------------------------------------ the setup
def _handler_of_root() -> StderrHandler | None:
    return next((h for h in logging.getLogger(ROOT).handlers if isinstance(h, StderrHandler)), None)


def _handler() -> StderrHandler:
    """The "hylo" logger's one handler (made on first use)."""
    found = _handler_of_root()
    if found is not None:
        return found
    root = logging.getLogger(ROOT)
    h = StderrHandler()
    h.setFormatter(Formatter())
    root.addHandler(h)
    root.propagate = False
    return h


def library_level(library: str, level: str | None = None) -> int:
    """The level library logger `library` is set to at the job's level (module docstring)."""
    number = LEVELS[level or current_level()]
    return LIBRARIES[library] if number == logging.INFO else number


class _AtLeast(logging.Filter):
    """On DeepSpeed's logger: drops what is below the job's level for it, also what DeepSpeed logs while it is
    imported (its accelerator warning), before the import's own `setLevel` can be changed. (The filter is
    set by name, before the import, which keeps a logger's filters.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= library_level("DeepSpeed")


def set_library_levels(level: str | None = None) -> None:
    """Ray's, DeepSpeed's and transformers' loggers at `level` (default: the job's), those of them that are
    loaded; call it again after importing one of them (their import sets their own)."""
    level = level or current_level()
    for name in LIBRARIES:
        number = library_level(name, level)
        lib = logging.getLogger(name)
        lib.setLevel(number)
        if name == "DeepSpeed":
            for h in lib.handlers:  # DeepSpeed's own handler filters at its import-time level too
                h.setLevel(number)
            if not any(isinstance(f, _AtLeast) for f in lib.filters):
                lib.addFilter(_AtLeast())
    if level != DEFAULT and not os.environ.get(TRANSFORMERS_ENV):
        os.environ[TRANSFORMERS_ENV] = logging.getLevelName(library_level("transformers", level)).lower()
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None and hasattr(tf_logging, "set_verbosity"):
        tf_logging.set_verbosity(library_level("transformers", level))


def set_level(level: str) -> str:
    """The job's level (`--log-level`), for this process and the processes it starts (HYLO_LOG_LEVEL); the
    libraries' loggers follow. Returns the level's name."""
    name = parse_level(level)
    os.environ[ENV] = name
    _handler()
    logging.getLogger(ROOT).setLevel(LEVELS[name])
    set_library_levels(name)
    return name


def setup() -> str:
    """The logger of a process at the level of HYLO_LOG_LEVEL (else info): every job's start (`job_main`), a
    training worker, a teacher replica. Returns the level's name. HYLO_LOG_LEVEL unset stays unset."""
    name = env_level()
    _handler()
    logging.getLogger(ROOT).setLevel(LEVELS[name])
    set_library_levels(name)
    return name


def child_env() -> dict[str, str]:
    """What a process this job starts elsewhere (a worker of a cluster it joined) needs to log at its level:
    HYLO_LOG_LEVEL when the level was given or is not the default, else nothing (a worker's default)."""
    level = current_level()
    return {} if level == DEFAULT and ENV not in os.environ else {ENV: level}


# ------------------------------------------------------------------------------------ the flag
class _LevelAction(argparse.Action):
    """`--log-level LEVEL`: set as it is parsed, so what the job logs while it reads its config has it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                  option_string: str | None = None) -> None:
        setattr(namespace, self.dest, set_level(values))


def _level_type(text: str) -> str:
    try:
        return parse_level(text)
    except LogLevelError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_level_type.__name__ = "log level"


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    """--log-level debug|info|warning|error (every command)."""
    parser.add_argument("--log-level", type=_level_type, action=_LevelAction, default=None,
                        metavar="{" + ",".join(LEVELS) + "}",
                        help=f"what the job logs on stderr (default: ${ENV}, else {DEFAULT}); Ray's, "
                             "DeepSpeed's and transformers' logs follow it")
