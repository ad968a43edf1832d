"""Decontaminate a chat mixture against evaluation benchmarks (n-gram matching, Ray Data scan).

    hylo decontaminate --input sharegpt=data/sg.json --benchmark humaneval --out runs/dc
    hylo decontaminate --input a.jsonl --input b.parquet \\
        --benchmark gsm8k --benchmark mine=evals/mine.jsonl:question,answer@qid --ngram 8 --mode cut
    hylo decontaminate --input sharegpt=data/sg.json --set match.boilerplate_docs=0 [--config FILE]
    hylo decontaminate --export-benchmarks /mnt/hylo/evals   # hub suites -> <dir>/<suite>.jsonl

--input [NAME=]PATH (repeatable; NAME defaults to the file stem); --benchmark NAME (built-in or
registry suite: humaneval, gsm8k, mmlu, ...) or NAME=PATH:FIELD[,FIELD...][@ID_FIELD].
Command-line flags override the YAML config (pipeline/config.py); outputs: <out>/clean.{jsonl,parquet},
removed.jsonl, rejects.jsonl, reports/<suite>.{json,md}, summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.assets import asset_name
from hylo.pipeline.cli import MAX_NGRAM, bounded_int, job_main, report_error
from hylo.pipeline.config import ConfigError, add_config_args, load_config, maybe_print_config
from hylo.pipeline.data.decontam import (
    SUITES,
    DecontamJobConfig,
    export_benchmarks,
    run_decontamination,
)
from hylo.pipeline.data.readers import SourceError
from hylo.pipeline.paths import resolve_paths


def _input_override(items: list[str]) -> list[dict]:
    out = []
    for text in items:
        name, sep, path = text.partition("=")
        if not sep:
            name, path = asset_name(text) or Path(text).name.split(".")[0], text
        out.append({"name": name, "path": path})
    return out


def _benchmark_override(items: list[str]) -> list[dict]:
    out = []
    for text in items:
        name, sep, rest = text.partition("=")
        if not sep:
            out.append({"name": name})
            continue
        rest, _, id_field = rest.partition("@")
        path, sep, fields = rest.rpartition(":")
        if not sep or not path or not fields:
            raise ConfigError(f"--benchmark {text!r}: expected NAME or NAME=PATH:FIELD[,FIELD...][@ID_FIELD]")
        spec = {"name": name, "path": path, "fields": fields.split(",")}
        if id_field:
            spec["id_field"] = id_field
        out.append(spec)
    return out


@job_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_config_args(ap)
    ap.add_argument("--input", action="append", default=[], metavar="[NAME=]PATH")
    ap.add_argument("--benchmark", action="append", default=[], metavar="SUITE|NAME=PATH:FIELDS[@ID]",
                    help=f"known suites: {', '.join(SUITES)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ngram", type=bounded_int(2, MAX_NGRAM), default=None)
    ap.add_argument("--mode", choices=("drop", "cut"), default=None)
    ap.add_argument("--format", dest="output_format", choices=("jsonl", "parquet"), default=None)
    ap.add_argument("--scanner", choices=("ray", "local", "reference"), default=None)
    ap.add_argument("--export-benchmarks", metavar="DIR", default=None,
                    help="write the hub suites (or those named by --benchmark) to DIR/<suite>.jsonl and exit")
    args = ap.parse_args(argv)
    if args.export_benchmarks:
        try:
            export_benchmarks(args.export_benchmarks, args.benchmark or None)
        except (ValueError, OSError) as e:
            print(f"decontaminate: error: {e}", file=sys.stderr)
            return 2
        return 0
    overrides = list(args.overrides)
    try:
        if args.input:
            overrides.append(f"inputs={json.dumps(_input_override(args.input))}")
        if args.benchmark:
            overrides.append(f"benchmarks={json.dumps(_benchmark_override(args.benchmark))}")
        for key, val in (("out", args.out), ("match.ngram", args.ngram), ("match.mode", args.mode),
                         ("output_format", args.output_format), ("scanner", args.scanner)):
            if val is not None:
                overrides.append(f"{key}={json.dumps(val)}")
        cfg = load_config(DecontamJobConfig, args.config, overrides)
        maybe_print_config(cfg, args)
        summary = run_decontamination(resolve_paths(cfg))
    except (ConfigError, SourceError, ValueError) as e:
        report_error(str(e))
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
