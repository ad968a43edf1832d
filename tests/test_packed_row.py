"""The packed row (kernels/varlen.py): one rule everywhere, and cu_seqlens read to the host once per forward."""

from __future__ import annotations

import pytest
import torch

from hylo.config import HybridConfig
from hylo.modeling import HyLoForCausalLM

# Tensor methods that copy values to the host: on a GPU each one waits for the device (a sync).
_HOST_READS = {"tolist", "item", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__"}


class HostReads(torch.Tensor):
    """An integer tensor that logs every read of its values, or of an integer tensor computed from it
    (lengths, positions, masks), back to the host. Float results (activations) are left plain."""

    log: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        # a data-dependent output size is a sync too (repeat_interleave without output_size, nonzero)
        sized = (name == "repeat_interleave" and kwargs.get("output_size") is None) or name == "nonzero"
        if name in _HOST_READS or to_cpu or sized:
            cls.log.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        # a host copy is host data (reading it further costs nothing); float results are activations
        if to_cpu or name == "cpu" or out.is_floating_point() or out.is_complex():
            return out.as_subclass(torch.Tensor)
        return out.as_subclass(cls)


def tiny_model(linear_type: str, **over) -> HyLoForCausalLM:
    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=64, n_layer=4, mla_layers=[0, 3],
                       num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8, gdn_num_heads=2, gdn_head_dim=8, gdn_chunk_size=8,
                       linear_type=linear_type, **over)
    return HyLoForCausalLM(cfg).double()


BOUNDS = [0, 7, 8, 30, 41]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
def test_cu_seqlens_is_read_to_the_host_once_per_forward(linear_type, checkpointing):
    model = tiny_model(linear_type)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 64, (1, BOUNDS[-1]))
    HostReads.log = []
    cu = torch.tensor(BOUNDS, dtype=torch.int32).as_subclass(HostReads)
    out = model(ids, cu_seqlens=cu)
    out.logits.float().square().mean().backward()
    # the model's entry reads the boundaries once; no layer (nor its recompute) reads them again
    assert HostReads.log == ["tolist"], f"{len(HostReads.log)} host reads of cu_seqlens: {HostReads.log}"


def test_the_host_read_counter_sees_a_layer_read():
    # guards the test above: a read of cu_seqlens, or of a tensor derived from it, is logged
    HostReads.log = []
    cu = torch.tensor(BOUNDS, dtype=torch.int32).as_subclass(HostReads)
    lengths = cu[1:] - cu[:-1]
    int(lengths.max())
    lengths.to(torch.long).cpu()
    assert HostReads.log == ["__int__", "cpu"]
