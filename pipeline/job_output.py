"""What of a job's output a multi-step run (the demo, the placement search) shows on its terminal.

    echo = JobEcho(tty=sys.stderr.isatty())
    for piece in stream:                    # opened with newline="": lines, and redraws ending in "\\r"
        log.write(echo.log_text(piece))     # the log gets everything, without ANSI codes
        shown = echo.terminal_text(piece)   # None: the log only

Design choices:
* The log keeps every line a job printed; the terminal leaves out only the lines `KNOWN_NOISE` names: messages
  of Ray, DeepSpeed and torch that every successful run prints and that say nothing about this run (why each
  is harmless is written beside it). Each is matched by its own text, never by its level or its source
  alone: an error, a traceback or a warning not listed here still reaches the terminal.
* A Python warning is two lines (the message, then its source line): the source line goes where its message
  went. Ray puts "(ActorName pid=N)" before each line of a worker (`RAY_PREFIX`); a line is matched after it.
* A progress bar (tqdm) redraws itself with "\\r": on a terminal a redraw is shown in place; elsewhere (a
  pipe, a file) only the bar's last state (the piece that ends its line) is, as one line.
* ANSI escape codes (Ray's colours, tqdm's cursor moves) are removed from the log, which is read as a file.
"""

from __future__ import annotations

import re

# Colours, cursor moves: CSI sequences ("\x1b[36m", "\x1b[A") and the two-character escapes.
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# "(RayTrainWorker pid=123)", "(MapWorker(MapBatches(TokenizeUDF)) pid=9, ip=10.0.0.2)", "(gcs_server)":
# where a line came from in Ray's cluster, before the line itself.
RAY_PREFIX = re.compile(r"^\((?:[^()]|\([^()]*(?:\([^()]*\))?[^()]*\))*?(?: pid=\d+[^)]*)?\) ")
# Ray's log-line header: "2026-12-06 02:57:34,591\tINFO worker.py:1841 -- ".
RAY_LOG = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\s+"

# (why it is harmless, the line's text after any RAY_PREFIX)
KNOWN_NOISE: tuple[tuple[str, re.Pattern[str]], ...] = tuple((why, re.compile(pattern)) for why, pattern in (
    # (a job's progress bar may come first on the line: tqdm's first state, ending without a newline)
    ("Ray's INFO log lines: joining the cluster, Ray Data's plan and progress",
     rf"^(?:.*\|.*\] ?)?{RAY_LOG}INFO \S+\.py:\d+ -- "),
    ("Ray Data's note that its progress bars are off in a pipe (the job prints its own progress)",
     rf"^{RAY_LOG}WARNING \S+\.py:\d+ -- Progress bars disabled\."),
    ("Ray Data starts its tokenizer actors with their arguments in the object store; Ray logs it at error "
     "level on every start",
     r"^\[[^\]]* E \d+ \d+\] core_worker\.cc:\d+: Actor with class name: '.*' .*has constructor arguments in "
     r"the object store and max_restarts > 0"),
    ("Ray Data keeps a 2-actor tokenizer pool for a split of a single block",
     r"UserWarning: The minimum number of concurrent actors for '.*' is set to \d+, but the operator only "
     r"received \d+ input"),
    ("Ray Train's placement-group cleaner asks the state API every second whether its controller lives; a "
     "local Ray without a dashboard has no state API (pipeline/ray_init.py). The training driver ends its "
     "run itself; the cleaner is only for a controller that dies",
     r"Failed to query Ray Train Controller actor state\. State API may be temporarily unavailable"),
    ("Ray's GCS, when a job's driver exits: it kills the job's actors, whose processes exited with it (the "
     "kill's connection is closed)",
     r"gcs_actor_\w+\.cc:\d+: Failed to kill actor [0-9a-f]+, return status: .*RpcError"),
    ("DeepSpeed on a machine without an accelerator: the demo runs on CPU by design",
     r"\[WARNING\] \[real_accelerator\.py:\d+:get_accelerator\] Setting accelerator to CPU\."),
    ("torch's deprecation of the collectives DeepSpeed's ZeRO calls (all_gather_into_tensor, "
     "reduce_scatter_tensor), once per training worker and step",
     r"FutureWarning: `torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
))
# A Python warning's first line ("file.py:12: FutureWarning: ..."): the next line is its source line.
WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def known_noise(line: str) -> str | None:
    """Why `line` (no ANSI codes) is known to be harmless, or None."""
    body = RAY_PREFIX.sub("", line, count=1)
    for why, pattern in KNOWN_NOISE:
        if pattern.search(body):
            return why
    return None


class JobEcho:
    """Decides, piece by piece of one job's output, what its log and the terminal get (module docstring)."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        # lines left out as known noise (redraws of a progress bar are not counted)
        self.held = 0
        # the Ray prefixes ("" outside Ray) of held warnings whose source line has not come yet: the lines of
        # Ray's workers interleave, so another worker's line may come in between
        self._pending_source: set[str] = set()

    @staticmethod
    def log_text(piece: str) -> str:
        """The piece as the log keeps it: no ANSI codes, a redraw on a line of its own."""
        text = strip_ansi(piece)
        return text[:-1] + "\n" if text.endswith("\r") and not text.endswith("\r\n") else text

    def terminal_text(self, piece: str) -> str | None:
        """The piece as the terminal shows it, or None."""
        redraw = piece.endswith("\r") and not piece.endswith("\r\n")
        line = strip_ansi(piece).rstrip("\r\n")
        m = RAY_PREFIX.match(line)
        prefix = m.group(0) if m else ""
        body = line[len(prefix):]
        if prefix in self._pending_source:
            self._pending_source.discard(prefix)
            if body.startswith("  "):
                self.held += 1
                return None
        if known_noise(line):
            self.held += 1
            if WARNING_LINE.match(body):
                self._pending_source.add(prefix)
            return None
        if redraw:
            return piece if self.tty and line.strip() else None
        return piece if self.tty else line + "\n"
