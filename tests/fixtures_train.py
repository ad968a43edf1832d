"""Tiny fixtures for the training tests: a random Llama base, its HyLo conversion, a config, a fake S3.

Test modules import it as `from fixtures_train import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml


def make_tiny_models(root: str | Path, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2,
                     mla_layers: str = "even", seed: int = 0) -> dict[str, Path]:
    """A random Llama base (also the teacher) and its HyLo conversion (MLA on `mla_layers`, GDN elsewhere)."""
    from hylo.io import save_hylo
    from hylo.upcycle import load_base_model, upcycle

    from fixtures_teacher import save_tiny_llama

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


@contextlib.contextmanager
def fake_s3(bucket: str = "bucket") -> Iterator[Callable[[str], str]]:
    """A local S3 server (moto) for tests: yields `uri(key)` -> `s3://<bucket>/<key>?endpoint_override=...`
    for pyarrow's S3 client; pickled filesystems carry the dummy credentials to Ray workers.

    moto 5.2 answers CompleteMultipartUpload with the wrong root element, which pyarrow's S3 client
    rejects (getmoto/moto#10055); a small WSGI filter renames it.
    """
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)

    def fixed(environ, start_response):
        if not (environ["REQUEST_METHOD"] == "POST" and "uploadId=" in environ.get("QUERY_STRING", "")):
            return app(environ, start_response)
        got: dict[str, Any] = {}

        def capture(status, headers, exc_info=None):
            got.update(status=status, headers=headers)
            return lambda data: None

        body = b"".join(app(environ, capture))
        body = body.replace(b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult")
        headers = [(k, str(len(body)) if k.lower() == "content-length" else v) for k, v in got["headers"]]
        start_response(got["status"], headers)
        return [body]

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = make_server("127.0.0.1", 0, fixed, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        uri = f"s3://{bucket}?endpoint_override=http://{host}:{port}&allow_bucket_creation=true"
        import pyarrow.fs as pafs

        fs, _ = pafs.FileSystem.from_uri(uri)
        fs.create_dir(bucket)
        query = uri.split("?", 1)[1]
        yield lambda key: f"s3://{bucket}/{key.strip('/')}?{query}"
    finally:
        server.shutdown()
        thread.join()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
