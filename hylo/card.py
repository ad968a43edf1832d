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
* README.md is written for someone who downloads the model: it names models and data by their Hub id or
  their directory's name, never by a path of the machine that wrote it (hylo_card.json, the record, keeps the
  paths); its code snippet loads the model by its name (the directory, or its Hub repo id once uploaded); it
  has an intended-use and limitations section, and a converted model that no stage trained says so.
* `datasets` lists the data the weights come from where known: the base's own (its card's front matter, or
  the asset registry's record of the base's card), then what training read. Evaluation results recorded with
  `--update-card` carry the conditions that make them differ from a full run (`--limit`).
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

import yaml

from hylo.assets import ASSETS, AssetError, asset_name
from hylo.atomic import atomic_write
from hylo.bounded_read import read_bounded
from hylo.json_files import MAX_JSON_BYTES, read_json
from hylo.yaml_limits import YamlShapeError, check_yaml_shape

CARD_JSON = "hylo_card.json"
CARD_MD = "README.md"


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = read_json(path)  # bounded, a regular file only
    except (OSError, ValueError):
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
    """The YAML front matter of a model card (README.md), {} when it has none (or one too deep, or of aliases
    that expand too far: hylo/yaml_limits.py)."""
    try:
        text = read_bounded(readme, MAX_JSON_BYTES, ValueError, "model card").decode("utf-8")
    except (OSError, ValueError):
        return {}
    m = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not m:
        return {}
    try:
        check_yaml_shape(m.group(1))
        data = yaml.safe_load(m.group(1))
    except (yaml.YAMLError, YamlShapeError):
        return {}
    return data if isinstance(data, dict) else {}


def _registry(name: str | None) -> Any:
    return ASSETS.get(name) if name else None


def base_identity(src: Path, base_cfg: dict[str, Any]) -> dict[str, Any]:
    """Hub id, license and training datasets of a base model directory, where known (None otherwise): the
    directory's own card and config first, then the asset registry (an asset directory is named after its
    asset)."""
    front = _front_matter(src / "README.md")
    spec = _registry(src.name)
    cand = base_cfg.get("_name_or_path")
    hub_id = cand if isinstance(cand, str) and _HUB_ID.fullmatch(cand) and not Path(cand).expanduser().exists() else None
    hub_id = hub_id or (spec.hub_id if spec is not None and spec.hub_id else None)
    lic = front.get("license") or (spec.license if spec is not None and spec.license else None)
    datasets = front.get("datasets") or (list(spec.datasets) if spec is not None and spec.datasets else None)
    if isinstance(datasets, str):
        datasets = [datasets]
    datasets = [d for d in datasets or [] if isinstance(d, str) and d] or None
    return {"hub_id": hub_id, "license": lic, "datasets": datasets}


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
    from huggingface_hub import EvalResult  # lazy: huggingface_hub

    out = []
    limit = (results or {}).get("limit")
    for suite, metrics in sorted(((results or {}).get("metrics") or {}).items()):
        for key, val in sorted((metrics or {}).items()):
            if not isinstance(val, int | float) or isinstance(val, bool):
                continue
            dataset, measure = key.split(" ", 1) if suite == "lm_eval" and " " in key else (suite, key)
            # a score on a --limit subset is not the task's score: its name says so
            shown = f"{measure} (--limit {limit:g})" if suite == "lm_eval" and limit else measure
            out.append(EvalResult(task_type="text-generation", dataset_type=dataset, dataset_name=dataset,
                                  metric_type=measure, metric_name=shown, metric_value=val))
    return out


def _shown_name(spec: Any) -> str:
    """How README.md names a model or data location: its Hub id where known, else its directory's name (a run's
    `model/` by its run), never a local path."""
    if spec is None:
        return "-"
    text = str(spec)
    try:
        name = asset_name(text)
    except AssetError:
        name = None
    if name is not None:
        spec_ = _registry(name)
        return spec_.hub_id if spec_ is not None and spec_.hub_id else name
    if "://" in text:
        return text
    p = Path(text)
    cfg = _read_json(p / "config.json") if p.is_dir() else None
    if cfg:
        own = load_card(p) or {}
        if (own.get("base") or {}).get("hub_id") is None and cfg.get("model_type") != "hylo":
            ident = base_identity(p, cfg)
            if ident["hub_id"]:
                return ident["hub_id"]
    if p.name == "model" and p.parent.name:
        return p.parent.name
    return p.name or text


def trained(card: dict[str, Any]) -> bool:
    """Whether a training stage produced (or preceded) this checkpoint."""
    return any((step.get("recipe") or {}).get("stage") for step in card.get("history") or [])


def front_matter(config, card: dict[str, Any], model_name: str) -> str:
    """The Hub metadata block (between `---` lines) of the card."""
    from huggingface_hub import ModelCardData  # lazy: huggingface_hub

    base = card.get("base") or {}
    datasets = list(base.get("datasets") or [])
    datasets += [spec.hub_id for spec in map(_registry, training_data(card))
                 if spec is not None and spec.hub_id and spec.hub_id not in datasets]
    results = _eval_results(card.get("eval"), model_name)
    data = ModelCardData(
        library_name="transformers", pipeline_tag="text-generation",
        tags=["hylo", "hybrid", "mla", "gated-deltanet" if config.linear_type == "gdn" else "mamba2"],
        base_model=base.get("hub_id"), license=base.get("license"), datasets=datasets or None,
        model_name=model_name if results else None, eval_results=results or None)
    return f"---\n{data.to_yaml()}\n---"


def _recipe_text(recipe: dict[str, Any]) -> str:
    """A training step's recipe as README.md shows it (names, not paths)."""
    parts = []
    for k, v in recipe.items():
        if k in ("stage", "run", "data_sources"):
            continue
        if k == "data":
            v = ", ".join(recipe["data_sources"]) if recipe.get("data_sources") else (
                v if str(v).startswith("synthetic") else _shown_name(v))
        elif k == "teacher":
            v = _shown_name(v)
        parts.append(f"{k} {_fmt(v)}")
    return ", ".join(parts)


def _intended_use(config, card: dict[str, Any], base_name: str) -> list[str]:
    kv = kv_cache(config)
    ratio = f" (its KV cache is {100 * kv['kv_cache_ratio']:.1f} % of the base's per token)" if "kv_cache_ratio" in kv else ""
    lines = ["", "## Intended use and limitations", "",
             f"A research checkpoint made with hylo-pipeline: {base_name} with its attention layers replaced by "
             f"{len(config.mla_layers)} MLA and {len(config.linear_layers)} "
             f"{'Gated DeltaNet' if config.linear_type == 'gdn' else 'Mamba-2'} layers{ratio}, for studying "
             "long-context efficiency and distillation; text generation in the base model's languages and chat "
             "format."]
    if not trained(card):
        lines += ["", "**Converted, not trained.** Its MLA and linear layers were initialised from the base's "
                      "attention weights (an SVD and a short calibration on a built-in text) and no training stage "
                      "has run: expect far worse output than the base's (compare the KL to the base below, when "
                      "evaluated). Train it with `hylo stage1` and `hylo stage2` before any other use."]
    else:
        recipes = [step["recipe"] for step in card.get("history") or [] if (step.get("recipe") or {}).get("stage")]
        budget = "; ".join(f"stage {r['stage']}: {_fmt(r.get('steps'))} steps of {_fmt(r.get('global_batch_sequences'))} "
                           f"rows" + (f" of {r['seq_len']} tokens" if r.get("seq_len") else "") for r in recipes)
        lines += ["", f"Distilled from its base / teacher with a limited budget ({budget}): its quality is bounded by "
                      "that budget and by its training data; evaluate it on your own task before relying on it."]
    lines += ["",
              "* It inherits the limitations and biases of the base model and of its training data, and has no "
              "safety tuning beyond the base's.",
              f"* Positions up to {config.max_position_embeddings} are configured; lengths beyond what training "
              "covered are not validated.",
              "* Not for decisions about people, or for medical, legal or financial advice."]
    return lines


def render(config, card: dict[str, Any]) -> str:
    """README.md of a checkpoint: front matter for the Hub, architecture, KV cache, provenance, intended use,
    results, usage. Models and data are named, never given as local paths (module docstring)."""
    model_name = card.get("name") or "hylo-model"
    base = card.get("base") or {}
    base_name = base.get("hub_id") or base.get("name") or "an unknown base model"
    kv = kv_cache(config)
    linear = config.linear_layers
    lines = [front_matter(config, card, model_name), "", f"# HyLo hybrid of {base_name}", "",
             f"A HyLo hybrid: {len(config.mla_layers)} Multi-head Latent Attention (MLA) layers and {len(linear)} "
             f"{'Gated DeltaNet' if config.linear_type == 'gdn' else 'Mamba-2'} layers, upcycled from "
             f"{base_name} by hylo-pipeline" + ("" if trained(card) else " (converted only: not trained yet)")
             + f". This file is generated from `{CARD_JSON}` and `config.json`.", "",
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
        lines.append(f"* Teacher: `{_shown_name(card['teacher'])}`.")
    for step in card.get("history") or []:
        desc = f"* {step.get('date', '')}: {step.get('step', 'save')}"
        if step.get("source"):
            shown = base_name if step.get("step") == "convert" else _shown_name(step["source"])
            desc += f" from `{shown}`"
        recipe = step.get("recipe") or {}
        if recipe:
            desc += f" ({_recipe_text(recipe)})"
        lines.append(desc)
    terms = []
    if base.get("datasets"):
        terms.append(f"* The base's training data, as its card names it: {', '.join(f'`{d}`' for d in base['datasets'])}.")
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
    lines += _intended_use(config, card, base_name)
    results = card.get("eval")
    if results:
        limit = results.get("limit")
        lines += ["", "## Evaluation", "", f"From `hylo eval` ({results.get('date', '')})."]
        if limit:
            lines += ["", f"lm-eval scores are on at most {limit:g} {'examples' if limit >= 1 else 'of the examples'} "
                          f"per task (`--limit {limit:g}`): a subset, not comparable with scores on the full tasks."]
        lines += ["", "| suite | measure | value |", "|---|---|---|"]
        for suite, metrics in sorted((results.get("metrics") or {}).items()):
            for key, val in sorted(metrics.items()):
                lines.append(f"| {suite} | {key} | {_fmt(val)} |")
        counts = results.get("samples") or {}
        if counts:
            lines += ["", "Examples evaluated per task: " + ", ".join(f"{t} {n}" for t, n in sorted(counts.items())) + "."]
    repo = card.get("repo_id") or model_name
    lines += ["", "## Use", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              f"model_id = {repo!r}  # this directory, or its Hub repo id once uploaded (e.g. your-name/{model_name})",
              "model = AutoModelForCausalLM.from_pretrained(model_id, trust_remote_code=True)  # the code is in the repo",
              "tok = AutoTokenizer.from_pretrained(model_id, trust_remote_code=True)  # a stock tokenizer class; "
              "transformers reads the model's config first",
              "out = model.generate(**tok('Hello', return_tensors='pt'), max_new_tokens=32)",
              "```", "",
              f"`lm_eval --model hf --model_args pretrained={repo},trust_remote_code=True --tasks ...` evaluates it; "
              f"with hylo-pipeline installed, `hylo-lm-eval --model hylo --model_args pretrained={repo} ...` too.", ""]
    return "\n".join(lines)


def write_card(directory: str | Path, config, card: dict[str, Any]) -> None:
    d = Path(directory)
    atomic_write(d / CARD_JSON, json.dumps(card, indent=2, sort_keys=True, default=str) + "\n")
    atomic_write(d / CARD_MD, render(config, card))


def add_eval_results(directory: str | Path, config, metrics: dict[str, dict[str, Any]], source: str,
                     limit: float | None = None, samples: dict[str, int] | None = None) -> Path:
    """Record evaluation results (suite -> {measure: value}) in a checkpoint's card and re-render it; `limit` is
    lm-eval's `--limit` (the scores are then on a subset, and the card says so), `samples` the examples each
    lm-eval task was scored on."""
    d = Path(directory)
    card = load_card(d) or {"format": 1, "base": None, "history": [], "teacher": None}
    card["eval"] = {"date": _now(), "source": source, "metrics": metrics,
                    **({"limit": limit} if limit else {}), **({"samples": samples} if samples else {})}
    write_card(d, config, card)
    return d / CARD_MD
