"""How often each Triton kernel is compiled and autotuned over decoding and over packed training rows.

    TRITON_INTERPRET=1 python bench/compile_counts.py [--decode-tokens 32] [--rows 10] [--row-tokens 256]
        [--variants 8mla8gdn,4mla12m2] [--json out.json]

Two scenarios per student variant (the tiny students of bench/gpu_check.py, every GPU branch taken):
* decode: one prefill of `--prefill` tokens, then `--decode-tokens` single-token steps from the cache;
* rows: `--rows` packed rows of `--row-tokens` tokens each (one length, as every training row of a run),
  each with different document boundaries: stage 2's student side, forward and backward (the student's
  hidden states, the fused KL against a teacher's hidden states, whose loss mask drops each document's last
  token, so the rows the KL's chunks hold differ from row to row).
Counts come from `hylo.kernels.compile_count` (Triton's JIT keys and autotune keys, per kernel). On CPU set
TRITON_INTERPRET=1: nothing is compiled, the keys the JIT would compile for are counted (fla's kernels run
through the interpreter harness of tests/helpers/fla_interpret.py). On a GPU leave it unset: real compiles.
The bounds the project holds to (`BOUNDS`, `LATER`): over the decode steps a kernel is compiled at most twice
(the prefill and the first single-token step, none after); over the rows once per call variant (e.g. fla's
cumsum runs forward and reversed in the backward), all for the first row, none for a later one; autotune runs
likewise. Exit status 1 when one is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hylo.atomic import atomic_write  # noqa: E402
from hylo.kernels.compile_count import count_compilations  # noqa: E402
from hylo.kernels.fused_kl import fused_linear_kl_div  # noqa: E402
from hylo.kernels.varlen import DocBounds  # noqa: E402
from hylo.modeling import HyLoForCausalLM  # noqa: E402

# per kernel: at most this many compilations (autotune runs) over the scenario, none first needed in phase LATER
# or after (decode: the prefill and the first single-token step may compile; the other steps must not; rows: a
# kernel's forward and backward variants compile for the first row, no later row compiles or tunes again)
BOUNDS = {"decode": 2, "rows": 2}
TEACHER_HIDDEN = 24
LATER = {"decode": 2, "rows": 1}


def row_bounds(T: int, seed: int) -> list[int]:
    """A packed row's document boundaries: 1 to 6 documents of random lengths, different for each seed."""
    rng = np.random.default_rng(seed)
    docs = int(rng.integers(1, 7))
    cuts = sorted(rng.choice(np.arange(1, T), size=docs - 1, replace=False).tolist())
    return [0, *cuts, T]


def decode(model: Any, prefill: int, tokens: int, device: Any, log: Any) -> None:
    ids = torch.randint(0, model.config.vocab_size, (1, prefill + tokens), generator=torch.Generator().manual_seed(6))
    ids = ids.to(device)
    with torch.no_grad():
        out = model(input_ids=ids[:, :prefill], cache=model.new_cache(prefill + tokens), use_cache=True)
        for t in range(prefill, prefill + tokens):
            if t - prefill < 2:
                log.next_phase()  # phase 1: the first single-token step; phase 2: the others
            out = model(input_ids=ids[:, t:t + 1], cache=out.cache, use_cache=True)


def rows(model: Any, n_rows: int, T: int, device: Any, log: Any) -> list[list[int]]:
    seen = []
    for r in range(n_rows):
        if r == 1:
            log.next_phase()  # phase 1: every row after the first
        cu = row_bounds(T, seed=r)
        seen.append(cu)
        g = torch.Generator().manual_seed(r)
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=g).to(device)
        bounds = DocBounds.from_host(cu, T, device)
        # every label scored but each document's last (what the stage-2 rows' loss mask drops)
        mask = torch.ones(T, dtype=torch.bool)
        mask[torch.tensor(cu[1:]) - 1] = False
        model.zero_grad(set_to_none=True)
        # stage 2's student side (pipeline/train/stage2.py): hidden states, the fused KL against a teacher
        h_TD = model.model(input_ids=ids, position_ids=bounds.positions[None], cu_seqlens=bounds).last_hidden_state[0]
        teacher_w = torch.randn(model.config.vocab_size, TEACHER_HIDDEN, generator=torch.Generator().manual_seed(0))
        teacher_h = torch.randn(T, TEACHER_HIDDEN, generator=g)
        kl = fused_linear_kl_div(h_TD, model.lm_head.weight, teacher_hidden=teacher_h.to(device, h_TD.dtype),
                                 teacher_weight=teacher_w.to(device, h_TD.dtype), mask=mask.to(device),
                                 reduction="sum")
        kl.backward()
    return seen


def student(variant: str, device: Any, dtype: Any) -> Any:
    from tests.helpers.fla_interpret import gpu_check_module  # lazy: tests

    torch.manual_seed(0)
    with torch.device(device):
        model = HyLoForCausalLM(gpu_check_module().hylo_config(variant, True))
    return model.to(dtype)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret:
        from tests.helpers import fla_interpret  # lazy: tests

        fla_interpret.install()
        branch: Any = fla_interpret.gpu_branch
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(min(2, torch.get_num_threads()))
    elif torch.cuda.is_available():
        branch, device, dtype = contextlib.nullcontext, torch.device("cuda"), torch.bfloat16
    else:
        raise SystemExit("compile_counts: no GPU; set TRITON_INTERPRET=1 to count the keys on CPU")
    warnings.filterwarnings("ignore")  # fla: "Triton is not supported on current platform, roll back to CPU"

    report: dict[str, Any] = {"interpreted": interpret, "decode_tokens": args.decode_tokens, "prefill": args.prefill,
                              "rows": args.rows, "row_tokens": args.row_tokens, "bounds": BOUNDS, "cases": {}}
    for variant in [v for v in args.variants.split(",") if v]:
        for scenario in ("decode", "rows"):
            model = student(variant, device, dtype)
            model.eval() if scenario == "decode" else model.train()
            with branch(), count_compilations() as log:
                if scenario == "decode":
                    decode(model, args.prefill, args.decode_tokens, device, log)
                    extra: dict[str, Any] = {}
                else:
                    extra = {"cu_seqlens": rows(model, args.rows, args.row_tokens, device, log)}
            table = log.table(later=LATER[scenario])
            report["cases"][f"{variant}/{scenario}"] = {"table": table, "over_bound": over_bound(scenario, table),
                                                        **extra, "keys": log.to_json()}
            print_table(f"{variant}/{scenario}", table, scenario)
    return report


def over_bound(scenario: str, table: list[dict[str, Any]]) -> list[str]:
    """The kernels that break `BOUNDS`: any key first needed in a later phase, or more keys than the bound."""
    return [r["kernel"] for r in table if r["compiles_later"] or r["tunes_later"]
            or max(r["compiles"], r["tunes"]) > BOUNDS[scenario]]


def print_table(title: str, table: list[dict[str, Any]], scenario: str) -> None:
    later = {"decode": "after 1st step", "rows": "after row 1"}[scenario]
    print(f"\n{title}: compiles / autotune runs per kernel, in all and first needed {later}")
    print(f"| kernel | launches | compiles | tunes | compiles {later} | tunes {later} |")
    print("|---|--:|--:|--:|--:|--:|")
    bad = set(over_bound(scenario, table))
    for r in table:
        flag = " **over**" if r["kernel"] in bad else ""
        name = r["kernel"].removeprefix("fla.ops.").removeprefix("fla.").removeprefix("hylo.kernels.")
        print(f"| {name}{flag} | {r['launches']} | {r['compiles']} | {r['tunes']} | {r['compiles_later']} | "
              f"{r['tunes_later']} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--variants", default="8mla8gdn,4mla12m2")
    ap.add_argument("--prefill", type=int, default=37)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--row-tokens", type=int, default=256)
    ap.add_argument("--json", help="write the counts and keys here")
    args = ap.parse_args(argv)
    report = measure(args)
    if args.json:
        atomic_write(Path(args.json), json.dumps(report, indent=1, default=str))
    return 1 if any(c["over_bound"] for c in report["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
