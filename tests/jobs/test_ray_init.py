"""The one Ray start-up helper (pipeline/ray_init.py) and the one `ray` config section of every job."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hylo import logs
from hylo.pipeline import ray_init
from hylo.pipeline.config import ConfigError, load_config

from tests.helpers.cluster import LOOPBACK, listening_ports
from tests.helpers.logs import level_kept, messages

ROOT = Path(__file__).resolve().parents[2]


class FakeRay:
    """Stands in for the `ray` module: records init/shutdown calls."""

    def __init__(self, initialized: bool = False) -> None:
        self.initialized, self.calls = initialized, []

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **kwargs) -> None:
        self.calls.append(("init", kwargs))
        # what the processes a local Ray starts inherit
        self.environ = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RAY_GCS_SERVER_PORT")}
        self.initialized = True

    def shutdown(self) -> None:
        self.calls.append(("shutdown", {}))
        self.initialized = False


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_GCS_SERVER_PORT", raising=False)
    for key in ("PYTHONPATH", "TORCH_EXTENSIONS_DIR", "RAY_worker_niceness"):
        # recorded, so that what init_ray puts there is undone after the test
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if not os.environ[key]:
            monkeypatch.delenv(key)
    return fake


def test_address_rule(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init.resolve_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_init.resolve_address(None) == "10.0.0.1:6379"
    assert ray_init.resolve_address("auto") == "auto"


def test_local_start_is_a_new_ray_without_dashboard_whose_workers_find_this_checkout(fake_ray, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with ray_init.ray_running(None, 3, log_to_driver=False) as started:
        assert started
    (name, kwargs), last = fake_ray.calls
    # "local": never the cluster /tmp/ray/ray_current_cluster names (another user's on a shared machine)
    assert name == "init" and kwargs == {"address": "local", "num_cpus": 3, "include_dashboard": False,
                                         "log_to_driver": False, "logging_level": logging.INFO}
    assert last[0] == "shutdown"
    # its processes (Ray Train's placement-group cleaner) find it by its address, never by searching the machine,
    # where another Ray may run; this process's environment is as it was
    port = fake_ray.environ["RAY_GCS_SERVER_PORT"]
    assert int(port) > 0 and fake_ray.environ["RAY_ADDRESS"] == f"127.0.0.1:{port}"
    assert "RAY_ADDRESS" not in os.environ and "RAY_GCS_SERVER_PORT" not in os.environ
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]
    assert os.environ["RAY_worker_niceness"] == "0" and os.environ["TORCH_EXTENSIONS_DIR"]
    # the checkout is put first once
    assert ray_init.project_env()["PYTHONPATH"] == os.environ["PYTHONPATH"]


def test_joining_a_cluster_never_stops_it(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with ray_init.ray_running(None, 3) as started:
        assert not started
    # no num_cpus (Ray refuses it when joining), no shutdown
    assert fake_ray.calls == [("init", {"address": "10.0.0.1:6379", "log_to_driver": True,
                                        "logging_level": logging.INFO})]
    fake_ray.calls.clear()
    fake_ray.initialized = False  # the next job, in a process of its own
    with ray_init.ray_running("auto"):
        pass
    assert fake_ray.calls == [("init", {"address": "auto", "log_to_driver": True,
                                        "logging_level": logging.INFO})]


@pytest.mark.parametrize("level,ray_level", [("warning", logging.WARNING), ("error", logging.ERROR),
                                             ("debug", logging.DEBUG), ("info", logging.INFO)])
def test_rays_logger_follows_the_jobs_log_level(fake_ray, level, ray_level, monkeypatch):
    """`--log-level` (hylo/logs.py) reaches Ray's own logger through `ray.init(logging_level=...)`, on a local
    Ray and on a joined one; at info Ray keeps its own default (info). The joined cluster is the fake one: its
    address is not looked up or probed (what a real "auto" finds depends on the machine)."""
    monkeypatch.setattr(ray_init, "_cluster_address", lambda target, source: target)
    monkeypatch.setattr(ray_init, "probe_address", lambda address, source, timeout=None: None)
    with level_kept():
        logs.set_level(level)
        with ray_init.ray_running(None, 1):
            pass
        fake_ray.initialized = False
        with ray_init.ray_running("auto"):
            pass
        assert [kw["logging_level"] for name, kw in fake_ray.calls if name == "init"] == [ray_level] * 2
        assert logging.getLogger("ray").level == ray_level


def test_a_running_ray_is_used_as_is(fake_ray):
    fake_ray.initialized = True
    assert ray_init.init_ray("auto", 2) is False
    with ray_init.ray_running():
        pass
    assert fake_ray.calls == []


def test_every_job_config_spells_it_ray_address_and_the_old_flat_keys_are_unknown():
    from hylo.pipeline.data.config import PrepareDataConfig
    from hylo.pipeline.data.decontam import DecontamJobConfig
    from hylo.pipeline.demo import DemoConfig
    from hylo.pipeline.placement import PlacementConfig
    from hylo.pipeline.teacher.config import TeacherCacheConfig
    from hylo.pipeline.train.config import Stage1Config, Stage2Config

    for cls in (PrepareDataConfig, DecontamJobConfig, TeacherCacheConfig, Stage1Config, Stage2Config, DemoConfig,
                PlacementConfig):
        cfg = load_config(cls, None, ["ray.address=auto", "ray.num_cpus=3"])
        assert (cfg.ray.address, cfg.ray.num_cpus) == ("auto", 3), cls
    assert load_config(PrepareDataConfig).ray.num_cpus == 2
    for cls in (PrepareDataConfig, DecontamJobConfig, TeacherCacheConfig):
        for key in ("ray_address=auto", "num_cpus=4"):
            with pytest.raises(ConfigError, match=rf"unknown key\(s\) {key.split('=')[0]} in {cls.__name__}"):
                load_config(cls, None, [key])
    with pytest.raises(ConfigError, match="ray.num_cpus=0: must be >= 1"):
        load_config(DecontamJobConfig, None, ["ray.num_cpus=0"])


def test_the_data_recipes_load_without_a_deprecation_warning(capsys):
    from hylo.pipeline.data.config import PrepareDataConfig

    for name in ("llama3", "qwen3"):
        cfg = load_config(PrepareDataConfig, ROOT / "configs" / f"data_{name}_stage1.yaml")
        assert cfg.ray.address == "auto"
    assert "deprecated" not in capsys.readouterr().err


JOINER = """
import os, ray
from hylo.pipeline.ray_init import init_ray
assert init_ray(None, 1) is False  # joins the Ray named by RAY_ADDRESS, starts none
@ray.remote(num_cpus=1)
def where():
    import hylo.pipeline
    return hylo.pipeline.__file__, os.nice(0)
print(*ray.get(where.remote()))
"""


@pytest.mark.slow
def test_another_job_joins_a_local_ray_through_ray_address(tmp_path, monkeypatch):
    """The demo's pattern: one local Ray, every step job joins it; their workers import this checkout.
    The local Ray's ports (GCS, raylet, workers, agents) listen on the loopback only, not on every
    interface, and a job of this machine still joins it (its address probed first: a real GCS answers the
    probe). The first port chosen for its GCS is taken by another process: the real Ray starts on another."""
    import socket

    import ray

    assert not ray.is_initialized()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    picks = iter([taken])
    real_pick = ray_init._free_loopback_port
    monkeypatch.setattr(ray_init, "_free_loopback_port", lambda: next(picks, None) or real_pick())
    # what this process listened on before is not Ray's: in one long pytest process, an earlier test's leftover
    # (test_train_nonfinite's in-process runs stopped on a NaN leave their DeepSpeed engine alive, and with it its
    # gloo group's torch.distributed store, listening on "::")
    before = {(ip, port) for ip, port, _ in listening_ports()}
    with ray_init.ray_running(None, 2, log_to_driver=False) as started:
        assert started
        ray.get(ray.remote(lambda: 1).remote())  # a worker process, with its own gRPC port
        rays = {x for x in listening_ports() if x[:2] not in before}
        assert rays and {ip for ip, _, _ in rays} <= LOOPBACK, sorted(rays)
        assert ray_init.gcs_address().startswith("127.0.0.1:")
        assert ray_init.gcs_address() != f"127.0.0.1:{taken}"
        held.close()
        env = {**os.environ, "RAY_ADDRESS": ray_init.gcs_address(), "PYTHONPATH": str(tmp_path)}
        code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{JOINER}"
        proc = subprocess.run([sys.executable, "-c", code],
                              env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        module, nice = proc.stdout.split()[-2:]
        assert Path(module).resolve().parent == (ROOT / "pipeline").resolve()
        assert nice == "0"
    assert not ray.is_initialized()


def test_a_local_ray_that_times_out_starting_is_started_again_then_one_line_is_raised(fake_ray, monkeypatch,
                                                                                     capsys):
    """Ray waits a fixed 30 s for its raylet; on a busy machine the start is tried again (a new port each time),
    and after the last try one RayStartupError line names what to change. Any other failure of Ray's start is
    one line at once (Ray's own first line, its logs, the setting), not retried."""
    failures = [Exception("The current node timed out during startup. ...")] * 2
    real_init = fake_ray.init

    def flaky_init(**kwargs):
        if failures:
            fake_ray.calls.append(("init", kwargs))
            raise failures.pop()
        real_init(**kwargs)

    monkeypatch.setattr(fake_ray, "init", flaky_init)
    assert ray_init.init_ray(None, 1) is True
    names = [c[0] for c in fake_ray.calls]
    assert names == ["init", "shutdown", "init", "shutdown", "init"]
    assert sum("starting it again" in m for m in messages(capsys.readouterr().err, "WARNING")) == 2
    fake_ray.initialized = False
    fake_ray.calls.clear()
    failures[:] = [Exception("The current node timed out during startup.")] * 3
    with pytest.raises(ray_init.RayStartupError, match=r"^a local Ray could not start in 3 tries: it did not start "
                                                       r"within Ray's 30 s .*set ray.address \(or RAY_ADDRESS\)"):
        ray_init.init_ray(None, 1)
    assert [c[0] for c in fake_ray.calls] == ["init", "shutdown", "init", "shutdown", "init", "shutdown"]
    fake_ray.calls.clear()
    failures[:] = [ValueError("some other problem")]
    with pytest.raises(ray_init.RayStartupError, match=r"^a local Ray could not start: ValueError: some other "
                                                       r"problem \(its logs: .*\); set ray.address"):
        ray_init.init_ray(None, 1)
    assert [c[0] for c in fake_ray.calls] == ["init"]


# ------------------------------------------------------------------------------ start-up faults, named in seconds
def test_a_gcs_port_taken_is_skipped_before_ray_starts_and_one_taken_meanwhile_is_retried(fake_ray, monkeypatch,
                                                                                          capsys):
    """Before: a local Ray whose GCS port was taken exited 1 after 44 s with Ray's raw `RuntimeError: Failed to
    start GCS ... Check failed: server_`, never on another port. Now the port is checked just before Ray starts
    (something listens there: another is chosen, Ray never sees it), and a port taken between that check and the
    GCS's bind (Ray's "Failed to start GCS") is retried on another port; after the last try, one line."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    picks = iter([taken])
    real_pick = ray_init._free_loopback_port
    monkeypatch.setattr(ray_init, "_free_loopback_port", lambda: next(picks, None) or real_pick())
    with held:
        assert ray_init.init_ray(None, 1) is True
    assert [c[0] for c in fake_ray.calls] == ["init"]
    assert int(fake_ray.environ["RAY_GCS_SERVER_PORT"]) != taken
    assert any(f"port {taken} is taken" in m for m in messages(capsys.readouterr().err, "WARNING"))
    # taken after the check: Ray's GCS fails, the start is tried again on another port
    ports = []
    real_init = fake_ray.init

    def gcs_fails_once(**kwargs):
        ports.append(os.environ["RAY_GCS_SERVER_PORT"])
        if len(ports) == 1:
            fake_ray.calls.append(("init", kwargs))
            raise RuntimeError("Failed to start GCS.  Last 1 lines of error files: ... Check failed: server_ Failed "
                               "to start the grpc server.")
        real_init(**kwargs)

    fake_ray.initialized = False
    fake_ray.calls.clear()
    monkeypatch.setattr(fake_ray, "init", gcs_fails_once)
    assert ray_init.init_ray(None, 1) is True
    assert [c[0] for c in fake_ray.calls] == ["init", "shutdown", "init"] and ports[0] != ports[1]
    # every try fails: one line, no Ray traceback
    fake_ray.initialized = False
    monkeypatch.setattr(fake_ray, "init", lambda **kw: (_ for _ in ()).throw(RuntimeError("Failed to start GCS.")))
    with pytest.raises(ray_init.RayStartupError, match=r"^a local Ray could not start in 3 tries: its GCS could not "
                                                       r"listen on 127\.0\.0\.1:\d+ \(taken by another process"):
        ray_init.init_ray(None, 1)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stale_ray_address_is_one_line_naming_it_before_ray_is_asked(fake_ray, monkeypatch):
    """Before: `RAY_ADDRESS` naming a closed port kept the job running (Ray's `Failed to connect to GCS` every
    ~41 s, still running at 300 s). Now the address is probed first: nothing listens, one line naming the
    variable (or `ray.address`, when the config sets it), and Ray's init is never called."""
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ray_init.RayStartupError, match=rf"^RAY_ADDRESS=127\.0\.0\.1:{port}: nothing accepts connections "
                                                       rf"at 127\.0\.0\.1:{port} .*; unset RAY_ADDRESS to start a local Ray"):
        ray_init.init_ray(None, 1)
    with pytest.raises(ray_init.RayStartupError, match=rf"^ray.address=ray://127\.0\.0\.1:{port}: nothing accepts "
                                                       r".*; leave ray.address unset \(null\)"):
        ray_init.check_ray_address(f"ray://127.0.0.1:{port}")
    with pytest.raises(ray_init.RayStartupError, match=r"^ray.address=nohost\.invalid:6379: cannot resolve the host"):
        ray_init.check_ray_address("nohost.invalid:6379")
    with pytest.raises(ray_init.RayStartupError, match=r"^ray.address=6379: not a Ray address"):
        ray_init.check_ray_address("6379")
    assert fake_ray.calls == []
    monkeypatch.delenv("RAY_ADDRESS")
    ray_init.check_ray_address(None)  # a local Ray: nothing to probe


def test_a_server_that_is_not_a_ray_gcs_is_named_and_a_grpc_server_passes(monkeypatch):
    """A port that accepts connections but is no GCS (another service took it): Ray's join would wait 30 s a
    try. The probe sends HTTP/2's preface, which a gRPC server (a GCS) answers at once with its SETTINGS frame;
    a server that says nothing, or something else, is refused within the probe's timeout. A real gRPC server
    (grpcio, the library Ray's GCS is built on) passes."""
    import socket
    import threading
    from concurrent import futures

    import grpc

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1]
    with silent:
        with pytest.raises(ray_init.RayStartupError, match=rf"^ray.address=127\.0\.0\.1:{port}: the server at "
                                                           rf"127\.0\.0\.1:{port} is not a Ray GCS"):
            ray_init.probe_address(f"127.0.0.1:{port}", f"ray.address=127.0.0.1:{port}", timeout=0.5)

    web = socket.socket()
    web.bind(("127.0.0.1", 0))
    web.listen()

    def answer() -> None:
        conn, _ = web.accept()
        with conn:
            conn.recv(64)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    with web, pytest.raises(ray_init.RayStartupError, match="is not a Ray GCS"):
        ray_init.probe_address(f"127.0.0.1:{web.getsockname()[1]}", "RAY_ADDRESS=x", timeout=2)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    gport = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        ray_init.probe_address(f"127.0.0.1:{gport}", "RAY_ADDRESS=x", timeout=5)
        ray_init.probe_address(f"ray://127.0.0.1:{gport}", "RAY_ADDRESS=x", timeout=5)
    finally:
        server.stop(0)


def test_the_address_source_is_what_the_user_wrote(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init.address_source("10.0.0.1:6379") == "ray.address=10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert ray_init.address_source(None) == "RAY_ADDRESS=10.0.0.2:6379"
    # Ray reads RAY_ADDRESS first for "auto"
    assert ray_init.address_source("auto") == "RAY_ADDRESS=10.0.0.2:6379 (read for ray.address=auto)"
    assert ray_init.address_source("10.0.0.1:6379") == "ray.address=10.0.0.1:6379"
    assert ray_init.host_port("ray://[::1]:10001") == ("::1", 10001) and ray_init.host_port("auto") is None


def test_a_joined_cluster_that_refuses_the_driver_is_one_line(fake_ray, monkeypatch):
    """The address answers but Ray's join fails (another Ray version, a cluster that goes away): Ray's first line,
    under the setting that named the cluster."""
    monkeypatch.setattr(ray_init, "probe_address", lambda *a, **k: None)

    def refuse(**kwargs):
        raise RuntimeError("Version mismatch: The cluster was started with:\n    Ray: 2.9.0\n...")

    monkeypatch.setattr(fake_ray, "init", refuse)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ray_init.RayStartupError, match=r"^RAY_ADDRESS=10\.0\.0\.1:6379: Ray could not join the "
                                                       r"cluster there: RuntimeError: Version mismatch: The cluster was "
                                                       r"started with:; unset RAY_ADDRESS"):
        ray_init.init_ray(None, 1)
