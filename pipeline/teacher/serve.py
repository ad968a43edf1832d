"""The teacher pool: a Ray Serve deployment holding one `TeacherModel` per replica.

Legend: T tokens of a row, H hidden size, V vocabulary, C tokens per chunk, K top-k.

Design choices:
* Handles, not HTTP, carry rows (from training workers, inside Ray). The HTTP proxy binds
  127.0.0.1 by default and only answers `GET /<app>` with the teacher's identity.
* One batched step per replica: `serve.batch` with a token-count size function collects rows until
  `max_batch_tokens` and runs their forward to hidden states together; a row bigger than the budget
  runs alone instead of being rejected. The forward runs in a worker thread, so the replica keeps
  queueing requests (and filling the next batch) while it computes.
* `topk(rows, k, dtype, token_range=None)`: one or more rows -> one top-k record per row (dicts of CPU
  tensors: logprobs fp16/bf16/fp32 [T, K], indices int32 [T, K], tail_logmass fp32 [T]); with
  `token_range=(start, end)` (a sequence-parallel rank's tokens) the replica runs the whole row (a token's
  targets need its whole prefix) and answers tokens [start, end) only, so only the range crosses the wire.
  A request without it (the protocol before ranges) gets whole rows, as before.
* `ranges=[(s0, e0), ..., (sN-1, eN-1)]` (every rank's range of a sequence-parallel group): ONE forward of the
  row answers every range. `topk` gives one record per range per row; `stream` gives chunk j of every range,
  in range order, then chunk j + 1 (its start and end are then offsets into each range, all of one length).
  One rank of the group asks and relays the others their parts (client.py), so a group costs one forward a row.
* `stream(row, C, start, end)`: a generator of full-logit chunks [C, V] for tokens [start, end) (a window
  of the whole row, or of a rank's range).
* `hidden(rows, token_range=None, ranges=None)`: the exact teacher as its final hidden states [T, H'] (after the
  final norm) in the teacher's dtype, one CPU tensor per row (per range with `ranges`): H' / V of the logits'
  bytes (4,096 / 128,256 for Llama-3.1-8B). The trainer holds the LM head (teacher/head.py) and checks it against
  `head_info()`: the replica's head's shape, dtype and digest.
* Both check the range(s) they receive against every row (`protocol.check_token_range`): one ValueError naming
  the request row and the range, which the client does not retry.
* `rows_seen` counts the row forwards a replica ran (`info()`). The driver prints every replica's count when it
  deletes the pool (`pool_forwards`, `forwards_line`); `hylo rehearse` checks the total: one forward per row
  per sequence-parallel group.
  Serve streams have no flow control of their own, so the client asks for a bounded window of
  chunks at a time; the replica keeps the row's hidden states [T, H] in a small LRU of sessions
  (a `serve.multiplexed` loader keyed by the session id, which also steers the next window to the
  same replica). A window that lands elsewhere recomputes the hidden states: slower, still exact.
* Test hook (`TeacherFaultConfig`, stage 2's `fault.teacher`): while `kill_marker` exists, the first
  replica to reach `kill_at_row` rows deletes it and exits its process (or kills its whole Ray node:
  `kill_target: node`), to exercise the client's retries against a real replica death.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

import torch
from ray import serve

from hylo import logs
from hylo.kernels.backend import keep_freed_host_memory
from hylo.logs import message_of
from hylo.pipeline.config import from_dict, to_dict
from hylo.pipeline.data.rows import PackedRow, check_row
from hylo.pipeline.ray_init import kill_this_node
from hylo.pipeline.teacher.config import (
    TeacherFaultConfig,
    TeacherModelConfig,
    TeacherPoolConfig,
    pool_port_taken,
)
from hylo.pipeline.teacher.head import head_info
from hylo.pipeline.teacher.model import TeacherModel, torch_dtype
from hylo.pipeline.teacher.protocol import check_token_range


class _TokenBudgetWarningFilter(logging.Filter):
    """Serve warns when max_batch_size exceeds max_ongoing_requests; ours counts tokens, not requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "max_ongoing_requests" not in record.getMessage()


_pool_log = logs.get_logger(__name__)


def _batch_tokens(rows: list[PackedRow]) -> int:
    return sum(r.num_tokens for r in rows)


def topk_to_wire(rec: Any) -> dict[str, torch.Tensor]:
    return {"logprobs": rec.logprobs, "indices": rec.indices, "tail_logmass": rec.tail_logmass}


def check_ranges(ranges: Any, rows: list[PackedRow], who: str, same_length: bool = False) -> list[tuple[int, int]]:
    """A group's ranges of a request: a non-empty list of token ranges, each fitting every row
    (`check_token_range`); `same_length`: all of one length (a stream's offsets index each). Else ValueError."""
    if isinstance(ranges, str | bytes) or not isinstance(ranges, list | tuple) or not ranges:
        raise ValueError(f"{who}: ranges={ranges!r} must be a non-empty list of (start, end) token ranges")
    out = [check_token_range(r, rows, who) for r in ranges]
    if same_length and len({e - s for s, e in out}) != 1:
        raise ValueError(f"{who}: ranges {out} must all be of one length (a stream's offsets index each)")
    return out


def pool_forwards(app_name: str, timeout_s: float = 30.0) -> list[int]:
    """The row forwards each running replica of pool `app_name` ran (its `rows_seen`), largest first: one
    `info` call on every replica (Serve's `broadcast`)."""
    infos = serve.get_app_handle(app_name).broadcast("info").results(timeout_s=timeout_s)
    return sorted((int(i["rows_seen"]) for i in infos), reverse=True)


def forwards_line(app_name: str, forwards: list[int]) -> str:
    """The line the driver logs when it deletes the pool (`forwards_in` reads it back)."""
    return (f"[teacher] pool {app_name!r}: its replicas ran {sum(forwards)} row forwards "
            f"({', '.join(map(str, forwards)) or 'no replica answered'})")


def forwards_in(line: str, app_name: str) -> int | None:
    """The total of a `forwards_line` of pool `app_name` (as logged: after the line's time, level and rank),
    None for any other line."""
    found = re.match(rf"\[teacher\] pool {re.escape(repr(app_name))}: its replicas ran (\d+) row forwards",
                     message_of(line))
    return int(found.group(1)) if found else None


class _Session:
    """Hidden states of one streamed row, computed once per replica."""

    def __init__(self) -> None:
        self.hidden_TH: torch.Tensor | None = None
        self.row_id: str | None = None
        self.lock = asyncio.Lock()


@serve.deployment
class TeacherDeployment:
    def __init__(self, model_cfg: dict[str, Any], pool_cfg: dict[str, Any], fault_cfg: dict[str, Any]) -> None:
        self.model_cfg = from_dict(TeacherModelConfig, model_cfg)
        self.pool_cfg = from_dict(TeacherPoolConfig, pool_cfg)
        self.fault_cfg = from_dict(TeacherFaultConfig, fault_cfg)
        logs.setup()  # a Serve replica: the job's level (HYLO_LOG_LEVEL)
        self.teacher = TeacherModel.from_config(self.model_cfg)
        if self.teacher.device.type == "cpu":
            keep_freed_host_memory()
        logging.getLogger("ray.serve").addFilter(_TokenBudgetWarningFilter())
        self._hidden_batched.set_max_batch_size(self.pool_cfg.max_batch_tokens)
        self._hidden_batched.set_batch_wait_timeout_s(self.pool_cfg.batch_wait_timeout_s)
        self.rows_seen = 0
        self.armed_rows = 0
        self._head_info: dict[str, Any] | None = None
        # (rows, tokens) of recent batched forwards: lets tests and operators see the token budget at work.
        self.batch_log: deque[tuple[int, int]] = deque(maxlen=256)

        async def new_session(session_id: str) -> _Session:
            return _Session()

        # Wired per instance so the LRU size comes from the config.
        self._session = serve.multiplexed(max_num_models_per_replica=self.pool_cfg.stream_sessions)(new_session)

    async def __call__(self, request: Any = None) -> dict[str, Any]:
        return self.info()

    def info(self) -> dict[str, Any]:
        return {**self.teacher.info(), "pid": os.getpid(), "rows_seen": self.rows_seen,
                "max_batch_tokens": self.pool_cfg.max_batch_tokens, "batches": list(self.batch_log)}

    def head_info(self) -> dict[str, Any]:
        """The LM head's vocabulary, hidden size, dtype and digest (teacher/head.py), computed once."""
        if self._head_info is None:
            self._head_info = head_info(self.teacher.lm_head_weight)
        return self._head_info

    def _maybe_fail(self) -> None:
        marker = self.fault_cfg.kill_marker
        if not marker or not os.path.exists(marker):
            return
        self.armed_rows += 1
        if self.armed_rows < self.fault_cfg.kill_at_row:
            return
        try:
            os.remove(marker)
        except FileNotFoundError:
            return
        if self.fault_cfg.kill_target == "node":
            # the replica's whole node goes, with the requests queued on it
            kill_this_node()
        # Hard exit: in-flight requests on this replica see a dead actor, as with a real crash.
        os._exit(1)

    def _check(self, row: Any, where: str) -> PackedRow:
        """A row a request brought, checked against the row contract and this teacher's vocabulary."""
        rid = getattr(row, "given_id", None) or (row.get("row_id") if isinstance(row, Mapping) else None)
        return check_row(row, where=f"teacher replica: {where}" + (f" (row_id {rid})" if rid else ""),
                         vocab_size=self.teacher.vocab_size, received=True)

    @serve.batch(max_batch_size=8192, batch_wait_timeout_s=0.02, batch_size_fn=_batch_tokens)
    async def _hidden_batched(self, rows: list[PackedRow]) -> list[torch.Tensor]:
        self.batch_log.append((len(rows), _batch_tokens(rows)))
        return await asyncio.to_thread(self.teacher.hidden_batch, rows)

    async def _hidden(self, row: PackedRow) -> torch.Tensor:
        self.rows_seen += 1
        self._maybe_fail()
        if row.num_tokens > self.pool_cfg.max_batch_tokens:
            return (await asyncio.to_thread(self.teacher.hidden_batch, [row]))[0]
        return await self._hidden_batched(row)

    async def topk(
        self, rows: Mapping[str, Any] | PackedRow | list[Mapping[str, Any] | PackedRow], k: int,
        dtype: str = "float16", token_range: tuple[int, int] | None = None,
        ranges: list[tuple[int, int]] | None = None,
    ) -> list[dict[str, torch.Tensor]] | list[list[dict[str, torch.Tensor]]]:
        """Top-k records, one per row, in request order; of tokens [start, end) only with `token_range`; with
        `ranges`, one list per row of one record per range (one forward of the row answers them all)."""
        if isinstance(rows, Mapping | PackedRow):
            rows = [rows]
        if not 0 < k <= self.teacher.vocab_size:
            raise ValueError(f"k={k} must be in 1..{self.teacher.vocab_size} (teacher vocabulary)")
        torch_dtype(dtype)
        # the whole rows' forward (the range's targets need their prefix); top-k of the range(s) only
        hiddens, rng, rngs = await self._forward_request(rows, token_range, ranges)
        out: list[Any] = []
        for h in hiddens:
            if rngs is not None:
                out.append([topk_to_wire(await asyncio.to_thread(self.teacher.topk_from_hidden, h[s:e], k, dtype))
                            for s, e in rngs])
                continue
            if rng is not None:
                h = h[rng[0]:rng[1]]
            rec = await asyncio.to_thread(self.teacher.topk_from_hidden, h, k, dtype)
            out.append(topk_to_wire(rec))
        return out

    async def _forward_request(
        self, rows: list[Mapping[str, Any] | PackedRow], token_range: tuple[int, int] | None,
        ranges: list[tuple[int, int]] | None,
    ) -> tuple[list[torch.Tensor], tuple[int, int] | None, list[tuple[int, int]] | None]:
        """A request's rows checked (they come over the network: each is checked here, whatever its type; the
        client sends PackedRows), its token range or ranges checked against them, and each whole row's final hidden
        states: (hiddens, token range, ranges)."""
        prows = [self._check(r, f"request row {i}") for i, r in enumerate(rows)]
        rng = check_token_range(token_range, prows, "teacher replica: request")
        if ranges is not None and rng is not None:
            raise ValueError(f"teacher replica: request: token_range={rng} and ranges={ranges!r}: give one")
        rngs = None if ranges is None else check_ranges(ranges, prows, "teacher replica: request")
        return list(await asyncio.gather(*(self._hidden(r) for r in prows))), rng, rngs

    async def hidden(
        self, rows: Mapping[str, Any] | PackedRow | list[Mapping[str, Any] | PackedRow],
        token_range: tuple[int, int] | None = None, ranges: list[tuple[int, int]] | None = None,
    ) -> list[torch.Tensor] | list[list[torch.Tensor]]:
        """Final hidden states [T, H'] (the teacher's dtype, on the host), one per row, in request order; of tokens
        [start, end) only with `token_range`; with `ranges`, one list per row of one tensor per range (one forward of
        the row answers them all)."""
        if isinstance(rows, Mapping | PackedRow):
            rows = [rows]
        hiddens, rng, rngs = await self._forward_request(rows, token_range, ranges)
        out: list[Any] = []
        for h in hiddens:
            if rngs is not None:
                out.append([h[s:e].to("cpu", copy=True) for s, e in rngs])
            else:
                # a copy of the range alone: what crosses the wire is the range's bytes, not the row's
                out.append((h if rng is None else h[rng[0]:rng[1]]).to("cpu", copy=True))
        return out

    async def stream(
        self, row: Mapping[str, Any], chunk_tokens: int, start: int = 0, end: int | None = None,
        dtype: str | None = None, ranges: list[tuple[int, int]] | None = None,
    ) -> AsyncIterator[torch.Tensor]:
        """Full logits [C, V] for tokens [start, end) of one row (end None: its last), chunk by chunk (CPU
        tensors); the hidden states are the whole row's. With `ranges` (all of one length L), [start, end) are
        offsets into each range (end None: L), and chunk j of every range comes in range order before chunk
        j + 1."""
        prow = self._check(row, "stream row")
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be > 0")
        bases = [0]
        if ranges is not None:
            rngs = check_ranges(ranges, [prow], "teacher replica: stream", same_length=True)
            length, bases = rngs[0][1] - rngs[0][0], [s for s, _ in rngs]
            end = length if end is None else end
            if not 0 <= start < end <= length:
                raise ValueError(f"teacher replica: stream: offsets ({start}, {end}) do not fit ranges {rngs} of "
                                 f"{length} tokens: it needs 0 <= start < end <= {length}")
        else:
            start, end = check_token_range((start, prow.num_tokens if end is None else end), [prow],
                                           "teacher replica: stream")
        dt = torch_dtype(dtype) if dtype else None
        session_id = serve.get_multiplexed_model_id()
        if session_id:
            session = await self._session(session_id)
            async with session.lock:
                if session.hidden_TH is None or session.row_id != prow.row_id:
                    session.hidden_TH, session.row_id = await self._hidden(prow), prow.row_id
            hidden_TH = session.hidden_TH
        else:
            hidden_TH = await self._hidden(prow)
        for s in range(start, end, chunk_tokens):
            for base in bases:
                yield await asyncio.to_thread(self._chunk, hidden_TH, base + s, base + min(s + chunk_tokens, end), dt)

    def _chunk(self, hidden_TH: torch.Tensor, s: int, e: int, dt: torch.dtype | None) -> torch.Tensor:
        with torch.no_grad():
            lg = self.teacher.output_layer(hidden_TH[s:e])
        return lg.to("cpu", dt) if dt is not None else lg.cpu()


def build_teacher_app(model_cfg: TeacherModelConfig, pool_cfg: TeacherPoolConfig,
                      fault_cfg: TeacherFaultConfig | None = None) -> serve.Application:
    actor = {"num_cpus": pool_cfg.num_cpus, "num_gpus": pool_cfg.num_gpus,
             "resources": dict(pool_cfg.resources or {})}
    level: dict[str, Any] = {}
    env = logs.child_env()
    if env:
        # a level other than the default: the replicas' own lines (also on a cluster this job joined) and
        # Serve's log lines in them follow it (hylo/logs.py)
        actor["runtime_env"] = {"env_vars": env}
        level["logging_config"] = {"log_level": logging.getLevelName(logs.library_level("ray"))}
    dep = TeacherDeployment.options(
        name=f"{pool_cfg.app_name}_teacher",
        num_replicas=pool_cfg.num_replicas,
        max_ongoing_requests=pool_cfg.max_ongoing_requests,
        ray_actor_options=actor,
        **level,
    )
    return dep.bind(to_dict(model_cfg), to_dict(pool_cfg), to_dict(fault_cfg or TeacherFaultConfig()))


# Serve's message when its HTTP proxy cannot listen on the pool's port (the proxy actor's error)
BIND_FAILED = "Failed to bind to address"
# ports tried for an unset teacher.pool.port (each one checked free first, on the head when it is this machine)
POOL_PORT_TRIES = 3


def start_teacher_pool(model_cfg: TeacherModelConfig, pool_cfg: TeacherPoolConfig,
                       fault_cfg: TeacherFaultConfig | None = None) -> serve.handle.DeploymentHandle:
    """Start Serve (HTTP on pool.host, 127.0.0.1 by default) and deploy the pool; returns its handle.
    `fault_cfg`: the test hook (None: off).

    The HTTP proxy's port is `pool.port`: one the user set must be free (checked before Serve starts, where the
    head is this machine; a RayStartupError names `teacher.pool.port` either way); an unset one (None) is a free
    port chosen here (on a head elsewhere: Serve's 8000, then 8001, 8002), and chosen again if another process
    takes it first. Needs a running Ray (`ray.init(...)`); the caller owns `serve.shutdown()`.
    """
    from hylo.pipeline.ray_init import RayStartupError, port_is_free, port_is_listening  # lazy: ray

    here = _head_is_here()
    if pool_cfg.port is not None and here and not port_is_free(pool_cfg.host, pool_cfg.port):
        raise RayStartupError(pool_port_taken(pool_cfg.host, pool_cfg.port, "another process listens there" if
                                              port_is_listening(pool_cfg.host, pool_cfg.port) else "it cannot be bound"))
    tries = 1 if pool_cfg.port is not None else POOL_PORT_TRIES
    for attempt in range(1, tries + 1):
        port = pool_cfg.port if pool_cfg.port is not None else _free_port(pool_cfg.host) if here else 8000 + attempt - 1
        if pool_cfg.port is None:
            _pool_log.info(f"[teacher] the pool's HTTP proxy listens on {pool_cfg.host}:{port} (teacher.pool.port "
                           f"unset: {'a free port' if here else 'the first try on the Ray head'})")
        try:
            # One HTTP proxy, on the head: it only answers `GET /<app>` (rows go through handles), and proxies on
            # every node would each bind pool.port (twice on one machine, when a cluster is simulated there).
            serve.start(proxy_location="HeadOnly", http_options={"host": pool_cfg.host, "port": port})
            return serve.run(build_teacher_app(model_cfg, pool_cfg, fault_cfg), name=pool_cfg.app_name,
                             route_prefix=f"/{pool_cfg.app_name}")
        except Exception as e:  # Serve raises a bare RuntimeError (the proxy actor's death) for this
            if BIND_FAILED not in str(e):
                raise
            serve.shutdown()
            if attempt == tries:
                if pool_cfg.port is not None:
                    raise RayStartupError(pool_port_taken(pool_cfg.host, port, "taken on the Ray head")) from None
                raise RayStartupError(f"teacher.pool.port=null: the teacher pool's HTTP proxy could not listen on "
                                      f"{pool_cfg.host}:{port} in {tries} tries (taken on the Ray head); set "
                                      f"teacher.pool.port to a port free there") from None
            _pool_log.warning(f"[teacher] port {port} was taken before the pool's HTTP proxy bound it; choosing "
                              f"another")
    raise AssertionError("unreachable")


def _head_is_here() -> bool:
    """Whether the Ray head (where Serve's HTTP proxy runs) is this machine: its GCS address is one of ours."""
    import ray  # lazy: ray

    host = ray.get_runtime_context().gcs_address.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or _is_local_address(host)


def _is_local_address(host: str) -> bool:
    """Whether `host` is an address of this machine (a socket can bind it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


def _free_port(host: str) -> int:
    """A port of `host` that nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
