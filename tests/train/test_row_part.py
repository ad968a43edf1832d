"""The step's row part (`loop.row_part`): each row cut once, in the loop, into this rank's tokens.

At train.sequence_parallel = 1 the part is the whole row and no code of the split path runs; at N > 1 the
parts of a group cover the row once, so every token is counted by exactly one rank. In-process, no group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hylo.pipeline.data.rows import check_row
from hylo.pipeline.train import loop
from hylo.pipeline.train.config import Stage2Config
from hylo.pipeline.train.worker import SoloContext


def _row():
    """24 tokens: two real documents and the packer's padding document (doc id "")."""
    cu = [0, 7, 18, 24]
    mask = torch.zeros(24, dtype=torch.bool)
    mask[2:6] = True
    mask[9:17] = True
    return check_row({"input_ids": torch.arange(24) % 11, "cu_seqlens": cu, "loss_mask": mask,
                      "doc_ids": ["a", "b", ""]})


def _ctx(n: int, rank: int = 0) -> SoloContext:
    return SoloContext(cfg=Stage2Config(), rank=rank, world_size=n, device=torch.device("cpu"),
                       dtype=torch.float32, run_dir=Path("."), grad_accum=1, sp_rank=rank, sequence_parallel=n)


def test_a_whole_row_part_runs_no_code_of_the_split_path(monkeypatch):
    def split(*args, **kwargs):
        raise AssertionError("the split path ran at train.sequence_parallel = 1")

    monkeypatch.setattr(loop, "shard_row", split)
    row = _row()
    part = loop.row_part(row, _ctx(1))
    assert (part.start, part.end, part.shard, part.token_range) == (0, 24, None, None)
    # the row's own host-checked boundaries and positions, its own counts
    assert part.bounds.host is row.host and torch.equal(part.positions, row.position_ids)
    assert part.loss_tokens == row.loss_tokens == 12
    assert part.real_tokens == row.real_token_count() == 18


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_parts_of_a_split_row_count_every_token_once(n):
    row = _row()
    parts = [loop.row_part(row, _ctx(n, r)) for r in range(n)]
    assert [(p.start, p.end) for p in parts] == [(r * 24 // n, (r + 1) * 24 // n) for r in range(n)]
    for p in parts:
        assert p.token_range == (p.start, p.end) and p.shard is not None and p.bounds is p.shard.local
        assert torch.equal(p.positions, row.position_ids[p.start:p.end])
        assert p.real_tokens == int(row.real_tokens()[p.start:p.end].sum())
        assert p.loss_tokens == int(row.loss_mask[p.start:p.end].sum())
    assert sum(p.real_tokens for p in parts) == row.real_token_count()
    assert sum(p.loss_tokens for p in parts) == row.loss_tokens
