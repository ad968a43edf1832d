"""The model card (README.md) and its record (hylo_card.json) written with every saved HyLo checkpoint.

Design choices:
* `hylo_card.json` is the record: the base model, each step that produced the checkpoint (convert, train
  stages with their recipe), the teacher, and evaluation results; README.md is rendered from it and from
  the config, never edited by hand (the next save or `--update-card` evaluation rewrites it).
* Provenance is inferred where the savers already say where they come from, so no caller has to pass
  it: the tokenizer source of a save is the directory the model came from. A HF base directory there
  means "converted from that base"; a HyLo checkpoint there means "trained from it" (its record is carried
  over); a training run's consolidated model (`<run>/model`) takes its recipe from the run's
  `config_stage<N>.json`. Callers that know more pass `provenance=` to `hylo.io.save_hylo`.
* The front matter is the Hub's model-card metadata, written with huggingface_hub's own `ModelCardData`
  (so `ModelCard.load` reads it back): `base_model` is the base's Hub id where it is known (a Hub id in the
  base config's `_name_or_path`, or the asset registry's `hub_id`; never a local path), `license` the
  base's (its own card's front matter, else the registry's), `datasets` the Hub ids of the training data the
  recipes name (packed data: its manifest's sources; the registry maps asset names to ids), `model-index`
  the evaluation results. The training data's terms are stated in the card's text.
* The card says what the checkpoint was made from: a synthetic-data run records "synthetic rows", not the
  (unread) `data.path` of its config.
* KV cache per token is computed from the config alone (MLA: latent + roped key, + one key 1/RMS per
  kv_b head with `mla_qk_norm`; linear layers: none)
  against the base's GQA cache (`base_num_key_value_heads`, `base_head_dim`).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from pathlib import Path
from typing import Any

from hylo.files import atomic_write

CARD_JSON = "hylo_card.json"
CARD_MD = "README.md"


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def load_card(directory: str | Path | None) -> dict[str, Any] | None:
    if directory is None:
        return None
    return _read_json(Path(directory) / CARD_JSON)


def kv_cache(config) -> dict[str, Any]:
    """Cached values per token of the hybrid and (when the config knows it) of its base, and their ratio."""
    hybrid = config.kv_cache_values_per_token()
    out: dict[str, Any] = {"hybrid_values_per_token": hybrid, "hybrid_bf16_bytes_per_token": 2 * hybrid}
    kv_heads = getattr(config, "base_num_key_value_heads", None)
    head_dim = getattr(config, "base_head_dim", None)
    if kv_heads and head_dim:
        base = config.n_layer * 2 * kv_heads * head_dim
        out.update(base_values_per_token=base, base_bf16_bytes_per_token=2 * base, kv_cache_ratio=hybrid / base)
    return out


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _front_matter(readme: Path) -> dict[str, Any]:
    """The YAML front matter of a model card (README.md), {} when it has none."""
    import yaml

    try:
        text = readme.read_text(encoding="utf-8")
    except OSError:
        return {}
    m = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not m:
        return {}
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _registry(name: str | None) -> Any:
    from hylo.assets import ASSETS

    return ASSETS.get(name) if name else None


def base_identity(src: Path, base_cfg: dict[str, Any]) -> dict[str, Any]:
    """Hub id and license of a base model directory, where known (None otherwise): the directory's own
    card and config first, then the asset registry (an asset directory is named after its asset)."""
    front = _front_matter(src / "README.md")
    spec = _registry(src.name)
    cand = base_cfg.get("_name_or_path")
    hub_id = cand if isinstance(cand, str) and _HUB_ID.fullmatch(cand) and not Path(cand).expanduser().exists() else None
    hub_id = hub_id or (spec.hub_id if spec is not None and spec.hub_id else None)
    lic = front.get("license") or (spec.license if spec is not None and spec.license else None)
    return {"hub_id": hub_id, "license": lic}


def _data_sources(path: str | None) -> list[str] | None:
    """Source names of a prepared (packed) dataset, from its manifest."""
    if not path:
        return None
    manifest = _read_json(Path(path) / "manifest.json") or {}
    sources = ((manifest.get("mixture") or {}).get("sources") or {})
    return sorted(sources) if isinstance(sources, dict) and sources else None


def _recipe_from_run(run_dir: Path) -> dict[str, Any] | None:
    """The training recipe of a consolidated run model, from the run's saved stage config."""
    configs = sorted(run_dir.glob("config_stage*.json"))
    if not configs:
        return None
    cfg = _read_json(configs[-1]) or {}
    train, optim, data = cfg.get("train") or {}, cfg.get("optim") or {}, cfg.get("data") or {}
    if data.get("source") == "synthetic":
        syn = data.get("synthetic") or {}
        data_desc: Any = (f"synthetic rows ({syn.get('rows')} random rows, vocabulary {syn.get('vocab_size')})"
                          if syn else "synthetic rows")
        sources = None
    else:
        data_desc, sources = data.get("path"), _data_sources(data.get("path"))
    recipe: dict[str, Any] = {"stage": cfg.get("stage"), "run": str(run_dir), "data": data_desc,
                              "data_sources": sources,
                              "seq_len": data.get("seq_len"), "lr": optim.get("lr"),
                              "global_batch_sequences": train.get("global_batch_sequences"),
                              "steps": train.get("total_steps") or train.get("max_steps"), "epochs": train.get("epochs")}
    teacher = cfg.get("teacher") or {}
    if cfg.get("stage") == 2 and teacher:
        tmodel = teacher.get("model") or {}
        recipe["teacher"] = tmodel.get("path") if isinstance(tmodel, dict) else tmodel
        recipe["teacher_source"] = teacher.get("source")
        # teacher.k (0 = exact); configs saved before it spell it top_k
        recipe["teacher_top_k"] = teacher.get("k", teacher.get("top_k"))
        recipe["teacher"] = recipe["teacher"] or (cfg.get("model") or {}).get("base")
    if cfg.get("stage") == 1:
        recipe["objective"] = "layer-wise distillation (ILD)"
    elif cfg.get("stage") == 2:
        recipe["objective"] = "KL distillation from the teacher"
    return {k: v for k, v in recipe.items() if v is not None}


def provenance(out_dir: Path, source: str | Path | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The card record of a checkpoint being written to `out_dir` from `source` (tokenizer source directory)."""
    src = Path(source) if source else None
    prior = load_card(src) if src is not None and src.is_dir() else None
    card: dict[str, Any] = dict(prior) if prior else {"format": 1, "base": None, "history": [], "teacher": None}
    card["history"] = list(card.get("history") or [])
    card.pop("eval", None)  # results of the previous checkpoint do not describe this one
    step: dict[str, Any] = {"date": _now()}
    if prior is not None:
        step.update(step="train", source=str(src))
    elif src is not None and (src / "config.json").is_file():
        base_cfg = _read_json(src / "config.json") or {}
        if base_cfg.get("model_type") != "hylo":
            card["base"] = {"path": str(src), "name": src.name, "model_type": base_cfg.get("model_type"),
                            **base_identity(src, base_cfg)}
            step.update(step="convert", source=str(src))
        else:
            step.update(step="save", source=str(src))
    else:
        step.update(step="save")
    recipe = _recipe_from_run(Path(out_dir).parent) if Path(out_dir).name == "model" else None
    if recipe:
        step["step"] = f"stage{recipe['stage']}" if recipe.get("stage") else "train"
        step["recipe"] = recipe
        if recipe.get("teacher"):
            card["teacher"] = recipe["teacher"]
    if extra:
        step.update({k: v for k, v in extra.items() if k not in ("base", "teacher")})
        if extra.get("base"):
            card["base"] = extra["base"] if isinstance(extra["base"], dict) else {"name": str(extra["base"])}
        if extra.get("teacher"):
            card["teacher"] = extra["teacher"]
    card["history"].append(step)
    # the model's name in the model-index: the directory, or the run of a run's `model/`
    out = Path(out_dir)
    card["name"] = (out.parent.name if out.name == "model" else out.name) or "hylo-model"
    return card


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v) if v else "-"
    return "-" if v is None else str(v)


def training_data(card: dict[str, Any]) -> list[str]:
    """Source names of the data every training step of the card read (in order, once each)."""
    names: list[str] = []
    for step in card.get("history") or []:
        for name in (step.get("recipe") or {}).get("data_sources") or []:
            if name not in names:
                names.append(name)
    return names


def _eval_results(results: dict[str, Any] | None, model_name: str) -> list[Any]:
    """The card's evaluation results as huggingface_hub EvalResults (the front matter's model-index)."""
    from huggingface_hub import EvalResult

    out = []
    for suite, metrics in sorted(((results or {}).get("metrics") or {}).items()):
        for key, val in sorted((metrics or {}).items()):
            if not isinstance(val, int | float) or isinstance(val, bool):
                continue
            dataset, measure = key.split(" ", 1) if suite == "lm_eval" and " " in key else (suite, key)
            out.append(EvalResult(task_type="text-generation", dataset_type=dataset, dataset_name=dataset,
                                  metric_type=measure, metric_name=measure, metric_value=val))
    return out


def front_matter(config, card: dict[str, Any], model_name: str) -> str:
    """The Hub metadata block (between `---` lines) of the card."""
    from huggingface_hub import ModelCardData

    base = card.get("base") or {}
    datasets = [spec.hub_id for spec in map(_registry, training_data(card)) if spec is not None and spec.hub_id]
    results = _eval_results(card.get("eval"), model_name)
    data = ModelCardData(
        library_name="transformers", pipeline_tag="text-generation",
        tags=["hylo", "hybrid", "mla", "gated-deltanet" if config.linear_type == "gdn" else "mamba2"],
        base_model=base.get("hub_id"), license=base.get("license"), datasets=datasets or None,
        model_name=model_name if results else None, eval_results=results or None)
    return f"---\n{data.to_yaml()}\n---"


def render(config, card: dict[str, Any]) -> str:
    """README.md of a checkpoint: front matter for the Hub, architecture, KV cache, provenance, results, usage."""
    model_name = card.get("name") or "hylo-model"
    base = card.get("base") or {}
    base_name = base.get("hub_id") or base.get("name") or "an unknown base model"
    kv = kv_cache(config)
    linear = config.linear_layers
    lines = [front_matter(config, card, model_name), "", f"# HyLo hybrid of {base_name}", "",
             f"A HyLo hybrid: {len(config.mla_layers)} Multi-head Latent Attention (MLA) layers and {len(linear)} "
             f"{'Gated DeltaNet' if config.linear_type == 'gdn' else 'Mamba-2'} layers, upcycled from "
             f"{base_name} by hylo-pipeline. This file is generated from `{CARD_JSON}` and `config.json`.", "",
             "## Architecture", "", "| | |", "|---|---|",
             f"| layers | {config.n_layer} |",
             f"| MLA layers | {_fmt(config.mla_layers)} |",
             f"| {config.linear_type} layers | {_fmt(linear)} |",
             f"| kv_lora_rank / qk_rope_head_dim | {config.kv_lora_rank} / {config.qk_rope_head_dim} |",
             *([f"| MLA q/k norm | yes (the cache also holds {config.kv_b_heads} key 1/RMS values per MLA layer and "
                f"token) |"] if getattr(config, "mla_qk_norm", False) else []),
             f"| hidden size / vocabulary | {config.hidden_size} / {config.vocab_size} |",
             f"| max positions | {config.max_position_embeddings} |",
             f"| KV cache per token (bf16) | {kv['hybrid_bf16_bytes_per_token']:,} bytes |"]
    if "kv_cache_ratio" in kv:
        lines.append(f"| KV cache vs base | {kv['base_bf16_bytes_per_token']:,} bytes/token: "
                     f"{100 * kv['kv_cache_ratio']:.1f} % |")
    lines += ["", "## How it was made", ""]
    if base:
        lines.append(f"* Base: `{base_name}` ({base.get('model_type') or 'unknown type'}"
                     + (f", license {base['license']}" if base.get("license") else ", license unknown") + ").")
    if card.get("teacher"):
        lines.append(f"* Teacher: `{card['teacher']}`.")
    for step in card.get("history") or []:
        desc = f"* {step.get('date', '')}: {step.get('step', 'save')}"
        if step.get("source"):
            desc += f" from `{step['source']}`"
        recipe = step.get("recipe") or {}
        if recipe:
            desc += " (" + ", ".join(f"{k} {_fmt(v)}" for k, v in recipe.items() if k not in ("stage", "run")) + ")"
        lines.append(desc)
    terms = []
    for name in training_data(card):
        spec = _registry(name)
        what = f"`{spec.hub_id}`" if spec is not None and spec.hub_id else f"`{name}` (local data)"
        lic = f", license {spec.license}" if spec is not None and spec.license else ""
        extra = f"; {spec.terms}" if spec is not None and spec.terms else ""
        terms.append(f"* Training data: {what}{lic}{extra}.")
    if terms or base.get("license"):
        lines += ["", "## License", "",
                  f"The weights derive from the base model and keep its license ({base.get('license') or 'unknown'}).",
                  *terms]
    results = card.get("eval")
    if results:
        lines += ["", "## Evaluation", "", f"From `{results.get('source', 'jobs/eval.py')}` ({results.get('date', '')}).",
                  "", "| suite | measure | value |", "|---|---|---|"]
        for suite, metrics in sorted((results.get("metrics") or {}).items()):
            for key, val in sorted(metrics.items()):
                lines.append(f"| {suite} | {key} | {_fmt(val)} |")
    lines += ["", "## Use", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)  # the code is in this directory",
              "tok = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)  # a stock tokenizer class; "
              "transformers reads the model's config first",
              "out = model.generate(**tok('Hello', return_tensors='pt'), max_new_tokens=32)",
              "```", "",
              "`lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True --tasks ...` evaluates it; "
              "with hylo-pipeline installed, `hylo-lm-eval --model hylo --model_args pretrained=PATH ...` too.", ""]
    return "\n".join(lines)


def write_card(directory: str | Path, config, card: dict[str, Any]) -> None:
    d = Path(directory)
    atomic_write(d / CARD_JSON, json.dumps(card, indent=2, sort_keys=True, default=str) + "\n")
    atomic_write(d / CARD_MD, render(config, card))


def add_eval_results(directory: str | Path, config, metrics: dict[str, dict[str, Any]], source: str) -> Path:
    """Record evaluation results (suite -> {measure: value}) in a checkpoint's card and re-render it."""
    d = Path(directory)
    card = load_card(d) or {"format": 1, "base": None, "history": [], "teacher": None}
    card["eval"] = {"date": _now(), "source": source, "metrics": metrics}
    write_card(d, config, card)
    return d / CARD_MD
