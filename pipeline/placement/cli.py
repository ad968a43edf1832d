"""The command line of the search (jobs/place_layers.py, `hylo place-layers`): flags as shorthands for the keys of
`PlacementConfig`."""

from __future__ import annotations

import argparse
import time

from hylo.logs import get_logger
from hylo.model_files import MAX_HIDDEN, MAX_LAYERS
from hylo.pipeline import runner
from hylo.pipeline.cli import MAX_COUNT, MAX_CPUS_PER_NODE, bounded_int
from hylo.pipeline.config import GivenOnce, config_from_args
from hylo.pipeline.placement.proxy import PROXIES
from hylo.pipeline.placement.workflow import PlaceLayers, PlacementConfig
from hylo.rules import ROW_TOKENS_MAX, SEED_MAX

logger = get_logger(__name__)

# Each shorthand flag's config key (the flags win over --config and --set).
FLAG_KEYS = {**runner.RUNNER_FLAGS, "num_cpus": "ray.num_cpus", **{name: name for name in (
    "base", "n_mla", "data_from", "stage1_data", "stage2_data", "heldout_data", "train_config", "train_set",
    "steps", "seq_len", "heldout_rows", "kv_lora_rank", "linear_type", "proxy_only", "proxy", "compare",
    "compare_steps", "compare_seeds")}}


def build_parser() -> argparse.ArgumentParser:
    ap = runner.runner_parser(
        "Choose which layers keep full attention (MLA) by measurement: the sensitivity search.\n\n"
        "    hylo place-layers --n-mla 15 --data-from runs/demo [--compare even uniform:15]   # after `hylo demo`\n"
        "    hylo place-layers --n-mla 15 --data-from runs/demo --proxy-only      # seconds, no training\n"
        "    hylo place-layers --n-mla 15 --data-from runs/demo --set compare_seeds=[0,1,2] --print-config\n\n"
        "run_dir default runs/placement. Every option is a key of PlacementConfig\n"
        "(pipeline/placement/workflow.py); the flags are shorthands for them.")
    ap.add_argument("--base", help="base HF model directory or asset:<name> (base)")
    ap.add_argument("--n-mla", type=bounded_int(1, MAX_LAYERS), help="how many layers get MLA (n_mla; required)")
    ap.add_argument("--data-from", help="a demo run directory: use its data/{stage1,stage2,heldout}")
    ap.add_argument("--stage1-data")
    ap.add_argument("--stage2-data")
    ap.add_argument("--heldout-data")
    ap.add_argument("--train-config", action=GivenOnce, help="training config of the short stages: a file or a shipped config's name (default "
                    "demo-smollm2.yaml)")
    ap.add_argument("--train-set", action="append", metavar="KEY=VALUE",
                    help="extra --set override for every training job, e.g. model.activation_checkpointing=false")
    ap.add_argument("--steps", type=bounded_int(1, MAX_COUNT), help="stage-1 steps of the two students the search scores")
    ap.add_argument("--seq-len", type=bounded_int(2, ROW_TOKENS_MAX), help="tokens per packed row (as the data was packed)")
    ap.add_argument("--heldout-rows", type=bounded_int(1, MAX_COUNT), help="held-out rows every layer is scored on")
    ap.add_argument("--kv-lora-rank", type=bounded_int(1, MAX_HIDDEN))
    ap.add_argument("--linear-type", choices=["gdn", "mamba2"])
    ap.add_argument("--num-cpus", type=bounded_int(1, MAX_CPUS_PER_NODE), help="CPUs of the local Ray that scores layers (ray.num_cpus)")
    ap.add_argument("--proxy-only", action="store_true", default=None, help="choose by the training-free proxy only")
    ap.add_argument("--proxy", choices=list(PROXIES), help="the proxy --proxy-only ranks by (default error_gap)")
    ap.add_argument("--compare", nargs="*", metavar="PLACEMENT",
                    help="placements to compare with the searched one, e.g. --compare even uniform:15 0,5,10")
    ap.add_argument("--compare-steps", type=bounded_int(1, MAX_COUNT), help="stage 1 and stage 2 steps of each compared run")
    ap.add_argument("--compare-seeds", nargs="+", type=bounded_int(0, SEED_MAX), metavar="SEED",
                    help="run every compared placement once per seed (conversion init, train.seed); with several "
                         "seeds the table gives mean, spread and the paired difference to the searched placement")
    return ap


def placement_config(argv: list[str] | None = None) -> PlacementConfig:
    """The search's config from its command line (`--print-config` prints it and exits)."""
    args = build_parser().parse_args(argv)
    return config_from_args(PlacementConfig, args, FLAG_KEYS)


def run_placement(cfg: PlacementConfig) -> int:
    t0 = time.time()
    with PlaceLayers(cfg) as job:
        rc = job.main()
    logger.info(f"[place] total {time.time() - t0:.0f} s")
    return rc
