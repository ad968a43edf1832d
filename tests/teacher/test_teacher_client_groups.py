"""The Serve pool under sequence parallelism: a group of N ranks asks for each row ONCE, and each rank gets the
targets of its own tokens.

* The replica (no Ray: the real `TeacherDeployment` built in this process): one request with the group's
  `ranges` runs one forward of the row and answers every range, bit for bit what a request of each range gives.
* Slow (gloo ranks, spawned): `TeacherClient.targets(..., shards=)` at N = 2 and 4, top-k and streamed logits,
  rows whose documents cross the splits. Each rank's targets are the unsplit row's cut to its range, the
  replicas ran one forward per row per group (N with the range requests of before), a rank whose loss reads
  fewer chunks does not stall the group, and a row its owner cannot get fails on every rank.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from hylo.pipeline.data.rows import check_row
from hylo.seq_parallel import shard_range

from tests.helpers import teacher as teacher_helpers
from tests.helpers.teacher import make_packed_row, save_tiny_llama

VOCAB = 96
K = 8
T = 24
CHUNK = 5  # chunks that do not line up with the ranges
# documents cross every split of 2 and 4; the last row ends in padding
DOCS = [([5, 11, 8], 0), ([24], 0), ([7, 9, 5], 3)]


def _rows() -> list:
    return [check_row(make_packed_row(docs, VOCAB, seed=40 + i, pad=pad)) for i, (docs, pad) in enumerate(DOCS)]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return teacher_helpers.local_replica(save_tiny_llama(tmp_path_factory.mktemp("groups") / "model", VOCAB), CHUNK)


def _ranges(n: int) -> list[tuple[int, int]]:
    return [shard_range(T, r, n) for r in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_one_request_answers_every_range_of_a_group_from_one_forward(replica, n):
    rows = _rows()
    seen = replica.rows_seen
    grouped = asyncio.run(replica.topk(rows, K, "float32", ranges=_ranges(n)))
    assert replica.rows_seen - seen == len(rows)
    seen = replica.rows_seen
    each = [asyncio.run(replica.topk(rows, K, "float32", token_range=r)) for r in _ranges(n)]
    assert replica.rows_seen - seen == n * len(rows)
    assert len(grouped) == len(rows) and all(len(g) == n for g in grouped)
    for i in range(len(rows)):
        for r in range(n):
            for name in ("logprobs", "indices", "tail_logmass"):
                assert torch.equal(grouped[i][r][name], each[r][i][name]), (i, r, name)


async def _drain(agen) -> list[torch.Tensor]:
    return [c async for c in agen]


@pytest.mark.parametrize("n", [2, 4])
def test_a_stream_of_a_groups_ranges_is_chunk_j_of_every_range_in_turn(replica, n):
    row, ranges = _rows()[2], _ranges(n)
    t = T // n
    seen = replica.rows_seen
    got = asyncio.run(_drain(replica.stream(row, CHUNK, 0, None, "float32", ranges=ranges)))
    assert replica.rows_seen - seen == 1
    want = [asyncio.run(_drain(replica.stream(row, CHUNK, s, e, "float32"))) for s, e in ranges]
    chunks = -(-t // CHUNK)
    assert len(got) == n * chunks
    for j in range(chunks):
        for r in range(n):
            assert torch.equal(got[j * n + r], want[r][j]), (j, r)
    # a window of offsets [CHUNK, t) of every range
    if t > CHUNK:
        part = asyncio.run(_drain(replica.stream(row, CHUNK, CHUNK, t, "float32", ranges=ranges)))
        assert [torch.equal(a, b) for a, b in zip(part, got[n:])] == [True] * (len(got) - n)


@pytest.mark.parametrize("ranges,match", [
    ([], r"ranges=\[\] must be a non-empty list"),
    ([(0, 12), (12, 25)], r"token_range \(12, 25\) does not fit row 0"),
    ("0,12", r"ranges='0,12' must be a non-empty list"),
], ids=["empty", "past-end", "not-a-list"])
def test_the_replica_checks_a_groups_ranges(replica, ranges, match):
    row = _rows()[0]
    with pytest.raises(ValueError, match=r"teacher replica: request: " + match):
        asyncio.run(replica.topk([row], K, "float32", ranges=ranges))
    with pytest.raises(ValueError, match=r"teacher replica: stream: " + match):
        asyncio.run(_drain(replica.stream(row, CHUNK, ranges=ranges)))


def test_a_stream_needs_ranges_of_one_length_and_offsets_inside_them(replica):
    row = _rows()[0]
    with pytest.raises(ValueError, match=r"ranges \[\(0, 10\), \(10, 24\)\] must all be of one length"):
        asyncio.run(_drain(replica.stream(row, CHUNK, ranges=[(0, 10), (10, 24)])))
    with pytest.raises(ValueError, match=r"offsets \(0, 13\) do not fit ranges"):
        asyncio.run(_drain(replica.stream(row, CHUNK, 0, 13, ranges=_ranges(2))))
    with pytest.raises(ValueError, match=r"token_range=\(0, 12\) and ranges="):
        asyncio.run(replica.topk([row], K, "float32", token_range=(0, 12), ranges=_ranges(2)))


# ------------------------------------------------------------------------------ gloo ranks
def _read(t: dict, n: int, pulls: int = 3) -> dict:
    """One row's targets as tensors: top-k as is; a stream read in `pulls` increasing calls (0: not read)."""
    if "teacher_topk" in t:
        rec = t["teacher_topk"]
        return {"logprobs": rec.logprobs, "indices": rec.indices, "tail_logmass": rec.tail_logmass}
    if pulls == 0:
        return {}
    fn, cuts = t["teacher_logits_fn"], [round(n * q / pulls) for q in range(pulls + 1)]
    return {"logits": torch.cat([fn(i, j) for i, j in zip(cuts[:-1], cuts[1:]) if j > i])}


def _digest(rec: dict) -> str:
    import hashlib

    return hashlib.sha256(b"".join(rec[k].contiguous().view(torch.uint8).numpy().tobytes()
                                   for k in ("logprobs", "indices", "tail_logmass"))).hexdigest()


def _group_rank(rank: int, world: int, model_dir: str) -> dict:
    """One rank of `world` = 4: for each group size n in (2, 4) (groups of ranks [g n, (g + 1) n), side by side
    at n = 2), its targets of every row with shards, against the unsplit rows' cut to its range and the range
    requests of before, and the forwards its replica ran for each."""
    import torch.distributed as dist

    from hylo.seq_parallel import shard_row

    out = {}
    for n in SIZES:
        # every rank creates every group, in the same order
        groups = [dist.new_group(list(range(g * n, (g + 1) * n))) for g in range(world // n)]
        out[str(n)] = _in_group(rank % n, n, groups[rank // n], model_dir, shard_row)
    return out


def _in_group(rank: int, n: int, group, model_dir: str, shard_row) -> dict:
    import torch.distributed as dist

    from hylo.pipeline.teacher.client import TeacherClient, TeacherUnavailableError
    from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec

    rows = _rows()
    replica = teacher_helpers.local_replica(model_dir, CHUNK)
    handle = teacher_helpers.LocalHandle(replica)
    # one window per range (a replica built in a test has no stream sessions: each window is a forward)
    client = TeacherClient(handle, chunk_tokens=CHUNK, window_chunks=3, dtype="float32", retry_backoff_s=0,
                           max_inflight_rows=2)
    answered: list = []
    ask = handle.topk.remote

    def remote(row, *args, **kw):
        response = ask(row, *args, **kw)
        if "ranges" in kw:
            index, result = [r.row_id for r in rows + [row]].index(row.row_id), response.result

            def keep(timeout_s=None):
                out = result(timeout_s)
                answered.append((index, out[0]))
                return out

            response.result = keep
        return response

    handle.topk.remote = remote
    shards = [shard_row(r.bounds(), rank, n, group) for r in rows]
    s, e = shards[0].start, shards[0].end
    out: dict = {"range": [s, e], "forwards": {}, "worst": {}, "unequal": {}}
    for spec in (TargetSpec(K, "topk"), TargetSpec(0, "logits")):
        teacher = BoundTeacher(client, spec)
        seen = replica.rows_seen
        got = []
        for i, t in enumerate(teacher.targets(rows, "cpu", shards=shards)):
            # the last rank's loss reads none of the last row's chunks (its tokens all masked): nobody waits on it
            got.append(_read(t, e - s, 0 if (i == len(rows) - 1 and rank == n - 1) else 3))
            # the student's own collectives on the group, between one row's targets and the next
            dist.all_reduce(torch.ones(1), group=group)
        split = replica.rows_seen - seen
        seen = replica.rows_seen
        ranged = [_read(t, e - s) for t in teacher.targets(rows, "cpu", token_range=(s, e))]
        out["forwards"][spec.form] = [split, replica.rows_seen - seen]
        whole = [_read(t, T) for t in teacher.targets(rows, "cpu")]
        # against another forward of the row (the range request's, the unsplit row's): MKL may round the last
        # bit of a forward otherwise from one run to the next; the top-k indices are the same
        worst, unequal = 0.0, []
        for i, (g, r, w) in enumerate(zip(got, ranged, whole)):
            for name, x in g.items():
                for other, y in (("range request", r[name]), ("unsplit row", w[name][s:e])):
                    if x.dtype != y.dtype or x.shape != y.shape or name == "indices" and not torch.equal(x, y):
                        unequal.append(f"row {i} {name}: not the {other}'s")
                    elif name != "indices":
                        worst = max(worst, float((x - y).abs().max()))
        out["worst"][spec.form], out["unequal"][spec.form] = worst, unequal
        if spec.form == "topk":
            # what this rank got, and what its replica answered for every rank (the rows it asked for)
            out["got"] = [_digest(g) for g in got]
            out["answered"] = {str(i): [_digest({k: v for k, v in rec.items()}) for rec in recs]
                               for i, recs in answered}
    # a row the pool refuses (ids past the teacher's vocabulary): its owner raises the replica's error, the
    # others hear of it from the owner instead of waiting
    bad = [check_row(make_packed_row([T], VOCAB + 50, seed=5))]
    try:
        list(BoundTeacher(client, TargetSpec(K, "topk")).targets(bad, "cpu",
                                                                 shards=[shard_row(bad[0].bounds(), rank, n, group)]))
        out["bad"] = "no error"
    except (ValueError, TeacherUnavailableError) as err:
        out["bad"] = f"{type(err).__name__}: {err}"
    dist.barrier(group=group)
    return out


SIZES = (2, 4)


@pytest.mark.slow  # 4 spawned gloo ranks
def test_a_group_asks_the_pool_once_per_row_and_each_rank_gets_its_tokens(tmp_path):
    from tests.helpers.sp_group import run_ranks

    model_dir = save_tiny_llama(tmp_path / "model", VOCAB)
    world, rows = 4, len(DOCS)
    figures = run_ranks(functools.partial(_group_rank, model_dir=str(model_dir)), world, tmp_path)
    for n in SIZES:
        for g in range(world // n):
            ranks = [figures[r][str(n)] for r in range(g * n, (g + 1) * n)]
            print(f"N={n}, group {g}: forwards per form [with shards, with token ranges] by rank:",
                  [r["forwards"] for r in ranks])
            _check_group(ranks, n, rows)


def _check_group(ranks: list[dict], n: int, rows: int) -> None:
    assert [r["range"] for r in ranks] == [list(x) for x in _ranges(n)]
    for form in ("topk", "logits"):
        # one forward per row for the whole group (the replica of the rank that asked), N before
        assert sum(r["forwards"][form][0] for r in ranks) == rows, form
        assert sum(r["forwards"][form][1] for r in ranks) == n * rows, form
        assert [r["unequal"][form] for r in ranks] == [[]] * n, form
        assert max(r["worst"][form] for r in ranks) <= 1e-5, form
    # every rank's record is, byte for byte, what the replica of the rank that asked answered for its range
    for i in range(rows):
        assert [r["got"][i] for r in ranks] == ranks[i % n]["answered"][str(i)], i
    # the refused row: the group's 7th row with shards (3 top-k, 3 streamed before it), its owner rank 6 % N
    owner = (2 * rows) % n
    for rank, r in enumerate(ranks):
        if rank == owner:
            assert r["bad"].startswith("PackedRowError: teacher replica: request row 0"), r["bad"]
        else:
            assert r["bad"].startswith("TeacherUnavailableError: teacher row 0") and \
                f"rank {owner} of this sequence-parallel group" in r["bad"], r["bad"]
