"""Pure-torch stand-ins for the GPU packages AMD's Hybrid-Models code imports (`mamba_ssm`, `causal_conv1d`,
`flash_attn`), so that their code runs unmodified on a CPU for bench/amd_compat.py.

Each function is the textbook math of the kernel it stands for, with that kernel's signature (only the
arguments AMD's code passes are implemented; any other one is refused rather than ignored):
* `mamba_ssm`: the RMSNorm of `ops.triton.layer_norm`, the gated (grouped) RMSNorm of
  `ops.triton.layernorm_gated`, `mamba_chunk_scan_combined` as the recurrence it computes in chunks,
  `selective_state_update` (one decode step); fp32 math at least, output in the input's dtype.
* `causal_conv1d`: `causal_conv1d_fn` (a depthwise conv padded on the left) and `causal_conv1d_update`.
* `flash_attn`: `flash_attn_func` / `flash_attn_varlen_func` (softmax attention, bottom-right causal mask as
  in flash-attn >= 2.1, GQA by repeating K/V heads) and the `bert_padding` helpers.

`install()` registers them in `sys.modules` (nothing is written to site-packages); `install_cpu_runtime()` lets
their CUDA-only calls run on a CPU. This file imports only torch (and transformers, to say flash-attn is
there); the project itself never imports it.
"""

from __future__ import annotations

import math
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _refuse(name: str, **given) -> None:
    used = [k for k, v in given.items() if v is not None and v is not False]
    if used:
        raise NotImplementedError(f"stand-in {name}: argument(s) {', '.join(used)} are not implemented")


# ------------------------------------------------------------------------------------ mamba_ssm
class RMSNorm(nn.Module):
    """mamba_ssm.ops.triton.layer_norm.RMSNorm: weight * x / sqrt(mean(x^2) + eps)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dropout_p: float = 0.0, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        _refuse("RMSNorm.forward", residual=residual, prenorm=prenorm)
        xf = x.to(_work_dtype(x))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(xf.dtype)
        return y.to(x.dtype)


class RMSNormGated(nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: RMSNorm per group of `group_size` channels of
    x * silu(z) (norm_before_gate=False), or RMSNorm(x) * silu(z) (norm_before_gate=True)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        wd = _work_dtype(x)
        xf = x.to(wd)
        if z is not None and not self.norm_before_gate:
            xf = xf * F.silu(z.to(wd))
        g = xf.unflatten(-1, (-1, self.group_size))
        y = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2) * self.weight.to(wd)
        if z is not None and self.norm_before_gate:
            y = y * F.silu(z.to(wd))
        return y.to(x.dtype)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """The SSD scan as its recurrence, token by token (the chunking only changes the order of the sums).

    x: [b, l, h, p], dt: [b, l, h], A: [h], B / C: [b, l, g, n] (head i reads group i // (h / g)),
    D: [h] or [h, p], z: [b, l, h, p] (gate silu(z)); state: [b, h, p, n]."""
    _refuse("mamba_chunk_scan_combined", seq_idx=seq_idx, cu_seqlens=cu_seqlens,
            return_varlen_states=return_varlen_states)
    wd = _work_dtype(x)
    b, L, h, p = x.shape
    g = B.shape[2]
    xf, Bf, Cf = x.to(wd), B.to(wd).repeat_interleave(h // g, 2), C.to(wd).repeat_interleave(h // g, 2)
    dtf = dt.to(wd) + (dt_bias.to(wd) if dt_bias is not None else 0)
    if dt_softplus:
        dtf = F.softplus(dtf)
    dtf = dtf.clamp(dt_limit[0], dt_limit[1])
    Af = A.to(wd)
    state = (initial_states.to(wd).clone() if initial_states is not None
             else torch.zeros(b, h, p, B.shape[-1], dtype=wd, device=x.device))
    ys = []
    for t in range(L):
        decay = torch.exp(dtf[:, t] * Af)  # [b, h]
        state = state * decay[:, :, None, None] + (dtf[:, t, :, None] * xf[:, t])[..., None] * Bf[:, t, :, None, :]
        ys.append((state * Cf[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D is not None:
        Df = D.to(wd)
        y = y + xf * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.to(wd))
    y = y.to(x.dtype)
    return (y, state.to(x.dtype)) if return_final_states else y


def mamba_split_conv1d_scan_combined(*args, **kwargs):
    raise NotImplementedError("stand-in: mamba_split_conv1d_scan_combined is imported but not called by AMD's code")


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """One recurrence step, updating `state` in place. state: [b, h, p, n], x / dt / z: [b, h, p],
    A: [h, p, n], B / C: [b, g, n], D / dt_bias: [h, p]. Returns y: [b, h, p]."""
    _refuse("selective_state_update", state_batch_indices=state_batch_indices)
    wd = _work_dtype(x)
    h, g = x.shape[1], B.shape[1]
    dtf = dt.to(wd) + (dt_bias.to(wd) if dt_bias is not None else 0)
    if dt_softplus:
        dtf = F.softplus(dtf)
    Bf, Cf = B.to(wd).repeat_interleave(h // g, 1), C.to(wd).repeat_interleave(h // g, 1)
    new = state.to(wd) * torch.exp(A.to(wd) * dtf[..., None]) + (dtf * x.to(wd))[..., None] * Bf[:, :, None, :]
    state.copy_(new.to(state.dtype))
    y = (new * Cf[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + x.to(wd) * D.to(wd)
    if z is not None:
        y = y * F.silu(z.to(wd))
    return y.to(x.dtype)


class _NotUsed:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("stand-in: tensor-parallel layers are imported but not used by AMD's code")


def _not_used(*args, **kwargs):
    raise NotImplementedError("stand-in: distributed helpers are imported but not used by AMD's code")


# ------------------------------------------------------------------------------------ causal_conv1d
def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """x: [b, d, l], weight: [d, w]: out[t] = sum_k weight[:, k] * x[t - w + 1 + k] (zeros before 0)."""
    _refuse("causal_conv1d_fn", seq_idx=seq_idx, initial_states=initial_states,
            return_final_states=return_final_states, final_states_out=final_states_out)
    d, w = weight.shape
    out = F.conv1d(F.pad(x, (w - 1, 0)), weight[:, None, :], bias, groups=d)
    return F.silu(out) if activation in ("silu", "swish") else out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None):
    """One step: x: [b, d], conv_state: [b, d, w] (updated in place: shifted left, x appended)."""
    _refuse("causal_conv1d_update", cache_seqlens=cache_seqlens)
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    out = (conv_state * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out) if activation in ("silu", "swish") else out


def causal_conv1d_varlen_states(*args, **kwargs):
    raise NotImplementedError("stand-in: causal_conv1d_varlen_states (varlen inference) is not implemented")


# ------------------------------------------------------------------------------------ flash_attn
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q: [b, tq, h, d], k / v: [b, tk, hk, d]: softmax(q k^T * scale) v, query i seeing keys j <= i + tk - tq."""
    if dropout_p:
        raise NotImplementedError("stand-in flash_attn_func: dropout is not implemented")
    _refuse("flash_attn_func", alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs)
    if tuple(window_size) != (-1, -1) or softcap:
        raise NotImplementedError("stand-in flash_attn_func: windows and softcap are not implemented")
    wd = _work_dtype(q)
    tq, h, tk, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    qf = q.to(wd).transpose(1, 2)
    kf = k.to(wd).repeat_interleave(h // hk, 2).transpose(1, 2)
    vf = v.to(wd).repeat_interleave(h // hk, 2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(tq, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        s = s.masked_fill(j > i + tk - tq, -math.inf)
    return (s.softmax(-1) @ vf).transpose(1, 2).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, **kwargs):
    """Packed sequences: q [total_q, h, d], k / v [total_k, hk, d]; each pair of segments attended alone."""
    outs = []
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[int(cu_seqlens_q[i]):int(cu_seqlens_q[i + 1])][None]
        ks = k[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])][None]
        vs = v[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])][None]
        outs.append(flash_attn_func(qs, ks, vs, dropout_p, softmax_scale, causal, **kwargs)[0])
    return torch.cat(outs)


def index_first_axis(x, indices):
    return x[indices]


def pad_input(hidden_states, indices, batch, seqlen):
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def unpad_input(hidden_states, attention_mask):
    """(tokens of the real positions, their flat indices, cu_seqlens, longest sequence) as flash-attn 2.6."""
    seqlens = attention_mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return hidden_states.flatten(0, 1)[indices], indices, cu, int(seqlens.max())


# ------------------------------------------------------------------------------------ a CPU for their CUDA calls
class _CpuForCuda(torch.overrides.TorchFunctionMode):
    """device='cuda' (a string or torch.device, positional or keyword) becomes the CPU in every torch call."""

    @staticmethod
    def _cpu(x):
        if (isinstance(x, str) and x.startswith("cuda")) or (isinstance(x, torch.device) and x.type == "cuda"):
            return torch.device("cpu")
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = tuple(self._cpu(a) for a in args)
        kwargs = {k: self._cpu(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


class _NoTimer:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0


def install_cpu_runtime() -> None:
    """Run their CUDA-only calls on a CPU, their code untouched: `.cuda()` is the identity, device='cuda'
    allocates on the CPU, `torch.cuda.Event` (their decode loop's timer) records nothing, and transformers is
    told flash-attn >= 2.1 is installed (it is: the stand-in above; its check also wants a GPU). Call before
    importing their modules (they read the flash-attn check at import)."""
    import transformers.modeling_utils as mu  # lazy: stand-ins
    import transformers.utils as tu  # lazy: stand-ins
    import transformers.utils.import_utils as iu  # lazy: stand-ins

    torch.nn.Module.cuda = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.Event = _NoTimer
    for mod in (tu, iu, mu):
        for name in ("is_flash_attn_2_available", "is_flash_attn_greater_or_equal_2_10"):
            if hasattr(mod, name):
                setattr(mod, name, lambda: True)
    _CpuForCuda().__enter__()


# ------------------------------------------------------------------------------------ registration
def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__path__ = []  # a package, so that submodules import
    return mod


def install() -> list[str]:
    """Register the stand-in packages in sys.modules; returns their names."""
    mods = [
        _module("mamba_ssm"), _module("mamba_ssm.ops"), _module("mamba_ssm.ops.triton"),
        _module("mamba_ssm.ops.triton.layer_norm", RMSNorm=RMSNorm),
        _module("mamba_ssm.ops.triton.layernorm_gated", RMSNorm=RMSNormGated),
        _module("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=mamba_chunk_scan_combined,
                mamba_split_conv1d_scan_combined=mamba_split_conv1d_scan_combined),
        _module("mamba_ssm.ops.triton.selective_state_update", selective_state_update=selective_state_update),
        _module("mamba_ssm.distributed"),
        _module("mamba_ssm.distributed.tensor_parallel", ColumnParallelLinear=_NotUsed, RowParallelLinear=_NotUsed),
        _module("mamba_ssm.distributed.distributed_utils", all_reduce=_not_used, reduce_scatter=_not_used),
        _module("causal_conv1d", causal_conv1d_fn=causal_conv1d_fn, causal_conv1d_update=causal_conv1d_update),
        _module("causal_conv1d.causal_conv1d_varlen", causal_conv1d_varlen_states=causal_conv1d_varlen_states),
        _module("flash_attn", flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
                __version__="2.6.3"),
        _module("flash_attn.bert_padding", index_first_axis=index_first_axis, pad_input=pad_input,
                unpad_input=unpad_input),
    ]
    for m in mods:
        sys.modules[m.__name__] = m
    return [m.__name__ for m in mods]
