"""Fetch the offline assets (model, ShareGPT, HumanEval) into the cache and print their paths.

    hylo fetch-assets                 # all assets
    hylo fetch-assets sharegpt humaneval --no-verify
    hylo fetch-assets --set cache_dir=/mnt/cache/hylo --print-config
Cache: --cache-dir (cache_dir), else $HYLO_CACHE, else ~/.cache/hylo. Every run re-hashes every file of an
asset already in the cache against the sha256 recorded when it was fetched, and fetches again an asset with a
file that differs (naming it on stderr); --no-verify checks sizes and the stamps of the last hash only (what
every use of an asset checks). Exit status 2 with one `error:` line on failure (a file that differs and cannot
be fetched again is named).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.assets import ASSETS, fetch_asset
from hylo.pipeline.cli import job_main
from hylo.pipeline.config import PATH, FieldError, add_config_args, config_from_args, rules, suggest
from hylo.pipeline.paths import resolve_paths


@dataclass
@rules(cache_dir=PATH)
class FetchAssetsConfig:
    # Assets to fetch; empty = all.
    names: list[str] = field(default_factory=list)
    # The cache; None = $HYLO_CACHE, else ~/.cache/hylo.
    cache_dir: str | None = None
    # Re-hash every file of the assets already fetched and fetch again one whose hash differs (false: sizes and
    # the stamps of the last hash only, as on every use).
    verify: bool = True
    # No progress bars.
    quiet: bool = False
    # Print one JSON object {name: path} instead of one line per asset.
    json: bool = False

    def __post_init__(self) -> None:
        for name in self.names:
            if name not in ASSETS:  # hylo.assets' own message, with did-you-mean
                raise FieldError("names", self.names, f"unknown asset {name!r}{suggest(name, ASSETS)} (known: "
                                 f"{', '.join(ASSETS)})")


FLAG_KEYS = {"names": "names", "cache_dir": "cache_dir", "verify": "verify", "quiet": "quiet", "json": "json"}


@job_main(stops=True)
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    add_config_args(ap, example="verify=true")
    ap.add_argument("names", nargs="*", default=None, help=f"assets to fetch (names; default: all): {', '.join(ASSETS)}")
    ap.add_argument("--cache-dir", default=None, help="the cache directory (cache_dir)")
    ap.add_argument("--verify", action="store_true", default=None,
                    help="re-hash existing assets, fetch again on mismatch (verify; the default)")
    ap.add_argument("--no-verify", dest="verify", action="store_false", default=None,
                    help="check sizes and the stamps of the last hash only, as every use does (verify=false)")
    ap.add_argument("--quiet", action="store_true", default=None, help="no progress bars (quiet)")
    ap.add_argument("--json", action="store_true", default=None, help="print one JSON object {name: path} (json)")
    args = ap.parse_args(argv)
    if not args.names:
        args.names = None  # not given: the config's (default: all)
    cfg = resolve_paths(config_from_args(FetchAssetsConfig, args, FLAG_KEYS))
    paths: dict[str, str] = {}
    for name in cfg.names or list(ASSETS):
        paths[name] = str(fetch_asset(name, cfg.cache_dir, progress=not cfg.quiet, verify=cfg.verify))
        if not cfg.json:
            print(f"{name}\t{paths[name]}", flush=True)
    if cfg.json:
        print(json.dumps(paths, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
