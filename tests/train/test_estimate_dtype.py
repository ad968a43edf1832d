"""The estimate's FLOPs by the dtype each matrix product runs at on a GPU, and their time at each dtype's rate
(pipeline/estimate/flops.py, gpus.py): products counted on fake tensors, in-process."""

from __future__ import annotations

import pytest
import torch

from hylo.pipeline.estimate.fake import fake_tensors, flop_registry
from hylo.pipeline.estimate.gpus import GPU, GPUS
from hylo.pipeline.estimate.report import format_table
from hylo.pipeline.estimate.step import Estimate
from hylo.pipeline.estimate.tracking import Phases

H100 = next(g for g in GPUS if g.name == "H100")


def _estimate(flops_by_dtype: dict[str, dict[str, int]]) -> Estimate:
    flops = {p: sum(c.values()) for p, c in flops_by_dtype.items()}
    return Estimate(stage=2, tokens=1024, world_size=1, dtype="bfloat16", parameters=1, trainable_parameters=1,
                    memory={"parameters": 1.0}, peak_bytes=1.0, peak_phase="forward/backward", loss_chunk_bytes=0.0,
                    flops=flops, host_reads=[], flops_by_dtype=flops_by_dtype)


def _counted_step() -> Phases:
    """A fake step: a bf16 [256, 128] x [128, 64] product in "student forward", an fp32 [64, 32] x [32, 16]
    product and a bf16 x bf16 -> fp32 one ([16, 8] x [8, 4], out_dtype) in "fused loss"."""
    with fake_tensors() as host:
        host.flop_registry = flop_registry()
        phases = Phases(host, memory=None)
        with phases.phase("student forward"):
            torch.empty(256, 128, dtype=torch.bfloat16) @ torch.empty(128, 64, dtype=torch.bfloat16)
        with phases.phase("fused loss"):
            torch.empty(64, 32) @ torch.empty(32, 16)
            a, b = torch.empty(16, 8, dtype=torch.bfloat16), torch.empty(8, 4, dtype=torch.bfloat16)
            assert torch.mm(a, b, out_dtype=torch.float32).dtype == torch.float32
            # addmm's formula takes out_shape where the dtype overload passes out_dtype
            torch.addmm(torch.empty(16, 4), a, b, out_dtype=torch.float32)
    return phases


BF16 = 2 * 256 * 128 * 64
FP32 = 2 * 64 * 32 * 16
OUT_DTYPE = 2 * 16 * 8 * 4


def test_each_product_counts_at_its_operands_dtype_and_phase():
    phases = _counted_step()
    assert phases.by_dtype["student forward"] == {"bf16": BF16}
    # the out_dtype products multiply bf16 operands: the bf16 rate
    assert phases.by_dtype["fused loss"] == {"fp32": FP32, "bf16": 2 * OUT_DTYPE}
    assert phases.flops["fused loss"] == FP32 + 2 * OUT_DTYPE


def test_each_dtype_is_timed_at_its_rate_and_the_json_has_it():
    est = _estimate(_counted_step().by_dtype)
    d = est.to_dict()
    bf16 = BF16 + 2 * OUT_DTYPE
    assert d["gemm_flops_by_dtype"] == {"bf16": bf16 / 1e12, "fp32": FP32 / 1e12}
    h100 = d["gpus"]["H100"]
    assert h100["seconds_by_dtype"] == {"bf16": pytest.approx(bf16 / 989.4e12), "fp32": pytest.approx(FP32 / 67e12)}
    assert h100["seconds"] == pytest.approx(bf16 / 989.4e12 + FP32 / 67e12)
    assert h100["unpriced"] == []
    # the per-phase split travels too
    assert d["flops_by_dtype"]["fused loss"]["fp32"] == FP32


def test_a_gpu_times_each_class_at_its_own_rate():
    g = GPU("X", 80.0, bf16_tflops=1000.0, fp32_tflops=50.0, tf32_tflops=500.0)
    assert g.time({"bf16": 2e12, "fp16": 1e12, "tf32": 1e12, "fp32": 1e12}) == pytest.approx(
        3e12 / 1e15 + 1e12 / 5e14 + 1e12 / 5e13)
    # without TF32 units (MI355X) a tf32 product runs at the fp32 rate
    no_tf32 = GPU("Y", 80.0, bf16_tflops=1000.0, fp32_tflops=50.0, tf32_tflops=None)
    assert no_tf32.time({"tf32": 1e12}) == pytest.approx(1e12 / 5e13)


def test_a_dtype_without_a_rate_is_counted_and_named_never_timed():
    with fake_tensors() as host:
        host.flop_registry = flop_registry()
        torch.empty(8, 4, dtype=torch.float64) @ torch.empty(4, 2, dtype=torch.float64)
    assert host.flops_by_dtype == {"float64": 2 * 8 * 4 * 2}
    est = _estimate({"student forward": {"bf16": 10**12, **host.flops_by_dtype}})
    h100 = est.to_dict()["gpus"]["H100"]
    assert h100["seconds"] is None and h100["seconds_by_dtype"]["float64"] is None
    assert h100["unpriced"] == ["float64"]
    table = format_table("training GPU:", [est])
    assert "float64 (no GPU rate: not timed)" in table
    assert [line.split()[-1] for line in table.splitlines() if line.strip().startswith("H100 (")] == ["n/a"]


def test_the_table_shows_the_fp32_share_when_there_is_one():
    shown = format_table("training GPU:", [_estimate({"fused loss": {"fp32": 3 * 10**12, "bf16": 10**12}})])
    assert [line.split()[-1] for line in shown.splitlines() if "fp32 share" in line] == ["75.0%"]
    time = next(line for line in shown.splitlines() if line.strip().startswith("H100 ("))
    assert float(time.split()[-1]) == pytest.approx(10**12 / 989.4e12 + 3 * 10**12 / 67e12, abs=0.005)
    assert "fp32 share" not in format_table("t:", [_estimate({"student forward": {"bf16": 10**12}})])


def _scan_inputs(dtype: torch.dtype, T: int = 128, H: int = 2, K: int = 16):
    q, k, v = (torch.empty(1, T, H, K, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.empty(1, T, H, requires_grad=True)
    beta = torch.empty(1, T, H, dtype=dtype, requires_grad=True)
    return q, k, v, g, beta


def test_the_gdn_scan_stands_in_for_flas_kernel_at_its_inputs_dtype_forward_and_backward():
    """The torch scan computes in fp32; fla multiplies bf16 tiles: its FLOPs, forward and backward, are bf16,
    as many as the scan's own count, while an fp32 product beside it in the same backward stays fp32."""
    from hylo.kernels.gdn import chunk as gdn_chunk

    def run(plain: bool):
        with fake_tensors() as host:
            scan = gdn_chunk.torch_chunk_gated_delta_rule
            if plain:
                scan = scan.__wrapped__
            host.flop_registry = flop_registry()
            q, k, v, g, beta = _scan_inputs(torch.bfloat16)
            w = torch.empty(32, 32, requires_grad=True)
            o, _ = scan(q, k, v, g, beta, chunk_size=32)
            fp32 = torch.empty(32, 32) @ w
            forward = dict(host.flops_by_dtype)
            (o.float().sum() + fp32.sum()).backward()
            return forward, dict(host.flops_by_dtype)

    fwd, total = run(False)
    mm = 2 * 32 * 32 * 32
    assert set(fwd) == {"bf16", "fp32"} and fwd["fp32"] == mm
    # backward: the fp32 product's one weight gradient (its input needs none), the scan's in bf16
    assert total["fp32"] == 2 * mm and total["bf16"] > 2 * fwd["bf16"]
    # the unwrapped scan counts the same FLOPs, in fp32
    _, plain = run(True)
    assert sum(plain.values()) == sum(total.values()) and set(plain) == {"fp32"}
