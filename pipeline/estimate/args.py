"""`hylo estimate`'s flags and the config they name.

It imports nothing of the estimator (torch, the training stack): jobs/estimate.py parses with it first, so
`--help`, a bad flag, a bad config and `--print-config` answer at once.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hylo.outputs import check_output_file
from hylo.pipeline import estimate
from hylo.pipeline.cli import MAX_WORLD_SIZE, bounded_int
from hylo.pipeline.config import (
    add_config_args,
    flag_overrides,
    maybe_print_config,
    read_config_file,
)
from hylo.pipeline.paths import job_inputs, resolve_paths
from hylo.pipeline.train.config import TEACHER_SPLITS, load_stage_config

if TYPE_CHECKING:
    from hylo.pipeline.train.config import StageConfig


# the shorthand flags that set config keys (pipeline/config.flag_overrides)
FLAG_KEYS = {"teacher_split": "train.sequence_parallel_teacher"}


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`description`: the help's text (jobs/estimate.py's docstring; default the package's)."""
    if description is None:
        description = estimate.__doc__
    ap = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, example="data.seq_len=32768")
    ap.add_argument("--stage", type=bounded_int(1, 2), default=None,
                    help="which stage's step (default: the `stage:` a printed config names, else 2)")
    ap.add_argument("--tokens", default=None,
                    help="comma-separated row lengths, e.g. 8192,65536 (default: the config's data.seq_len)")
    ap.add_argument("--world-size", type=bounded_int(1, MAX_WORLD_SIZE), default=None,
                    help="ZeRO-3 world size (default: the config's ray.num_workers)")
    ap.add_argument("--sequence-parallel", type=bounded_int(1, MAX_WORLD_SIZE), default=None, metavar="N",
                    help="one row split by tokens over N GPUs (default: the config's train.sequence_parallel, else 1): "
                         "per GPU the rank's step at T/N tokens plus what splitting adds, and the bytes each layer "
                         "sends (pipeline/estimate/sp.py)")
    ap.add_argument("--teacher-split", choices=TEACHER_SPLITS, default=None,
                    help="how the teacher (stage 1: the base) splits with the row, train.sequence_parallel_teacher: "
                         "its figures per GPU are printed whole (before) and split this way (after) "
                         "(pipeline/estimate/sp_teacher.py)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="the step's dtype (default: model.dtype as on a GPU: auto = bfloat16)")
    ap.add_argument("--cpu", action="store_true",
                    help="the step as a CPU runs it (fused KL's host checks and chunk size; fp32 unless --dtype)")
    ap.add_argument("--json", default=None,
                    help="also write every figure to this file (never over a file this project did not write)")
    ap.add_argument("--force", action="store_true",
                    help="let --json replace an existing file this project did not write")
    return ap


def estimate_args(argv: list[str] | None, description: str | None = None) -> tuple[argparse.Namespace, StageConfig]:
    """The flags and the loaded config (`--stage`, else the `stage:` the file names, else 2); `--print-config`
    prints it and exits."""
    args = build_parser(description).parse_args(argv)
    if args.stage is None:  # a stage's --print-config (and this job's) heads its file with `stage: N`
        named = read_config_file(args.config)[0].get("stage") if args.config else None
        args.stage = named if named in (1, 2) else 2
    # --teacher-split is train.sequence_parallel_teacher (checked by the config's rules)
    overrides = [*args.overrides, *flag_overrides(args, FLAG_KEYS)]
    cfg = load_stage_config(args.stage, args.config, overrides)
    maybe_print_config(cfg, args)
    if args.json:
        # before the work: --json is none of the files the estimate reads (its config, the student's and the
        # base's folders, the teacher's: never one of their files, --force or not), nor a file of the user's
        check_output_file(args.json, "--json", job_inputs(resolve_paths(cfg)), force=args.force)
    return args, cfg
