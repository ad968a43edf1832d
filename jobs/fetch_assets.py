"""Fetch the offline assets (model, ShareGPT, HumanEval) into the cache and print their paths.

    python jobs/fetch_assets.py                 # all assets
    python jobs/fetch_assets.py sharegpt humaneval --verify
Cache: --cache-dir, else $HYLO_CACHE, else ~/.cache/hylo. Exit status 2 with one `error:` line on failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:
    # run as a file (python jobs/NAME.py): the packages are in the checkout beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main  # noqa: E402

from hylo.assets import ASSETS, fetch_asset  # noqa: E402


@job_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"assets to fetch (default: all): {', '.join(ASSETS)}")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--verify", action="store_true", help="re-hash existing assets, rebuild on mismatch")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--json", action="store_true", help="print one JSON object {name: path}")
    args = ap.parse_args(argv)
    names = args.names or list(ASSETS)
    paths: dict[str, str] = {}
    for name in names:
        paths[name] = str(fetch_asset(name, args.cache_dir, progress=not args.quiet, verify=args.verify))
        if not args.json:
            print(f"{name}\t{paths[name]}", flush=True)
    if args.json:
        print(json.dumps(paths, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
