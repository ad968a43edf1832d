"""Session set-up shared by every test."""

from __future__ import annotations

import signal

import pytest


def pytest_configure(config) -> None:
    # A shell starts a background job (`make test &`, `nohup ... &`) with SIGINT ignored, and a child inherits an
    # ignored signal: the Ctrl-C tests would then send SIGINT to processes that never see it. Ctrl-C is
    # Python's default KeyboardInterrupt again for this process, and children start with the default action.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
# `make test` hands whole test files to its worker processes in collection order (pytest-xdist, --dist
# loadfile): the files that take longest go first, so that none of them starts last and runs alone. The
# order is a scheduling hint only; every test runs, in its file's own order. Measured (make test, this 2-core
# machine): each of these takes several minutes, mostly process start-up (a wheel install, Ray Serve pools,
# Ray Train runs, clusters of Ray nodes, job subprocesses).
LONGEST_FIRST = ("test_quickstart.py", "test_train_e2e.py", "test_train_e2e_ray.py", "test_teacher_serve.py",
                 "test_faults_cluster.py",
                 "test_job_errors.py", "test_train_seq_parallel.py", "test_packaging.py", "test_faults.py",
                 "test_train_nonfinite.py", "test_eval.py", "test_checkout_block.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    def weight(item) -> tuple[int, int]:
        name = item.path.name
        rank = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return (rank, 0 if item.get_closest_marker("slow") is not None else 1)

    # stable: a file's tests keep their order; files of equal weight keep the collection order
    modules: dict[object, list] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    order = sorted(modules, key=lambda p: min(weight(i) for i in modules[p]))
    items[:] = [i for p in order for i in modules[p]]
