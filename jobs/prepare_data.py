"""Prepare packed training rows: mixture -> chat template -> tokenise (Ray Data) -> best-fit -> shards.

    hylo prepare-data --config data_stage1.yaml [--set packing.max_len=4096 ...]
    hylo prepare-data --config data_smoke.yaml --set output.dir=runs/data/mine

--config takes a file or the name of a shipped config (`hylo configs` lists them).

Writes shard-*.parquet, manifest.json, rejects.jsonl, report.json and report.md into output.dir.
Joins the Ray at `ray.address` (or `$RAY_ADDRESS`), else starts a local one of `ray.num_cpus` CPUs (pipeline/ray_init.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main
from hylo.pipeline.config import ConfigError, add_config_args, config_from_args
from hylo.pipeline.data.config import PrepareDataConfig
from hylo.pipeline.paths import resolve_paths


@job_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_config_args(parser)
    args = parser.parse_args(argv)
    cfg = resolve_paths(config_from_args(PrepareDataConfig, args))
    if not cfg.mixture.sources:
        raise ConfigError(f"{args.config or '<defaults>'}: mixture.sources is empty; list at least one source")
    # the data stack (Ray Data, pyarrow, torch) after --help and --print-config answered
    from hylo.pipeline.data.prepare import prepare  # lazy: torch

    report = prepare(cfg)
    c = report["counts"]
    print(json.dumps({k: c[k] for k in ("documents", "document_tokens", "rows", "read_rejects",
                                         "render_rejects", "docs_split", "pieces_without_loss", "efficiency")},
                     indent=1))
    print(f"wrote {len(report['shards'])} shard(s) to {cfg.output.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
