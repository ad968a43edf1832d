from kernels.fused_kl.topk import TeacherTopK, tail_logmass_from_topk, topk_from_logits

__all__ = ["TeacherTopK", "tail_logmass_from_topk", "topk_from_logits"]
