"""`hylo kernels-check`: Triton kernels compiled for GPUs this machine does not have, none launched.

The compiles run in child processes (the stand-in driver and `torch.cuda` answers are per process), at tiny
shapes: our fused KL for one AMD and one NVIDIA target through the job's own child, and a toy autotuned
kernel with one configuration over MI300X's shared memory. The full matrix (fla's GDN at the recipes' heads,
minutes per target) is bench/kernels_check_matrix.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hylo.kernels.compile_check import TARGETS
from hylo.ownership import ForeignOutputError, is_own_file, record_files
from hylo.pipeline import kernels_check as kc


def _record(kernel: str, shared: int, limit: int = 65536, compiled: bool = True, spec: str = "{}") -> dict:
    return {"kernel": kernel, "target": "gfx942", "site": "gdn.train[H6]", "num_warps": 4, "num_stages": 2,
            "constexprs": {}, "autotuned": True, "compiled": compiled, "shared_bytes": shared if compiled else None,
            "shared_limit": limit, "fits": compiled and shared <= limit, "error": None if compiled else "boom",
            "registers": 128, "spills": 0, "extra": {"specialisation": spec}}


def test_a_kernel_with_no_configuration_that_fits_is_named_with_the_way_out():
    ok = [_record("fits_kernel", 32768), _record("fits_kernel", 131072)]
    res = {"gfx942": {"records": list(ok), "sites": [{"id": "gdn.train[H6]", "error": None}]}}
    assert kc.verdicts(res) == []
    too_big = [_record("big_kernel", 69632), _record("big_kernel", 131072)]
    res["gfx942"]["records"] += too_big
    bad = kc.verdicts(res)
    assert len(bad) == 1 and "big_kernel" in bad[0] and "gfx942" in bad[0] and "69632" in bad[0]
    assert "way out" in bad[0]
    # a specialisation of the same kernel is judged on its own configurations
    res["gfx942"]["records"] = [*ok, _record("fits_kernel", 131072, spec='{"K": 256}')]
    assert len(kc.verdicts(res)) == 1
    assert "1 of 2 specialisations: none fits**" in kc.table(res)


@pytest.mark.slow
def test_every_target_is_one_that_tritons_backends_accept():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler.compiler import make_backend

    for name, t in TARGETS.items():
        backend = make_backend(GPUTarget(t.backend, t.arch, t.warp_size))
        options = backend.parse_options({})
        # the warp (wavefront) size the backend derives for the arch is the target's
        assert options.warp_size == t.warp_size, name
        if t.backend == "cuda":
            assert get_ptxas(t.arch).path, name
        else:
            assert options.arch == t.arch, name


def test_bad_targets_are_one_error_line():
    from hylo.pipeline.cli import BadArgument

    with pytest.raises(BadArgument, match="sm_80"):
        kc.parse_targets("gfx942,sm_80")


@pytest.mark.slow
def test_the_fused_kl_compiles_for_one_amd_and_one_nvidia_target(tmp_path):
    """... and `--warm-cache DIR` (`cache_dir`): the binaries go into DIR (Triton's cache layout, what a job gets as
    TRITON_CACHE_DIR); a second run finds every one there (Triton's cache hits) and compiles none."""
    sites = {"tiny": [kc.Site("kl.dense", (("rows", 4), ("vocab", 1000))),
                      kc.Site("kl.topk", (("rows", 4), ("vocab", 1000)))]}
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    bad = kc.check(sites, ["gfx942", "sm_90"], tmp_path, 16, cache_dir=cache)
    assert bad == []
    doc = json.loads((tmp_path / "kernels_check.json").read_text())
    recs = doc["records"]
    for target in ("gfx942", "sm_90"):
        mine = [r for r in recs if r["target"] == target]
        kernels = {r["kernel"] for r in mine}
        assert kernels == {"_row_lse_kernel", "_dense_kl_kernel", "_tail_grad_kernel"}, (target, kernels)
        # the dense step with and without the gradient: two specialisations of _dense_kl_kernel
        assert len([r for r in mine if r["kernel"] == "_dense_kl_kernel"]) == 2
        for r in mine:
            assert r["compiled"] and r["fits"] and r["error"] is None
            assert r["shared_limit"] == TARGETS[target].shared_limit
            assert r["num_warps"] == 8 and r["registers"] and r["registers"] > 0
    # fla read the stand-in device at import: the platform, Hopper, the shared-memory tier, the CU count
    fla = {t: doc["children"][t]["fla"] for t in ("gfx942", "sm_90")}
    assert fla["gfx942"]["is_amd"] and fla["gfx942"]["multiprocessor_count"] == 304
    assert not fla["gfx942"]["shared_mem_tiers"]["ampere"]
    assert fla["sm_90"]["is_nvidia_hopper"] and fla["sm_90"]["shared_mem_tiers"]["hopper"]
    # and so does fla's block-size choice on the CPU tensors of the launch sites (their device index is None)
    assert fla["sm_90"]["shared_mem_tiers_cpu_tensor"]["hopper"]
    assert not fla["gfx942"]["shared_mem_tiers_cpu_tensor"]["ampere"]
    # the route around fla #640 is installed as in a training worker (it declines off Hopper with a bad Triton)
    assert fla["sm_90"]["hylo_route"] == {"installed": True, "problem": None}
    md = (tmp_path / "kernels_check.md").read_text()
    assert "_dense_kl_kernel" in md and "gfx942" in md and "sm_90" in md
    assert "Compile seconds per target" in md
    for target in ("gfx942", "sm_90"):
        child = doc["children"][target]
        # _row_lse_kernel: compiled by the kl.dense site, in memory for the kl.topk site
        assert child["records"] == len([r for r in recs if r["target"] == target])
        assert (child["compiled"], child["reused"], child["cache_hits"]) == (child["records"] - 1, 1, 0)
        assert child["compile_seconds"] > 0 and child["compile_cpu_seconds"] > 0
    assert doc["triton_cache"] == str(cache) and any(p.suffix == ".cubin" for p in cache.rglob("*"))
    # the warmed cache: the same sites again for sm_90 compile nothing
    assert kc.check(sites, ["sm_90"], tmp_path / "again", 16, cache_dir=cache) == []
    first = doc["children"]["sm_90"]
    again = json.loads((tmp_path / "again" / "kernels_check.json").read_text())["children"]["sm_90"]
    assert again["records"] == first["records"]
    assert (again["compiled"], again["cache_hits"], again["reused"]) == (0, first["compiled"], first["reused"])
    assert again["compile_cpu_seconds"] < first["compile_cpu_seconds"]


def test_compile_seconds_are_totalled_per_target_and_shown_per_kernel():
    recs = [dict(_record("k1", 1024), seconds=2.0, cpu_seconds=1.5, cache_hit=False),
            dict(_record("k1", 2048), seconds=0.5, cpu_seconds=0.25, cache_hit=True)]
    res = {"gfx942": {"records": recs, "sites": [{"id": "gdn.train[H6]", "error": None}]}}
    recs.append(dict(_record("k1", 4096), seconds=0.0, cpu_seconds=0.0, cache_hit=None))
    totals = kc.compile_totals(res)
    assert totals == {"gfx942": {"records": 3, "compiled": 1, "cache_hits": 1, "reused": 1, "compile_seconds": 2.5,
                                 "compile_cpu_seconds": 1.8}}
    assert ("gfx942 2.5 s, 1.8 CPU-s (3 binaries: 1 compiled, 1 from the Triton cache, 1 compiled by an earlier "
            "site)") in kc.totals_line(totals)
    assert "| k1 | gdn.train | 3/3/3; 2.5 s;" in kc.table(res)


def test_warm_cache_is_the_triton_cache_the_check_compiles_into(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(kc, "recipe_sites", lambda *a, **kw: [])
    monkeypatch.setattr(kc, "check", lambda *a, **kw: seen.update(kw, recipes=list(a[0])) or [])
    out, kernel_cache = tmp_path / "kcheck", tmp_path / "node" / "kernel_cache"
    argv = ["--config", "demo-smollm2.yaml", "--targets", "sm_90", "--out", str(out)]
    assert kc.main([*argv, "--warm-cache", str(kernel_cache)]) == 0
    # DIR is a run's kernel cache (ray.kernel_cache): the Triton cache is where the run's workers look
    from hylo.pipeline.train.kernel_cache import kernel_cache_env

    cache = Path(kernel_cache_env(kernel_cache.resolve())["TRITON_CACHE_DIR"])
    assert seen["cache_dir"] == cache and cache.is_dir() and cache.parent == kernel_cache.resolve()
    # the report names the config's recipe (before: the last report file's name, "kernels_check.md")
    assert seen["recipes"] == ["demo-smollm2"]
    assert kc.main(argv) == 0 and seen["cache_dir"] is None


TOY = textwrap.dedent("""
    import json, os, sys, tempfile
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    from hylo.kernels import compile_check as cc
    t = cc.TARGETS[sys.argv[1]]
    cc.install(t)
    import torch, triton, triton.language as tl

    @triton.autotune(configs=[triton.Config({"BLOCK": 32}, num_warps=4, num_stages=1),
                              triton.Config({"BLOCK": 256}, num_warps=4, num_stages=1)], key=["n"])
    @triton.jit
    def _square(A, C, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        a = tl.load(A + offs[:, None] * BLOCK + offs[None, :])
        tl.store(C + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, a))

    with cc.compile_only(t) as log:
        log.site = "toy"
        _square[(1,)](torch.randn(256 * 256, dtype=torch.float16), torch.empty(256 * 256), 256)
    print(json.dumps([r.__dict__ for r in log.records], default=str))
""")


@pytest.mark.slow
def test_a_configuration_over_the_targets_shared_memory_is_reported_as_not_fitting(tmp_path):
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    out = subprocess.run([sys.executable, str(script), "gfx942"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    recs = json.loads(out.stdout.strip().splitlines()[-1])
    by_block = {r["constexprs"]["BLOCK"]: r for r in recs}
    # both configurations compiled although the autotuner would have picked one: the [256, 256] fp16 dot
    # operands need 128 KiB of LDS, over MI300X's 64 KiB; the [32, 32] ones fit
    assert set(by_block) == {32, 256}
    assert by_block[256]["compiled"] and not by_block[256]["fits"] and by_block[256]["shared_bytes"] > 65536
    assert by_block[32]["compiled"] and by_block[32]["fits"]
    assert by_block[256]["shared_limit"] == 65536
    res = {"gfx942": {"records": recs, "sites": [{"id": "toy", "error": None}]}}
    assert kc.verdicts(res) == []
    res["gfx942"]["records"] = [by_block[256]]
    bad = kc.verdicts(res)
    assert len(bad) == 1 and "_square" in bad[0] and "65536" in bad[0]


def _tiny_hc(linear_type: str):
    from hylo.config import HybridConfig

    return HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=64, n_layer=2, mla_layers=[0],
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, kv_lora_rank=8, q_lora_rank=None,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, linear_type=linear_type,
                        gdn_num_heads=2, gdn_head_dim=8, gdn_expand_v=2.0, gdn_chunk_size=16)


@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
def test_sequence_parallel_adds_the_state_passing_sites_and_they_run_at_a_tiny_shape(linear_type):
    import torch

    hc = _tiny_hc(linear_type)
    plain = {s.site for s in kc.sites_of(hc, 64, 96)}
    sites = {s.site: s for s in kc.sites_of(hc, 64, 96, sequence_parallel=2)}
    added = {"gdn": {"gdn.sp_local", "gdn.sp_transition"}, "mamba2": {"ssd.sp_local"}}[linear_type]
    assert set(sites) - plain == added
    torch.manual_seed(0)
    for name in added:
        site = sites[name]
        # the rank's half of the row, its documents (the first one continues from the previous rank; the
        # transition pass is for a rank inside one document)
        T, docs = site.get("T"), site.get("docs")
        assert T == 48 and sum(docs) == 48 and len(docs) == (1 if name == "gdn.sp_transition" else 2)
        # the torch path at this shape, fp32: every output and gradient, the passed state's too
        res = kc._run_site(site, dtype=torch.float32)
        grads = res["grads"]
        assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
        if name == "gdn.sp_transition":
            # the state map [1, H, K, K] of the chunk: a state S in gives M S out (zero values add nothing)
            K = site.get("K")
            assert res["final_state"].shape == (1, site.get("H"), K, K)
            continue
        if linear_type == "gdn":
            shape = (2, site.get("H"), site.get("K"), site.get("V"))
        else:
            shape = (2, site.get("H"), site.get("P"), site.get("N"))
        assert res["final_state"].shape == shape
        # the passed state's gradient (last): the state reaches the output
        assert grads[-1].shape == shape
    # a plan names them apart from the training site (the row length in the id)
    plan, _ = kc.plan_for({"tiny": list(sites.values())})
    assert any(p["id"].startswith(sorted(added)[0]) and p["id"].endswith("[T48]") for p in plan)


def test_a_sequence_parallel_group_that_does_not_split_the_row_is_one_error_line():
    from hylo.pipeline.cli import BadArgument

    with pytest.raises(BadArgument, match=r"--sequence-parallel=3: .*--tokens=2048"):
        kc.check_sequence_parallel(3, 2048, "--sequence-parallel")
    kc.check_sequence_parallel(4, 2048, "--sequence-parallel")


def test_the_reports_never_overwrite_a_users_files_in_out_and_are_refused_before_the_work(tmp_path, monkeypatch):
    """--out's kernels_check.md of the user's is refused (named, untouched) before anything compiles; the job's
    own reports (listed in --out's .hylo-output.json by `write_report`) are replaced; --force lets it through."""
    def started(*a, **kw):
        raise AssertionError("the check started")

    monkeypatch.setattr(kc, "recipe_sites", started)
    out = tmp_path / "kcheck"
    out.mkdir()
    (out / "kernels_check.md").write_text("my notes")
    argv = ["--config", "demo-smollm2.yaml", "--targets", "sm_90", "--out", str(out)]
    with pytest.raises(ForeignOutputError, match=f"--out {out / 'kernels_check.md'} exists and this project did not"):
        kc.main(argv)
    assert (out / "kernels_check.md").read_text() == "my notes"
    with pytest.raises(AssertionError, match="the check started"):
        kc.main([*argv, "--force"])
    record_files(out, kc.REPORT_FILES)
    with pytest.raises(AssertionError, match="the check started"):
        kc.main(argv)


def test_write_report_records_its_files_as_ours(tmp_path):
    kc.write_report(tmp_path, {}, {}, {"recipes": ["tiny"], "targets": [], "tokens": 16})
    assert all(is_own_file(tmp_path / name) for name in kc.REPORT_FILES)
