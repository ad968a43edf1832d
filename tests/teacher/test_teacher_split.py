"""The teacher splits with the row (`train.sequence_parallel_teacher`, hylo/seq_parallel.py `split_attention`):
over 2 and 4 gloo ranks each rank runs a Llama, a Qwen3 (YaRN) or a HyLo teacher on its own tokens; its hidden states,
top-k targets, streamed logits and stage 1's captured layer tensors equal the unsplit teacher's for those tokens
(fp64 within 1e-10, fp32 within 1e-5), while its FLOPs fall to 1 / N of the unsplit forward."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.config import TEACHER_SPLITS, load_stage_config
from hylo.seq_parallel import TEACHER_SPLITS as SHARD_SPLITS
from hylo.seq_parallel import ulysses_problem

from tests.helpers.sp_group import run_ranks

VOCAB, K = 64, 8
# 48 tokens: at N = 2 the document [7, 28) crosses the split at 24; at N = 4 rank 1's tokens [12, 24) lie inside
# that document, which started on rank 0, and [28, 37) crosses the split at 36
DOCS = [7, 21, 9, 11]
MODELS = ("llama", "qwen3-yarn", "hylo")
DTYPES = {"float64": (torch.float64, 1e-10), "float32": (torch.float32, 1e-5)}


def _save_models(root: Path) -> dict[str, Path]:
    """A tiny random Llama (4 query heads, 2 kv heads) and a tiny Qwen3 with q/k norms and YaRN RoPE."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.helpers.teacher import save_tiny_llama

    save_tiny_llama(root / "llama", vocab_size=VOCAB, seed=0)
    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=False, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                  "original_max_position_embeddings": 16,
                                                                  "rope_theta": 10000.0})
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(root / "qwen3-yarn")
    # a HyLo teacher (MLA + GDN, converted from the Llama): it takes the shard as the student does
    from hylo.io import save_hylo
    from hylo.upcycle import load_base_model, upcycle

    save_hylo(upcycle(load_base_model(root / "llama"), mla_layers="even", kv_lora_rank=16, gdn_head_dim=8,
                      gdn_num_heads=4), root / "hylo", tokenizer_from=root / "llama")
    return {name: root / name for name in MODELS}


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref.double() - got.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _targets(teacher: Any, row: Any, spec: Any, shard: Any) -> dict[str, Any]:
    from hylo.pipeline.teacher.protocol import BoundTeacher

    shards = None if shard is None else [shard]
    return next(BoundTeacher(teacher, spec, VOCAB).targets([row], "cpu", shards=shards))


def _rank_cases(rank: int, world: int, root: str) -> dict[str, Any]:
    """On every rank: each model, dtype, group size and split; the relative errors of this rank's teacher outputs
    against the unsplit teacher's (computed here too) and the FLOPs of its forward."""
    import torch.distributed as dist

    from hylo.pipeline.data.rows import check_row
    from hylo.pipeline.estimate.fake import count_flops
    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.teacher.protocol import TargetSpec
    from hylo.pipeline.train.deepspeed_cfg import import_deepspeed
    from hylo.pipeline.train.stage1 import BaseLayerTargets
    from hylo.seq_parallel import shard_row

    from tests.helpers.teacher import make_packed_row

    import_deepspeed().init_distributed(dist_backend="gloo")
    groups = {n: [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)] for n in (2, 4)}
    row = check_row(make_packed_row(DOCS, VOCAB, seed=3))
    bounds = row.bounds(torch.device("cpu"))
    topk, logits = TargetSpec(K, "topk"), TargetSpec(0, "logits")
    out: dict[str, Any] = {"errors": {}, "flops": {}}
    for name in MODELS:
        for dt_name, (dtype, _) in DTYPES.items():
            teacher = TeacherModel(Path(root) / name, dtype=dtype, device="cpu")
            ref_h, ref_flops = count_flops(lambda: teacher.hidden(row))  # noqa: B023
            ref_topk = _targets(teacher, row, topk, None)["teacher_topk"]
            ref_logits = teacher.logits(row)
            # stage 1's base is a transformers model (the model a HyLo student was converted from)
            base = None if teacher.is_hylo else BaseLayerTargets(teacher.model)
            ref_layers = [[x[0].clone() for x in kind] for kind in base(row)] if base else []
            for n in (2, 4):
                for split in TEACHER_SPLITS:
                    shard = shard_row(bounds, rank % n, n, groups[n][rank // n], teacher=split)
                    s, e = shard.start, shard.end
                    key = f"{name} {dt_name} N={n} {split}"
                    if split != "whole":
                        h, flops = count_flops(lambda: teacher.hidden_split(row, shard))  # noqa: B023
                        out["errors"][f"{key} hidden"] = _rel(ref_h[s:e], h)
                        out["flops"][f"{key}"] = {"rank": flops, "unsplit": ref_flops}
                    got = _targets(teacher, row, topk, shard)["teacher_topk"]
                    out["errors"][f"{key} topk logprobs"] = _rel(ref_topk.logprobs[s:e], got.logprobs)
                    out["errors"][f"{key} topk tail"] = _rel(ref_topk.tail_logmass[s:e], got.tail_logmass)
                    if dtype == torch.float64:
                        out["errors"][f"{key} topk indices"] = float(not torch.equal(ref_topk.indices[s:e],
                                                                                     got.indices))
                    stream = _targets(teacher, row, logits, shard)["teacher_logits_fn"]
                    out["errors"][f"{key} logits"] = _rel(ref_logits[s:e], stream(0, e - s))
                    if base is None:
                        continue
                    layers = base(row, shard)
                    out["errors"][f"{key} stage-1 base"] = max(
                        _rel(ref[s:e], got[0]) for ref_kind, got_kind in zip(ref_layers, layers)
                        for ref, got in zip(ref_kind, got_kind))
    return out


@pytest.fixture(scope="module")
def split_results(tmp_path_factory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("teacher-split")
    _save_models(root)
    return run_ranks(functools.partial(_rank_cases, root=str(root)), 4, root)


@pytest.mark.slow  # 4 spawned gloo ranks
def test_a_split_teacher_gives_the_unsplit_teachers_outputs_for_each_ranks_tokens(split_results):
    """Llama, Qwen3 (q/k norms, YaRN) and HyLo (MLA + GDN: the student's split), fp64 and fp32, at N = 2 and 4, by
    each split (allgather, ulysses, and
    whole: the whole row's forward cut to the rank's tokens): hidden states, top-k records (fp64: the same
    indices), streamed logits and stage 1's captured layer inputs, outputs and attention outputs."""
    cases, worst = 0, {}
    for rank, result in enumerate(split_results):
        for key, err in result["errors"].items():
            tol = DTYPES[key.split()[1]][1]
            assert err <= tol, f"rank {rank} {key}: relative error {err:.3g} > {tol:g}"
            cases += 1
            kind = " ".join(key.split()[:2])
            worst[kind] = max(worst.get(kind, 0.0), err)
    print("worst relative error per teacher / dtype:", {k: f"{v:.2g}" for k, v in worst.items()})
    # per rank, 3 models x 2 dtypes x 2 sizes x 3 splits: top-k logprobs and tail, logits; fp64's top-k indices;
    # stage 1's tensors (the 2 transformers models); the hidden states of the two splits that run `hidden_split`
    assert cases == 4 * (3 * 2 * 2 * 3 * 3 + 3 * 2 * 3 + 2 * 2 * 2 * 3 + 3 * 2 * 2 * 2)


@pytest.mark.slow  # the same ranks' counts
def test_a_split_teachers_flops_per_rank_fall_to_one_nth(split_results):
    """torch's FLOP counter over each rank's forward (attention's [q, k] blocks included): the busiest rank of a
    group runs ~1 / N of the unsplit forward (the linear layers exactly 1 / N; a rank's queries also attend to
    the earlier ranks' keys of its first document, which the unsplit count holds in that document's block)."""
    table = {}
    for key in split_results[0]["flops"]:
        n = int(key.split("N=")[1].split()[0])
        ranks = [r["flops"][key]["rank"] for r in split_results]
        unsplit = split_results[0]["flops"][key]["unsplit"]
        share = max(ranks) / unsplit
        table[key] = f"{share:.3f} of {unsplit:,} (1/N = {1 / n:.3f}); ranks {ranks}"
        # a HyLo teacher's unsplit MLA attends over the packed row's dense blocks: its split counts less than 1 / N
        low = 0.0 if key.startswith("hylo") else 0.95 / n
        assert low <= share <= 1.15 / n, f"{key}: {table[key]}"
    print(json.dumps(table, indent=1))


def test_the_config_and_the_shard_know_the_same_splits():
    assert TEACHER_SPLITS == SHARD_SPLITS
    cfg = load_stage_config(2, None, ["train.sequence_parallel_teacher=ulysses"])
    assert cfg.train.sequence_parallel_teacher == "ulysses"
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel_teacher.*allgather.*ulysses.*whole"):
        load_stage_config(2, None, ["train.sequence_parallel_teacher=ring"])


def test_ulysses_refuses_a_head_count_it_cannot_split_before_ray_naming_the_largest_size_that_works(tmp_path):
    """Checked with the model's config.json, with the other input checks before Ray starts."""
    from hylo.pipeline.train.inputs import _heads_split

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 12}))
    sets = ["ray.num_workers=8", "train.sequence_parallel=8", "data.seq_len=64", "train.global_batch_sequences=1"]
    cfg = load_stage_config(1, None, [*sets, "train.sequence_parallel_teacher=ulysses"])
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel_teacher=ulysses: Ulysses splits the 12 attention "
                                          r"heads over the 8 ranks of a group: they must divide \(the largest group "
                                          r"size that works is 4\) \(model\.base: .*config\.json\)"):
        _heads_split(cfg, tmp_path, "model.base")
    # all-gathering the keys splits any head count; 12 heads over 4 ranks split by heads
    _heads_split(load_stage_config(1, None, sets), tmp_path, "model.base")
    _heads_split(load_stage_config(1, None, ["ray.num_workers=4", "train.sequence_parallel=4", "data.seq_len=64",
                                             "train.global_batch_sequences=1", "train.sequence_parallel_teacher=ulysses"]),
                 tmp_path, "model.base")
    assert "largest group size that works is 6" in ulysses_problem(12, 8)


def test_a_split_teacher_refuses_sliding_window_attention_naming_the_way_out():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hylo.kernels.varlen import DocBounds
    from hylo.seq_parallel import shard_row, split_attention

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_sliding_window=True,
                      sliding_window=4, max_window_layers=0, layer_types=["sliding_attention"])
    model = Qwen3ForCausalLM(cfg).eval()
    shard = shard_row(DocBounds.from_host([0, 8], 8, "cpu"), 0, 1)
    with split_attention(model, shard), pytest.raises(ValueError, match=r"layer 0 of the teacher uses sliding-window "
                                                                         r"attention \(4 tokens\).*sequence_parallel_teacher: whole"):
        model.model(input_ids=torch.zeros(1, 8, dtype=torch.long), position_ids=shard.local.positions[None])
    # the model's own attention again after the block
    assert model.config._attn_implementation != "hylo_split"
