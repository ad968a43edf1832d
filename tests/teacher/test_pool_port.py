"""The Serve pool's HTTP port (`teacher.pool.port`): a port the user set and another process holds is one line
naming the key, before Serve starts; an unset one is a free port, chosen again if it is taken before the proxy
binds it. Serve itself is stood in for (its start and deploy recorded); the real pool with a taken port runs in
tests/train/test_refusals.py."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("ray")

from hylo.pipeline.ray_init import RayStartupError  # noqa: E402
from hylo.pipeline.teacher import serve as pool  # noqa: E402
from hylo.pipeline.teacher.config import TeacherModelConfig, TeacherPoolConfig  # noqa: E402


class FakeServe:
    """Records serve.start / run / shutdown; `bind_fails` ports raise Serve's proxy error."""

    def __init__(self, bind_fails: set[int] | None = None) -> None:
        self.calls: list[tuple[str, object]] = []
        self.bind_fails = bind_fails or set()
        self.port: int | None = None

    def start(self, proxy_location: str, http_options: dict) -> None:
        self.calls.append(("start", http_options["port"]))
        self.port = http_options["port"]

    def run(self, app: object, name: str, route_prefix: str) -> str:
        self.calls.append(("run", self.port))
        if self.port in self.bind_fails:
            # what Ray Serve 2.60 raises when its HTTP proxy actor cannot listen
            raise RuntimeError(f"ProxyActor failed: ... Failed to bind to address '127.0.0.1:{self.port}': "
                               "address already in use")
        return "handle"

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None))


@pytest.fixture
def fake_serve(monkeypatch):
    fake = FakeServe()
    for name in ("start", "run", "shutdown"):
        monkeypatch.setattr(pool.serve, name, getattr(fake, name))
    monkeypatch.setattr(pool, "build_teacher_app", lambda *a, **k: "app")
    monkeypatch.setattr(pool, "_head_is_here", lambda: True)
    return fake


def test_a_taken_port_the_user_set_is_named_before_serve_starts(fake_serve):
    """Before: a taken teacher.pool.port exited 1 after 14 s with Ray Serve's raw "Failed to bind to address"
    traceback, nothing naming the key."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    with held, pytest.raises(RayStartupError, match=rf"^teacher.pool.port={port}: the teacher pool's HTTP proxy cannot "
                                                    rf"listen on 127.0.0.1:{port} \(another process listens there\); "
                                                    r"choose a free port, or leave teacher.pool.port unset"):
        pool.start_teacher_pool(TeacherModelConfig(), TeacherPoolConfig(port=port))
    assert fake_serve.calls == []


def test_an_unset_port_is_a_free_one_and_chosen_again_when_taken_first(fake_serve, monkeypatch, capsys):
    picks: list[int] = []
    real_free = pool._free_port

    def pick(host: str) -> int:
        picks.append(real_free(host))
        if len(picks) == 1:
            fake_serve.bind_fails = {picks[0]}  # another process takes it before Serve's proxy binds it
        return picks[-1]

    monkeypatch.setattr(pool, "_free_port", pick)
    assert pool.start_teacher_pool(TeacherModelConfig(), TeacherPoolConfig()) == "handle"
    assert [c[0] for c in fake_serve.calls] == ["start", "run", "shutdown", "start", "run"]
    assert fake_serve.calls[0][1] == picks[0] != fake_serve.calls[3][1] == picks[1]
    out = capsys.readouterr().err
    assert f"port {picks[0]} was taken before the pool's HTTP proxy bound it; choosing another" in out
    assert f"listens on 127.0.0.1:{picks[1]} (teacher.pool.port unset: a free port)" in out


def test_a_port_taken_on_a_remote_head_is_named_after_serve_fails(fake_serve, monkeypatch):
    """Where the head is another machine the port cannot be checked from here: Serve's failure is turned into the
    same one line naming the key."""
    monkeypatch.setattr(pool, "_head_is_here", lambda: False)
    fake_serve.bind_fails = {8123}
    with pytest.raises(RayStartupError, match=r"^teacher.pool.port=8123: the teacher pool's HTTP proxy cannot "
                                              r"listen on 127.0.0.1:8123 \(taken on the Ray head\); choose a free port"):
        pool.start_teacher_pool(TeacherModelConfig(), TeacherPoolConfig(port=8123))
    assert [c[0] for c in fake_serve.calls] == ["start", "run", "shutdown"]


def test_the_serve_source_checks_a_set_port_before_ray_starts_when_the_run_starts_its_own_ray():
    """The driver's check before the run directory is made or Ray starts (train/driver.py check_run): with a local
    Ray the pool listens on this machine, so a taken teacher.pool.port stops the run there; joining a cluster, the
    head may be elsewhere and the check waits for Ray (start_teacher_pool)."""
    from hylo.pipeline.teacher.config import ServeSection
    from hylo.pipeline.teacher.sources import source_kind

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    serve_source = source_kind("serve")
    with held:
        with pytest.raises(RayStartupError, match=rf"^teacher.pool.port={port}: .*another process listens there"):
            serve_source.check_ports(ServeSection(pool=TeacherPoolConfig(port=port)), local=True)
        serve_source.check_ports(ServeSection(pool=TeacherPoolConfig(port=port)), local=False)
        serve_source.check_ports(ServeSection(pool=TeacherPoolConfig(port=port), start_pool=False), local=True)
    serve_source.check_ports(ServeSection(pool=TeacherPoolConfig()), local=True)  # unset: chosen at start
