"""The Serve teacher pool end to end on a local Ray: top-k, isolation, streams, batching, replica death.

One module-scoped Ray + Serve with a tiny random Llama and 2 replicas (starting it costs ~30-60 s on
this machine; every test after that takes about a second).
"""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
import torch

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from hylo.pipeline.data.rows import PackedRow, check_row  # noqa: E402
from hylo.pipeline.ray_init import ray_running  # noqa: E402
from hylo.pipeline.teacher.client import TeacherClient  # noqa: E402
from hylo.pipeline.teacher.config import TeacherFaultConfig, TeacherModelConfig, TeacherPoolConfig  # noqa: E402
from hylo.pipeline.teacher.serve import start_teacher_pool  # noqa: E402

from tests.helpers.cluster import LOOPBACK, listening_ports  # noqa: E402
from tests.helpers.common import assert_topk_matches  # noqa: E402
from tests.helpers.teacher import make_packed_row, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow
VOCAB = 96
BUDGET = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher")
    model_dir = save_tiny_llama(d / "model", vocab_size=VOCAB)
    marker = d / "kill-armed"
    pool_cfg = TeacherPoolConfig(app_name="teacher_test", num_replicas=2, num_cpus=0.5,
                                 max_batch_tokens=BUDGET, batch_wait_timeout_s=0.05, port=_free_port())
    with ray_running(None, 4, log_to_driver=False):
        try:
            handle = start_teacher_pool(TeacherModelConfig(path=str(model_dir)), pool_cfg,
                                        TeacherFaultConfig(kill_marker=str(marker), kill_at_row=2))
            from transformers import AutoModelForCausalLM

            ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            yield {"handle": handle, "ref": ref, "marker": marker, "cfg": pool_cfg, "model_dir": model_dir}
        finally:
            serve.shutdown()


@torch.no_grad()
def _ref_logits(ref, row) -> torch.Tensor:
    cu = row["cu_seqlens"].tolist()
    parts = [ref(input_ids=torch.as_tensor(row["input_ids"][s:e]).unsqueeze(0)).logits[0]
             for s, e in zip(cu[:-1], cu[1:])]
    return torch.cat(parts)


def _rows(n: int, seed: int) -> list[dict]:
    return [make_packed_row([3 + (i + seed) % 9, 5, 2 + i % 4], VOCAB, seed=seed * 100 + i, pad=i % 2)
            for i in range(n)]


def _checked(rows: list[dict]) -> list[PackedRow]:
    return [check_row(r) for r in rows]


def _check(ref, rows, records, k):
    assert len(records) == len(rows)
    for row, rec in zip(rows, records):
        # The pool batches rows: a different computation from the reference, so tolerances (near-ties
        # may swap) rather than torch.equal.
        dtype = str(rec.logprobs.dtype).removeprefix("torch.")
        assert_topk_matches(torch.log_softmax(_ref_logits(ref, row).float(), dim=-1), rec, k, dtype)


def test_pool_topk_equals_direct_forward_per_document(pool):
    rows = _rows(6, seed=1)
    client = TeacherClient(pool["handle"], max_inflight_rows=4, timeout_s=60)
    _check(pool["ref"], rows, client.topk_all(_checked(rows), 8), 8)


def test_the_pools_ports_are_on_the_loopback_but_ray_serves_own_replica_port(pool):
    """A local Ray's pool: its HTTP proxy (`teacher.pool.port`) and every Ray process listen on 127.0.0.1, except
    the one port Ray Serve 2.60 opens in each replica for calls between deployments, which it binds to "[::]:0"
    itself (ray/serve/_private/replica.py, no setting). docs/cluster.md says so; when Ray changes it, this
    fails and the docs change with it. (The Ray processes only: this long pytest process may hold an earlier
    test's leftover.)"""
    ports = listening_ports(itself=False)
    assert any(port == pool["cfg"].port and ip in LOOPBACK for ip, port, _ in ports), sorted(ports)
    outside = {(ip, who) for ip, _, who in ports if ip not in LOOPBACK}
    assert all("ServeReplica:teacher_test" in who for _, who in outside), sorted(outside)
    replicas = {who for ip, who in outside if ip == "::"}
    assert len(replicas) == pool["cfg"].num_replicas, sorted(ports)


def test_one_request_with_several_rows(pool):
    rows = _rows(3, seed=2)
    out = pool["handle"].topk.remote(rows, 5, "float32").result(timeout_s=60)
    assert [o["logprobs"].dtype for o in out] == [torch.float32] * 3
    from hylo.kernels.fused_kl.topk import TeacherTopK

    _check(pool["ref"], rows, [TeacherTopK(o["logprobs"], o["indices"], o["tail_logmass"]) for o in out], 5)


def test_batches_are_cut_by_token_budget(pool):
    # 10 rows of 20 tokens at once, plus one row bigger than the whole budget.
    rows = [make_packed_row([12, 8], VOCAB, seed=300 + i) for i in range(10)] + [make_packed_row([50, 40], VOCAB, seed=7)]
    client = TeacherClient(pool["handle"], max_inflight_rows=11, timeout_s=60)
    _check(pool["ref"], rows, client.topk_all(_checked(rows), 4), 4)
    infos = pool["handle"].broadcast("info").results(timeout_s=30)
    batches = [b for info in infos for b in info["batches"]]
    assert all(tokens <= BUDGET for _, tokens in batches)
    assert any(n > 1 for n, _ in batches), batches


@pytest.mark.parametrize("chunk,window", [(4, 2), (7, 1), (64, 4)], ids=["C4-W2", "C7-W1", "C64-W4"])
def test_stream_chunks_concatenate_to_full_logits(pool, chunk, window):
    row = make_packed_row([17, 9], VOCAB, seed=21, pad=3)
    client = TeacherClient(pool["handle"], timeout_s=60)
    chunks = list(client.stream(check_row(row), chunk_tokens=chunk, window_chunks=window))
    assert all(c.shape[0] == chunk for c in chunks[:-1]) and 0 < chunks[-1].shape[0] <= chunk
    torch.testing.assert_close(torch.cat(chunks), _ref_logits(pool["ref"], row), rtol=1e-5, atol=1e-5)


def test_a_groups_ranges_cost_one_forward_of_the_row(pool):
    """What a sequence-parallel group's asking rank sends (client.py): one request for every rank's range of a
    row. The pool runs one forward (its count as the driver prints it) and answers each range; a stream of the
    ranges comes chunk j of every range in turn, window by window, the unsplit row's logits cut to each range."""
    from hylo.pipeline.teacher.serve import pool_forwards

    app = pool["cfg"].app_name
    raw = make_packed_row([17, 9], VOCAB, seed=22, pad=2)
    row = check_row(raw)
    ranges = [(0, 14), (14, 28)]
    before = sum(pool_forwards(app))
    (recs,) = pool["handle"].topk.remote(row, 5, "float32", ranges=ranges).result(timeout_s=60)
    assert [tuple(r["logprobs"].shape) for r in recs] == [(14, 5)] * 2
    assert sum(pool_forwards(app)) - before == 1
    ref = _ref_logits(pool["ref"], raw)
    from hylo.kernels.fused_kl.topk import TeacherTopK

    for r, (s, e) in zip(recs, ranges):
        assert_topk_matches(torch.log_softmax(ref[s:e].float(), dim=-1),
                            TeacherTopK(r["logprobs"], r["indices"], r["tail_logmass"]), 5, "float32")
    client = TeacherClient(pool["handle"], timeout_s=60)
    parts = list(client._stream_parts(row, 4, 0, 14, window_chunks=2, ranges=ranges))
    assert [len(p) for p in parts] == [2] * 4 and [p[0].shape[0] for p in parts] == [4, 4, 4, 2]
    for r, (s, e) in enumerate(ranges):
        torch.testing.assert_close(torch.cat([p[r] for p in parts]), ref[s:e], rtol=1e-5, atol=1e-5)


def test_replica_killed_midflight_every_row_once_in_order(pool):
    rows = _rows(12, seed=3)
    pool["marker"].write_text("armed")
    client = TeacherClient(pool["handle"], max_inflight_rows=6, timeout_s=60, max_retries=6,
                           retry_backoff_s=0.5)
    records = client.topk_all(_checked(rows), 6)
    # The armed replica consumed the marker and exited while rows were in flight on it.
    assert not pool["marker"].exists()
    assert client.stats.retries >= 1, client.stats
    _check(pool["ref"], rows, records, 6)


def test_user_error_comes_back_without_retries(pool):
    client = TeacherClient(pool["handle"], timeout_s=60, max_retries=3)
    with pytest.raises(ValueError, match="k=97"):
        client.topk_all(_checked(_rows(1, seed=4)), VOCAB + 1)
    assert client.stats.retries == 0


def test_bad_row_is_refused_by_the_server(pool):
    # rows come over the network: the server checks them (in-process rows were checked by their reader)
    row = make_packed_row([4], VOCAB, seed=0)
    row["cu_seqlens"] = row["cu_seqlens"][:1]
    with pytest.raises(ValueError, match="request row 0.*cu_seqlens"):
        pool["handle"].topk.remote([row], 4, "float16").result(timeout_s=60)


def _forged(ids, cu, host=None, dtype=torch.int64) -> PackedRow:
    """A PackedRow as the client sends it, built without check_row (what any other process may send)."""
    ids = torch.as_tensor(ids).to(dtype)
    cu = torch.tensor(cu, dtype=torch.int32)
    pos = torch.cat([torch.arange(e - s) for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:])] or [torch.zeros(0)])
    if pos.shape[0] != ids.shape[0]:
        pos = torch.arange(ids.shape[0])
    return PackedRow(ids, cu, pos.long(), host=tuple(host or cu.tolist()), given_id="forged-1")


@pytest.mark.parametrize("case,row,needle", [
    # cu_seqlens ends at 10 for 20 tokens: the replica answered rc 0 with uninitialised values for tokens 10-19
    ("short-cu", lambda: _forged(range(20), [0, 10]), r"cu_seqlens.*end"),
    ("host-disagrees", lambda: _forged(range(20), [0, 10, 20], host=(0, 5, 20)), r"disagree with field 'cu_seqlens'"),
    ("negative-id", lambda: _forged([3, -1, 4, 5], [0, 4]), r"negative token id -1"),
    ("id-past-vocab", lambda: _forged([3, VOCAB, 4, 5], [0, 4]), rf"token id {VOCAB} at token 1, outside the vocabulary"),
    ("float-ids", lambda: _forged([3.0, 1.5, 4.0], [0, 3], dtype=torch.float32), r"must hold integers"),
    ("empty", lambda: _forged([], [0]), r"'input_ids' is empty"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_replica_checks_every_row_the_client_sends(pool, case, row, needle):
    """The replica checks every row it receives, PackedRows included (what the client sends): a forged row
    (bad boundaries would give silently wrong or uninitialised values, bad ids a raw IndexError) is refused
    in one line naming it and the field, and is not retried."""
    from hylo.pipeline.data.rows import PackedRowError

    client = TeacherClient(pool["handle"], timeout_s=60, max_retries=3)
    with pytest.raises(PackedRowError, match=r"teacher replica: request row 0 \(row_id forged-1\): .*" + needle):
        client.topk_all([row()], 4)
    assert client.stats.retries == 0
    if case != "empty":  # a stream of no tokens asks nothing
        with pytest.raises(PackedRowError, match=r"teacher replica: stream row \(row_id forged-1\): .*" + needle):
            list(client.stream(row(), chunk_tokens=4))
    # the same client goes on serving good rows
    good = _rows(1, seed=9)
    _check(pool["ref"], good, client.topk_all(_checked(good), 4), 4)


def test_http_answers_on_localhost_only(pool):
    port = pool["cfg"].port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{pool['cfg'].app_name}", timeout=30) as r:
        info = json.loads(r.read())
    assert info["vocab_size"] == VOCAB and info["tokenizer_hash"].startswith("tok-")
    psutil = pytest.importorskip("psutil")
    listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    assert listening == {"127.0.0.1"}


def test_protocol_targets_are_identical_from_model_pool_and_cache(pool, tmp_path):
    """One teacher protocol, three sources: the same rows give the same fused-KL targets.

    Every document length is distinct, so every source runs the same [1, L] forwards whatever its
    batching. In-process model and cache (written by the cache job's compute_shard, read by stage 2's
    reader) run in this process: top-k ids, fp16 log-probabilities and the tail are equal bit for bit
    (the cache stores fp16 exactly). The pool's replicas are other processes (other thread counts): ids
    equal, log-probabilities within one fp16 step (rtol 2**-9), the tail and streamed fp32 logits within 1e-5.
    """
    from hylo.pipeline.teacher.cache import compute_shard, finalize_cache, prepare_cache
    from hylo.pipeline.teacher.config import CacheTeacherSection, TeacherCacheConfig, TeacherClientConfig
    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.teacher.sources import open_teacher
    from hylo.pipeline.train.config import TeacherSection

    from tests.helpers.teacher import write_packed_parquet

    model_dir = pool["model_dir"]
    raw = [make_packed_row(docs, VOCAB, seed=500 + i) for i, docs in enumerate([[3, 11], [5, 9, 2], [13], [7, 4]])]
    write_packed_parquet(tmp_path / "data" / "part-0.parquet", raw)
    rows = _checked(raw)
    model_cfg = TeacherModelConfig(path=str(model_dir))
    cache_cfg = TeacherCacheConfig(data=str(tmp_path / "data"), out=str(tmp_path / "cache"), rows_per_shard=2,
                                   teacher=CacheTeacherSection(k=8, model=model_cfg))
    header, plan, todo = prepare_cache(cache_cfg)
    for p in todo:
        compute_shard(TeacherModel.from_config(model_cfg), cache_cfg.data, cache_cfg.out, header, p)
    assert finalize_cache(cache_cfg.out, plan)

    def targets(k: int, source: str, **kw) -> list[dict]:
        t = TeacherSection(source=source, k=k, model=model_cfg, pool=pool["cfg"],
                           client=TeacherClientConfig(timeout_s=60), **kw)
        return list(open_teacher(t, VOCAB, cache_cfg.data).targets(rows, "cpu"))

    model, served = targets(8, "inprocess"), targets(8, "serve")
    cached = targets(8, "offline", cache_path=cache_cfg.out)
    for r, m, s, c in zip(rows, model, served, cached):
        m, s, c = m["teacher_topk"], s["teacher_topk"], c["teacher_topk"]
        assert m.logprobs.shape == (r.num_tokens, 8) and m.logprobs.dtype == torch.float16
        assert torch.equal(m.indices, c.indices) and torch.equal(m.indices, s.indices)
        assert torch.equal(m.logprobs, c.logprobs) and torch.equal(m.tail_logmass, c.tail_logmass)
        torch.testing.assert_close(s.logprobs.float(), m.logprobs.float(), rtol=2.0 ** -9, atol=0.0)
        torch.testing.assert_close(s.tail_logmass, m.tail_logmass, rtol=1e-5, atol=1e-5)
    # the exact teacher (k = 0): streamed logits from the model and from the pool, hidden states in-process and
    # from the pool (auto: a transformers teacher whose head the trainer reads)
    exact_model = targets(0, "inprocess", exact_form="logits")
    exact_pool, hidden = targets(0, "serve", exact_form="logits"), targets(0, "inprocess")
    hidden_pool = targets(0, "serve")
    for r, m, s, h, hp in zip(rows, exact_model, exact_pool, hidden, hidden_pool):
        full = m["teacher_logits_fn"](0, r.num_tokens)
        torch.testing.assert_close(s["teacher_logits_fn"](0, r.num_tokens), full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h["teacher_hidden"] @ h["teacher_weight"].T, full, rtol=1e-5, atol=1e-5)
        assert torch.equal(hp["teacher_weight"], h["teacher_weight"])
        torch.testing.assert_close(hp["teacher_hidden"], h["teacher_hidden"], rtol=1e-5, atol=1e-5)
    # a sequence-parallel rank's tokens [4, 11) of every row: the range travels through Serve in each request
    t = TeacherSection(source="serve", k=8, model=model_cfg, pool=pool["cfg"], client=TeacherClientConfig(timeout_s=60))
    ranged = list(open_teacher(t, VOCAB).targets(rows, "cpu", token_range=(4, 11)))
    for m, s in zip(model, ranged):
        m, s = m["teacher_topk"], s["teacher_topk"]
        assert s.logprobs.shape == (7, 8) and torch.equal(s.indices, m.indices[4:11])
        torch.testing.assert_close(s.logprobs.float(), m.logprobs[4:11].float(), rtol=2.0 ** -9, atol=0.0)
    (stream,) = open_teacher(TeacherSection(source="serve", k=0, exact_form="logits", model=model_cfg,
                                            pool=pool["cfg"], client=TeacherClientConfig(timeout_s=60)), VOCAB).targets(
        rows[:1], "cpu", token_range=(4, 11))
    torch.testing.assert_close(stream["teacher_logits_fn"](0, 7), exact_model[0]["teacher_logits_fn"](0, 14)[4:11],
                               rtol=1e-5, atol=1e-5)


def test_the_pools_hidden_states_give_the_inprocess_loss_in_a_fraction_of_the_bytes(pool):
    """The exact teacher through the real pool in each form: the bytes that arrive per row (what the estimator
    prices, pipeline/estimate/wire.py), and the fused KL's loss and student gradients with the pool's hidden
    states and the trainer's head against the in-process teacher's (fp32, within 1e-5)."""
    from hylo.kernels.fused_kl import fused_linear_kl_div
    from hylo.pipeline.estimate.wire import TeacherWire
    from hylo.pipeline.teacher.config import TeacherClientConfig
    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec
    from hylo.pipeline.teacher.sources import open_teacher
    from hylo.pipeline.train.config import TeacherSection

    model_cfg = TeacherModelConfig(path=str(pool["model_dir"]))
    rows = _checked([make_packed_row([40, 23], VOCAB, seed=77, pad=1)])
    T = rows[0].num_tokens
    # the pool the fixture started: attach to it (auto would pick logits for a pool this run does not deploy)
    section = TeacherSection(source="serve", k=0, exact_form="hidden", start_pool=False, model=model_cfg,
                             pool=pool["cfg"], client=TeacherClientConfig(timeout_s=60))
    bound = open_teacher(section, VOCAB)  # reads the head, checks it against a replica's
    client = bound.source
    k, fp16 = 8, TeacherClientConfig().dtype
    got = {"hidden": sum(h.nbytes for h in client.hidden(rows)),
           "logits": sum(c.nbytes for c in client.stream(rows[0])),
           "topk": sum(x.nbytes for rec in client.topk(rows, k) for x in rec)}
    wire = TeacherWire(T, client.head.shape[1], VOCAB, k, 4, torch.empty((), dtype=getattr(torch, fp16)).element_size())
    print(f"bytes on the wire for a row of {T} tokens (hidden {client.head.shape[1]}, vocab {VOCAB}, fp32, "
          f"top-{k} in {fp16}): {got}")
    assert got == {f: wire.bytes(f) for f in got}
    assert got["hidden"] * VOCAB == got["logits"] * client.head.shape[1]

    torch.manual_seed(0)
    h_TD = torch.randn(T, 24, requires_grad=True)
    w_VD = torch.randn(VOCAB, 24, requires_grad=True)
    mask = rows[0].loss_mask

    def loss_and_grads(targets):
        h_TD.grad = w_VD.grad = None
        loss = fused_linear_kl_div(h_TD, w_VD, **targets, mask=mask, reduction="sum", temperature=2.0)
        loss.backward()
        return loss.detach(), h_TD.grad.clone(), w_VD.grad.clone()

    (pool_t,) = bound.targets(rows, "cpu")
    (inproc_t,) = BoundTeacher(TeacherModel.from_config(model_cfg), TargetSpec(0, "hidden")).targets(rows, "cpu")
    for a, b in zip(loss_and_grads(pool_t), loss_and_grads(inproc_t)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
