"""Cold start: how often each Triton kernel is compiled and autotuned (`hylo.kernels.compile_count`).

The counter on kernels of its own, in process under Triton's interpreter: a new length that changes an int's
specialisation (divisible by 16, equal to 1) is a new JIT key, an autotune key naming the length re-tunes per
length. Then, in a fresh process (fla must be imported after TRITON_INTERPRET=1), bench/compile_counts.py over
the tiny students' GPU branches: 32 decode steps after a prefill, ten packed rows of one length with different
document boundaries; no kernel compiles or re-tunes after the first decode step or the first row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_counter_sees_specialisations_and_autotune_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    triton = pytest.importorskip("triton")
    import torch
    import triton.language as tl

    from hylo.kernels.compile_count import count_compilations

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def copy(X, Y, T, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < T), mask=offs < T)

    def copy_tuned(X, Y, T, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < T), mask=offs < T)

    jitted = triton.jit(copy)
    # no GPU to time configurations on: every one "takes" 0 s
    tuned = triton.autotune([triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["T"],
                            do_bench=lambda fn, quantiles: [0.0, 0.0, 0.0])(triton.jit(copy_tuned))
    with count_compilations() as log:
        for T in (32, 48, 64):  # all divisible by 16: one specialisation
            x = torch.arange(T, dtype=torch.float32)
            jitted[(triton.cdiv(T, 16),)](x, torch.empty_like(x), T, BLOCK=16)
        log.next_phase()
        for T in (17, 1):  # not divisible by 16; equal to 1 (a constant): two more
            x = torch.arange(T, dtype=torch.float32)
            jitted[(triton.cdiv(T, 16),)](x, torch.empty_like(x), T, BLOCK=16)
        for T in (32, 48):  # the autotune key names T: a run per length
            x = torch.arange(T, dtype=torch.float32)
            tuned[lambda meta, T=T: (triton.cdiv(T, meta["BLOCK"]),)](x, torch.empty_like(x), T)
    name = f"{__name__}.test_counter_sees_specialisations_and_autotune_keys.<locals>.copy"
    assert log.launches[name] == 5
    assert log.compiles()[name] == 3
    assert log.compiles(since=1)[name] == 2
    # tuned: two autotune runs, then one specialisation (both lengths divisible by 16, the chosen config's)
    assert log.tunes() == {name + "_tuned": 2}
    assert log.launches[name + "_tuned"] == 2 and log.compiles()[name + "_tuned"] == 1
    rows = {r["kernel"]: r for r in log.table(later=1)}
    assert (rows[name]["compiles_later"], rows[name]["tunes_later"]) == (2, 0)
    assert (rows[name + "_tuned"]["compiles_later"], rows[name + "_tuned"]["tunes_later"]) == (1, 2)


@pytest.mark.slow
def test_no_recompile_over_decode_steps_and_packed_rows(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "counts.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("HYLO_KERNELS", None)
    # fewer steps and rows than the documented run (32 and 10): a new key shows at the second step or row already.
    # 32-token rows (documented: 256): the same kernels and keys as 64 (each row still 3 to 6 documents), at 2/3 of
    # the CPU time (the fused KL under the interpreter runs a program per token)
    proc = subprocess.run([sys.executable, "bench/compile_counts.py", "--decode-tokens", "6", "--rows", "4",
                           "--row-tokens", "32", "--json", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    log = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert out.is_file(), log
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {f"{v}/{s}" for v in ("8mla8gdn", "4mla12m2") for s in ("decode", "rows")}
    for case, rec in report["cases"].items():
        kernels = {r["kernel"] for r in rec["table"]}
        # the fla kernels of each path were counted, so a bound cannot hold by counting nothing
        assert any(k.endswith("chunk_o.chunk_fwd_kernel_o") for k in kernels), (case, kernels)
        if case.endswith("rows"):
            assert any("bwd" in k for k in kernels), (case, kernels)
            assert len({tuple(cu) for cu in rec["cu_seqlens"]}) == 4
        for r in rec["table"]:
            assert r["compiles_later"] == 0 and r["tunes_later"] == 0, (case, r, rec["keys"])
            assert max(r["compiles"], r["tunes"]) <= report["bounds"][case.split("/")[1]], (case, r)
        assert not rec["over_bound"]
    assert proc.returncode == 0, log
