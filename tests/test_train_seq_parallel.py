"""Sequence parallelism in training (`train.sequence_parallel: N`, issue 36): the config rules, the rows each
group reads and the data position that makes a checkpoint independent of N, and (gloo, one process per rank)
each stage's loss and every parameter's gradient over a split row against the unsplit row's.

Legend: W workers, N the sequence-parallel size, D = W / N data-parallel ranks (groups), B the global batch
in rows, G = B / D rows per rank per step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.reader import RowReader
from hylo.pipeline.train.config import breaking_diff, breaking_hash, config_to_dict, load_stage_config
from hylo.pipeline.train.deepspeed_cfg import build_deepspeed_config
from hylo.pipeline.train.row_sources import open_rows, resume_position


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("sets,needle", [
    (["ray.num_workers=4", "train.sequence_parallel=3"],
     "train.sequence_parallel=3: must divide ray.num_workers (4)"),
    (["ray.num_workers=4", "train.sequence_parallel=4", "data.seq_len=50"],
     "train.sequence_parallel=4: must divide data.seq_len (50)"),
    (["ray.num_workers=4", "train.sequence_parallel=0"], "train.sequence_parallel=0"),
    (["ray.num_workers=4", "train.sequence_parallel=2", "train.global_batch_sequences=3"],
     "train.global_batch_sequences=3: must be a multiple of ray.num_workers / train.sequence_parallel (2)"),
], ids=["workers", "seq_len", "zero", "batch"])
def test_a_sequence_parallel_size_that_does_not_divide_is_refused_naming_the_setting(sets, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        load_stage_config(2, None, sets)


def test_the_groups_share_their_rows_and_deepspeed_sees_every_worker():
    cfg = load_stage_config(2, None, ["ray.num_workers=4", "train.sequence_parallel=2", "data.seq_len=64",
                                      "train.global_batch_sequences=6"])
    # 2 groups of 2 workers: 3 rows per group (and per worker of it) per step
    assert cfg.data_parallel == 2 and cfg.grad_accum == 3
    ds = build_deepspeed_config(cfg, world_size=4, dtype=torch.float32)
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_batch_size"] == 3 * 4
    # N = W: one group, every worker reads every row of the batch
    one = load_stage_config(1, None, ["ray.num_workers=4", "train.sequence_parallel=4", "train.global_batch_sequences=1"])
    assert one.data_parallel == 1 and one.grad_accum == 1
    # N = 1: as before (a multiple of the workers, G = B / W)
    assert load_stage_config(2, None, ["ray.num_workers=4", "train.global_batch_sequences=8"]).grad_accum == 2


def test_sequence_parallel_may_change_on_resume_the_workers_may_not():
    a = load_stage_config(2, None, ["ray.num_workers=4", "train.sequence_parallel=4", "train.global_batch_sequences=4"])
    b = load_stage_config(2, None, ["ray.num_workers=4", "train.sequence_parallel=1", "train.global_batch_sequences=4"])
    assert breaking_diff(config_to_dict(a), config_to_dict(b)) == []
    assert breaking_hash(a) == breaking_hash(b)
    c = load_stage_config(2, None, ["ray.num_workers=2", "train.sequence_parallel=1", "train.global_batch_sequences=4"])
    assert any(d.startswith("ray.num_workers") for d in breaking_diff(config_to_dict(a), config_to_dict(c)))


# ------------------------------------------------------------------------------------ rows and positions
class _Rows:
    """A row source of `n` rows whose row g is just its index (what the reader's striding decides)."""

    max_len = None
    max_len_from = None
    fingerprint = "test"

    def __init__(self, n: int) -> None:
        self.num_rows = n

    def raw(self, g: int) -> dict[str, Any]:
        return {"input_ids": [g, g], "cu_seqlens": [0, 2], "position_ids": [0, 1], "loss_mask": [1, 0],
                "row_key": f"r{g}"}

    def where(self, g: int) -> str:
        return f"row {g}"


def _readers(n_rows: int, workers: int, sp: int, positions: list[int] | None = None) -> list[RowReader]:
    """The reader of each worker (the workers of a group share their group's reader's rows)."""
    dp = workers // sp
    out = []
    for rank in range(workers):
        # what loop.train_worker opens for a parquet split (drop_to: the pass of the W workers)
        r = RowReader(_Rows(n_rows), rank // sp, dp, drop_to=workers)
        if positions is not None:
            r.seek(positions[rank])
        out.append(r)
    return out


def _step_rows(readers: list[RowReader], sp: int, batch: int) -> tuple[list[str], list[list[str]]]:
    """One step: the sorted keys the run trained on (each group's rows once), and each worker's keys."""
    per_worker = [[r.next_row().key for _ in range(batch // (len(readers) // sp))] for r in readers]
    for g in range(0, len(readers), sp):
        assert all(per_worker[g + i] == per_worker[g] for i in range(sp)), "a group's workers read other rows"
    return sorted(k for g in range(0, len(readers), sp) for k in per_worker[g]), per_worker


@pytest.mark.parametrize("saved_sp,resumed_sp", [(4, 2), (4, 1), (1, 4), (2, 1)])
def test_a_run_saved_at_one_size_reads_the_same_rows_in_the_same_steps_at_another(saved_sp, resumed_sp):
    """22 rows, W = 4, B = 4: the pass is 20 rows at every N (cut by the workers, not the groups), and steps 4 to
    6 run into the second pass. A run that saved at step 3 with N = saved_sp and resumes with N = resumed_sp
    trains steps 4 to 6 on exactly the rows an uninterrupted run at N = resumed_sp (or saved_sp) does."""
    W, B, rows = 4, 4, 22
    uninterrupted = _readers(rows, W, resumed_sp)
    want = [_step_rows(uninterrupted, resumed_sp, B)[0] for _ in range(6)]
    other = _readers(rows, W, saved_sp)
    assert [_step_rows(other, saved_sp, B)[0] for _ in range(6)] == want
    saving = _readers(rows, W, saved_sp)
    for _ in range(3):
        _step_rows(saving, saved_sp, B)
    # what each rank's checkpoint holds (rows.state()), read back by the same rank at the new size
    states = [r.state() for r in saving]
    resumed = _readers(rows, W, resumed_sp, [resume_position(states[rank], W // resumed_sp) for rank in range(W)])
    assert [_step_rows(resumed, resumed_sp, B)[0] for _ in range(3)] == want[3:]
    assert all(r.global_rows == 20 for r in resumed + saving)


def test_a_checkpoint_of_before_sequence_parallelism_resumes_at_its_position():
    # a state written before this change: position and world_size of the W workers' readers
    assert resume_position({"position": 6, "rank": 1, "world_size": 4, "num_rows": 8}, 4) == 6
    assert resume_position({"position": 6, "rank": 1, "world_size": 4, "num_rows": 8}, 2) == 12
    with pytest.raises(ValueError, match="does not divide over 4"):
        resume_position({"position": 3, "world_size": 2}, 4)


def test_synthetic_rows_are_read_by_group():
    from hylo.pipeline.train.config import DataSection, SyntheticData

    data = DataSection(source="synthetic", seq_len=16, synthetic=SyntheticData(rows=6, vocab_size=20,
                                                                               min_doc_len=2, max_doc_len=8))
    # W = 4, N = 2: groups 0 and 1 stride over the rows as two workers did
    keys = {dp: [open_rows(data, 0, dp, 2, workers=4).next_row().key for _ in range(1)] for dp in range(2)}
    assert keys == {0: ["syn-0"], 1: ["syn-1"]}
