"""Session set-up shared by every test."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config) -> None:
    # A shell starts a background job (`make test &`, `nohup ... &`) with SIGINT ignored, and a child inherits an
    # ignored signal: the Ctrl-C tests would then send SIGINT to processes that never see it. Ctrl-C is
    # Python's default KeyboardInterrupt again for this process, and children start with the default action.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    isolate_ray_discovery(os.environ.get("PYTEST_XDIST_WORKER"))
    one_thread_per_process(os.environ.get("PYTEST_XDIST_WORKER"))
    # Three test processes on two cores start a Ray Train worker group in 15-65 s (docs/testing.md), against Ray
    # Train's default limit of 60 s; a test about faults must not fail on the load of its neighbours.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600")
    # Ray's memory monitor kills a worker when the whole machine's memory passes 95%, as if the node were Ray's
    # alone; here the other test processes hold most of it. A fresh-clone `make test` in three processes had a
    # Ray Train worker of the cluster-fault tests killed so ("OutOfMemoryError", 2026-12-04) and the test failed
    # on a fault it was not about. Tests run with the monitor off (the kernel's OOM killer remains); it is Ray's
    # own behaviour, which no test of ours checks.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    # Tests read the lines jobs log at info (hylo/logs.py): a level set in the shell that runs them is not
    # theirs.
    os.environ.pop("HYLO_LOG_LEVEL", None)


def isolate_ray_discovery(worker: str | None) -> None:
    """Give each test process (pytest-xdist worker `worker`; None: the only one) a Ray temp root of its own.

    Ray's own helper actors look their cluster up by address discovery: Ray Train's placement-group cleaner asks
    the state API whether its controller still lives, without an address, and Ray then takes the cluster that
    `<temp root>/ray/ray_current_cluster` names, i.e. the newest one started on the machine. With test processes
    side by side that can be another process's cluster, one that never had the controller ("Found multiple active
    Ray instances ... Connecting to latest cluster"): if that cluster has a dashboard, the cleaner is told the
    controller is gone and removes the placement group of a live run. A temp root per process (RAY_TMPDIR, which
    the processes Ray starts inherit) keeps each process's lookups to its own clusters. Short: Ray's socket paths
    live below it."""
    if worker:
        root = Path(tempfile.gettempdir()) / f"hylo-ray-{worker}"
        root.mkdir(exist_ok=True)
        os.environ["RAY_TMPDIR"] = str(root)


def one_thread_per_process(worker: str | None) -> None:
    """Under pytest-xdist (`worker` set), one intra-op thread for torch in each test process and in every process
    it starts (OMP_NUM_THREADS / MKL_NUM_THREADS, inherited; torch reads them when it loads), unless already set.

    Several test processes share the machine's cores, each with processes of its own (jobs, torchrun ranks, Ray
    workers): the cores are already busy with processes, and a torch that also spreads each op over every core
    only adds threads that wait on each other (OpenMP's workers spin while they wait). Measured on the 2-core
    build machine, the tests of tests/model and tests/kernels not marked slow in three processes: 230 CPU-seconds
    and 1 min 58 s with torch's default threads, 162 and 1 min 22 s with one (docs/results.md#one-thread). Ray
    workers (one thread per CPU they hold) and torchrun ranks (OMP_NUM_THREADS=1 unless set) had one already.
    One process (`TEST_WORKERS=0`) keeps torch's default: there the cores are often idle."""
    if worker:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
        if "torch" in sys.modules:  # loaded before this hook (a plugin): it read the environment already
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _log_level_of_its_own():
    """A test that runs a command with `--log-level` in this process (tests/project/test_examples.py runs the docs'
    examples) leaves HYLO_LOG_LEVEL and the logger's level as it found them (hylo/logs.py): the next test's jobs log
    at info again."""
    from hylo import logs

    names = (logs.ENV, logs.TRANSFORMERS_ENV)
    saved = {k: os.environ.get(k) for k in names}
    level = logs.current_level()
    yield
    if {k: os.environ.get(k) for k in names} != saved or logs.current_level() != level:
        from tests.helpers.logs import restore_environ

        restore_environ(saved)
        logs.setup()


# ---------------------------------------------------------------------------------------------- the fast tier
# `make test-fast` runs every test not marked `slow` and must start no Ray and no process. A test without the
# marker that starts one fails here, in `make test` too, naming what it started, so the marker cannot drift
# from what a test does.
_STARTS = "starts {what}: mark it @pytest.mark.slow (make test-fast starts no Ray and no process)"


class StartsAProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _fast_tier_starts_nothing(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        yield
        return

    def refuse(what: str):
        def starts(*args, **kwargs):
            raise StartsAProcess(f"{request.node.nodeid} " + _STARTS.format(what=what))
        return starts

    import multiprocessing.process
    import os
    import subprocess

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("a multiprocessing process"))
    monkeypatch.setattr(os, "fork", refuse("a forked process"))
    try:
        import ray
    except ImportError:
        pass
    else:
        monkeypatch.setattr(ray, "init", refuse("Ray (ray.init)"))
    yield


# ---------------------------------------------------------------------------------------------- scheduling
# `make test` hands whole test files to its worker processes in the order of this list (pytest-xdist, --dist
# loadfile --no-loadscope-reorder): first the files of FIRST, the longest single chains of work (the wheel quick
# start: a wheel, a virtualenv, the demo and the stages, 6 min alone on a quiet machine; the cluster faults: six
# Ray Train runs with faults on a simulated multi-node cluster, 8 min alone), so that neither starts last and
# runs alone while the third process takes the quick files; then xdist's own order, the files with the most tests
# first, which mixes the other slow files with many quick ones (measured on 2026-12-03: starting every slow file
# first overloads the two cores and is slower). A scheduling hint only: every test runs, in its file's own order.
FIRST = ("test_quickstart.py", "test_faults_cluster.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    modules: dict[object, list] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)

    def weight(path) -> tuple[int, int]:
        name = path.name
        return (FIRST.index(name) if name in FIRST else len(FIRST), -len(modules[path]))

    order = sorted(modules, key=weight)  # stable: equal weights keep the collection order
    items[:] = [i for p in order for i in modules[p]]
