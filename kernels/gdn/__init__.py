"""Gated DeltaNet ops: `chunk_gated_delta_rule` (fla on GPU, chunked WY torch path on CPU), the decode step
`recurrent_gated_delta_rule` (fla's recurrent kernel on GPU, a torch loop on CPU) and the step-by-step
reference `naive_recurrent_gated_delta_rule`. Math in README.md beside this file."""

from hylo.kernels.gdn.checks import GatedDeltaRuleInputError
from hylo.kernels.gdn.chunk import chunk_gated_delta_rule, torch_chunk_gated_delta_rule
from hylo.kernels.gdn.naive import naive_recurrent_gated_delta_rule
from hylo.kernels.gdn.recurrent import recurrent_gated_delta_rule, torch_recurrent_gated_delta_rule

__all__ = [
    "GatedDeltaRuleInputError",
    "chunk_gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
]
