"""`hylo estimate --sequence-parallel N` (pipeline/estimate/sp.py): the flag's rules, the analytic
communication and extras against torch's own counts, and the rank's step at T / N tokens. Tiny shapes, seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from hylo.config import HybridConfig
from hylo.pipeline.cli import BadArgument
from hylo.pipeline.estimate import sp


def tiny(linear_type: str = "gdn", heads: int = 4) -> HybridConfig:
    return HybridConfig(vocab_size=256, hidden_size=64, intermediate_size=128, n_layer=4, mla_layers=[0, 2],
                        num_attention_heads=heads, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, gdn_num_heads=2, gdn_head_dim=16, gdn_expand_v=2.0, gdn_chunk_size=16,
                        linear_type=linear_type, tie_word_embeddings=False)


def test_the_group_must_divide_the_workers_and_every_row():
    sp.check_sequence_parallel(4, 8, [1024, 4096], "--sequence-parallel", "--world-size", "--tokens")
    with pytest.raises(BadArgument, match=r"^--sequence-parallel=3: .*8 training workers \(--world-size\)"):
        sp.check_sequence_parallel(3, 6 + 2, [96], "--sequence-parallel", "--world-size", "--tokens")
    with pytest.raises(BadArgument, match=r"^train.sequence_parallel=4: the 1,026-token row \(data.seq_len\)"):
        sp.check_sequence_parallel(4, 8, [1026], "train.sequence_parallel", "ray.num_workers", "data.seq_len")
    with pytest.raises(BadArgument, match="at least 1"):
        sp.check_sequence_parallel(0, 8, [1024], "--sequence-parallel", "--world-size", "--tokens")


def test_latent_gathering_and_ulysses_bytes_as_ring_collectives_move_them():
    hc = tiny(heads=4)
    T, b = 4096, 2
    assert all(c.total == 0 for c in sp.communication(hc, T, 1, b, True))
    for N in (2, 4):
        rows = {(c.layer, c.scheme.split()[0]): c for c in sp.communication(hc, T, N, b, checkpointing=True)}
        Tq = T // N
        gather = rows["MLA", "gather"]
        # every rank receives the other ranks' latent + k_pe (R + P = 40 values): (N - 1) pieces of Tq tokens,
        # forward twice (the checkpoint's recompute gathers again) and the reduce-scatter of the backward once
        assert gather.backward == (N - 1) * Tq * 40 * b and gather.forward == 2 * gather.backward
        uly = rows["MLA", "Ulysses"]
        # q, k [Tq, 4 heads, 16], v and the output [Tq, 4, 16]: (N - 1) / N of each leaves the rank
        assert uly.backward == pytest.approx((N - 1) / N * Tq * 4 * (16 + 16 + 16 + 16) * b)
        # the group's bytes per token of the row: independent of T for both MLA schemes
        again = {(c.layer, c.scheme.split()[0]): c for c in sp.communication(hc, 2 * T, N, b, checkpointing=True)}
        assert again["MLA", "gather"].per_row_token == pytest.approx(gather.per_row_token)
        assert again["MLA", "Ulysses"].per_row_token == pytest.approx(uly.per_row_token)
        # state passing: a fixed size per step whatever T: all-gathers of the fp32 [2, 16, 32] state + [2, 16, 16]
        # transition and of the conv window (3 tokens of q, k, v channels: 2 x (16 + 16 + 32))
        state = rows["GDN", "states"]
        assert state.backward == (N - 1) * (2 * 16 * (32 + 16) * 4 + 3 * 2 * (16 + 16 + 32) * b)
        assert again["GDN", "states"].total == state.total
    # Ulysses shards heads: 6 heads over 4 ranks is not possible, and says so
    rows = {c.scheme: c for c in sp.communication(tiny(heads=6), T, 4, b, True) if c.layer == "MLA"}
    assert math.isnan(rows["Ulysses"].total) and "6 heads" in rows["Ulysses"].note
    assert not math.isnan(rows["gather latent + k_pe"].total)


def test_the_extra_attention_flops_are_the_estimates_count_of_the_last_ranks_block():
    from hylo.pipeline.estimate import fake_tensors, flop_registry

    hc = tiny()
    T, N = 256, 4
    Tq, E = T // N, T - T // N
    flops = sp.extra_flops(hc, T, N, torch.float32, checkpointing=False)
    attn = next(v for k, v in flops.items() if "MLA" in k)
    # the last rank's Tq queries against the E earlier keys (all visible, no mask), forward and backward, and
    # kv_b_proj's decompression of the earlier keys (its heads x (nope 8 + v 16) from the 32-wide latent), run on
    # fake tensors and counted as the estimate counts the step (SDPA's CPU flash kernel as CUDA's flash kernel)
    with fake_tensors() as host:
        host.flop_registry = flop_registry()
        q = torch.empty(1, 4, Tq, 16, requires_grad=True)
        k, v = (torch.empty(1, 4, E, 16, requires_grad=True) for _ in range(2))
        x = torch.empty(E, 32, requires_grad=True)
        w = torch.empty(hc.kv_b_heads * (8 + 16), 32, requires_grad=True)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.autograd.grad(o, (q, k, v), torch.empty_like(o))
        y = torch.nn.functional.linear(x, w)
        torch.autograd.grad(y, (x, w), torch.empty_like(y))
        counted = host.flops
    # two MLA layers
    assert attn == 2 * counted
    # with checkpointing the forward runs again in the recompute: more, by the forward's count
    assert sp.extra_flops(hc, T, N, torch.float32, True)[next(iter(flops))] > attn
    assert sp.extra_flops(hc, T, 1, torch.float32, False) == {}


@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
def test_the_extra_scans_are_counted_on_the_real_kernels_linearly_in_the_rank_tokens(linear_type):
    hc = tiny(linear_type)
    a = sp._scan_flops(hc, 64, torch.bfloat16)
    b = sp._scan_flops(hc, 128, torch.bfloat16)
    assert a[0] > 0 and a[1] > a[0]
    assert b[0] == pytest.approx(2 * a[0], rel=0.02) and b[1] == pytest.approx(2 * a[1], rel=0.02)
    if linear_type == "gdn":
        # the transition pass: values of width K (16) instead of V (32): fewer FLOPs than the value pass
        t = sp._scan_flops(hc, 64, torch.bfloat16, transition=True)
        assert 0 < t[0] < a[0]
    extra = sp.extra_flops(hc, 128, 2, torch.bfloat16, checkpointing=False)
    scans = next(v for k, v in extra.items() if "scan" in k)
    per_layer = a[0] + a[1] + ((t[0] + t[1]) if linear_type == "gdn" else 0)
    assert scans == pytest.approx(2 * per_layer, rel=0.02)  # two linear layers, 64 tokens each


def test_the_extra_memory_grows_with_the_earlier_keys_and_the_group():
    hc = tiny()
    assert sp.extra_memory(hc, 1024, 1, 2, True) == {}
    m2, m4 = sp.extra_memory(hc, 1024, 2, 2, True), sp.extra_memory(hc, 1024, 4, 2, True)
    key = sp.MLA_ANALYTIC
    # E = T - T/N earlier keys: 512 at N = 2, 768 at N = 4
    assert m4[key] == pytest.approx(m2[key] * 768 / 512)
    # without checkpointing every MLA layer holds its forward part: more
    assert sp.extra_memory(hc, 1024, 2, 2, False)[key] > m2[key]
    # a measured layer's figure replaces the bound: once with checkpointing, per MLA layer without
    assert sp.extra_memory(hc, 1024, 2, 2, True, 1000.0)[sp.MLA_MEASURED] == 1000.0
    assert sp.extra_memory(hc, 1024, 2, 2, False, 1000.0)[sp.MLA_MEASURED] == 2000.0


def test_the_split_mla_layer_is_measured_on_the_fake_group_below_the_bound_and_linear_in_the_earlier_keys():
    import torch.distributed as dist

    hc = tiny()
    got = {(T, N): sp.measure_mla_extra(hc, T, N, torch.float32) for T, N in ((512, 2), (1024, 2), (1024, 4))}
    # the fake group is gone again
    assert not dist.is_initialized()
    for (T, N), measured in got.items():
        bound = sp.extra_memory(hc, T, N, 4, True)[sp.MLA_ANALYTIC]
        assert 0 < measured < bound, (T, N, measured, bound)
    # the earlier keys E = T - T/N: 256, 512, 768; the bytes per earlier key about the same
    per_key = [got[512, 2] / 256, got[1024, 2] / 512, got[1024, 4] / 768]
    assert max(per_key) < 1.3 * min(per_key), per_key
    assert sp.measure_mla_extra(hc, 1024, 1, torch.float32) is None


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    tiny().save_pretrained(tmp_path / "student")
    cfg = {"model": {"student": str(tmp_path / "student"), "activation_checkpointing": True},
           "train": {"global_batch_sequences": 2}, "ray": {"num_workers": 2},
           "data": {"source": "synthetic", "seq_len": 128},
           "teacher": {"source": "offline", "k": 8, "cache_path": str(tmp_path / "cache")}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_hylo_estimate_sequence_parallel_runs_the_split_step_as_the_last_rank(tiny_config: Path, tmp_path: Path,
                                                                               capsys):
    import torch.distributed as dist

    from hylo.pipeline.estimate import estimate_step
    from hylo.pipeline.estimate.cli import main
    from hylo.pipeline.train.config import load_stage_config

    out = tmp_path / "est.json"
    assert main(["--config", str(tiny_config), "--tokens", "128", "--sequence-parallel", "2", "--json", str(out)]) == 0
    # the fake process group is gone again
    assert not dist.is_initialized()
    text = capsys.readouterr().out
    for words in ("sequence parallel over N = 2", "split step (measured)", "gather latent + k_pe", "Ulysses"):
        assert words in text, text
    data = json.loads(out.read_text())
    assert data["sequence_parallel"] == 2
    e = data["sequence_parallel_estimates"][0]
    assert e["tokens"] == 128 and e["local_tokens"] == 64 and e["split_step"]
    assert e["peak_bytes"] == e["local"]["peak_bytes"] and not e["extra_memory"]
    # every FLOP of the split step has its dtype class; the student's are bf16, its scans' stand-ins included
    assert sum(e["gemm_flops_by_dtype"].values()) == pytest.approx(e["total_flops"] / 1e12, rel=1e-9)
    assert set(e["local"]["flops_by_dtype"]["student forward"]) == {"bf16"}
    # the last rank of one 128-token document against the same step on its 64 tokens alone: its MLA layers
    # attend to the 64 earlier keys too (more memory, more FLOPs), its GDN layers run twice
    cfg = load_stage_config(2, tiny_config)
    alone = estimate_step(cfg, 64, 2, torch.bfloat16, doc_tokens=(64, 64))
    assert e["peak_bytes"] > alone.peak_bytes
    assert e["total_flops"] > alone.total_flops + sum(sp.extra_flops(tiny(), 128, 2, torch.bfloat16, True).values()) / 2
    with pytest.raises(BadArgument, match="--sequence-parallel=2: the 129-token row"):
        main(["--config", str(tiny_config), "--tokens", "129", "--sequence-parallel", "2"])


class _Bytes:
    """The bytes each rank sends in the collectives `hylo.seq_parallel` calls, as ring collectives move them
    (all-gather: (N - 1) x the rank's piece; reduce-scatter: (N - 1) x the rank's part; all-reduce: 2 (N - 1) / N
    x the tensor), recorded around torch.distributed's own functions."""

    def __init__(self, monkeypatch, N: int) -> None:
        import torch.distributed as dist

        self.sent = 0.0
        real = {name: getattr(dist, name) for name in ("all_gather", "reduce_scatter_tensor", "all_reduce")}

        def all_gather(outs, x, group=None, **kw):
            self.sent += (N - 1) * x.numel() * x.element_size()
            return real["all_gather"](outs, x, group=group, **kw)

        def reduce_scatter_tensor(out, x, group=None, **kw):
            self.sent += (N - 1) * out.numel() * out.element_size()
            # the fake group splits the input along dim 0 into N of the output's shape ([N, *out] as the core
            # passes it is the same memory as NCCL reads it)
            return real["reduce_scatter_tensor"](out, x.reshape(-1, *out.shape[1:]), group=group, **kw)

        def all_reduce(x, group=None, **kw):
            self.sent += 2 * (N - 1) / N * x.numel() * x.element_size()
            return real["all_reduce"](x, group=group, **kw)

        for name, fn in (("all_gather", all_gather), ("reduce_scatter_tensor", reduce_scatter_tensor),
                         ("all_reduce", all_reduce)):
            monkeypatch.setattr(dist, name, fn)


@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
@pytest.mark.parametrize("N", [2, 4])
def test_the_counted_bytes_are_what_the_split_layers_collectives_send(monkeypatch, N: int, linear_type: str):
    """One decoder layer of each kind, as the LAST rank of a row that is one document (every exchange happens),
    forward and backward on torch's fake process group (collectives that move nothing, with real shapes): the
    bytes its collectives send equal `communication`'s count per layer (no checkpointing: forward once)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hylo.kernels.varlen import DocBounds
    from hylo.modeling import HyLoDecoderLayer
    from hylo.seq_parallel import shard_row

    hc = tiny(linear_type)
    T = 64
    counted = {(c.layer, c.scheme.split()[0]): c.total for c in sp.communication(hc, T, N, 4, checkpointing=False)}
    dist.init_process_group("fake", store=FakeStore(), rank=N - 1, world_size=N)
    try:
        shard = shard_row(DocBounds.from_host([0, T], T), N - 1, N)
        torch.manual_seed(0)
        for idx, kind in ((hc.mla_layers[0], ("MLA", "gather")), (hc.linear_layers[0], ("GDN" if linear_type == "gdn" else "Mamba-2", "states"))):
            layer = HyLoDecoderLayer(hc, idx).float()
            x = torch.randn(1, shard.end - shard.start, hc.hidden_size, requires_grad=True)
            sent = _Bytes(monkeypatch, N)
            out, _ = layer(x, shard.local.positions[None], shard.local, None, None, shard)
            out.float().sum().backward()
            assert sent.sent > 0 and sent.sent == pytest.approx(counted[kind]), kind
            monkeypatch.undo()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the teacher split with the row (sp_teacher.py)
def tiny_teacher(heads: int = 4, kv_heads: int = 2, hidden: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16)


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
def test_the_split_teachers_flops_per_gpu_fall_to_one_nth_and_whole_stays_whole(mode: str):
    from torch.utils.flop_counter import sdpa_flop_count

    from hylo.pipeline.estimate import sp_teacher as st
    from hylo.pipeline.estimate.fake import causal_pairs

    cfg, T = tiny_teacher(), 512
    measured: dict = {}
    one = st.teacher_split(cfg, T, 1, mode, torch.float32, lm_head=False, measured=measured)
    # a (query, key) pair of one head in every layer; the row's causal attention, the rest is linear in the tokens
    pair = cfg.num_hidden_layers * sdpa_flop_count((1, 1, 1, 16), (1, 1, 1, 16), (1, 1, 1, 16))
    H = cfg.num_attention_heads
    linear = one.total_flops - pair * H * causal_pairs(T, T)
    for N in (2, 4):
        split = st.teacher_split(cfg, T, N, mode, torch.float32, lm_head=False, measured=measured)
        whole = st.teacher_split(cfg, T, N, "whole", torch.float32, lm_head=False, measured=measured)
        Tq = T // N
        # the forward of T / N tokens (linear parts: 1/N exactly) and the attention as the kernels run it: the
        # all-gather's last rank its Tq queries over the T keys up to its own (lower-right causal: more than 1/N),
        # Ulysses H / N heads over the row's causal triangle (1/N exactly)
        attention = H * causal_pairs(Tq, T) if mode == "allgather" else H // N * causal_pairs(T, T)
        assert split.tokens_run == Tq and split.total_flops == linear // N + pair * attention, (N, split.flops)
        assert whole.tokens_run == T and whole.total_flops == one.total_flops
        # the rank's activations are measured at its tokens: fewer than the whole row's
        assert 0 < split.activations < whole.activations and not whole.buffers and split.buffers
    # the lm_head runs on the rank's T / N tokens in every mode (top-k records, streamed logits)
    a = st.teacher_split(cfg, T, 4, "whole", torch.float32, lm_head=True, measured=measured)
    b = st.teacher_split(cfg, T, 4, mode, torch.float32, lm_head=True, measured=measured)
    assert a.flops[st.LM_HEAD] == b.flops[st.LM_HEAD] == 2 * (T // 4) * 64 * 256


def test_the_teacher_bytes_per_layer_by_hand():
    from hylo.pipeline.estimate import sp_teacher as st

    # the 8B teacher's attention: 32 query heads, 8 key-value heads of 128; a 128K row over 4 GPUs in bf16
    td = st.TeacherDims(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=128256)
    T, N, b = 131072, 4, 2
    rows = {c.scheme: c for c in st.teacher_comm(td, T, N, b)}
    # all-gather: the other 3 ranks' 32,768 tokens of keys and values, 8 heads x 128 each: 384 MiB
    assert rows["all-gather K, V"].total == 3 * 32768 * 2 * 8 * 128 * 2 == 384 * 2 ** 20
    # Ulysses: 3/4 of the rank's q (32 heads), k, v (8 each) and the output (32) leave it: 480 MiB
    assert rows["Ulysses q, k, v, o"].total == 3 / 4 * 32768 * (32 + 8 + 8 + 32) * 128 * 2 == 480 * 2 ** 20
    assert rows["whole row (today)"].total == 0 and all(c.backward == 0 for c in rows.values())
    # at N = 8 the all-gather sends more (7 x 16K tokens), Ulysses less (7/8 of 16K tokens' q, k, v, o)
    at8 = {c.scheme: c for c in st.teacher_comm(td, T, 8, b)}
    assert at8["all-gather K, V"].total == 448 * 2 ** 20 and at8["Ulysses q, k, v, o"].total == 280 * 2 ** 20
    # key-value heads that N does not divide are replicated to the query heads: 8 kv heads over 16 ranks
    at16 = {c.scheme: c for c in st.teacher_comm(td, T, 16, b)}
    assert at16["Ulysses q, k, v, o"].total == 15 / 16 * 8192 * (4 * 32) * 128 * 2
    # one layer's transient buffers, a bound: the gathered keys and values of the row (8 heads: grouped) and the
    # rank's own repeated to the 32 query heads; the all-to-all's both sides and the keys and values repeated to
    # the rank's 8 heads
    assert st.transient_buffers(td, T, N, b, "allgather") == {st.GATHERED: (T * 8 + T // N * 32) * 2 * 128 * 2}
    assert st.transient_buffers(td, T, N, b, "ulysses") == {st.ALL_TO_ALL: 2 * 32768 * (64 + 16 + 32) * 128 * 2}


def test_ulysses_is_flagged_and_refused_where_the_heads_do_not_split():
    from hylo.pipeline.estimate import sp_teacher as st

    # Llama-3.2-3B's 24 heads: over 16 ranks no, the largest group that works is 12
    td = st.TeacherDims(layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, vocab=128256)
    row = next(c for c in st.teacher_comm(td, 65536, 16, 2) if c.scheme.startswith("Ulysses"))
    assert math.isnan(row.total) and "24 heads" in row.note
    with pytest.raises(BadArgument, match=r"^train.sequence_parallel_teacher=ulysses at N = 16: .*24 query heads"
                                          r".*the largest N that works is 12"):
        st.check_teacher_split(td, 16, "ulysses", "train.sequence_parallel_teacher")
    # the all-gather takes any head count; Ulysses where N divides the heads
    st.check_teacher_split(td, 16, "allgather", "train.sequence_parallel_teacher")
    st.check_teacher_split(td, 8, "ulysses", "--teacher-split")


def test_hylo_estimate_prints_the_teacher_before_and_after_and_refuses_ulysses_it_cannot_split(tmp_path: Path,
                                                                                                capsys):
    from hylo.pipeline.estimate.cli import main

    tiny().save_pretrained(tmp_path / "student")
    tiny_teacher(heads=6, kv_heads=2, hidden=96).save_pretrained(tmp_path / "teacher")
    cfg = {"model": {"student": str(tmp_path / "student"), "activation_checkpointing": True},
           "train": {"global_batch_sequences": 4}, "ray": {"num_workers": 4},
           "data": {"source": "synthetic", "seq_len": 128},
           "teacher": {"source": "inprocess", "k": 8, "model": {"path": str(tmp_path / "teacher")}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "est.json"
    assert main(["--config", str(path), "--sequence-parallel", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for words in ("before, whole: tokens run", "after, allgather: tokens run", "training GPU peak, after",
                  "the measured step's teacher forward",
                  "teacher, all-gather K, V", "teacher, Ulysses q, k, v, o", "teacher, whole row (today)"):
        assert words in text, text
    t = json.loads(out.read_text())["teacher_split"]
    assert t["mode"] == "allgather" and t["before"][0]["tokens_run"] == 128 and t["after"][0]["tokens_run"] == 64
    peak = t["training_gpu_peak"]
    assert peak["after"][0] <= peak["before"][0]
    # 6 heads over 4 ranks: Ulysses is refused before the step runs, with the largest N that works: 2, which
    # divides the config's 4 workers too (3 divides the heads, not the workers: the run would refuse it)
    with pytest.raises(BadArgument, match=r"^--teacher-split=ulysses at N = 4: .*largest N that works is 2,"):
        main(["--config", str(path), "--sequence-parallel", "4", "--teacher-split", "ulysses"])


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
def test_the_split_teacher_is_measured_on_the_fake_group_within_the_analytic_bound(mode: str):
    """The last rank's forward under `seq_parallel.split_attention`, its collectives on torch's fake process group:
    what it holds beyond the same forward of its tokens unsplit is at most the scheme's analytic bound."""
    import torch.distributed as dist

    from hylo.pipeline.estimate import sp_teacher as st

    cfg, T, N = tiny_teacher(), 1024, 4
    got = st.measure_split_forward(cfg, T, N, mode, torch.float32)
    assert not dist.is_initialized()
    alone = st.measure_forward(cfg, T // N, torch.float32)
    assert got.tokens == alone.tokens == T // N and got.weights == alone.weights
    bound = sum(st.transient_buffers(st.TeacherDims.of(cfg), T, N, 4, mode).values())
    assert 0 <= got.activations - alone.activations <= bound, (got.activations, alone.activations, bound)
    # the queries of T / N tokens against the row's T keys, counted as the analytic split counts them
    split = st.teacher_split(cfg, T, N, mode, torch.float32, lm_head=False)
    assert got.flops == split.total_flops and st.SPLIT_MEASURED in split.buffers


def test_the_teacher_forward_builds_no_row_by_row_mask_on_fake_tensors():
    """transformers takes a fake tensor for a traced graph and builds a [T, T] mask a GPU run does not build
    (`fake._untraced_masks`): the teacher's forward is linear in its tokens, as SDPA's causal kernel holds it."""
    from hylo.pipeline.estimate import sp_teacher as st

    a, b = (st.measure_forward(tiny_teacher(), T, torch.float32).activations for T in (2048, 4096))
    assert 1.9 * a < b < 2.1 * a, (a, b)


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
@pytest.mark.parametrize("N", [2, 4])
def test_the_teacher_bytes_are_what_split_attentions_collectives_send(monkeypatch, N: int, mode: str):
    """A tiny Llama teacher's forward as the LAST rank under `seq_parallel.split_attention`, its collectives on
    torch's fake process group (real shapes, nothing moved): the bytes they send per layer equal `teacher_comm`'s
    (all-gather: (N - 1) x the rank's piece; all-to-all: (N - 1) / N of the rank's tensor)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hylo.kernels.varlen import DocBounds
    from hylo.pipeline.estimate import sp_teacher as st
    from hylo.pipeline.estimate.fake_group import split_rank
    from hylo.seq_parallel import shard_row, split_attention

    cfg, T = tiny_teacher(), 64
    counted = {c.scheme: c.total for c in st.teacher_comm(st.TeacherDims.of(cfg), T, N, 4)}
    sent = [0.0]
    real_gather, real_a2a = dist.all_gather, dist.all_to_all_single

    def all_gather(outs, x, group=None, **kw):
        sent[0] += (N - 1) * x.numel() * x.element_size()
        return real_gather(outs, x, group=group, **kw)

    def all_to_all_single(output, input, *args, **kw):
        sent[0] += (N - 1) / N * input.numel() * input.element_size()
        return real_a2a(output, input, *args, **kw)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    with split_rank(N, deepspeed_comm=mode == "ulysses"):
        shard = shard_row(DocBounds.from_host([0, T], T), N - 1, N, teacher=mode)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).float().eval()
        ids = torch.randint(0, 256, (1, T // N))
        with torch.no_grad(), split_attention(model, shard):
            model.model(input_ids=ids, position_ids=shard.local.positions[None], use_cache=False)
    scheme = "all-gather K, V" if mode == "allgather" else "Ulysses q, k, v, o"
    assert sent[0] > 0 and sent[0] / cfg.num_hidden_layers == pytest.approx(counted[scheme])
