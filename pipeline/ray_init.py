"""How every job finds its Ray: one start-up helper and one config section (`ray.address`, `ray.num_cpus`).

    from hylo.pipeline.ray_init import init_ray, ray_running

    with ray_running(cfg.ray.address, cfg.ray.num_cpus):   # or: started = init_ray(...)
        ...

Design choices:
* One address rule for every job: `ray.address` when set ("auto", "host:port", "ray://..."), else
  `RAY_ADDRESS` (which `ray job submit` sets for its driver, and `jobs/demo.py` for its steps), else a
  new local Ray for this job. A Ray already initialised in the process (a test, the demo) is used as is.
* A local Ray is started with `address="local"`: a plain `ray.init()` would join whatever cluster
  `/tmp/ray/ray_current_cluster` names on a shared machine. It has `ray.num_cpus` CPUs (None = all of the
  machine's), no dashboard (it costs ~1 GiB and a port), and its workers find this checkout and the
  compiled DeepSpeed ops: the project's environment (`project_env`) is put into this process's
  environment before Ray starts, and Ray's processes and workers inherit it, also the workers of other
  jobs that join the same Ray (the demo's steps). Its workers run at nice 0 (Ray's default is 15): a
  local batch job's workers then get a fair share of the CPU next to its own driver.
* A local Ray listens on the loopback only (`_loopback_node`): Ray binds its servers (GCS, raylet, object
  manager, every worker's gRPC port, its agents) to all interfaces unless the node's address is 127.0.0.1,
  and it picks that address only in its single-machine mode (`ray_constants.ENABLE_RAY_CLUSTER` false, its
  default on macOS and Windows); a node address of "127.0.0.1" given to `ray.init` is replaced by the
  machine's reachable one. That mode is set while the local Ray starts, so its node address is 127.0.0.1 and
  everything it starts listens there, and restored after; a job joining it (RAY_ADDRESS=127.0.0.1:port, the
  demo's steps) joins in the same mode, so that its driver looks for the node at that address. A cluster
  started with `ray start` is the way to be reachable from other machines (docs/cluster.md says what it
  exposes).
* A local Ray's processes know its address: its GCS port is chosen before it starts (a free loopback port,
  `RAY_GCS_SERVER_PORT`) and `RAY_ADDRESS` names it in the environment its raylet and workers inherit (set
  while it starts, restored after). Ray's own helper actors look their cluster up without an address (Ray
  Train's placement-group cleaner asks the state API whether its controller lives); without `RAY_ADDRESS`
  Ray searches the machine's processes, and next to another Ray (another user's, a `ray start`) it fails
  ("Found multiple active Ray instances", a traceback and a warning every second) or takes the newest one
  `ray start` recorded, which never had the controller (the cleaner then removes a live run's placement
  group).
* `num_cpus` is for a Ray this job starts; a job that joins a cluster takes what the cluster has.
* Only a Ray the job started is shut down (`ray_running`); joining a cluster never stops it.
* `ray.init` installs a SIGTERM handler of its own (exit status 15, nothing cleaned up): under the signal
  rule of hylo/stopping.py (the demo, place-layers) the rule's handler is put back right after.
* Ray's logger follows the job's level (hylo/logs.py: `ray.init(logging_level=...)`); a local Ray's workers
  inherit HYLO_LOG_LEVEL with the rest of this process's environment.
* The config section is `hylo.pipeline.config.RayInitSection` (training's `ray` section extends it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import hylo
from hylo import logs

# RayInitSection lives with the config system (configs import no implementation); imported here for callers.
from hylo.pipeline.config import RayInitSection  # noqa: F401
from hylo.stopping import reclaim

log = logs.get_logger(__name__)

# The directory that holds the `hylo` package: a checkout's root (used without installing), or site-packages.
# (Not this file's parents[1]: installed, that is site-packages/hylo, whose folders would shadow top-level
# packages such as Hugging Face's `kernels` in every worker.)
ROOT = Path(hylo.__file__).resolve().parents[1]


# Ray's message when its raylet did not register with the GCS within its fixed 30 s (ray/_private/node.py)
STARTUP_TIMEOUT = "timed out during startup"
START_ATTEMPTS = 3


def resolve_address(address: str | None) -> str | None:
    """The cluster a job joins (`address`, else $RAY_ADDRESS), or None: start a local Ray."""
    return address or os.environ.get("RAY_ADDRESS") or None


def torch_extensions_dir() -> str:
    """Where DeepSpeed keeps its compiled ops (`TORCH_EXTENSIONS_DIR`, default ~/.cache/hylo/torch_extensions)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "hylo" / "torch_extensions")


def project_env() -> dict[str, str]:
    """Environment the workers of a local Ray need: the directory holding the `hylo` package first on
    PYTHONPATH (a checkout's root), the compiled-op cache, workers at nice 0, and Ray Train's print patch
    off."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        paths.insert(0, str(ROOT))
    return {"PYTHONPATH": os.pathsep.join(paths), "TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
            "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0"),
            # Ray Train's print() patch doubles every line a training worker prints (train/driver.py run_config)
            "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def init_ray(address: str | None = None, num_cpus: int | None = None, *, log_to_driver: bool = True) -> bool:
    """Join or start this job's Ray (see the module docstring); True when this call started a local one."""
    import ray  # lazy: ray

    if ray.is_initialized():
        return False
    target = resolve_address(address)
    if target:
        # a local Ray of another job of this machine (the demo's steps) is on the loopback: this driver's
        # node address must be the loopback too, or it would look for its raylet at the reachable one
        with _loopback_node() if _is_loopback(target) else contextlib.nullcontext():
            ray.init(address=target, log_to_driver=log_to_driver, logging_level=logs.library_level("ray"))
        logs.set_library_levels()
        reclaim()
        return False
    os.environ.update(project_env())
    for attempt in range(1, START_ATTEMPTS + 1):
        port = _free_loopback_port()
        try:
            with _loopback_node(), _environ(RAY_GCS_SERVER_PORT=str(port), RAY_ADDRESS=f"127.0.0.1:{port}"):
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                         log_to_driver=log_to_driver, logging_level=logs.library_level("ray"))
            break
        except Exception as e:  # Ray raises a bare Exception for this
            if STARTUP_TIMEOUT not in str(e) or attempt == START_ATTEMPTS:
                raise
            # Ray waits a fixed 30 s for its raylet to register; a busy machine can take longer. The half-started
            # processes are Ray's reaper's to end when this driver exits.
            log.warning("local Ray did not start within Ray's 30 s on this machine (load average %.1f); "
                        "starting it again (attempt %d of %d)", os.getloadavg()[0], attempt + 1, START_ATTEMPTS)
            ray.shutdown()
    logs.set_library_levels()
    reclaim()
    return True


def _free_loopback_port() -> int:
    """A TCP port of the loopback that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """These environment variables for a block; each one's earlier value (or absence) restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _is_loopback(address: str) -> bool:
    """Whether a Ray address ("host:port", "ray://host:port") names this machine's loopback."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """While a local Ray starts: Ray's single-machine mode, whose node address is 127.0.0.1, so that every
    server it starts listens on the loopback only (see the module docstring). Restored after: a later join
    of a real cluster from this process must find the machine's reachable address."""
    try:
        from ray._private import ray_constants  # lazy: ray
    except ImportError:  # another Ray layout: it starts as it does by itself
        yield
        return
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved is None:
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = saved


def gcs_address() -> str:
    """The address other processes join this process's Ray with (`RAY_ADDRESS=...`)."""
    import ray  # lazy: ray

    return ray.get_runtime_context().gcs_address


@contextlib.contextmanager
def ray_running(address: str | None = None, num_cpus: int | None = None, *,
                log_to_driver: bool = True) -> Iterator[bool]:
    """`init_ray` for a block; a Ray it started is shut down at the end (yields whether it started one)."""
    import ray  # lazy: ray

    started = init_ray(address, num_cpus, log_to_driver=log_to_driver)
    try:
        yield started
    finally:
        if started:
            ray.shutdown()


def kill_this_node() -> None:
    """Fault injection (tests, drills): SIGKILL the Ray node this worker runs on, then this process.

    Ray starts its workers as children of the node's raylet, which also holds the node's object store;
    once it is gone the node's other processes exit and the cluster marks the node dead after its
    health checks (`health_check_period_ms` x `health_check_failure_threshold`), as when a machine
    vanishes. Outside a Ray worker (torchrun) only this process is killed.
    """
    ppid = os.getppid()
    try:
        is_raylet = Path(f"/proc/{ppid}/comm").read_text().strip() == "raylet"
    except OSError:
        is_raylet = False
    if is_raylet:
        os.kill(ppid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
