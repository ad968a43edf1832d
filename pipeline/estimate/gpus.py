"""The GPUs the estimate's figures are compared with: what a process can allocate and the dense bf16 peak."""

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
    # dense (no sparsity) bf16 matrix peak, the vendor's figure
    bf16_tflops: float

    def fits(self, peak_bytes: float) -> bool:
        return peak_bytes <= (1 - FIT_MARGIN) * self.memory_gib * GIB

    def seconds(self, flops: float) -> float:
        return flops / (self.bf16_tflops * 1e12)


GPUS = (
    GPU("H100", 79.6, 989.4),      # H100 SXM 80 GB: 81,559 MiB
    GPU("H200", 140.4, 989.4),     # H200 SXM 141 GB: 143,771 MiB
    GPU("MI300X", 191.7, 1307.4),  # 192 GB HBM3
    GPU("MI355X", 288.0, 2516.6),  # 288 GB HBM3E (nominal)
)
