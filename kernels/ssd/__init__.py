"""Mamba-2 SSD ops: `chunk_ssd` (fla's simple-GLA kernel on GPU, chunked torch path on CPU), the decode step
`recurrent_ssd` (fla's recurrent simple-GLA kernel on GPU, a torch loop on CPU) and the step-by-step
reference `naive_ssd`. Math in README.md beside this file."""

from hylo.kernels.ssd.checks import SSDInputError
from hylo.kernels.ssd.chunk import chunk_ssd, fla_chunk_ssd, torch_chunk_ssd
from hylo.kernels.ssd.naive import naive_ssd
from hylo.kernels.ssd.recurrent import fla_recurrent_ssd, recurrent_ssd, torch_recurrent_ssd

__all__ = ["SSDInputError", "chunk_ssd", "fla_chunk_ssd", "fla_recurrent_ssd", "naive_ssd", "recurrent_ssd",
           "torch_chunk_ssd", "torch_recurrent_ssd"]
