"""Fused linear KL(teacher || student): logits, loss and gradients chunk by chunk over tokens.

Design choices:
* One autograd.Function whose forward computes the loss AND the gradients w.r.t. student_hidden and
  student_weight, one chunk of C tokens at a time; backward only scales them by grad_output. No [N, V]
  tensor exists at any time: the largest tensors are a few [C, V] chunk buffers.
* Every product goes through `gemm.mm_f32`: bf16/fp16 operands are multiplied in their dtype (tensor
  cores) with fp32 accumulation and an fp32 result, so logits are fp32 (fp64 for fp64 inputs) and never
  rounded to bf16 before the softmax. fp32 inputs keep the fp32 product.
* The fp32 logit gradient enters the two gradient products as a hi + lo pair of the input dtype
  (`precision="accurate"`, the default: error ~1e-6 before the final rounding) or rounded once
  (`"fast"`, one product each, Liger's arithmetic); `gemm.split_operands`. fp32 inputs ignore it.
* dW is accumulated across chunks in an fp32 [V, H] buffer (`addmm`, no per-chunk temporary); dH is
  written once per row. Both are cast to the input dtype at the end of the forward.
* Masked tokens are dropped before any logits are computed (their loss and gradient are zero), so a
  mostly masked input costs little; "mean" divides by the number of unmasked tokens.
* The per-chunk softmax / KL / gradient step is swappable: pure torch (`steps.py`; CPU, fallback) or
  the Triton kernels in `triton_kernel.py`, chosen by `hylo.kernels.backend.use_gpu_kernels`.
* The chunk size, when not given, bounds the chunk buffers to a fixed byte budget (`auto_chunk_size`);
  the [C, V] buffers are allocated once per call and reused by every chunk (`Workspace`), which on CPU
  saves re-faulting ~100 MB of fresh pages per chunk.
* Teacher tensors never get gradients; gradients are computed only for inputs that require them.
* No host read on an accelerator (`inputs.reads_are_free`): there value checks are deferred device
  flags, masked tokens are zeroed by multiplication instead of being selected (selecting them needs
  their count on the host), "mean" divides by the device count of unmasked tokens at the end, and
  backward scales the stored gradients in place instead of testing grad_output == 1. On CPU the
  reads are free: masked tokens are dropped before any logits are computed.

Legend: N tokens, C tokens in a chunk (the rows of a [C, V] buffer), H student hidden, H' teacher hidden, V vocabulary, k top-k width,
B = k + 1 teacher buckets (top-k plus tail). Temperature convention and math: README.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from hylo.kernels.backend import use_gpu_kernels
from hylo.kernels.checks import compute_dtype
from hylo.kernels.fused_kl.gemm import LOW_PRECISION, PRECISIONS, SPLIT_SHIFT, mm_f32, split_operands
from hylo.kernels.fused_kl.inputs import (
    CheckedTeacher,
    LogitsFn,
    check_inputs,
    check_teacher_logits,
    reads_are_free,
)
from hylo.kernels.fused_kl.steps import (
    DenseStep,
    StepParams,
    TopkStep,
    Workspace,
    dense_kl_step_torch,
    teacher_bucket_logprobs,
    topk_kl_step_torch,
)
from hylo.kernels.fused_kl.topk import TeacherTopK

# Byte budget for the live [C, V] buffers of one chunk (about four of them at once).
CHUNK_BUDGET_BYTES = {"cpu": 256 << 20, "other": 1 << 30}
_LIVE_CHUNK_BUFFERS = 4


def auto_chunk_size(n_tokens: int, vocab: int, device: torch.device, dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk so that ~4 [C, V] buffers of `dtype` fit the device's byte budget."""
    budget = CHUNK_BUDGET_BYTES["cpu" if device.type == "cpu" else "other"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = budget // (_LIVE_CHUNK_BUFFERS * vocab * itemsize)
    # Multiples of 16 keep matmul tiles aligned; never fewer than 16 rows unless N is smaller.
    rows = max(16, rows // 16 * 16)
    return max(1, min(rows, n_tokens))


def fused_linear_kl_div(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    *,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_topk: TeacherTopK | tuple | None = None,
    teacher_logits_fn: LogitsFn | None = None,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    precision: str = "accurate",
) -> torch.Tensor:
    """Forward KL(teacher || student) per token, summed (`"sum"`) or averaged over unmasked tokens (`"mean"`).

    `student_hidden`: `[N, H]`, `student_weight`: `[V, H]` (student logits = `student_hidden @ student_weight.T`).
    Exactly one teacher form:

    * `teacher_hidden` `[N, H']` + `teacher_weight` `[V, H']`: teacher logits computed chunk by chunk;
    * `teacher_topk`: `TeacherTopK` or `(logprobs [N, k], indices [N, k][, tail_logmass [N]])`, log-probs at
      temperature 1. With a tail, the student's probability outside the k ids is one bucket matched
      against the teacher's tail mass; without one, the teacher's top-k are renormalised (zero tail).
      With k = V this is exactly the full-vocabulary loss;
    * `teacher_logits_fn(i, j) -> [j - i, V]`: teacher logits for rows `i:j` (streamed; any float dtype).

    Options:

    * `mask`: `[N]` bool (or 0/1 ints); False rows contribute nothing.
    * `temperature` T: both distributions are `softmax(logits / T)` (the convention: kernels/fused_kl/README.md,
      "The loss"). For top-k, the k+1 bucket log-probs are divided by T and renormalised.
    * `chunk_size`: rows per chunk; None picks one that bounds the chunk buffers (`auto_chunk_size`).
    * `precision`: for bf16/fp16 inputs, how the fp32 logit gradient enters the two gradient products:
      `"accurate"` (hi + lo halves, two tensor-core products each) or `"fast"` (rounded once to the input
      dtype, one product); fp32/fp64 inputs take fp32/fp64 products either way (kernels/fused_kl/README.md,
      "Precision").

    Returns a scalar in fp32 (fp64 for fp64 inputs); 0 when no token is unmasked. Gradients flow to
    `student_hidden` and `student_weight` only; they are computed during this call (double backward is
    not supported).
    """
    teacher, mask = check_inputs(
        "fused_linear_kl_div", student_hidden, student_weight, teacher_hidden, teacher_weight,
        teacher_topk, teacher_logits_fn, mask, temperature, reduction, chunk_size,
    )
    if precision not in PRECISIONS:
        raise ValueError(f"fused_linear_kl_div: precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if chunk_size is None:
        chunk_size = auto_chunk_size(
            student_hidden.shape[0], student_weight.shape[0], student_hidden.device,
            compute_dtype(student_hidden),
        )
    options = _Options(
        teacher=teacher,
        mask=mask,
        inv_temp=1.0 / float(temperature),
        reduction=reduction,
        chunk_size=chunk_size,
        use_triton=use_gpu_kernels(student_hidden),
        precision=precision,
    )
    needs_grad = torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad)
    if not needs_grad:
        loss, _, _ = _forward_backward(student_hidden, student_weight, options, False, False)
        return loss
    return _FusedLinearKL.apply(student_hidden, student_weight, options)


@dataclasses.dataclass(frozen=True)
class _Options:
    """Non-tensor arguments of the autograd.Function (teacher tensors travel here: they get no grad)."""

    teacher: CheckedTeacher
    mask: torch.Tensor | None
    inv_temp: float
    reduction: str
    chunk_size: int
    use_triton: bool
    precision: str = "accurate"


class _FusedLinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_hidden: torch.Tensor, student_weight: torch.Tensor, options: _Options):
        loss, grad_hidden, grad_weight = _forward_backward(
            student_hidden, student_weight, options, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.has_grad = (grad_hidden is not None, grad_weight is not None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if not reads_are_free(grad_loss.device):
            # No host read of grad_loss: the stored gradients are scaled in place (they are ours and
            # used once), so a second backward through the same graph would scale them twice.
            if getattr(ctx, "consumed", False):
                raise RuntimeError("fused_linear_kl_div: backward through the same loss twice is not supported")
            ctx.consumed = True
            return tuple(
                None if not has else g.mul_(grad_loss.to(g.dtype)) for has, g in zip(ctx.has_grad, (grad_hidden, grad_weight))
            ) + (None,)
        # The usual grad_loss is exactly 1: hand the stored gradients over without a [V, H] copy.
        unit = bool(grad_loss == 1)
        out = []
        for has, g in zip(ctx.has_grad, (grad_hidden, grad_weight)):
            out.append(None if not has else g if unit else g * grad_loss.to(g.dtype))
        return out[0], out[1], None


def _rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


@torch.no_grad()
def _forward_backward(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    options: _Options,
    want_grad_hidden: bool,
    want_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Loss, and the gradients of the loss w.r.t. student_hidden / student_weight (None if not wanted)."""
    n_tokens, hidden = student_hidden.shape
    vocab = student_weight.shape[0]
    device = student_hidden.device
    cdtype = compute_dtype(student_hidden)
    teacher = options.teacher
    # operands stay in their dtype: `mm_f32` multiplies bf16/fp16 with fp32 accumulation
    weight_VH = student_weight.detach()

    grad_hidden_NH = torch.zeros(n_tokens, hidden, dtype=cdtype, device=device) if want_grad_hidden else None
    grad_weight_VH = torch.zeros(vocab, hidden, dtype=cdtype, device=device) if want_grad_weight else None
    need_grad = want_grad_hidden or want_grad_weight
    loss = torch.zeros((), dtype=cdtype, device=device)

    # select_rows: drop masked rows (CPU); else keep every row and zero the masked ones (no host read)
    select_rows = reads_are_free(device)
    mask = options.mask
    n_valid_dev = None
    if mask is None:
        n_valid = n_tokens
    elif select_rows:
        n_valid = int(mask.sum())
    else:
        n_valid, n_valid_dev = n_tokens, mask.sum().clamp(min=1).to(cdtype)
    if n_valid == 0:
        return loss, _cast(grad_hidden_NH, student_hidden), _cast(grad_weight_VH, student_weight)
    # with a device count the "mean" division comes at the end
    scale = 1.0 / n_valid if options.reduction == "mean" and n_valid_dev is None else 1.0
    # d(loss)/d(student logits) = scale / T * (q - p): the 1/T comes from logits / T. For bf16/fp16 operands
    # the step writes (q - p) * shift and the products' alpha applies scale / T / shift (`gemm.SPLIT_SHIFT`).
    factor = scale * options.inv_temp
    low = student_weight.dtype if student_weight.dtype in LOW_PRECISION else None
    shift = SPLIT_SHIFT[low] if low is not None else factor
    alpha = factor / shift if low is not None else 1.0
    step = StepParams(options.inv_temp, grad_scale=shift, need_grad=need_grad)
    dense_step, topk_step = _chunk_steps(options.use_triton)
    workspace = Workspace(min(options.chunk_size, n_tokens), vocab, cdtype, device)

    for rows, teacher_CV in _chunks(student_hidden, options, n_tokens, vocab, select_rows):
        hidden_CH = _rows(student_hidden, rows).detach()
        n_chunk = hidden_CH.shape[0]
        logits_CV = mm_f32(hidden_CH, weight_VH.t(), workspace.get("student", n_chunk))
        if teacher.kind == "topk":
            logprobs_Ck, indices_Ck, tail_C = (None if t is None else _rows(t, rows) for t in teacher.topk)
            indices_Ck = indices_Ck.long()
            logp_CB = teacher_bucket_logprobs(logprobs_Ck, tail_C, options.inv_temp, vocab, cdtype)
            kl_C = topk_step(logits_CV, indices_Ck, logp_CB, step, workspace)
        else:
            owned = teacher.kind == "hidden"
            if owned:
                teacher_hidden_CH = _rows(teacher.hidden_NH, rows)
                teacher_CV = workspace.get("teacher", n_chunk)
                if compute_dtype(teacher_hidden_CH) == cdtype:
                    mm_f32(teacher_hidden_CH, teacher.weight_VH.t(), teacher_CV)
                else:
                    # a teacher of another precision than the student's: its own product, then one copy
                    logits = torch.empty(n_chunk, vocab, dtype=compute_dtype(teacher_hidden_CH), device=device)
                    teacher_CV.copy_(mm_f32(teacher_hidden_CH, teacher.weight_VH.t(), logits))
            elif teacher_CV.dtype != cdtype:
                teacher_CV = workspace.get("teacher", n_chunk).copy_(teacher_CV)
                owned = True
            kl_C = dense_step(logits_CV, teacher_CV, owned, step, workspace)
        keep_C = None if mask is None or select_rows else _rows(mask, rows).to(cdtype)
        loss += (kl_C.sum() if keep_C is None else kl_C @ keep_C) * scale
        if need_grad:
            if keep_C is not None:
                logits_CV.mul_(keep_C.unsqueeze(1))
            # logits_CV now holds d(loss)/d(logits) / alpha for these rows: the products' operands
            parts = [logits_CV] if low is None else split_operands(
                logits_CV, low, options.precision, workspace.get("split", n_chunk))
            _gradient_products(parts, rows, weight_VH, hidden_CH, grad_hidden_NH, grad_weight_VH, alpha)
        del logits_CV, teacher_CV
    if n_valid_dev is not None and options.reduction == "mean":
        loss /= n_valid_dev
        for g in (grad_hidden_NH, grad_weight_VH):
            if g is not None:
                g.div_(n_valid_dev)
    return loss, _cast(grad_hidden_NH, student_hidden), _cast(grad_weight_VH, student_weight)


def _gradient_products(parts: list[torch.Tensor], rows: slice | torch.Tensor, weight_VH: torch.Tensor,
                       hidden_CH: torch.Tensor, grad_hidden_NH: torch.Tensor | None,
                       grad_weight_VH: torch.Tensor | None, alpha: float) -> None:
    """grad_h[rows] = alpha * sum(parts) @ W and grad_W += alpha * sum(parts)^T h, one product per part (the
    gradient [C, V], or its hi and lo halves), summed in the fp32 accumulators."""
    if grad_hidden_NH is not None:
        direct = isinstance(rows, slice)
        out_CH = grad_hidden_NH[rows] if direct else grad_hidden_NH.new_empty(parts[0].shape[0], weight_VH.shape[1])
        for i, part_CV in enumerate(parts):
            mm_f32(part_CV, weight_VH, out_CH, accumulate=i > 0, alpha=alpha)
        if not direct:
            grad_hidden_NH.index_copy_(0, rows, out_CH)
    if grad_weight_VH is not None:
        for part_CV in parts:
            mm_f32(part_CV.t(), hidden_CH, grad_weight_VH, accumulate=True, alpha=alpha)


def _cast(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else grad.to(like.dtype)


def _chunks(
    student_hidden: torch.Tensor, options: _Options, n_tokens: int, vocab: int, select_rows: bool = True
) -> Iterator[tuple[slice | torch.Tensor, torch.Tensor | None]]:
    """Yield (rows, streamed teacher logits or None): rows is a slice, or an index tensor under a mask.

    Without `select_rows` every row comes as a slice (the caller zeroes the masked ones): no host read."""
    size = options.chunk_size
    mask = options.mask if select_rows else None
    if options.teacher.kind == "logits_fn":
        # The callback is defined on contiguous row ranges of the original order: chunk those, then
        # drop masked rows inside each chunk.
        for i in range(0, n_tokens, size):
            j = min(i + size, n_tokens)
            if mask is not None and not bool(mask[i:j].any()):
                continue
            logits = options.teacher.logits_fn(i, j)
            logits_CV = check_teacher_logits("fused_linear_kl_div", logits, i, j, vocab).detach()
            if not select_rows:
                logits_CV = logits_CV.clamp(min=-1e30)
            elif bool(torch.isneginf(logits_CV.amin())):
                # Banned ids: a finite, hugely negative logit has the same zero probability and keeps
                # 0 * -inf out of the arithmetic.
                logits_CV = logits_CV.clamp(min=-1e30)
            if mask is None or bool(mask[i:j].all()):
                yield slice(i, j), logits_CV
            else:
                keep = mask[i:j].nonzero().squeeze(1)
                yield keep + i, logits_CV.index_select(0, keep)
        return
    if mask is None or bool(mask.all()):
        for i in range(0, n_tokens, size):
            yield slice(i, min(i + size, n_tokens)), None
        return
    valid = mask.nonzero().squeeze(1)
    for a in range(0, valid.numel(), size):
        yield valid[a : a + size], None


def _chunk_steps(use_triton: bool) -> tuple[DenseStep, TopkStep]:
    if use_triton:
        from hylo.kernels.fused_kl.triton_kernel import dense_kl_step, topk_kl_step  # optional: triton

        return dense_kl_step, topk_kl_step
    return dense_kl_step_torch, topk_kl_step_torch
