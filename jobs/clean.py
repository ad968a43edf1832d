r"""Remove what killed jobs left beside their output directories, and only that.

    hylo clean runs/hylo-smollm2                # the output of a killed `hylo convert --out runs/hylo-smollm2`
    hylo clean runs/hylo-3b-released runs/eval  # several outputs at once

A job writes a directory output under a hidden temporary name beside it, `.OUT.tmp-<pid>-<hex>`, and renames
it into place when complete; a killed job leaves that directory behind (a model's worth of bytes). The next
run of the same output removes it by itself; `hylo clean OUT` does it now. Removed: a `.OUT.tmp-*` directory
that carries this project's staging record (`.hylo-output.json`, "staging": true) naming a process of this
host that is gone, and a `.OUT.old-*` directory (a crash between the two renames of a swap) whose process is
gone and whose record lists all it holds (put back as OUT when OUT is missing). Anything else that matches the
pattern is listed and left alone. Nothing is removed while the job that owns it still runs. A teacher cache
(`hylo teacher-cache`) is written in place: for it, `hylo clean CACHE` removes the shard or manifest a killed
writer left half written (`shards/.shard-NNNNN.parquet.tmp-<pid>-<hex>`), as its next run does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.leftovers import stale_leftovers, sweep_stale
from hylo.logs import add_log_level_flag
from hylo.ownership import output_target, recorded_entries
from hylo.pipeline.cli import job_main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("outputs", nargs="+", metavar="OUT", help="an output directory a job was writing (--out)")
    add_log_level_flag(p)
    return p


@job_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for out in args.outputs:
        for d, done in sweep_stale(out):
            print(f"{done} {d}" + (f" as {output_target(out)}" if done == "put back" else ""))
        if (output_target(out) / "manifest.json").is_file() and recorded_entries(output_target(out)) is not None:
            # a teacher cache is resumed in place: what a killed writer left is inside it
            from hylo.pipeline.teacher.cache import sweep_cache_leftovers  # lazy: torch

            for f in sweep_cache_leftovers(output_target(out)):
                print(f"removed {f}")
        for d in stale_leftovers(out)[1]:
            print(f"left {d}: not provably a leftover of a finished job of this project (no staging record of "
                  f"ours, made on another host, or its process still runs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
