"""Tiny fixtures for the training tests: a random Llama base, its HyLo conversion, a config, a fake S3, and
the stage jobs under torchrun.

Test modules import it as `from tests.helpers.train import ...`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def make_tiny_models(root: str | Path, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2,
                     mla_layers: str = "even", seed: int = 0) -> dict[str, Path]:
    """A random Llama base (also the teacher) and its HyLo conversion (MLA on `mla_layers`, GDN elsewhere)."""
    from hylo.io import save_hylo
    from hylo.upcycle import load_base_model, upcycle

    from tests.helpers.teacher import save_tiny_llama

    root = Path(root)
    base = save_tiny_llama(root / "base", vocab_size=vocab_size, hidden_size=hidden_size, layers=layers, seed=seed)
    student = upcycle(load_base_model(base), mla_layers=mla_layers, kv_lora_rank=16, gdn_head_dim=8,
                      gdn_num_heads=4)
    save_hylo(student, root / "student", tokenizer_from=base)
    return {"base": base, "student": root / "student"}


def tiny_config(models: dict[str, Path], storage: str | Path, name: str, stage: int = 2,
                **sections: dict[str, Any]) -> dict[str, Any]:
    """A config dict for a tiny 2-worker run on synthetic rows (torchrun launcher by default)."""
    cfg: dict[str, Any] = {
        "model": {"student": str(models["student"]), "base": str(models["base"])},
        "data": {"source": "synthetic", "seq_len": 64, "split": f"stage{stage}",
                 "synthetic": {"rows": 48, "vocab_size": 96, "min_doc_len": 8, "max_doc_len": 40}},
        "optim": {"lr": 1e-3, "warmup_ratio": 0.1},
        "train": {"global_batch_sequences": 4},
        "checkpoint": {"every_steps": 3, "keep": None},
        "ray": {"num_workers": 2, "storage_path": str(storage), "name": name, "launcher": "torchrun"},
        "metrics": {"tensorboard": True},
    }
    if stage == 2:
        cfg["teacher"] = {"model": {"path": str(models["base"])}}
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def write_config(cfg: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# The dummy credentials of the local S3 server: Ray processes started before the server must have them too
# (a filesystem made from the environment's credentials does not carry them when pickled).
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def quiet_port() -> int:
    """A free loopback port below the kernel's ephemeral range and above Ray's worker ports (10002-19999), or 0.

    The fake S3 server goes away and must come back on its port. A port the kernel handed out (bind to 0) sits in
    the ephemeral range, where, while the server is down, any process of the machine may get it for a connection
    or a listener of its own: a fresh-clone `make test` in three processes had "Port 45055 is in use by another
    program" there (2026-12-03). Below that range a port is taken only by a process that asks for it by number."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    candidates = list(range(20000, low))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return 0


class FakeS3:
    """A local S3 server (moto) that can go away and come back on the same port with the same objects.

    `uri(key)` -> `s3://<bucket>/<key>?endpoint_override=...` for pyarrow's S3 client; pickled
    filesystems carry the dummy credentials to Ray workers. `stop()` closes the port (new connections
    are refused) and answers requests on connections still open with 503; `start()` brings it back.
    `outage_on(fragment, after=n)`: the server stops itself when the (n+1)-th upload request whose
    path holds `fragment` arrives, i.e. in the middle of uploading the files below it.
    `outage_on(fragment, whole=n)`: it stops at the first upload request below `fragment` that arrives once
    n objects below it are whole (a single PUT of a file, or the request completing a multipart upload): at
    least n files of a cut upload are there, however the client interleaves its concurrent uploads (an output
    stream the client abandoned may still complete its file once the server is back).

    moto 5.2 answers CompleteMultipartUpload with the wrong root element, which pyarrow's S3 client
    rejects (getmoto/moto#10055); the WSGI wrapper renames it.
    """

    def __init__(self, bucket: str = "bucket") -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app

        self.bucket = bucket
        self.app = DomainDispatcherApplication(create_backend_app)
        self.port = 0
        self.down = False
        self.server: Any = None
        self.thread: threading.Thread | None = None
        self.outage: tuple[str, int] | None = None
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def outage_on(self, fragment: str, after: int = 0, *, whole: int | None = None) -> None:
        self.outage = (fragment, after, whole)

    def _trip(self, environ) -> bool:
        method, path, query = environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", "")
        with self.lock:
            if self.outage is None or method not in ("PUT", "POST"):
                return False
            fragment, after, whole = self.outage
            if fragment not in path:
                return False
            if whole is not None:
                # a request that makes an object whole: a file's single PUT, or a multipart upload's completion
                completes = ((method == "PUT" and "uploadId=" not in query and not path.endswith("/"))
                             or (method == "POST" and "uploadId=" in query))
                if whole > 0:
                    self.outage = (fragment, after, whole - completes)
                    return False
            elif after > 0:
                self.outage = (fragment, after - 1, whole)
                return False
            self.outage = None
            self.down = True  # from this request on, every request is refused, whichever thread it comes on
        threading.Thread(target=self.stop, daemon=True).start()
        return True

    def __call__(self, environ, start_response):
        if self.down or self._trip(environ):
            start_response("503 Service Unavailable", [("Content-Length", "0")])
            return [b""]
        if not (environ["REQUEST_METHOD"] == "POST" and "uploadId=" in environ.get("QUERY_STRING", "")):
            return self.app(environ, start_response)
        got: dict[str, Any] = {}

        def capture(status, headers, exc_info=None):
            got.update(status=status, headers=headers)
            return lambda data: None

        body = b"".join(self.app(environ, capture))
        body = body.replace(b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult")
        headers = [(k, str(len(body)) if k.lower() == "content-length" else v) for k, v in got["headers"]]
        start_response(got["status"], headers)
        return [body]

    def start(self) -> None:
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self.server = make_server("127.0.0.1", self.port or quiet_port(), self, threaded=True)
        self.port = self.server.server_address[1]
        self.down = False
        self.stopped.clear()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.down = True
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        self.stopped.set()

    def uri(self, key: str = "") -> str:
        query = f"endpoint_override=http://127.0.0.1:{self.port}&allow_bucket_creation=true"
        return f"s3://{self.bucket}/{key.strip('/')}?{query}" if key else f"s3://{self.bucket}?{query}"


@contextlib.contextmanager
def s3_server(bucket: str = "bucket") -> Iterator[FakeS3]:
    """A running `FakeS3` with its bucket, the dummy credentials in the environment; stopped at the end."""
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    s3 = FakeS3(bucket)
    s3.start()
    try:
        import pyarrow.fs as pafs

        fs, _ = pafs.FileSystem.from_uri(s3.uri())
        fs.create_dir(bucket)
        yield s3
    finally:
        s3.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def fake_s3(bucket: str = "bucket") -> Iterator[Callable[[str], str]]:
    """A local S3 server (moto) for tests: yields `uri(key)` -> `s3://<bucket>/<key>?endpoint_override=...`."""
    with s3_server(bucket) as s3:
        yield s3.uri


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    """A one-process gloo group's environment, as torchrun sets it up for a single rank (the tests that run the
    real loop in-process: test_train_step, test_train_nonfinite)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "TORCH_EXTENSIONS_DIR": os.environ.get(
               "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hylo" / "torch_extensions"))}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        forget_deepspeed_world()
        yield
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_deepspeed_world()


def forget_deepspeed_world() -> None:
    """DeepSpeed keeps a clone of the world group it made for an engine (`deepspeed.utils.groups._WORLD_GROUP`):
    once that group is destroyed, the next engine in this process (another test module's) must not find it."""
    if "deepspeed.utils.groups" in sys.modules:
        sys.modules["deepspeed.utils.groups"]._WORLD_GROUP = None


# ------------------------------------------------------------------ jobs under torchrun
# the per-step losses of a run and its resumed run (the same steps on the same rows)
STEP_LOSS_TOL = 1e-6


def job_env() -> dict[str, str]:
    """A job subprocess's environment: this checkout first on PYTHONPATH, DeepSpeed's compiled ops cached."""
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hylo" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def torchrun(stage: int, config: Path, *extra: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    """jobs/stage{1,2}.py under torchrun, 2 processes on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "jobs" / f"stage{stage}.py"), "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_same_steps(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    for s in steps:
        assert abs(a[s]["loss"] - b[s]["loss"]) <= STEP_LOSS_TOL, (s, a[s]["loss"], b[s]["loss"])
        assert a[s]["rows"] == b[s]["rows"], s
        assert a[s]["data_position"] == b[s]["data_position"], s
