"""The CPU path's host allocator setting (kernels/backend.keep_freed_host_memory).

Each case runs in a fresh interpreter: glibc's malloc settings are per process and cannot be undone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A step's pattern: each cycle writes three 48 MiB activation-sized buffers (an MLP's [8192, 1536] fp32) and
# frees them all; the minor page faults of 10 cycles after 4 warm-up ones, with and without the setting.
_PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from hylo.kernels.backend import keep_freed_host_memory
    applied = keep_freed_host_memory() if sys.argv[1] == "call" else None
    x = torch.randn(8192, 1536)

    def cycle():
        a = x * 2.0
        b = torch.nn.functional.silu(a)
        return float((a * b).sum(0).sum())

    for _ in range(4):
        cycle()
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        cycle()
    print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0}))
""")
PAGES = 3 * 8192 * 1536 * 4 // 4096  # the pages of one cycle's three buffers


def _probe(call: bool, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, "call" if call else "no"], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.slow
def test_freed_activation_buffers_are_reused_instead_of_faulted_in_again() -> None:
    plain = _probe(call=False)
    kept = _probe(call=True)
    assert kept["applied"] is True
    # without the setting every cycle maps its buffers afresh and faults every page in again
    assert plain["faults"] >= 10 * PAGES, plain
    # with it they come from the heap the earlier cycles left (a stray refit of one buffer aside)
    assert kept["faults"] <= 3 * PAGES, (plain, kept)


@pytest.mark.slow
def test_system_mode_leaves_malloc_alone_and_a_bad_mode_is_named() -> None:
    off = _probe(call=True, HYLO_HOST_MALLOC="system")
    assert off["applied"] is False
    if sys.platform.startswith("linux"):
        assert off["faults"] >= 10 * PAGES, off
    out = subprocess.run([sys.executable, "-c", _PROBE, "call"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "HYLO_HOST_MALLOC": "jemalloc"}, timeout=120)
    assert out.returncode != 0
    assert "HYLO_HOST_MALLOC='jemalloc' is not valid; allowed: keep, system" in out.stderr

