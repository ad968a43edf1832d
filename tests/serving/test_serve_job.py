"""`hylo serve` (jobs/serve.py, pipeline/serve.py) up to the command it runs: every refusal is one line naming the
key to change, before anything starts. vLLM itself runs in tests/serving/test_vllm_exports.py and the quick
start's demo (tests/e2e/test_quickstart.py)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_hylo_split
from tests.helpers.serving import BASE, write_serving_export


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return write_serving_export("mla-gdn", tmp_path_factory.mktemp("serve") / "mla-gdn")


def serve(*argv: str) -> tuple[int, str, str]:
    return run_hylo_split(["serve", *argv, "--python", sys.executable])


def test_print_command_is_vllm_serve_of_the_export_on_localhost(export):
    rc, out, err = serve(str(export), "--max-model-len", "256", "--port", "8123", "--print-command")
    assert rc == 0, err
    assert "VLLM_CPU_KVCACHE_SPACE=4" in out
    cmd = out.split()
    i = cmd.index(sys.executable)
    assert cmd[i + 1:i + 5] == ["-m", "hylo.serving.cli", "serve", str(export)]
    flags = dict(zip(cmd[i + 5::2], cmd[i + 6::2]))
    assert flags == {"--host": "127.0.0.1", "--port": "8123", "--max-model-len": "256", "--dtype": "bfloat16",
                     "--config-format": "hylo", "--served-model-name": "mla-gdn"}


def test_the_length_is_the_trained_one_from_the_card(export, tmp_path):
    """A stage's card records its rows' length: that is what is served, unless max_model_len says otherwise."""
    import shutil

    model = tmp_path / "run" / "model"
    shutil.copytree(export, model)
    card = model / "hylo_card.json"
    record = json.loads(card.read_text()) if card.is_file() else {}
    record["history"] = [*(record.get("history") or []), {"recipe": {"stage": 2, "seq_len": 1024}}]
    card.write_text(json.dumps(record))
    rc, out, err = serve(str(model), "--print-command")
    assert rc == 0, err
    assert "--max-model-len 1024 " in out and "--served-model-name run" in out, out
    rc, out, err = serve(str(model), "--max-model-len", "4096", "--print-command")
    assert rc == 2 and "max_model_len=4096: beyond the model's max_position_embeddings (2048)" in err, err


@pytest.mark.parametrize("case", ["no length", "no config", "taken port", "no python", "qk norm"])
def test_a_refusal_is_one_line_naming_what_to_change(case, export, tmp_path):
    args = [str(export), "--max-model-len", "256"]
    if case == "no length":
        args, want = [str(export)], "set max_model_len (--max-model-len N)"
    elif case == "no config":
        args[0], want = str(tmp_path), "no config.json there"
    elif case == "qk norm":
        from hylo.config import HybridConfig
        from hylo.io import save_hylo
        from hylo.modeling import HyLoForCausalLM

        save_hylo(HyLoForCausalLM(HybridConfig(**{**BASE, "mla_qk_norm": True})), tmp_path / "qwen")
        args[0], want = str(tmp_path / "qwen"), "mla_qk_norm"
    held = socket.socket()
    if case == "taken port":
        held.bind(("127.0.0.1", 0))
        held.listen()
        args += ["--port", str(held.getsockname()[1])]
        want = f"port={held.getsockname()[1]}: 127.0.0.1:{held.getsockname()[1]} is taken"
    with held:
        if case == "no python":
            rc, out, err = run_hylo_split(["serve", *args, "--python", str(tmp_path / "nowhere" / "python")])
            want = "no such interpreter"
        else:
            rc, out, err = serve(*args, "--print-command")
    assert rc == 2 and out == "", (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], err


def test_python_is_a_path_or_a_command_on_path(export, tmp_path, monkeypatch):
    """`--python python3.11` is looked up on PATH as a shell would; a relative path is taken from the directory
    the command runs in."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm-python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    for given in ("vllm-python", "bin/vllm-python"):
        rc, out, err = run_hylo_split(["serve", str(export), "--max-model-len", "64", "--python", given,
                                       "--print-command"])
        assert rc == 0, err
        assert f" {bindir / 'vllm-python'} -m hylo.serving.cli serve " in f" {out}", out
