"""Evaluate a HyLo or HF checkpoint: KL/perplexity, retrieval, KV cache, lm-evaluation-harness.

    hylo eval --model runs/hylo-smollm2 --teacher smollm2-135m-instruct \\
        --base smollm2-135m-instruct --data runs/data/smoke --out runs/eval --suite kl,retrieval,kvcache
    hylo eval --config eval_smoke.yaml --model runs/hylo-smollm2 --suite kvcache --set kvcache.lengths=[512,1024]
    hylo eval --model runs/hylo-smollm2 --suite lm_eval --lm-eval-tasks arc_easy,gsm8k --batch-size 16 \\
        --log-samples --update-card          # gsm8k runs with its own 5 shots; --num-fewshot N overrides all

(runs/hylo-smollm2: `hylo convert --base smollm2-135m-instruct --out runs/hylo-smollm2 --mla-layers even`;
runs/data/smoke: `hylo prepare-data --config data_smoke.yaml`.)

Writes results.json and results.md into --out and prints the Markdown; files of those names it did not
write itself (listed in --out's .hylo-output.json) are never overwritten, and --out must not be (or be inside,
or hold) the model, teacher, base, tokenizer or data. Options given as flags override the same keys of
--config / --set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.logs import get_logger
from hylo.pipeline.cli import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_FEWSHOT,
    bounded_int,
    job_main,
    positive_finite_float,
    writable_dir,
)
from hylo.pipeline.config import add_config_args, load_config, maybe_print_config
from hylo.pipeline.eval.config import EvalConfig
from hylo.pipeline.paths import resolve_paths
from hylo.weight_files import check_weights_dir

logger = get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_config_args(p)
    p.add_argument("--model", help="HyLo or HF checkpoint directory, or asset name (models.path)")
    p.add_argument("--teacher", help="teacher checkpoint for KL (models.teacher)")
    p.add_argument("--base", help="base HF model for KV-cache / retrieval comparison (models.base)")
    p.add_argument("--tokenizer", help="tokenizer directory (models.tokenizer)")
    p.add_argument("--data", help="held-out rows: packed-data dir, Parquet, or JSON/JSONL chat records (kl.data)")
    p.add_argument("--out", help="output directory (out)")
    p.add_argument("--suite", help="comma list of kl,retrieval,kvcache,lm_eval (suites)")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (models.device)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="models.dtype")
    p.add_argument("--lm-eval-tasks", help="comma list of lm-eval task names (lm_eval.tasks)")
    p.add_argument("--num-fewshot", type=bounded_int(0, MAX_FEWSHOT), help="few-shot examples for every lm-eval task (lm_eval.num_fewshot; "
                   "default: each task's own)")
    p.add_argument("--batch-size", type=bounded_int(1, MAX_BATCH), help="lm-eval prompts per generate() call (lm_eval.batch_size)")
    p.add_argument("--limit", type=positive_finite_float(MAX_COUNT), help="lm-eval examples per task, or a fraction < 1 (lm_eval.limit)")
    p.add_argument("--log-samples", action="store_true", default=None,
                   help="write every lm-eval sample beside the results (lm_eval.log_samples)")
    p.add_argument("--apply-chat-template", action="store_true", default=None,
                   help="render lm-eval prompts with the chat template (lm_eval.apply_chat_template)")
    p.add_argument("--update-card", action="store_true", default=None,
                   help="record the results in the checkpoint's model card (update_card)")
    p.add_argument("--quiet", action="store_true", help="do not print the Markdown report")
    return p


FLAG_KEYS = {"model": "models.path", "teacher": "models.teacher", "base": "models.base",
             "tokenizer": "models.tokenizer", "data": "kl.data", "out": "out", "device": "models.device",
             "dtype": "models.dtype", "num_fewshot": "lm_eval.num_fewshot", "batch_size": "lm_eval.batch_size",
             "limit": "lm_eval.limit", "log_samples": "lm_eval.log_samples",
             "apply_chat_template": "lm_eval.apply_chat_template", "update_card": "update_card"}


def overrides_from_flags(args: argparse.Namespace) -> list[str]:
    out = [f"{key}={json.dumps(getattr(args, flag))}" for flag, key in FLAG_KEYS.items()
           if getattr(args, flag) is not None]
    if args.suite:
        out.append(f"suites={json.dumps([s.strip() for s in args.suite.split(',') if s.strip()])}")
    if args.lm_eval_tasks:
        out.append(f"lm_eval.tasks={json.dumps([s.strip() for s in args.lm_eval_tasks.split(',') if s.strip()])}")
    return out


def check_model_files(cfg) -> None:
    """Name a truncated weights file of any model the run loads before loading anything."""
    from hylo.pipeline.eval.decode import resolve_path  # lazy: torch

    for spec in (cfg.models.path, cfg.models.teacher, cfg.models.base):
        if spec is not None:
            check_weights_dir(resolve_path(spec))


@job_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    # a bad config (ConfigError) or input (EvalError) is one `error:` line and exit status 2 (job_main)
    cfg = load_config(EvalConfig, args.config, [*args.overrides, *overrides_from_flags(args)])
    maybe_print_config(cfg, args)
    cfg = resolve_paths(cfg)
    cfg.check_inputs()
    # the evaluation stack (torch, transformers) after --help and --print-config answered
    from hylo.pipeline.eval.run import check_out, render_markdown, run_eval  # lazy: torch

    check_out(cfg)
    check_model_files(cfg)
    writable_dir(cfg.out, "out")

    res = run_eval(cfg)
    if not args.quiet:
        print(render_markdown(res))
    logger.info(f"[eval] wrote {Path(cfg.out) / 'results.json'} and results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
