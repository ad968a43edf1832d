"""Teacher targets of a token range (a sequence-parallel rank's tokens [start, end) of every row), from every
source: the ranges' targets, concatenated, are the unsplit rows' targets, and a bad range is refused naming
the row and the range.

No Ray: the pool's client talks to the real replica class (`TeacherDeployment`), instantiated in this process
behind a handle that calls its methods (its token budget of 1 sends every row around Serve's batcher).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.pipeline.data.rows import check_row
from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec

from tests.helpers import teacher as teacher_helpers
from tests.helpers.teacher import make_packed_row, save_tiny_llama, write_packed_parquet

VOCAB = 96
K = 8
T = 24
# documents cross every range boundary of the 2- and 4-part splits; the last row ends in padding
DOCS = [([5, 11, 8], 0), ([24], 0), ([7, 9, 5], 3)]
SPLITS = [2, 4]
CHUNK = 5  # logits chunks that do not line up with the ranges


def _ranges(parts: int) -> list[tuple[int, int]]:
    """The token ranges of the ranks of a sequence-parallel group of `parts`."""
    from hylo.seq_parallel import shard_range

    return [shard_range(T, rank, parts) for rank in range(parts)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from hylo.pipeline.teacher.model import TeacherModel

    d = tmp_path_factory.mktemp("ranges")
    model_dir = save_tiny_llama(d / "model", vocab_size=VOCAB)
    raw = [make_packed_row(docs, VOCAB, seed=40 + i, pad=pad) for i, (docs, pad) in enumerate(DOCS)]
    write_packed_parquet(d / "data" / "part-0.parquet", raw)
    rows = [check_row(r) for r in raw]
    assert {r.num_tokens for r in rows} == {T}
    return {"dir": d, "model_dir": model_dir, "rows": rows,
            "model": TeacherModel(model_dir, logits_chunk_tokens=CHUNK)}


# ------------------------------------------------------------------------------ comparing targets
def _pull(t: dict, n: int) -> dict:
    """One row's targets with a stream read out: the logits [n, V] pulled in three increasing calls."""
    if "teacher_logits_fn" not in t:
        return t
    fn, cuts = t["teacher_logits_fn"], [0, n // 3, 2 * n // 3 + 1, n]
    return {"logits": torch.cat([fn(i, j) for i, j in zip(cuts[:-1], cuts[1:])])}


def _cat(parts: list[dict]) -> dict:
    first = parts[0]
    if "teacher_topk" in first:
        return {"teacher_topk": TeacherTopK(*(torch.cat(x) for x in zip(*(p["teacher_topk"] for p in parts))))}
    if "teacher_hidden" in first:
        assert all(p["teacher_weight"] is first["teacher_weight"] for p in parts)
        return {"teacher_hidden": torch.cat([p["teacher_hidden"] for p in parts]),
                "teacher_weight": first["teacher_weight"]}
    return {"logits": torch.cat([p["logits"] for p in parts])}


def _assert_same(got: dict, want: dict, exact: bool) -> None:
    """`exact`: bit for bit (a storage round trip); else within float tolerance (the lm_head of a range is
    another matrix shape than the row's: the last bits may differ)."""
    def close(a, b, rtol, atol):
        if exact:
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)

    assert got.keys() == want.keys()
    if "teacher_topk" in want:
        g, w = got["teacher_topk"], want["teacher_topk"]
        assert g.logprobs.shape == w.logprobs.shape and g.indices.dtype == torch.int32
        assert torch.equal(g.indices, w.indices)
        close(g.logprobs, w.logprobs, 2.0 ** -9, 1e-3)
        close(g.tail_logmass, w.tail_logmass, 1e-5, 1e-5)
    elif "teacher_hidden" in want:
        close(got["teacher_hidden"], want["teacher_hidden"], 1e-6, 1e-6)
        assert got["teacher_weight"] is want["teacher_weight"]
    else:
        close(got["logits"], want["logits"], 1e-5, 1e-5)


def _check_split(teacher: BoundTeacher, rows, exact: bool) -> None:
    """For 2 and 4 parts: the ranges' targets of every row, concatenated, are its unsplit targets."""
    whole = [_pull(t, r.num_tokens) for r, t in zip(rows, teacher.targets(rows, "cpu"))]
    for parts in SPLITS:
        per_range = []
        for s, e in _ranges(parts):
            got = [_pull(t, e - s) for t in teacher.targets(rows, "cpu", token_range=(s, e))]
            assert len(got) == len(rows)
            per_range.append(got)
        for i, w in enumerate(whole):
            _assert_same(_cat([per_range[p][i] for p in range(parts)]), w, exact)


BAD = [((0, 0), "does not fit row 0"), ((9, 3), "does not fit row 0"), ((-1, 6), "does not fit row 0"),
       ((0, T + 1), "does not fit row 0"), ((6,), "must be two integers"), ((0.0, 6), "must be two integers"),
       ((True, 6), "must be two integers")]


def _assert_refused(targets, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        next(iter(targets))


def _bad_range_refused(targets_of) -> None:
    """Every bad range is one ValueError naming the range and the row (its index, row_id and T)."""
    for rng, why in BAD:
        _assert_refused(targets_of(rng), why)
    rows = targets_of.rows
    _assert_refused(targets_of((0, T + 1)),
                    rf"token_range \(0, {T + 1}\) does not fit row 0 \(row_id {rows[0].row_id}, {T} tokens\): "
                    rf"it needs 0 <= start < end <= {T}")
    # a range must fit every row of the step: a shorter second row is named
    short = check_row(make_packed_row([4, 6], VOCAB, seed=7))
    _assert_refused(targets_of((4, 12), [rows[0], short]), rf"does not fit row 1 \(row_id {short.row_id}, 10 tokens\)")


class _TargetsOf:
    def __init__(self, teacher, rows) -> None:
        self.teacher, self.rows = teacher, rows

    def __call__(self, rng, rows=None):
        return self.teacher.targets(rows or self.rows, "cpu", token_range=rng)


# ------------------------------------------------------------------------------ in-process
FORMS = [TargetSpec(K, "topk"), TargetSpec(0, "hidden"), TargetSpec(0, "logits")]


@pytest.mark.parametrize("spec", FORMS, ids=lambda s: s.form)
def test_inprocess_range_targets_concatenate_to_the_rows(env, spec):
    teacher = BoundTeacher(env["model"], spec, VOCAB)
    _check_split(teacher, env["rows"], exact=False)
    _bad_range_refused(_TargetsOf(teacher, env["rows"]))


def test_inprocess_range_holds_only_its_tokens(env):
    """The whole row's forward runs (a token needs its prefix), what is kept is the range's: the hidden states
    are a copy of the range's, not a view holding the row's [T, H]."""
    (t,) = BoundTeacher(env["model"], TargetSpec(0, "hidden")).targets(env["rows"][:1], "cpu", (6, 12))
    h = t["teacher_hidden"]
    assert h.shape == (6, env["model"].hidden_size)
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()


class _WholeRowsOnly:
    """A source whose `targets` knows no token range (one registered from outside, written before ranges)."""

    def __init__(self, model) -> None:
        self.model = model

    def targets(self, rows, spec):
        return self.model.targets(rows, spec)


@pytest.mark.parametrize("spec", FORMS, ids=lambda s: s.form)
def test_a_source_without_ranges_is_cut_by_the_bound_teacher(env, spec):
    teacher = BoundTeacher(_WholeRowsOnly(env["model"]), spec, VOCAB)
    _check_split(teacher, env["rows"], exact=False)
    # the cut of its whole-row targets is the range form of the in-process source
    ranged = BoundTeacher(env["model"], spec, VOCAB)
    for got, want in zip(teacher.targets(env["rows"], "cpu", (5, 17)), ranged.targets(env["rows"], "cpu", (5, 17))):
        _assert_same(_pull(got, 12), _pull(want, 12), exact=False)
    _bad_range_refused(_TargetsOf(teacher, env["rows"]))


# ------------------------------------------------------------------------------ offline cache
@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def cache(env, request):
    from hylo.pipeline.teacher.cache import compute_shard, finalize_cache, prepare_cache
    from hylo.pipeline.teacher.config import CacheTeacherSection, TeacherCacheConfig, TeacherModelConfig

    cfg = TeacherCacheConfig(data=str(env["dir"] / "data"), out=str(env["dir"] / f"cache-{request.param}"),
                             rows_per_shard=2, dtype=request.param,
                             teacher=CacheTeacherSection(k=K, model=TeacherModelConfig(path=str(env["model_dir"]))))
    header, plan, todo = prepare_cache(cfg)
    for p in todo:
        compute_shard(env["model"], cfg.data, cfg.out, header, p)
    assert finalize_cache(cfg.out, plan)
    return cfg


def _offline(cfg):
    from hylo.pipeline.teacher.sources import open_teacher
    from hylo.pipeline.train.config import TeacherSection

    return open_teacher(TeacherSection(source="offline", k=K, cache_path=cfg.out), VOCAB, cfg.data)


def test_offline_range_records_are_the_stored_rows_bit_for_bit(env, cache):
    teacher = _offline(cache)
    _check_split(teacher, env["rows"], exact=True)
    _bad_range_refused(_TargetsOf(teacher, env["rows"]))


def test_offline_range_converts_only_the_ranges_bytes(env, cache):
    """What a range returns owns the range's records alone (not views into the whole row's decoded values)."""
    (t,) = _offline(cache).targets(env["rows"][1:2], "cpu", token_range=(18, 24))
    rec = t["teacher_topk"]
    assert rec.logprobs.shape == (6, K) and rec.indices.shape == (6, K) and rec.tail_logmass.shape == (6,)
    for x in rec:
        assert x.untyped_storage().nbytes() == x.numel() * x.element_size()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "uint16", "int32"])
def test_stored_bytes_of_a_range_are_those_rows_of_the_tensor(dtype):
    from hylo.pipeline.teacher.cache import _from_bytes, _to_bytes

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 60000, (11, 3), generator=g) if dtype in ("uint16", "int32") \
        else torch.randn(11, 3, generator=g).to(torch.bfloat16 if dtype == "bfloat16" else getattr(torch, dtype))
    b = _to_bytes(x, dtype)
    whole = _from_bytes(b, dtype, (11, 3))
    for s, e in [(0, 11), (0, 1), (4, 9), (10, 11)]:
        part = _from_bytes(b, dtype, (11, 3), (s, e))
        assert part.dtype == whole.dtype and torch.equal(part, whole[s:e])


# ------------------------------------------------------------------------------ Serve pool (no Ray)
@pytest.fixture(scope="module")
def replica(env):
    return teacher_helpers.local_replica(env["model_dir"], CHUNK)


def _client(replica):
    from hylo.pipeline.teacher.client import TeacherClient

    handle = teacher_helpers.LocalHandle(replica)
    return TeacherClient(handle, chunk_tokens=CHUNK, window_chunks=2, dtype="float32", retry_backoff_s=0), handle


@pytest.mark.parametrize("spec", FORMS, ids=lambda s: s.form)
def test_pool_range_targets_concatenate_to_the_rows(env, replica, spec):
    client, handle = _client(replica)
    if spec.form == "hidden":
        from hylo.pipeline.teacher.head import load_head

        client.head = load_head(env["model_dir"], torch.float32)
    teacher = BoundTeacher(client, spec)
    _check_split(teacher, env["rows"], exact=False)
    _bad_range_refused(_TargetsOf(teacher, env["rows"]))


def test_pool_requests_carry_the_range_and_answers_only_the_ranges_tokens(env, replica):
    rows = env["rows"]
    client, handle = _client(replica)
    # without a range: the protocol before ranges, whole rows back
    list(client.targets(rows, TargetSpec(K, "topk")))
    assert [r[1:] for r in handle.requests] == [((K, "float32"), {})] * len(rows)
    assert handle.tokens_back == [T] * len(rows)
    handle.requests.clear(), handle.tokens_back.clear()
    list(client.targets(rows, TargetSpec(K, "topk"), token_range=(6, 12)))
    assert [r[1:] for r in handle.requests] == [((K, "float32"), {"token_range": (6, 12)})] * len(rows)
    assert handle.tokens_back == [6] * len(rows)
    # a stream of tokens 7..20: windows of 2 chunks of 5 from token 7 on, 13 tokens back in all
    handle.requests.clear(), handle.tokens_back.clear()
    (t,) = client.targets(rows[:1], TargetSpec(0, "logits"), token_range=(7, 20))
    t["teacher_logits_fn"](0, 13)
    assert [r[1][1:3] for r in handle.requests] == [(7, 17), (17, 20)]
    assert sum(handle.tokens_back) == 13


@pytest.mark.parametrize("rng,match", [((0, T + 1), rf"token_range \(0, {T + 1}\) does not fit row 0"),
                                       ((12, 12), r"token_range \(12, 12\) does not fit row 0"),
                                       (("a", 3), r"token_range=\('a', 3\) must be two integers")],
                         ids=["past-end", "empty", "not-ints"])
def test_the_replica_checks_the_range_it_receives(env, replica, rng, match):
    """A request from any client: the replica refuses a bad range in one line naming it and the row."""
    row = env["rows"][0]
    with pytest.raises(ValueError, match=r"teacher replica: request: " + match):
        asyncio.run(replica.topk([row], K, "float32", token_range=rng))
    if not isinstance(rng[0], str):
        s, e = rng

        async def drain():
            return [c async for c in replica.stream(row, CHUNK, s, e)]

        with pytest.raises(ValueError, match=r"teacher replica: stream: " + match):
            asyncio.run(drain())
    # and still answers a request without a range (the protocol before ranges) with whole rows
    (out,) = asyncio.run(replica.topk(row, K, "float32"))
    assert out["logprobs"].shape == (T, K)
