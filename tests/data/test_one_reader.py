"""Every consumer of packed rows on disk reads them through the one reader (pipeline/data/reader.py): from
the same Parquet file, training, evaluation, placement and the teacher-cache job get identical `PackedRow`s
(the same tensors with the same dtypes, boundaries, ids and keys), each through its own entry point."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.data.shards import ShardWriter, write_manifest
from hylo.pipeline.eval.kl import iter_eval_rows
from hylo.pipeline.placement import load_rows
from hylo.pipeline.teacher.cache import SHARD_DIR, compute_shard, data_fingerprint, make_header, plan_shards
from hylo.pipeline.train.config import DataSection
from hylo.pipeline.train.row_sources import open_rows

from tests.helpers.teacher import make_packed_row

V = 96
N = 7
FIELDS = ("input_ids", "cu_seqlens", "position_ids", "loss_mask")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared split of one shard file: N rows in row groups of 3, some ending in a padding document."""
    d = tmp_path_factory.mktemp("one") / "stage2"
    rows = [make_packed_row([3 + i % 4, 5, 2 + i], V, seed=i, pad=i % 3) for i in range(N)]
    for i, r in enumerate(rows):
        if i % 3:
            r["doc_ids"][-1] = ""  # the packer's padding document
    w = ShardWriter(d, rows_per_shard=N, row_group_rows=3)
    for r in rows:
        w.add(r)
    shards = w.finish()
    assert len(shards) == 1
    write_manifest(d, {"split": "stage2", "max_len": 64, "config_hash": "c", "shards": shards})
    return d, rows


class _Recorder:
    """A teacher that keeps the rows the cache job hands it and answers with empty top-k records."""

    def __init__(self):
        self.rows: list[PackedRow] = []

    def topk_batch(self, rows, k, dtype):
        self.rows += rows
        return [TeacherTopK(torch.zeros(r.num_tokens, k), torch.zeros(r.num_tokens, k, dtype=torch.int32),
                            torch.zeros(r.num_tokens)) for r in rows]


def _same(a: PackedRow, b: PackedRow) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.doc_ids, a.given_id, a.host, a.key, a.epoch, a.row_id) == (b.doc_ids, b.given_id, b.host, b.key,
                                                                          b.epoch, b.row_id)


def test_training_eval_placement_and_the_cache_job_get_identical_rows(prepared, tmp_path):
    d, rows = prepared
    shard = d / "shard-00000.parquet"
    training = list(open_rows(DataSection(source="parquet", path=str(d), split="stage2"), 0, 0, 1))
    eval_dir = [r for _, r in iter_eval_rows(d)]
    eval_file = [r for _, r in iter_eval_rows(shard)]
    placement = load_rows(d, max_rows=N)
    teacher = _Recorder()
    (tmp_path / "cache" / SHARD_DIR).mkdir(parents=True)
    _, files, _ = data_fingerprint(d)
    header = make_header("t", "tok", 4, "float32", V, "fp", 3)
    for plan in plan_shards(files, 3):
        compute_shard(teacher, d, tmp_path / "cache", header, plan)
    for got in (training, eval_dir, eval_file, placement, teacher.rows):
        assert len(got) == N and all(isinstance(r, PackedRow) for r in got)
        for a, b in zip(training, got):
            _same(a, b)
    # ... and they are the rows that were written
    for r, want in zip(training, rows):
        np.testing.assert_array_equal(r.input_ids.numpy(), want["input_ids"])
        np.testing.assert_array_equal(r.loss_mask.numpy(), want["loss_mask"])
        assert list(r.doc_ids) == want["doc_ids"] and r.key is not None
    assert [r.key for r in training] == [str(g) for g in range(N)]
