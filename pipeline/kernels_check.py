"""Every Triton kernel a config's step launches, compiled for each target GPU on this machine, none launched.

    hylo kernels-check --config configs/llama-3.2-1b-8mla8gdn-64k.yaml --out kcheck/
    hylo kernels-check --config configs/qwen3-1.7b-7mla21gdn-64k.yaml --targets gfx942,sm_90 --out kcheck/

Legend: T tokens of the packed row, H heads, K / V key / value head dims, P / N Mamba-2 head / state dims.

What runs, per target (sm_90, sm_100, gfx942, gfx950) in a child process of its own
(`python -m hylo.pipeline.kernels_check --child`): fla imported under the target's device properties and
every Triton launch held at compile-only (hylo/kernels/compile_check.py), then each launch site of the step
is called on CPU tensors at the config's shapes and dtypes:
* `gdn.train`: `hylo.kernels.gdn.chunk_gated_delta_rule` -> fla's `chunk_gated_delta_rule`, forward and
  backward, bf16 q/k/v [1, T, H, K] / [1, T, H, V], fp32 gate, a packed row of two documents (`cu_seqlens`),
  q/k L2-norm in the kernel, as `hylo/layers/gdn.py` calls it in training;
* `gdn.decode`: `hylo.kernels.gdn.recurrent_gated_delta_rule` -> fla's `fused_recurrent_gated_delta_rule` at
  T = 1 with the fp32 state [1, H, K, V] in and out, as a decode step calls it;
* `ssd.train` (Mamba-2 configs): `hylo.kernels.ssd.fla_chunk_ssd` -> fla's `chunk_simple_gla`; `ssd.decode`:
  `hylo.kernels.ssd.fla_recurrent_ssd` -> fla's `fused_recurrent_simple_gla`;
* with sequence parallelism (`train.sequence_parallel` or `--sequence-parallel` N > 1: one packed row split
  by tokens over N ranks, each rank holding T / N of them), the state-passing launches of
  `hylo/seq_parallel.py` at the rank's T / N tokens: `gdn.sp_local` / `ssd.sp_local`, the op from a zero
  state with the final states out (the gradient flowing back into them), then again from the passed fp32
  states ([docs, H, K, V] / [docs, H, P, N], requiring their gradient), forward and backward;
  `gdn.sp_transition`, the GDN transition pass of a rank inside one document (values of width K, all zero,
  from the identity state [1, H, K, K], the final state out), forward and backward;
* `kl.dense` / `kl.topk`: our fused KL's Triton steps (`hylo/kernels/fused_kl/triton_kernel.py`) over
  fp32 [C, vocab] chunks, with and without the gradient (both teacher forms; the gradient is written in the
  loss's forward, its backward only scales it).
The sites are driven directly with the shapes the config's step gives them, not through the whole step
(model, loss, optimizer): the compile-only launches leave their outputs uninitialised, and only these calls
reach Triton (attention is torch's SDPA, the rest torch ops). Every autotune configuration of every kernel
is compiled, in a fresh Triton cache per run (or into --warm-cache DIR, kept: a job's TRITON_CACHE_DIR then
finds the binaries), so neither compiled binaries nor autotuning choices kept on disk decide what is checked. Kernels are specialised on T only through divisibility (and T = 1): the
default --tokens 2048 gives the same binaries as 64K.

Each compile is one record of DIR/kernels_check.json (kernel, target, num_warps, num_stages, compiled,
shared_bytes, shared_limit, fits, error, registers, spills, the site and constexprs, the compile's wall and CPU
seconds and whether Triton found it in its cache), with totals per target; DIR/kernels_check.md is the table by
kernel and target. Exit status 1 when some launch site has a kernel with no configuration
that compiles and fits on a target (named, with the way out).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from itertools import accumulate
from pathlib import Path
from typing import Any

from hylo.json_files import read_json
from hylo.kernels import compile_check as cc
from hylo.logs import get_logger
from hylo.outputs import check_not_an_input, check_output_file, write_output_file
from hylo.ownership import record_files
from hylo.pipeline.cli import MAX_WORLD_SIZE, BadArgument, bounded_int
from hylo.pipeline.config import add_config_args, maybe_print_config
from hylo.pipeline.paths import job_inputs, resolve_paths
from hylo.pipeline.train.config import load_stage_config, sp_shard_problem
from hylo.stopping import make_dir, popen, track_temp

logger = get_logger(__name__)

TARGET_NAMES = ("sm_90", "sm_100", "gfx942", "gfx950")
DEFAULT_TOKENS = 2048
# The longest --tokens: the recipes train 64K-128K rows, and a kernel specialises on T only by divisibility.
MAX_TOKENS = 1 << 24
KL_ROWS = 16


@dataclasses.dataclass(frozen=True)
class Site:
    """One launch site at one shape: what the child calls."""

    site: str
    args: tuple[tuple[str, Any], ...]

    def get(self, key: str) -> Any:
        return dict(self.args)[key]


def _docs(tokens: int) -> tuple[int, ...]:
    return (tokens - tokens // 3, tokens // 3) if tokens >= 32 else (tokens,)


def sites_of(hc: Any, vocab: int, tokens: int, sequence_parallel: int = 1) -> list[Site]:
    """The launch sites of a student of HybridConfig `hc` with a `vocab`-wide KL at a `tokens`-long row;
    with `sequence_parallel` N > 1 also the state-passing sites of a rank's T / N tokens."""
    docs = _docs(tokens)
    local = tokens // sequence_parallel
    out = []
    if hc.linear_type == "gdn":
        g = (("H", hc.gdn_num_heads), ("K", hc.gdn_head_dim), ("V", hc.gdn_value_dim), ("chunk", hc.gdn_chunk_size))
        out += [Site("gdn.train", (("T", tokens), ("docs", docs), *g)), Site("gdn.decode", (("T", 1), *g))]
        if sequence_parallel > 1:
            out += [Site("gdn.sp_local", (("T", local), ("docs", _docs(local)), *g)),
                    Site("gdn.sp_transition", (("T", local), ("docs", (local,)), *g))]
    else:
        H, P, N, G = hc.mamba2_dims
        if hc.mamba2_xb_groups is not None:
            G = H
        m = (("H", H), ("P", P), ("N", N), ("G", G))
        out += [Site("ssd.train", (("T", tokens), ("docs", docs), *m)), Site("ssd.decode", (("T", 1), *m))]
        if sequence_parallel > 1:
            out += [Site("ssd.sp_local", (("T", local), ("docs", _docs(local)), *m))]
    out += [Site("kl.dense", (("rows", KL_ROWS), ("vocab", vocab))), Site("kl.topk", (("rows", KL_ROWS), ("vocab", vocab)))]
    return out


# ------------------------------------------------------------------------------------------- child
def _bounds(docs: tuple[int, ...], T: int) -> Any:
    from hylo.kernels.varlen import DocBounds  # lazy: torch

    return DocBounds.from_host([0, *accumulate(docs)], T)


def _run_site(site: Site, dtype: Any = None) -> dict[str, Any]:
    """Call one launch site (bf16 inputs unless `dtype`); returns its outputs and gradients by name (in the
    compile-only child they are uninitialised: nothing reads them there; the tests read them on the torch path)."""
    import torch  # lazy: torch

    bf16 = dtype or torch.bfloat16
    res: dict[str, Any] = {}
    if site.site.startswith("gdn."):
        from hylo.kernels.gdn import chunk as gdn_chunk  # lazy: torch

        H, K, V, T = site.get("H"), site.get("K"), site.get("V"), site.get("T")
        if site.site == "gdn.sp_transition":
            # what the rank's tokens do to a state: values of width K, the state [K, K] per head and document
            V = K
        q, k = (torch.randn(1, T, H, K, dtype=bf16) for _ in range(2))
        v = torch.randn(1, T, H, V, dtype=bf16)
        g = -torch.rand(1, T, H)
        beta = torch.rand(1, T, H, dtype=bf16)
        if site.site == "gdn.train":
            bounds = _bounds(site.get("docs"), T)
            for x in (q, k, v, g, beta):
                x.requires_grad_(True)
            o, _ = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=bounds, use_qk_l2norm_in_kernel=True,
                                                    chunk_size=site.get("chunk"))
            res["grads"] = torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o), allow_unused=True)
            res["o"] = o
        elif site.site == "gdn.sp_local":
            docs = site.get("docs")
            kw = {"cu_seqlens": _bounds(docs, T), "use_qk_l2norm_in_kernel": True, "chunk_size": site.get("chunk")}
            for x in (q, k, v, g, beta):
                x.requires_grad_(True)
            # from a zero state, the final states out (gathered by the group: their gradient comes back)
            o0, ht = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, **kw)
            # again from the passed states
            h0 = torch.randn(len(docs), H, K, V, requires_grad=True)
            o, _ = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kw)
            res["o"], res["final_state"] = o, ht
            res["grads"] = torch.autograd.grad((o0, ht, o), (q, k, v, g, beta, h0),
                                               (torch.randn_like(o0), torch.randn_like(ht), torch.randn_like(o)),
                                               allow_unused=True)
        elif site.site == "gdn.sp_transition":
            # what the rank's chunk (inside one document) does to a state: zero values from the identity
            eye = torch.eye(K).expand(1, H, K, K).contiguous()
            # (the queries do not reach the state: no gradient for them)
            for x in (k, g, beta):
                x.requires_grad_(True)
            _, M = gdn_chunk.chunk_gated_delta_rule(q, k, torch.zeros_like(k), g, beta, initial_state=eye,
                                                    output_final_state=True, cu_seqlens=_bounds(site.get("docs"), T),
                                                    use_qk_l2norm_in_kernel=True, chunk_size=site.get("chunk"))
            res["final_state"] = M
            res["grads"] = torch.autograd.grad(M, (k, g, beta), torch.randn_like(M), allow_unused=True)
        else:
            from hylo.kernels.gdn import recurrent as gdn_recurrent  # lazy: torch

            with torch.no_grad():
                gdn_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=torch.randn(1, H, K, V),
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    elif site.site.startswith("ssd."):
        from hylo.kernels.ssd import chunk as ssd_chunk  # lazy: torch
        from hylo.kernels.ssd.chunk import fla_chunk_ssd  # lazy: torch

        H, P, N, G, T = (site.get(x) for x in ("H", "P", "N", "G", "T"))
        x = torch.randn(1, T, H, P, dtype=bf16)
        dt = torch.rand(1, T, H)
        A = -torch.rand(H)
        B, C = (torch.randn(1, T, G, N, dtype=bf16) for _ in range(2))
        D = torch.ones(H)
        if site.site == "ssd.train":
            for t in (x, dt, B, C):
                t.requires_grad_(True)
            y, _ = fla_chunk_ssd(x, dt, A, B, C, D, cu_seqlens=_bounds(site.get("docs"), T))
            res["grads"] = torch.autograd.grad(y, (x, dt, B, C), torch.randn_like(y), allow_unused=True)
            res["o"] = y
        elif site.site == "ssd.sp_local":
            docs = site.get("docs")
            h0 = torch.randn(len(docs), H, P, N, requires_grad=True)
            for t in (x, dt, B, C):
                t.requires_grad_(True)
            # the dispatcher (the child routes it to fla_chunk_ssd; the tests run its torch path): from a zero
            # state with the final states out, then again from the passed states
            y0, ht = ssd_chunk.chunk_ssd(x, dt, A, B, C, D, output_final_state=True, cu_seqlens=_bounds(docs, T))
            y, _ = ssd_chunk.chunk_ssd(x, dt, A, B, C, D, initial_state=h0, cu_seqlens=_bounds(docs, T))
            res["o"], res["final_state"] = y, ht
            res["grads"] = torch.autograd.grad((y0, ht, y), (x, dt, B, C, h0),
                                               (torch.randn_like(y0), torch.randn_like(ht), torch.randn_like(y)),
                                               allow_unused=True)
        else:
            from hylo.kernels.ssd.recurrent import fla_recurrent_ssd  # lazy: torch

            with torch.no_grad():
                fla_recurrent_ssd(x, dt, A, B, C, D, initial_state=torch.randn(1, H, P, N), output_final_state=True)
    elif site.site.startswith("kl."):
        from hylo.kernels.fused_kl import triton_kernel  # lazy: torch
        from hylo.kernels.fused_kl.steps import StepParams  # lazy: torch

        rows, vocab = site.get("rows"), site.get("vocab")
        for need_grad in (False, True):
            step = StepParams(inv_temp=1.0, grad_scale=1.0 / rows, need_grad=need_grad)
            z = torch.randn(rows, vocab)
            if site.site == "kl.dense":
                triton_kernel.dense_kl_step(z, torch.randn(rows, vocab), False, step)
            else:
                k = min(8, vocab)
                idx = torch.stack([torch.randperm(vocab)[:k] for _ in range(rows)])
                triton_kernel.topk_kl_step(z, idx, torch.log_softmax(torch.randn(rows, k + 1), -1), step)
    else:
        raise ValueError(f"unknown launch site {site.site}")
    return res


def child_main(argv: list[str]) -> int:
    """One target: `--child TARGET PLAN.json OUT.json` (the parent sets TRITON_CACHE_DIR to a fresh folder)."""
    target_name, plan_path, out_path = argv

    t = cc.TARGETS[target_name]
    cc.install(t)
    import torch  # lazy: torch

    from hylo.kernels.gdn import chunk as gdn_chunk  # lazy: torch
    from hylo.kernels.gdn import recurrent as gdn_recurrent  # lazy: torch
    from hylo.kernels.ssd import chunk as ssd_chunk  # lazy: torch

    # the GPU branch of the ops on CPU tensors: their fla calls compile for the target and launch nothing
    for mod in (gdn_chunk, gdn_recurrent, ssd_chunk):
        if not hasattr(mod, "use_fla"):
            raise RuntimeError(f"{mod.__name__} no longer chooses fla through use_fla: update kernels-check")
        mod.use_fla = lambda x: True
    fla = cc.fla_view()
    # what every training worker installs (kernels/backend.check_fla_backward): the route around fla's
    # chunk_bwd_dqkwg on Hopper, which some Tritons miscompile; it declines elsewhere
    from hylo.kernels.backend import fla_route_problem, install_fla_route  # lazy: torch

    fla["hylo_route"] = {"installed": install_fla_route(), "problem": fla_route_problem()}
    torch.manual_seed(0)
    plan = read_json(Path(plan_path))
    sites_done: list[dict[str, Any]] = []

    def save(records: list[cc.Record]) -> None:
        # at the start and after every compile, so that a child stopped part way leaves what it finished
        out = {"target": dataclasses.asdict(t), "fla": fla, "sites": sites_done,
               "records": [dataclasses.asdict(r) for r in records]}
        tmp = Path(out_path).with_suffix(".part")
        tmp.write_text(json.dumps(out, indent=1, default=str))
        tmp.replace(out_path)

    save([])
    with cc.compile_only(t) as log:
        log.on_add = save
        for s in plan:
            site = Site(s["site"], tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in s["args"]))
            log.site = s["id"]
            t0 = time.time()
            error = None
            try:
                _run_site(site)
            except Exception as e:  # a failure around the launches (not a compile error) ends this site
                error = f"{type(e).__name__}: {' '.join(str(e).split())[:1000]}"
            sites_done.append({"id": s["id"], "seconds": round(time.time() - t0, 1), "error": error})
            compiles = len([r for r in log.records if r.site == s["id"]])
            logger.info(f"{target_name} {s['id']}: {compiles} compiles in {time.time() - t0:.0f} s"
                        + (f" ({error})" if error else ""))
            save(log.records)
    return 0


# ------------------------------------------------------------------------------------------- parent
def _site_id(site: Site) -> str:
    keys = [f"{k}{v}" for k, v in site.args if k in ("H", "K", "V", "P", "N", "G", "vocab", "chunk")]
    return f"{site.site}[{','.join(keys)}]"


def plan_for(recipes: dict[str, list[Site]]) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """Distinct sites over the recipes (recipes with the same head shapes share them) and which recipes use each."""
    plan: dict[str, dict[str, Any]] = {}
    users: dict[str, list[str]] = {}
    for name, sites in recipes.items():
        for site in sites:
            sid = _site_id(site) + (f"[T{site.get('T')}]" if site.site.endswith(("train", "sp_local", "sp_transition"))
                                    else "")
            plan.setdefault(sid, {"id": sid, "site": site.site, "args": [list(a) for a in site.args]})
            users.setdefault(sid, []).append(name)
    return list(plan.values()), users


def run_targets(plan: list[dict[str, Any]], targets: list[str], work: Path, log_to: Any = None,
                cache_dir: Path | None = None) -> dict[str, Any]:
    """One child per target (sequential: each compiles on every core it gets); their outputs by target. A child
    that fails or is stopped part way still gives the sites it finished. Each child compiles into a fresh
    Triton cache, or into `cache_dir` (--warm-cache: kept, shared by the targets, as TRITON_CACHE_DIR is)."""
    results: dict[str, Any] = {}
    plan_path = work / "plan.json"
    plan_path.write_text(json.dumps(plan))
    for target in targets:
        cache = cache_dir or Path(tempfile.mkdtemp(prefix=f"triton-{target}-", dir=work))
        env = dict(os.environ, TRITON_CACHE_DIR=str(cache), TRITON_INTERPRET="0")
        env.pop("HYLO_KERNELS", None)
        out = work / f"{target}.json"
        t0 = time.time()
        # (under the signal rule, hylo/stopping.py: its own process group, ended with the command)
        with popen([sys.executable, "-m", "hylo.pipeline.kernels_check", "--child", target, str(plan_path), str(out)],
                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            lines = []
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if log_to is not None and "Warning" not in line and "warn_once" not in line:
                    log_to.write(line)
                    log_to.flush()
        res: dict[str, Any] = read_json(out) if out.is_file() else {"records": [], "sites": []}
        if proc.returncode != 0:
            tail = " ".join(" ".join(lines).split()[-60:])
            res["error"] = f"the {target} child failed (exit {proc.returncode}): {tail}"
        res["planned"] = [p["id"] for p in plan]
        res["seconds"] = round(time.time() - t0, 1)
        results[target] = res
    return results


WAY_OUT = ("pin a configuration that fits (a smaller BV/BK block or fewer stages) for this target, or use an fla "
           "version whose configurations for this GPU fit its shared memory")


def verdicts(results: dict[str, Any]) -> list[str]:
    """One line per (site, kernel, target) with no configuration that compiles and fits, and per failed child/site."""
    bad = []
    for target, res in results.items():
        if res.get("error"):
            bad.append(res["error"])
        done = {s["id"] for s in res["sites"]}
        left = [sid for sid in res.get("planned", []) if sid not in done]
        if left:
            bad.append(f"{target}: {len(left)} of {len(res['planned'])} launch sites not finished (the child stopped "
                       f"in or before them; records so far are in the JSON, unjudged): {', '.join(left)}")
        for s in res["sites"]:
            if s["error"]:
                bad.append(f"{s['id']} on {target}: the launch site failed before its launches: {s['error']}")
        groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for r in res["records"]:
            if r["site"] not in done:
                continue
            groups.setdefault((r["site"], r["kernel"], r["extra"]["specialisation"]), []).append(r)
        for (site, kernel, _), recs in groups.items():
            if not any(r["compiled"] and r["fits"] for r in recs):
                worst = min((r["shared_bytes"] for r in recs if r["shared_bytes"] is not None), default=None)
                why = (f"smallest needs {worst} B of shared memory, the target has {recs[0]['shared_limit']} B"
                       if worst is not None else f"no configuration compiles: {recs[0]['error']}")
                bad.append(f"{kernel} ({site}) on {target}: none of its {len(recs)} configurations compiles and fits "
                           f"({why}); way out: {WAY_OUT}")
    return bad


def compile_totals(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per target: the compile records, how many binaries Triton compiled, found in its cache on disk, or had in
    memory already (a kernel an earlier site of the same child compiled: no listener call), and the seconds of
    all of them (`Record.seconds`: Triton's compile call, cache lookups included)."""
    out = {}
    for target, res in results.items():
        recs = res.get("records", [])
        out[target] = {"records": len(recs), "compiled": sum(r.get("cache_hit") is False for r in recs),
                       "cache_hits": sum(r.get("cache_hit") is True for r in recs),
                       "reused": sum(r.get("compiled", True) and r.get("cache_hit") is None for r in recs),
                       "compile_seconds": round(sum(r.get("seconds") or 0.0 for r in recs), 1),
                       "compile_cpu_seconds": round(sum(r.get("cpu_seconds") or 0.0 for r in recs), 1)}
    return out


def totals_line(totals: dict[str, dict[str, Any]]) -> str:
    return "Compile seconds per target (wall, CPU): " + "; ".join(
        f"{t} {v['compile_seconds']} s, {v['compile_cpu_seconds']} CPU-s ({v['records']} binaries: {v['compiled']} "
        f"compiled, {v['cache_hits']} from the Triton cache, {v.get('reused', 0)} compiled by an earlier site)"
        for t, v in totals.items())


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("triton", "flash-linear-attention", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.0f} KiB"


def table(results: dict[str, Any]) -> str:
    """Markdown: one row per kernel, one column per target: configurations fitting / compiled / tried, the
    smallest and largest shared memory, the most registers, spills."""
    targets = list(results)
    kernels: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for target, res in results.items():
        for r in res.get("records", []):
            kernels.setdefault(r["kernel"], {}).setdefault(target, []).append(r)
    head = "| kernel | sites | " + " | ".join(targets) + " |"
    lines = [head, "|" + "---|" * (len(targets) + 2)]
    for kernel in sorted(kernels):
        by = kernels[kernel]
        sites = sorted({r["site"].split("[")[0] for rs in by.values() for r in rs})
        cells = []
        for target in targets:
            rs = by.get(target, [])
            if not rs:
                cells.append("-")
                continue
            ok = [r for r in rs if r["compiled"] and r["fits"]]
            comp = [r for r in rs if r["compiled"]]
            sh = [r["shared_bytes"] for r in comp]
            regs = [r["registers"] for r in comp if r["registers"] is not None]
            spills = [r["spills"] for r in ok if r["spills"] is not None]
            cell = f"{len(ok)}/{len(comp)}/{len(rs)}"
            secs = [r["seconds"] for r in rs if r.get("seconds") is not None]
            if secs:
                cell += f"; {sum(secs):.1f} s"
            if sh:
                cell += f"; {_size(min(sh))}-{_size(max(sh))}"
            if regs:
                cell += f"; ≤{max(regs)} regs"
            if spills and max(spills):
                cell += f"; spills ≤{max(spills)}"
            groups: dict[tuple[str, str], bool] = {}
            for r in rs:
                key = (r["site"], r["extra"]["specialisation"])
                groups[key] = groups.get(key, False) or (r["compiled"] and r["fits"])
            stuck = sum(not v for v in groups.values())
            if stuck:
                cell = f"**{cell}; {stuck} of {len(groups)} specialisations: none fits**"
            cells.append(cell)
        lines.append(f"| {kernel} | {', '.join(sites)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# what the job writes into --out
REPORT_FILES = ("kernels_check.json", "kernels_check.md")


def write_report(out_dir: Path, results: dict[str, Any], users: dict[str, list[str]], meta: dict[str, Any]) -> list[str]:
    bad = verdicts(results)
    records = [r for res in results.values() for r in res.get("records", [])]
    totals = compile_totals(results)
    doc = {**meta, "versions": _versions(), "date": datetime.date.today().isoformat(),
           "sites": {sid: {"recipes": names} for sid, names in users.items()},
           "children": {t: {"seconds": res.get("seconds"), "error": res.get("error"), "fla": res.get("fla"),
                            "sites": res.get("sites"), **totals[t]}
                        for t, res in results.items()},
           "records": records, "problems": bad}
    write_output_file(out_dir / "kernels_check.json", json.dumps(doc, indent=1, default=str) + "\n")
    v = doc["versions"]
    md = [f"# kernels-check {doc['date']}", "",
          f"triton {v['triton']}, fla {v['flash-linear-attention']}, torch {v['torch']}; recipes: "
          f"{', '.join(meta['recipes'])}; T = {meta['tokens']}.", "",
          "Cell: configurations that fit / compile / were tried, counted over every site and specialisation "
          "(constexprs) the kernel has; seconds of their compiles; shared memory of the compiled ones; most registers (AMD: `.vgpr_count`); spills of the fitting ones (NVIDIA: local-memory bytes; AMD: spilled registers). "
          "Bold: some specialisation (site, constexprs) of the kernel has no configuration that fits.", "",
          table(results), ""]
    md += ["Child time per target: " + ", ".join(f"{t} {res.get('seconds')} s" for t, res in results.items()), "",
           totals_line(totals), ""]
    md += (["Problems:", ""] + [f"* {b}" for b in bad]) if bad else ["Every launch site has a configuration that "
                                                                     "compiles and fits on every target."]
    write_output_file(out_dir / "kernels_check.md", "\n".join(md) + "\n")
    # recorded as ours: a later run may replace them (hylo.outputs.check_output_file)
    record_files(out_dir, REPORT_FILES)
    return bad


def check(recipes: dict[str, list[Site]], targets: list[str], out_dir: Path, tokens: int, log_to: Any = None,
          cache_dir: Path | None = None) -> list[str]:
    """Compile every launch site of `recipes` for `targets` (into `cache_dir` as the Triton cache, or a fresh one),
    write the report, return the problems."""
    # made now, so that an unwritable --out fails before the compiles; a signal removes it while empty
    make_dir(out_dir)
    plan, users = plan_for(recipes)
    with tempfile.TemporaryDirectory(prefix="kernels-check-") as work:
        track_temp(work)
        results = run_targets(plan, targets, Path(work), log_to, cache_dir)
    meta = {"recipes": list(recipes), "targets": targets, "tokens": tokens,
            "triton_cache": str(cache_dir) if cache_dir else None}
    bad = write_report(out_dir, results, users, meta)
    if log_to is not None:
        log_to.write(totals_line(compile_totals(results)) + "\n")
    return bad


def recipe_sites(cfg: Any, stage1: Any, tokens: int, sequence_parallel: int = 1,
                 sp_flag: str = "train.sequence_parallel") -> list[Site]:
    """The launch sites of the recipe's student; BadArgument (naming `sp_flag`) when a rank's share of the row is
    shorter than its linear blocks' conv window (`sp_shard_problem`)."""
    from hylo.pipeline.estimate.shapes import student_config  # lazy: torch

    hc = student_config(cfg, stage1)
    if why := sp_shard_problem(tokens, sequence_parallel, hc.gdn_conv_size if hc.linear_layers else 1):
        raise BadArgument(f"{sp_flag}={sequence_parallel}: {why}")
    return sites_of(hc, hc.vocab_size, tokens, sequence_parallel)


def check_sequence_parallel(n: int, tokens: int, where: str) -> None:
    """N splits the `tokens`-long row into equal parts of at least 2 tokens (BadArgument naming `where`)."""
    if n < 1 or tokens % n or tokens // n < 2:
        raise BadArgument(f"{where}={n}: the sequence-parallel group must split the --tokens={tokens} row into "
                          f"equal parts of at least 2 tokens (N >= 1 dividing {tokens})")


def parse_targets(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in TARGET_NAMES]
    if unknown or not names:
        raise BadArgument(f"--targets={text}: unknown target(s) {', '.join(unknown) or '(none given)'}; "
                          f"choose from {','.join(TARGET_NAMES)}")
    return names


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """`hylo kernels-check` (`description`: the help's text, jobs/kernels_check.py's docstring)."""
    ap = argparse.ArgumentParser(description=description or __doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, example="kd.temperature=2.0")
    ap.add_argument("--targets", default=",".join(TARGET_NAMES),
                    help=f"comma-separated targets (default: all of {','.join(TARGET_NAMES)})")
    ap.add_argument("--tokens", type=bounded_int(2, MAX_TOKENS), default=DEFAULT_TOKENS,
                    help=f"tokens of the packed row the training sites get (default {DEFAULT_TOKENS}: kernels "
                         "specialise on T only by divisibility, so this gives a 64K row's binaries)")
    ap.add_argument("--sequence-parallel", type=bounded_int(1, MAX_WORLD_SIZE), default=None, metavar="N",
                    help="also the state-passing launch sites of a row split over N ranks (default: the "
                         "config's train.sequence_parallel, 1 = none)")
    ap.add_argument("--out", required="--print-config" not in (argv if argv is not None else sys.argv),
                    help="folder for kernels_check.json and kernels_check.md (never over files of those names "
                         "this project did not write)")
    ap.add_argument("--force", action="store_true",
                    help="let the reports replace files of their names in --out that this project did not write")
    ap.add_argument("--warm-cache", metavar="DIR", default=None,
                    help="compile into the kernel cache directory DIR, kept (made if missing; a run's "
                         "ray.kernel_cache, else its <run dir>/kernel_cache: its workers get DIR/triton as "
                         "TRITON_CACHE_DIR), instead of a fresh Triton cache per run: a rerun finds every binary "
                         "there and compiles nothing. Compiles only, for the --targets, on this machine's CPU: "
                         "autotuning (timing each configuration) needs the GPU and happens at the job's first step")
    args = ap.parse_args(argv)
    targets = parse_targets(args.targets)
    cfg = load_stage_config(2, args.config, args.overrides)
    maybe_print_config(cfg, args)
    cfg = resolve_paths(cfg)
    # the student's shape: its checkpoint, or the stage-1 conversion the config describes; a named student that does
    # not exist is refused as the stages refuse it, unless stage 1 of this config writes it (estimate/shapes.py)
    from hylo.pipeline.estimate.shapes import conversion_for_student, conversion_note  # lazy: torch

    stage1 = conversion_for_student(cfg, args.config, args.overrides)
    name = Path(args.config).stem if args.config else "defaults"
    sp = args.sequence_parallel or int(getattr(cfg.train, "sequence_parallel", 1) or 1)
    check_sequence_parallel(sp, args.tokens, "--sequence-parallel" if args.sequence_parallel
                            else "train.sequence_parallel")
    # before the work: neither report is in (or is) anything the check reads (its config, the student's or the
    # base's folder: --force or not), nor a file of the user's, and --out can be written
    inputs = [*job_inputs(cfg), *(job_inputs(stage1) if stage1 is not None else [])]
    if args.warm_cache:
        check_not_an_input(args.warm_cache, inputs, "--warm-cache")
    for report in REPORT_FILES:
        check_output_file(Path(args.out) / report, "--out", inputs, force=args.force)
    sites = recipe_sites(cfg, stage1, args.tokens, sp, "--sequence-parallel" if args.sequence_parallel
                         else "train.sequence_parallel")
    cache_dir = None
    if args.warm_cache:
        # the layout a job's workers read (one function: pipeline/train/kernel_cache.py)
        from hylo.pipeline.train.kernel_cache import kernel_cache_env  # lazy: pyarrow

        cache_dir = Path(kernel_cache_env(Path(args.warm_cache).expanduser().resolve())["TRITON_CACHE_DIR"])
        make_dir(cache_dir)
    if note := conversion_note(cfg, stage1):
        print(note, flush=True)
    bad = check({name: sites}, targets, Path(args.out), args.tokens, log_to=sys.stdout, cache_dir=cache_dir)
    print(f"wrote {Path(args.out) / 'kernels_check.json'} and kernels_check.md")
    for b in bad:
        print(f"problem: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2:]))
    sys.exit(main())
