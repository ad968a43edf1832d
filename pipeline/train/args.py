"""The training stages' command line (`hylo stage1`, `hylo stage2`): the flags and the config they name.

It imports nothing of the training stack (torch, Ray, DeepSpeed): jobs/stage1.py and jobs/stage2.py parse with
it before they import the driver, so `--help`, a bad flag, a bad config and `--print-config` answer at once.
"""

from __future__ import annotations

import argparse

from hylo.pipeline.config import add_config_args, maybe_print_config
from hylo.pipeline.train.config import StageConfig, load_stage_config


def build_parser(stage: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=f"HyLo stage {stage} training (Ray Train + DeepSpeed ZeRO-3)\n\n"
        f"    hylo stage{stage} --config demo-smollm2.yaml [--set optim.lr=1e-4 ...] [--resume [PATH]]\n"
        f"    hylo stage{stage} --config demo-smollm2.yaml --set train.total_steps=4 --print-config\n\n"
        "--config takes a file or the name of a shipped config (`hylo configs` lists them); a relative\n"
        "path in a config is relative to the current directory. All options: pipeline/train/config.py\n"
        "(--print-config prints every key with its value).",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_config_args(p, example="optim.lr=1e-4")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue the run from its newest checkpoint, or from checkpoint directory PATH")
    p.add_argument("--break-lock", action="store_true",
                   help="take over the run directory's lock (run.lock) left by a run that is no longer "
                        "running; a lock held by a live process of this host is never broken")
    return p


def stage_args(stage: int, argv: list[str] | None) -> tuple[argparse.Namespace, StageConfig]:
    """The flags and the loaded config of stage `stage`'s command line; `--print-config` checks it as the run
    would (its inputs, when they are on this machine: train/inputs.py `check_inputs_for_print`), prints it and
    exits."""
    args = build_parser(stage).parse_args(argv)
    cfg = load_stage_config(stage, args.config, args.overrides)
    if getattr(args, "print_config", False):
        from hylo.pipeline.train.inputs import check_inputs_for_print  # lazy: pyarrow

        check_inputs_for_print(cfg)
    maybe_print_config(cfg, args)
    return args, cfg
