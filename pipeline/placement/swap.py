"""The swapped-layer KL: the all-linear student with one layer taken from the all-MLA student, run from that
layer's input only, scored against the base model's final hidden states (pure PyTorch, no Ray)."""

from __future__ import annotations

import torch
from torch import nn

from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.eval.kl import hidden_states, scored_tokens, sum_kl


@torch.no_grad()
def teacher_hidden(base: nn.Module, rows: list[PackedRow]) -> list[torch.Tensor]:
    """The base model's final hidden states on each row's scored tokens ([N, D] per row)."""
    return [hidden_states(base, r)[scored_tokens(r)] for r in rows]


@torch.no_grad()
def layer_inputs(model: nn.Module, row: PackedRow) -> list[torch.Tensor]:
    """The input [T, D] of every layer of a HyLo model on one packed row."""
    out = model.model(input_ids=row.input_ids[None], cu_seqlens=row.cu_seqlens, output_hidden_states=True)
    return [h[0] for h in out.hidden_states[:-1]]


@torch.no_grad()
def run_from(layers: list[nn.Module], norm: nn.Module, h_TD: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Final normed hidden states [T, D] from `h_TD` through `layers` (one packed row)."""
    h, pos = h_TD[None], row.position_ids[None]
    for layer in layers:
        h, _ = layer(h, pos, row.cu_seqlens, None)
    return norm(h)[0]


@torch.no_grad()
def swapped_kl(linear: nn.Module, mla: nn.Module, i: int | None, inputs: list[torch.Tensor], rows: list[PackedRow],
               teacher: list[torch.Tensor], teacher_weight: torch.Tensor) -> float:
    """KL per scored token of the all-linear student with layer i taken from the all-MLA student.

    inputs[r] is row r's input to layer i in the all-linear student (the embeddings when i is None, which
    scores the all-linear student itself); teacher[r] holds the base's final hidden states on row r's scored
    tokens and `teacher_weight` its output weights.
    """
    lin_layers = list(linear.model.layers)
    start = 0 if i is None else i
    layers = lin_layers[start:] if i is None else [mla.model.layers[i], *lin_layers[i + 1:]]
    ws = linear.get_output_embeddings().weight
    total = tokens = 0.0
    for r, h_TD, ht_ND in zip(rows, inputs, teacher):
        scored = scored_tokens(r)
        if scored.numel() == 0:
            continue
        hs_ND = run_from(layers, linear.model.norm, h_TD, r)[scored]
        total += sum_kl(hs_ND, ws, ht_ND, teacher_weight, chunk=None)
        tokens += scored.numel()
    return total / tokens
