"""`hylo serve`: vLLM's OpenAI-compatible server for a HyLo checkpoint, on 127.0.0.1, at its trained length.

Design choices:
* vLLM runs in its own environment (`make serve-install`: vLLM pins a transformers older than training's), so
  this job checks the model here and then starts that environment's `vllm serve` as a child process, which the
  `hylo` plugin (hylo/serving/plugin.py) lets find the model. `--print-command` shows the command instead.
* The length served is the length the model was trained at: the last training stage's row length in its card
  (`hylo_card.json`), or its rows' `max_len` where the stage read packed data; 65,536 for AMD's released
  checkpoints (HyLo's stage 2), whose configs inherit the base's 131,072. `max_model_len` overrides it.
* Refused before anything starts, in one line naming the key: a model vLLM's MLA cannot compute exactly
  (hylo/serving/widen.py), a length beyond the model's positions, a taken port, no serving interpreter.
* The KV bytes per token are printed at start, native and served (vLLM's MLA takes a wider latent).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hylo.logs import get_logger
from hylo.pipeline.config import NONEMPTY, PATH, ConfigError, at_least, between, one_of, rules

logger = get_logger(__name__)

# HyLo's stage 2 trains at 64K (the paper, and AMD's released checkpoints' cards)
RELEASED_TRAINED_LENGTH = 65536
SERVE_PYTHON_ENV = "HYLO_SERVE_PYTHON"
ROOT = Path(__file__).resolve().parents[1]


class ServeError(ValueError):
    """A model or setting `hylo serve` cannot serve; the message names the key and what to change."""


@dataclass
@rules(model=PATH, python=NONEMPTY, max_model_len=at_least(1), port=between(1, 65535),
       host=NONEMPTY, dtype=one_of("bfloat16", "float16", "float32", "auto"), cpu_kv_cache_gib=at_least(1))
class ServeConfig:
    # The checkpoint to serve: a HyLo export (a stage's `model/`, `hylo convert --out`) or AMD's released layout.
    model: str | None = None
    # Longest prompt + answer served; None = the length the model was trained at (see above).
    max_model_len: int | None = None
    # Where the server listens; 127.0.0.1 unless you mean to expose it.
    host: str = "127.0.0.1"
    port: int = 8000
    # bf16: vLLM's CPU Gated DeltaNet kernels take bf16 only; "auto" = the checkpoint's dtype.
    dtype: str = "bfloat16"
    # The interpreter whose environment has vLLM (a path, or a command on PATH); None = $HYLO_SERVE_PYTHON,
    # else this one when vLLM imports here, else the checkout's .venv-serve (`make serve-install`).
    python: str | None = None
    # The name clients put in a request's `model` field; None = the checkpoint's directory name.
    served_model_name: str | None = None
    # On a CPU: GiB of memory for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE), unless that variable is set.
    cpu_kv_cache_gib: int = 4
    # More `vllm serve` flags, passed as given (e.g. ["--tensor-parallel-size", "2"]).
    vllm_args: list[str] = field(default_factory=list)


def trained_length(model: Path, card: dict[str, Any] | None, released: bool) -> int | None:
    """The row length of the last training stage that made `model`, or None when its record does not say."""
    if released:
        return RELEASED_TRAINED_LENGTH
    for step in reversed((card or {}).get("history") or []):
        recipe = step.get("recipe") or {}
        if not recipe.get("stage"):
            continue
        if recipe.get("seq_len"):
            return int(recipe["seq_len"])
        data = recipe.get("data")
        if isinstance(data, str) and (Path(data) / "manifest.json").is_file():
            from hylo.pipeline.data.shards import read_manifest

            max_len = read_manifest(data).get("max_len")
            if max_len:
                return int(max_len)
        return None
    return None


def serving_python(cfg: ServeConfig) -> str:
    """The interpreter that runs vLLM, or a ServeError saying how to get one."""
    if cfg.python:  # a command on PATH (python3.11) or a path, as a shell takes it
        found = shutil.which(cfg.python)
        if found is None:
            raise ServeError(f"python={cfg.python}: no such interpreter (neither an executable file nor a command "
                             f"on PATH)")
        return str(Path(found).absolute())
    if os.environ.get(SERVE_PYTHON_ENV):
        return os.environ[SERVE_PYTHON_ENV]
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = ROOT / ".venv-serve" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    raise ServeError("no interpreter with vLLM: run `make serve-install` in the checkout (it makes .venv-serve), or "
                     f"set python (or ${SERVE_PYTHON_ENV}) to one whose environment has vLLM and this package")


def port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def plan(cfg: ServeConfig) -> tuple[list[str], dict[str, str], list[str]]:
    """(command, environment additions, lines to print first) of serving `cfg`, after every check."""
    from hylo.card import load_card
    from hylo.released.layout import is_released_layout
    from hylo.serving.plugin import CONFIG_FORMAT, hylo_config
    from hylo.serving.widen import served_bytes_per_token, served_mla
    from hylo.serving.widths import CPU_WIDTHS, GPU_WIDTHS

    if not cfg.model:
        raise ConfigError("model: which checkpoint to serve (`hylo serve DIR`)", "model")
    model = Path(cfg.model)
    if not (model / "config.json").is_file():
        raise ServeError(f"model={model}: no config.json there; give a HyLo checkpoint directory (a stage's model/, "
                         f"`hylo convert --out`) or AMD's released layout")
    released = is_released_layout(model)
    hcfg = hylo_config(model)
    try:
        on_cpu, on_gpu = served_mla(hcfg, CPU_WIDTHS), served_mla(hcfg, GPU_WIDTHS)
    except ValueError as e:
        raise ServeError(f"model={model}: {e}") from None
    length = cfg.max_model_len or trained_length(model, load_card(model), released)
    if length is None:
        raise ServeError(f"model={model}: its card records no training length (a converted model no stage trained); "
                         f"set max_model_len (--max-model-len N) to the length to serve")
    if length > hcfg.max_position_embeddings:
        raise ServeError(f"max_model_len={length}: beyond the model's max_position_embeddings "
                         f"({hcfg.max_position_embeddings})")
    if port_taken(cfg.host, cfg.port):
        raise ServeError(f"port={cfg.port}: {cfg.host}:{cfg.port} is taken by another process; choose a free port")
    python = serving_python(cfg)
    name = cfg.served_model_name or (model.parent.name if model.name == "model" else model.name)
    cmd = [python, "-m", "hylo.serving.cli", "serve", str(model), "--host", cfg.host, "--port",
           str(cfg.port), "--max-model-len", str(length), "--dtype", cfg.dtype, "--config-format", CONFIG_FORMAT,
           "--served-model-name", name, *cfg.vllm_args]
    env = {} if "VLLM_CPU_KVCACHE_SPACE" in os.environ else {"VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kv_cache_gib)}
    native, cpu = served_bytes_per_token(hcfg, on_cpu)
    _, gpu = served_bytes_per_token(hcfg, on_gpu)
    lines = [
        f"[serve] {model} ({'AMD released layout' if released else 'HyLo export'}), {len(hcfg.mla_layers)} MLA + "
        f"{len(hcfg.linear_layers)} {hcfg.linear_type} layers, served up to {length:,} tokens",
        f"[serve] MLA cache per token, bf16: {native:,} B native (latent {on_cpu.rank} + rope {on_cpu.rope}); "
        f"served {gpu:,} B on a GPU ({on_gpu.served_rank} + {on_gpu.served_rope}), {cpu:,} B on a CPU "
        f"({on_cpu.served_rank} + {on_cpu.served_rope}): vLLM's MLA widths; the linear layers' state is fixed-size",
        f"[serve] OpenAI API on http://{cfg.host}:{cfg.port}/v1 (model name {name!r}); Ctrl-C stops it",
    ]
    return cmd, env, lines


def serve(cfg: ServeConfig, print_command: bool = False) -> int:
    cmd, env, lines = plan(cfg)
    if print_command:
        print(" ".join(f"{k}={v}" for k, v in env.items()), *cmd)
        return 0
    for line in lines:
        logger.info(line)
    return subprocess.call(cmd, env={**os.environ, **env})


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (our own server on 127.0.0.1)
        return json.loads(resp.read())


def served_answers(cfg: ServeConfig, prompts: list[str], max_tokens: int, log: Path,
                   start_timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Start the server of `cfg` on a free port, ask its OpenAI chat endpoint each prompt (greedy, `max_tokens`),
    stop it; [{prompt, answer, new_tokens}] as the `samples` suite writes them. Its output goes to `log`."""
    cfg = ServeConfig(**{**cfg.__dict__, "port": free_port(cfg.host)})
    cmd, env, lines = plan(cfg)
    base = f"http://{cfg.host}:{cfg.port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write("\n".join(lines) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if proc.poll() is not None:
                    raise ServeError(f"the vLLM server of {cfg.model} exited with status {proc.returncode} before it "
                                     f"answered (its output: {log})")
                try:
                    with urllib.request.urlopen(base + "/health", timeout=5) as resp:  # noqa: S310
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise ServeError(f"the vLLM server of {cfg.model} did not answer within {start_timeout_s:.0f} s "
                                     f"(its output: {log})")
                time.sleep(2)
            name = cmd[cmd.index("--served-model-name") + 1]
            out = []
            for prompt in prompts:
                reply = _post(base + "/v1/chat/completions",
                              {"model": name, "messages": [{"role": "user", "content": prompt}],
                               "temperature": 0.0, "max_tokens": max_tokens}, timeout=300)
                out.append({"prompt": prompt, "answer": (reply["choices"][0]["message"]["content"] or "").strip(),
                            "new_tokens": reply["usage"]["completion_tokens"]})
            return out
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
