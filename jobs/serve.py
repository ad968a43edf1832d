"""Serve a HyLo checkpoint with vLLM's OpenAI-compatible server (on 127.0.0.1, at the length it was trained at).

    hylo serve runs/demo/stage2/model                       # the demo's distilled model, http://127.0.0.1:8000/v1
    hylo serve path/to/HyLo-Llama-8MLA8GDN-64K --port 8001  # AMD's released layout (served up to 65,536 tokens)
    hylo serve runs/demo/stage2/model --print-command       # the `vllm serve` command, not run

vLLM lives in its own environment (`make serve-install`, docs/serving.md). Every flag is a shorthand for a key of
the job's config (pipeline/serve.py; `--print-config` lists them): the file (`--config`) first, then the flags,
then `--set KEY=VALUE`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import bounded_int, job_main
from hylo.pipeline.config import add_config_args, flag_overrides, load_config, maybe_print_config
from hylo.pipeline.paths import resolve_paths
from hylo.pipeline.serve import ServeConfig, serve

FLAGS = {"model": "model", "max_model_len": "max_model_len", "port": "port", "host": "host", "python": "python"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    add_config_args(p, example="port=8001")
    p.add_argument("model", nargs="?", default=None, help="the checkpoint directory (model)")
    p.add_argument("--max-model-len", type=bounded_int(1, 1 << 24), help="longest prompt + answer (max_model_len; "
                   "default: the trained length)")
    p.add_argument("--port", type=bounded_int(1, 65535), help="port (port; default 8000)")
    p.add_argument("--host", help="address to listen on (host; default 127.0.0.1)")
    p.add_argument("--python", help="the interpreter with vLLM (python; default: .venv-serve, `make serve-install`)")
    p.add_argument("--print-command", action="store_true", help="print the `vllm serve` command and exit")
    return p


@job_main(stops=True)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(ServeConfig, args.config, [*flag_overrides(args, FLAGS), *args.overrides])
    cfg = resolve_paths(cfg)
    maybe_print_config(cfg, args)
    return serve(cfg, print_command=args.print_command)


if __name__ == "__main__":
    sys.exit(main())
