"""This process as one rank of a sequence-parallel group on torch's fake process group, for the estimator
(`hylo estimate --sequence-parallel N`: step.py runs the split step in it, sp.py measures split layers in it).
Imports nothing of the estimator, so both can use it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn.functional as F


class FakeGroupError(RuntimeError):
    """The fake process group cannot be made (this process already has a process group)."""


@dataclass(frozen=True)
class LowerRight:
    """The split MLA attention's `causal_lower_right(q_len, k_len)` bias, as `fused_attention` receives it."""

    q_len: int
    k_len: int


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """SDPA as a GPU's fused kernel holds memory and runs its mask: the split MLA attention's `causal_lower_right`
    bias (which cannot be built on fake tensors, and sends CPU tensors to the math kernel's materialised scores)
    becomes `is_causal`, which `fake.flop_registry` counts as a lower-right-aligned causal kernel runs it (the
    visible pairs only); on fake tensors a mask changes values, not buffers."""
    import torch.nn.attention.bias as masks  # lazy: imports torch._dynamo

    sdpa, bias = F.scaled_dot_product_attention, masks.causal_lower_right

    def fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        # a grouped-query model's (transformers' Llama / Qwen3) fewer key-value heads stay grouped
        causal = is_causal or isinstance(attn_mask, LowerRight)
        return sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)

    # hylo.seq_parallel.attend_shard imports the bias where it runs: patched in torch's module
    F.scaled_dot_product_attention, masks.causal_lower_right = fused, LowerRight
    try:
        yield
    finally:
        F.scaled_dot_product_attention, masks.causal_lower_right = sdpa, bias


# the deprecation torch prints where hylo/seq_parallel.py (and DeepSpeed) call the collectives by their old names,
# torch >= 2.4 having only these (pipeline/job_output.py keeps it out of a job's lines too)
COLLECTIVE_DEPRECATION = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


@contextlib.contextmanager
def split_rank(N: int, deepspeed_comm: bool = False) -> Iterator[None]:
    """This process as the last rank of a sequence-parallel group of N on torch's fake process group (its
    collectives move nothing; shapes are real), with SDPA as a fused kernel (`fused_attention`). `deepspeed_comm`:
    DeepSpeed's communication over that group too (Ulysses runs DeepSpeed's all-to-all: the teacher split
    `ulysses`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # lazy: distributed

    if dist.is_available() and dist.is_initialized():
        raise FakeGroupError("the split step runs on a fake process group, and this process has a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=N - 1, world_size=N)
    try:
        if deepspeed_comm:
            from hylo.pipeline.train.deepspeed_cfg import import_deepspeed  # lazy: deepspeed

            # over the process group that exists (DeepSpeed's torch backend makes none when one exists)
            import_deepspeed().init_distributed(dist_backend="fake", auto_mpi_discovery=False)
        with fused_attention(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=COLLECTIVE_DEPRECATION, category=FutureWarning)
            yield
    finally:
        dist.destroy_process_group()
