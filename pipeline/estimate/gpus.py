"""The GPUs the estimate's figures are compared with: what a process can allocate and the dense (no sparsity)
peak of each dtype class a matrix product runs at (flops.py): bf16 / fp16 on tensor (matrix) cores, tf32,
fp32 on the vector units.

Rates in TFLOP/s, from the vendors' data sheets (dense figures: NVIDIA prints its tensor-core rows with 2:4
sparsity, footnote "* With sparsity", dense is half; AMD prints dense and sparse side by side):
* H100 SXM: NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
  table "Technical Specifications", column "H100 SXM": rows "BFLOAT16 Tensor Core" 1,979* (dense 989.4),
  "TF32 Tensor Core" 989* (dense 494.7), "FP32" 67 (vector).
* H200 SXM: NVIDIA H200 page, https://www.nvidia.com/en-us/data-center/h200/ table "Specifications", column
  "H200 SXM": the same rows and figures as the H100 SXM (same GH100 chip and clocks).
* B200 (HGX B200, 1,000 W): NVIDIA HGX platform page, https://www.nvidia.com/en-us/data-center/hgx/ table
  "Technical Specifications", "Individual Blackwell GPU Specifications", column "HGX B200": rows "FP16/BF16
  Tensor Core" 4.5 PFLOPS (sparse; dense 2,250), "TF32 Tensor Core" 2.2 PFLOPS (sparse; dense 1,100), "FP32"
  75 TFLOPS; memory 180 GB (nvidia-smi: about 179 GiB).
* MI300X: AMD Instinct MI300X data sheet,
  https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf
  table "AI performance" / "HPC performance": "Peak bfloat16" 1,307.4 (dense; 2,614.9 with sparsity), "Peak
  TF32" 653.7 (dense), "Peak Single Precision (FP32) Vector" 163.4.
* MI355X: AMD Instinct MI355X product page, https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html
  "Specifications", "AI Performance" / "HPC Performance": "Peak Half Precision (FP16/BF16) Matrix" 2.5 PFLOPs
  (dense 2,516.6; 5.0 with sparsity), "Peak Single Precision (FP32) Vector" 157.3; no TF32 row: CDNA 4 has no
  TF32 (xf32) matrix instructions (AMD CDNA 4 white paper), so a tf32 product is timed at its fp32 rate.
fp16 runs at the bf16 rate on every GPU here (the data sheets give one figure for both).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
# share of a GPU's memory left for what the estimate does not count (context, communication buffers,
# allocator fragmentation)
FIT_MARGIN = 0.10


@dataclass(frozen=True)
class GPU:
    name: str
    # what a process can allocate, as nvidia-smi / rocm-smi report the device's memory
    memory_gib: float
    # dense (no sparsity) bf16 matrix peak, the vendor's figure (TFLOP/s; also fp16's)
    bf16_tflops: float
    # fp32 on the vector units (TFLOP/s)
    fp32_tflops: float
    # dense TF32 matrix peak (TFLOP/s); None: no TF32 units, a tf32 product runs at the fp32 rate
    tf32_tflops: float | None

    def fits(self, peak_bytes: float) -> bool:
        return peak_bytes <= (1 - FIT_MARGIN) * self.memory_gib * GIB

    def seconds(self, flops: float) -> float:
        """`flops` at the dense bf16 peak."""
        return flops / (self.bf16_tflops * 1e12)

    def rate(self, cls: str) -> float | None:
        """TFLOP/s of a dtype class (flops.py); None: this estimate has no rate for it (float64, fp8...)."""
        if cls in ("bf16", "fp16"):
            return self.bf16_tflops
        if cls == "tf32":
            return self.tf32_tflops or self.fp32_tflops
        if cls == "fp32":
            return self.fp32_tflops
        return None

    def seconds_by_dtype(self, flops_by_dtype: dict[str, float]) -> dict[str, float | None]:
        """Each class's FLOPs at its rate (s); None for a class without one."""
        out: dict[str, float | None] = {}
        for cls, n in flops_by_dtype.items():
            rate = self.rate(cls)
            out[cls] = None if rate is None else n / (rate * 1e12)
        return out

    def time(self, flops_by_dtype: dict[str, float]) -> float | None:
        """Every class at its dense peak (s, a lower bound); None when a class with FLOPs has no rate."""
        parts = self.seconds_by_dtype(flops_by_dtype)
        if any(v is None and flops_by_dtype[k] for k, v in parts.items()):
            return None
        return sum(v or 0.0 for v in parts.values())


GPUS = (
    GPU("H100", 79.6, 989.4, 67.0, 494.7),     # H100 SXM 80 GB: 81,559 MiB
    GPU("H200", 140.4, 989.4, 67.0, 494.7),    # H200 SXM 141 GB: 143,771 MiB
    GPU("B200", 179.0, 2250.0, 75.0, 1100.0),  # HGX B200 180 GB
    GPU("MI300X", 191.7, 1307.4, 163.4, 653.7),  # 192 GB HBM3
    GPU("MI355X", 288.0, 2516.6, 157.3, None),   # 288 GB HBM3E (nominal)
)


def unpriced(flops_by_dtype: dict[str, float]) -> list[str]:
    """The classes with FLOPs that no GPU here has a rate for."""
    return [k for k, n in flops_by_dtype.items() if n and GPUS[0].rate(k) is None]
