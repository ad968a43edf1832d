"""Mamba-2 SSD ops: `chunk_ssd` (fla's simple-GLA kernel on GPU, chunked torch path on CPU) and its
step-by-step reference `naive_ssd`. Math in README.md beside this file."""

from hylo.kernels.ssd.checks import SSDInputError
from hylo.kernels.ssd.chunk import chunk_ssd, fla_chunk_ssd, torch_chunk_ssd
from hylo.kernels.ssd.naive import naive_ssd

__all__ = ["SSDInputError", "chunk_ssd", "fla_chunk_ssd", "naive_ssd", "torch_chunk_ssd"]
