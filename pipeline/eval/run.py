"""Run the evaluation suites of an `EvalConfig` and write results.json + results.md into `out`.

Design choices:
* One process, no Ray: evaluation of one checkpoint fits one device; on a cluster the job is
  submitted with `ray job submit --entrypoint-num-gpus=1` so Ray places it on a GPU.
* Suites are independent; each one's section in results.json records its own wall time, and a
  suite that needs an input that was not given fails with an error naming the missing option.
* The model under test and (when given) the base model run the same retrieval prompts and the
  same KV-cache lengths, so their numbers sit side by side in one table.
* Results are written atomically (temp file + rename).
* Progress: one `[eval]` line per suite on stderr and a progress bar over each suite's work (rows,
  samples, context lengths, lm-eval requests). The lm-eval tasks are loaded before any suite runs, so
  a task that cannot run (unknown, dataset not available offline) stops the job at once.
* `update_card`: the results also go into the evaluated HyLo checkpoint's model card.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from hylo.assets import local_path
from hylo.atomic import atomic_write
from hylo.card import CARD_JSON, CARD_MD, add_eval_results
from hylo.logs import get_logger
from hylo.outputs import check_not_an_input
from hylo.ownership import check_own_files, record_files, recorded_entries
from hylo.pipeline.config import config_hash, to_dict
from hylo.pipeline.eval import kvcache
from hylo.pipeline.eval.config import EvalConfig
from hylo.pipeline.eval.decode import (
    EvalError,
    is_hylo,
    load_model,
    load_tokenizer,
    pick_device,
    resolve_path,
)
from hylo.pipeline.eval.kl import TeacherStateCache, evaluate_kl, iter_eval_rows
from hylo.pipeline.eval.lm_eval_adapter import prepare_lm_eval, run_lm_eval
from hylo.pipeline.eval.retrieval import make_samples, run_retrieval
from hylo.pipeline.eval.samples import greedy_answers
from hylo.pipeline.paths import job_inputs

logger = get_logger(__name__)


def _need(value: Any, option: str, suite: str) -> Any:
    if value is None:
        raise EvalError(f"suite {suite!r} needs {option}")
    return value


def _model_info(model) -> dict[str, Any]:
    info = {"kind": "hylo" if is_hylo(model) else type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    if is_hylo(model):
        info["mla_layers"] = list(model.config.mla_layers)
        info["n_layer"] = model.config.n_layer
    return info


def _log(msg: str) -> None:
    logger.info(f"[eval] {msg}")


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    cfg.check_inputs()  # before any model is loaded
    m = cfg.models
    model_path = _need(m.path, "--model (models.path)", "any")
    t0 = time.perf_counter()
    _log(f"loading {model_path}" + (f" and base {m.base}" if m.base else ""))
    model = load_model(model_path, m.dtype, m.device)
    tokenizer = load_tokenizer(m.tokenizer or model_path) if _has_tokenizer(m.tokenizer or model_path) else None
    base = load_model(m.base, m.dtype, m.device) if m.base else None
    # the teacher is often the base model itself: load it once
    loaded = {m.base: base} if base is not None else {}
    results: dict[str, Any] = {
        "config": to_dict(cfg), "config_hash": config_hash(cfg),
        "model": {"path": str(model_path), **_model_info(model)},
        "base": {"path": m.base, **_model_info(base)} if base is not None else None,
        "load_s": time.perf_counter() - t0,
    }
    lm_prepared = None
    if "lm_eval" in cfg.suites:
        _log(f"lm_eval: loading tasks {', '.join(cfg.lm_eval.tasks)}")
        lm_prepared = prepare_lm_eval(str(model_path), cfg.lm_eval)
    for suite in cfg.suites:
        ts = time.perf_counter()
        _log(f"suite {suite} ({cfg.suites.index(suite) + 1}/{len(cfg.suites)})")
        if suite == "kl":
            results["kl"] = _suite_kl(cfg, model, tokenizer, loaded)
        elif suite == "retrieval":
            results["retrieval"] = _suite_retrieval(cfg, model, base, tokenizer)
        elif suite == "kvcache":
            results["kvcache"] = _suite_kvcache(cfg, model, base)
        elif suite == "samples":
            results["samples"] = _suite_samples(cfg, model, base, tokenizer)
        elif suite == "lm_eval":
            le = cfg.lm_eval
            results["lm_eval"] = run_lm_eval(str(model_path), le, m.dtype, m.device, model=model, tokenizer=tokenizer,
                                             output_path=le.output_path or Path(cfg.out) / "lm_eval", seed=cfg.seed,
                                             prepared=lm_prepared)
        results[suite]["seconds"] = time.perf_counter() - ts
        _log(f"suite {suite} done in {results[suite]['seconds']:.1f} s")
    write_results(results, Path(cfg.out), results_files(cfg))
    if cfg.update_card:
        update_model_card(results, Path(cfg.out) / "results.json")
    return results


def card_metrics(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The headline numbers of each suite, for the model card."""
    out: dict[str, dict[str, Any]] = {}
    if "kl" in res:
        k = res["kl"]
        out["kl"] = {key: k[key] for key in ("kl", "ppl", "teacher_ppl") if k.get(key) is not None}
    if "retrieval" in res:
        acc = res["retrieval"]["model"]["accuracy"]
        out["retrieval"] = {f"{t}@{L}": c["accuracy"] for t in sorted(acc) for L, c in sorted(acc[t].items(), key=lambda x: int(x[0]))}
    if "kvcache" in res:
        c = res["kvcache"]["comparison"]
        kv = {f"measured ratio @{r['context']}": r.get("measured_ratio") for r in c["per_length"] if r.get("measured_ratio")}
        out["kvcache"] = {"kv_cache_ratio": c.get("kv_cache_ratio"), **kv}
    if "lm_eval" in res:
        # a metric is `name,filter` (acc,none); `sample_len` (the examples scored) and `alias` are not metrics
        out["lm_eval"] = {f"{task} {key.split(',')[0]}": val for task, metrics in res["lm_eval"]["results"].items()
                          for key, val in metrics.items() if "," in key and isinstance(val, int | float)
                          and "stderr" not in key and not isinstance(val, bool)}
    return out


def lm_eval_samples(res: dict[str, Any]) -> dict[str, int]:
    """Examples each lm-eval task was scored on (its `sample_len`)."""
    return {task: int(m["sample_len"]) for task, m in ((res.get("lm_eval") or {}).get("results") or {}).items()
            if isinstance(m.get("sample_len"), int | float) and not isinstance(m.get("sample_len"), bool)}


# what `update_card` rewrites in the evaluated checkpoint
CARD_FILES = (CARD_JSON, CARD_MD)


def update_model_card(res: dict[str, Any], results_path: Path) -> None:
    from hylo.config import HybridConfig  # lazy: transformers

    path = Path(res["model"]["path"])
    if res["model"].get("kind") != "hylo" or not (path / "config.json").is_file():
        raise EvalError(f"update_card: {path} is not a HyLo checkpoint directory")
    limit = ((res.get("config") or {}).get("lm_eval") or {}).get("limit") if "lm_eval" in res else None
    check_own_files(path, CARD_FILES, "update_card: the model card of --model")
    card = add_eval_results(path, HybridConfig.from_pretrained(path), card_metrics(res), str(results_path),
                            limit=limit, samples=lm_eval_samples(res))
    if recorded_entries(path) is not None:
        # the checkpoint's record follows its card (a later convert --out over it replaces the model whole)
        record_files(path, CARD_FILES)
    _log(f"model card updated: {card}")


def _has_tokenizer(path: str) -> bool:
    p = Path(path)
    return not p.is_dir() or any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def _suite_kl(cfg: EvalConfig, model, tokenizer, loaded: dict[str, Any]) -> dict[str, Any]:
    data = _need(cfg.kl.data, "--data (kl.data)", "kl")
    t = cfg.models.teacher
    teacher = (loaded[t] if t in loaded else load_model(t, cfg.models.dtype, cfg.models.device)) if t else None
    tok_dir = (cfg.models.tokenizer or cfg.models.path) if tokenizer is not None else None
    rejects: list[dict[str, Any]] | None = [] if cfg.kl.on_bad_record == "report" else None
    rows = iter_eval_rows(data, tok_dir, cfg.kl.max_rows, rejects)
    cache = _teacher_cache(cfg, t) if (t and cfg.kl.teacher_cache) else None
    res = evaluate_kl(model, rows, teacher, use_fused=cfg.kl.use_fused, chunk=cfg.kl.chunk_tokens,
                      teacher_cache=cache, total=cfg.kl.max_rows,
                      show_progress=True).to_dict()
    if cache is not None:
        cache.save()
        res["teacher_cache"] = {"path": str(cache.path), "hits": cache.hits, "misses": cache.misses}
    res["teacher"] = cfg.models.teacher
    res["data"] = data
    res["rejected_records"] = len(rejects or [])
    res["rejects"] = (rejects or [])[:20]
    return res


def _teacher_cache(cfg: EvalConfig, teacher: str):
    """kl.teacher_cache for this teacher: keyed by its weights (path, size, mtime), dtype and device."""
    path = resolve_path(teacher)
    weights = sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in path.glob("*.safetensors"))
    key = config_hash({"teacher": str(path), "weights": weights, "dtype": cfg.models.dtype,
                       "device": str(pick_device(cfg.models.device))})
    return TeacherStateCache(cfg.kl.teacher_cache, key)


def _suite_retrieval(cfg: EvalConfig, model, base, tokenizer) -> dict[str, Any]:
    tok = _need(tokenizer, "a tokenizer beside the model (or models.tokenizer)", "retrieval")
    r = cfg.retrieval
    samples = make_samples(tok, r.lengths, r.samples_per_length, r.tasks, cfg.seed, r.prompt_format,
                           r.multikey_needles)
    out = {"model": run_retrieval(model, tok, samples, r.max_new_tokens, desc="retrieval model")}
    if base is not None:
        out["base"] = run_retrieval(base, tok, samples, r.max_new_tokens, desc="retrieval base")
    return out


def _suite_kvcache(cfg: EvalConfig, model, base) -> dict[str, Any]:
    k = cfg.kvcache
    model_rows = kvcache.measure(model, k.lengths, k.decode_tokens, cfg.seed, desc="kvcache model")
    base_rows = kvcache.measure(base, k.lengths, k.decode_tokens, cfg.seed, desc="kvcache base") if base is not None else None
    ratio = kvcache.expected_ratio(base, model)
    return {
        "model": model_rows,
        "base": base_rows,
        "comparison": kvcache.compare(base_rows, model_rows, ratio, kvcache.hybrid_expected_bytes_per_token(model)),
    }


# ------------------------------------------------------------------------------------------ report
def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}g}"
    return str(x)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|") or "(empty)"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return lines


def _suite_samples(cfg: EvalConfig, model, base, tokenizer) -> dict[str, Any]:
    tok = _need(tokenizer, "a tokenizer (models.tokenizer, or one saved beside the model)", "samples")
    s = cfg.samples
    out: dict[str, Any] = {"model": greedy_answers(model, tok, s.prompts, s.max_new_tokens, s.chat_template)}
    if base is not None and s.base:
        out["base"] = greedy_answers(base, tok, s.prompts, s.max_new_tokens, s.chat_template)
    return out


def render_markdown(res: dict[str, Any]) -> str:
    lines = [f"# Evaluation of `{res['model']['path']}`", ""]
    lines += [f"Model: {res['model']['kind']}, {res['model']['parameters']:,} parameters, {res['model']['dtype']}."]
    if res.get("base"):
        lines += [f"Base: `{res['base']['path']}` ({res['base']['kind']})."]
    lines.append("")
    if "kl" in res:
        k = res["kl"]
        lines += ["## KL to the teacher and perplexity", ""]
        lines += _table(["rows", "documents", "scored tokens", "KL(teacher‖model) / token", "model ppl",
                         "teacher ppl", "KL computed by"],
                        [[k["rows"], k["documents"], k["tokens"], k["kl"], k["ppl"], k["teacher_ppl"], k["kl_backend"]]])
        if k.get("rejected_records"):
            lines += ["", f"{k['rejected_records']} record(s) of the data could not be used, e.g. "
                      + "; ".join(f"{r['record']}: {r['reason']}" for r in k["rejects"][:3])]
        lines.append("")
    if "retrieval" in res:
        lines += ["## Needle-in-a-haystack retrieval (accuracy)", ""]
        r = res["retrieval"]
        who = [("model", r["model"])] + ([("base", r["base"])] if "base" in r else [])
        tasks = sorted(r["model"]["accuracy"])
        lengths = sorted({int(L) for t in tasks for L in r["model"]["accuracy"][t]})
        rows = []
        for name, rr in who:
            for t in tasks:
                acc = rr["accuracy"][t]
                rows.append([name, t] + [acc[str(L)]["accuracy"] for L in lengths])
        lines += _table(["model", "task"] + [f"{L:,} tok" for L in lengths], rows)
        beyond = sorted({int(L) for _, rr in who for t in tasks for L, c in rr["accuracy"][t].items()
                         if c["beyond_max_positions"]})
        if beyond:
            lines += ["", f"Lengths beyond a model's max_position_embeddings: {beyond}."]
        lines.append("")
    if "kvcache" in res:
        kv = res["kvcache"]
        c = kv["comparison"]
        lines += ["## KV cache measured during generation", ""]
        base_by = {b["context"]: b for b in kv["base"] or []}
        rows = []
        for h, cmp in zip(kv["model"], c["per_length"]):
            b = base_by.get(h["context"], {})
            rows.append([h["context"], b.get("bytes_per_token"), h["growing_bytes_per_token"], h["constant_bytes"],
                         cmp.get("measured_ratio"), c["kv_cache_ratio"], b.get("decode_tokens_per_s"),
                         h["decode_tokens_per_s"]])
        lines += _table(["context", "base bytes/token", "hybrid bytes/token (growing)", "hybrid constant bytes",
                         "measured ratio", "kv_cache_ratio", "base decode tok/s", "hybrid decode tok/s"], rows)
        lines += ["", f"Hybrid within {c['tolerance']:.0%} of kv_cache_ratio: {_fmt(c['hybrid_within_tolerance'])}."]
        if "base_grows_linearly" in c:
            lines += [f"Base bytes per token constant over lengths (linear growth): {_fmt(c['base_grows_linearly'])} "
                      f"(spread {_fmt(c['base_bytes_per_token_spread'])})."]
        lines.append("")
    if "samples" in res:
        lines += ["## Sample answers (greedy)", ""]
        s = res["samples"]
        who = ["model"] + (["base"] if "base" in s else [])
        lines += _table(["prompt", *who], [[a["prompt"], *(_cell(s[w][i]["answer"]) for w in who)]
                                            for i, a in enumerate(s["model"])])
        lines.append("")
    if "lm_eval" in res:
        lines += ["## lm-evaluation-harness", ""]
        rows = []
        for task, metrics in sorted(res["lm_eval"]["results"].items()):
            for key, val in sorted(metrics.items()):
                if isinstance(val, int | float) and not key.endswith("_stderr,none") and "stderr" not in key:
                    rows.append([task, key, val])
        lines += _table(["task", "metric", "value"], rows)
        lines.append("")
    return "\n".join(lines)


def results_files(cfg: EvalConfig) -> list[str]:
    """What the job writes into `out`: results.json, results.md, and lm_eval/ (the harness's own files) when
    lm_eval runs with its default output path."""
    own_lm_eval = "lm_eval" in cfg.suites and cfg.lm_eval.output_path is None
    return ["results.json", "results.md", *(["lm_eval"] if own_lm_eval else [])]


def check_out(cfg: EvalConfig) -> None:
    """Before any model is loaded: `out` (and lm_eval.output_path) is none of what the job reads (its config file,
    the models, the data, the teacher cache: `job_inputs`; nor inside or around one), and holds no file of the
    names the job writes that it did not write itself, as it wrote it (a user's results.md is never
    overwritten)."""
    m = cfg.models
    flags = [("--model", m.path), ("--teacher", m.teacher), ("--base", m.base), ("--tokenizer", m.tokenizer),
             ("--data", cfg.kl.data if "kl" in cfg.suites else None)]
    inputs = job_inputs(cfg, extra=[(o, local_path(v) if v else None) for o, v in flags])
    check_not_an_input(cfg.out, inputs, "out")
    if "lm_eval" in cfg.suites and cfg.lm_eval.output_path:
        check_not_an_input(cfg.lm_eval.output_path, inputs, "lm_eval.output_path")
    check_own_files(cfg.out, results_files(cfg), "out")
    if cfg.update_card and cfg.models.path and Path(cfg.models.path).is_dir():
        # the card is written into the model the job reads, asked for: only over card files of ours, as written
        check_own_files(cfg.models.path, CARD_FILES, "update_card: the model card of --model")


def write_results(res: dict[str, Any], out: Path, names: list[str] | None = None) -> None:
    """results.json and results.md, atomically, into `out`; only over files of ours (`check_own_files`), and
    recorded as ours (`record_files`), with `names` (default: those two) the files the job wrote there. Only the
    two results files are checked here: the others (lm_eval/, written by the harness during the run) were checked
    before the run (`check_out`) and are this run's own by now."""
    results = ["results.json", "results.md"]
    names = names or results
    out.mkdir(parents=True, exist_ok=True)
    check_own_files(out, results, "out")
    atomic_write(out / "results.json", json.dumps(res, indent=1, default=str))
    atomic_write(out / "results.md", render_markdown(res))
    record_files(out, names)
