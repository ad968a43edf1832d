from hylo.kernels.fused_kl.ce import fused_linear_cross_entropy
from hylo.kernels.fused_kl.chunked import auto_chunk_size, fused_linear_kl_div
from hylo.kernels.fused_kl.naive import naive_cross_entropy, naive_kl_div
from hylo.kernels.fused_kl.topk import TeacherTopK, tail_logmass_from_topk, topk_from_logits

__all__ = [
    "TeacherTopK",
    "auto_chunk_size",
    "fused_linear_cross_entropy",
    "fused_linear_kl_div",
    "naive_cross_entropy",
    "naive_kl_div",
    "tail_logmass_from_topk",
    "topk_from_logits",
]
