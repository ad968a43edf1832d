"""The whole HyLo recipe on SmolLM2-135M-Instruct and real ShareGPT, on local Ray, on CPU (`jobs/demo.py`).

fetch assets -> decontaminate ShareGPT against HumanEval -> prepare stage-1 / stage-2 / held-out rows ->
convert (MLA on even layers, GDN elsewhere) -> stage 1 (Enhanced-ILD) -> stage 2 (KL from the teacher)
-> evaluate (KL to the teacher and perplexity before and after each stage; KV cache and decode speed vs
context after stage 2). `full_eval` adds the needle-in-a-haystack retrieval suite, which a 135M model
does not pass at any length (it is there for real models), and longer KV-cache contexts.

Design choices:
* Each step runs the project's own job as a subprocess (the same command a user would type), logged to
  <run_dir>/logs/<step>.log; a finished step leaves <run_dir>/done/<step>.json and is skipped on a re-run
  after checking its outputs still exist (`hylo.pipeline.runner.StepRunner`). The steps that use Ray join
  one local Ray started once for the run, instead of starting one each.
* The options are a `DemoConfig` (`--config`, `--set key=value`, `--print-config`); the job's flags
  (`--steps 8`, `--full-eval`, ...) are shorthands for its keys.
* The run ends with a table on stdout and <run_dir>/report.md with PNG plots (loss curves, KL per
  stage, KV-cache bytes per token vs context); `update_readme` copies the table into README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from hylo.assets import fetch_asset
from hylo.atomic import atomic_write
from hylo.json_files import read_json
from hylo.logs import get_logger
from hylo.pipeline.cli import MAX_COUNT, bounded_int, int_list
from hylo.pipeline.config import at_least, config_from_args, each, rules, shipped_config
from hylo.pipeline.paths import job_inputs
from hylo.pipeline.runner import (
    ROOT,
    RUNNER_FLAGS,
    RunnerConfig,
    StepRunner,
    convert_cmd,
    eval_cmd,
    job,
    last_json_object,
    lengths_arg,
    runner_parser,
    train_cmd,
)
from hylo.rules import ROW_TOKENS_MAX, SEED_MAX

logger = get_logger(__name__)

# The KV cache grows linearly: three short contexts show the measured ratio as well as long ones.
DEFAULT_KV_LENGTHS = [512, 1024, 2048]
FULL_KV_LENGTHS = [1024, 2048, 4096]
# Greedy tokens of each sample answer (pipeline/eval/samples.py): a sentence, seconds per model on a CPU.
SAMPLE_TOKENS = 20
README_START, README_END = "<!-- demo-results:start -->", "<!-- demo-results:end -->"


@dataclass
@rules(steps=at_least(1), records=at_least(1), heldout=at_least(1), heldout_rows=at_least(1), seq_len=at_least(2),
       retrieval_lengths=each(at_least(1), nonempty=True), kv_lengths=each(at_least(1), nonempty=True),
       placement_seeds=each(at_least(0), nonempty=True))
class DemoConfig(RunnerConfig):
    # run_dir, force, quiet, ray: RunnerConfig (pipeline/runner.py); the report is <run_dir>/report.md.
    run_dir: str = "runs/demo"
    # Optimiser steps per training stage.
    steps: int = 8
    # Clean ShareGPT records read for the training rows.
    records: int = 300
    # Held-out conversations (after the training records) for the KL evaluation.
    heldout: int = 64
    # Packed held-out rows the KL is measured on.
    heldout_rows: int = 8
    # Tokens per packed row.
    seq_len: int = 512
    # After stage 2 also run needle-in-a-haystack retrieval (base and hybrid) and the KV cache at
    # FULL_KV_LENGTHS: the real-run suites at CPU sizes (a 135M model scores ~0 on them).
    full_eval: bool = False
    # With full_eval: NIAH context lengths.
    retrieval_lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    # KV-cache context lengths (None: DEFAULT_KV_LENGTHS, FULL_KV_LENGTHS with full_eval).
    kv_lengths: list[int] | None = None
    # Also run jobs/place_layers.py: the searched 15-MLA placement vs even vs uniform:15, each with the
    # same stage 1 + stage 2 budget (about three demo runs more).
    placement_study: bool = False
    # With placement_study: repeat each compared placement per seed (mean, spread, paired gaps).
    placement_seeds: list[int] = field(default_factory=lambda: [0])
    # Write the results table and KL plot into README.md (maintainers).
    update_readme: bool = False


def config(name: str) -> str:
    """The path of shipped config file `name` (configs/ of a checkout, hylo/configs/ installed)."""
    found = shipped_config(name)
    assert found is not None, f"the package ships no config {name}"
    return str(found)


class Demo(StepRunner):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__(cfg.run_dir, force=cfg.force, quiet=cfg.quiet, tag="demo", ray=cfg.ray,
                         inputs=job_inputs(cfg))
        self.cfg = cfg

    # ------------------------------------------------------------------ steps
    def assets(self) -> dict:
        self.base = fetch_asset("smollm2-135m-instruct")
        self.sharegpt = fetch_asset("sharegpt")
        fetch_asset("humaneval")
        return {"base": str(self.base)}

    def decontaminate(self) -> dict:
        out = self.run / "decontam"
        self.sh("decontaminate", [*job("decontaminate"), "--input", f"sharegpt={self.sharegpt}",
                                  "--benchmark", "humaneval", "--out", str(out),
                                  "--set", "output_format=jsonl"], ray=True)
        summary = read_json(out / "summary.json")
        return {"summary": summary}

    def heldout(self) -> dict:
        """Held-out chat records for the KL evaluation: clean records after the ones training reads."""
        c = self.cfg
        clean = self.run / "decontam" / "clean.jsonl"
        lines = clean.read_text().splitlines()
        start = min(c.records, max(0, len(lines) - c.heldout))
        keep = lines[start : start + c.heldout]
        path = self.run / "heldout.jsonl"
        path.write_text("\n".join(keep) + "\n")
        # packed like the training rows, so the evaluation cost is bounded by rows x seq_len
        self.sh("prepare_heldout", [
            *job("prepare_data"), "--config", config("data_stage2.yaml"), "--set", "split=all",
            "--set", f"mixture.sources=[{{name: heldout, path: '{path}'}}]",
            "--set", f"packing.max_len={c.seq_len}",
            "--set", f"output.dir={self.run / 'data' / 'heldout'}", "--set", "output.overwrite=true",
        ], ray=True)
        return {"records": len(keep), "first_index": start}

    def training_records(self) -> Path:
        """The first `records` clean records in a file of their own, so each prepare job reads only those."""
        path = self.run / f"train-{self.cfg.records}.jsonl"
        if not path.is_file():
            with open(self.run / "decontam" / "clean.jsonl") as f:
                lines = [line for _, line in zip(range(self.cfg.records), f)]
            atomic_write(path, "".join(lines))
        return path

    def prepare(self, split: str) -> dict:
        out = self.run / "data" / split
        train = self.training_records()
        self.sh(f"prepare_{split}", [
            *job("prepare_data"), "--config", config(f"data_{split}.yaml"),
            "--set", f"split={split}",
            "--set", f"mixture.sources=[{{name: sharegpt, path: '{train}'}}]",
            "--set", f"packing.max_len={self.cfg.seq_len}",
            "--set", f"output.dir={out}", "--set", "output.overwrite=true",
        ], ray=True)
        manifest = read_json(out / "manifest.json")
        return {"manifest_counts": manifest.get("counts", {})}

    def convert(self) -> dict:
        out = self.run / "converted"
        text = self.sh("convert", convert_cmd(self.base, out, "even", 256))
        return {"summary": last_json_object(text)}

    def train(self, stage: int) -> dict:
        name = f"stage{stage}"
        student = self.run / ("converted" if stage == 1 else "stage1/model")
        # 512-token rows need no activation checkpointing; without it a CPU step is ~1/4 faster
        # the rows' length is the one the data was prepared with (seq_len -> packing.max_len -> manifest)
        self.sh(name, train_cmd(stage, config("demo-smollm2.yaml"), self.run, name, student,
                                self.run / "data" / name, None, self.cfg.steps,
                                ["--set", "model.activation_checkpointing=false"]), ray=True)
        return {"model": str(self.run / name / "model")}

    def final_suites(self) -> list[str]:
        """Suites after stage 2: KL and the KV cache; with full_eval also needle-in-a-haystack retrieval."""
        return ["kl", "retrieval", "kvcache", "samples"] if self.cfg.full_eval else ["kl", "kvcache", "samples"]

    def kv_lengths(self) -> list[int]:
        return self.cfg.kv_lengths or (FULL_KV_LENGTHS if self.cfg.full_eval else DEFAULT_KV_LENGTHS)

    def evaluate(self, name: str, model: Path, suites: list[str]) -> dict:
        out = self.run / "eval" / name
        # the teacher (the base model) is the same for all three evaluations: its forward on the held-out
        # rows runs once and later evaluations reuse its hidden states; the results go into each model's card
        extra = ["--update-card", "--set", "kvcache.decode_tokens=8",
                 "--set", f"kl.teacher_cache={self.run / 'eval' / 'teacher_states.safetensors'}"]
        if "retrieval" in suites:
            extra += ["--set", f"retrieval.lengths={lengths_arg(self.cfg.retrieval_lengths)}",
                      "--set", "retrieval.samples_per_length=4"]
        if "kvcache" in suites:
            extra += ["--set", f"kvcache.lengths={lengths_arg(self.kv_lengths())}"]
        if "samples" in suites:
            # the base's answers once, with the converted model's
            extra += ["--set", f"samples.max_new_tokens={SAMPLE_TOKENS}", "--set", f"samples.base={name == 'converted'}"]
        cmd = eval_cmd(model, self.base, self.run / "data" / "heldout", out, ",".join(suites),
                       self.cfg.heldout_rows, extra)
        self.sh(f"eval_{name}", cmd)
        return read_json(out / "results.json")

    def serving_python(self) -> str | None:
        """vLLM's interpreter (`make serve-install`), or None with a line saying the served answers are skipped."""
        from hylo.pipeline.serve import ServeConfig, ServeError, serving_python

        try:
            return serving_python(ServeConfig())
        except ServeError as e:
            logger.warning(f"[{self.tag}] served answers (vLLM): not run: {e}")
            return None

    def serve(self, python: str) -> dict:
        """The stage-2 model served by vLLM (`hylo serve`), asked the samples' prompts through its OpenAI chat
        endpoint, greedily, as many tokens as the samples suite's answers."""
        from hylo.pipeline.eval.config import SamplesSection
        from hylo.pipeline.serve import ServeConfig, served_answers

        logger.info(f"[{self.tag}] === serve: the stage-2 model in vLLM ({python}), asked the samples' prompts")
        # eager: on a CPU, vLLM's torch.compile warm-up of this model takes minutes, longer than the answers
        cfg = ServeConfig(model=str(self.run / "stage2" / "model"), python=python, cpu_kv_cache_gib=1,
                          vllm_args=["--enforce-eager"])
        answers = served_answers(cfg, SamplesSection().prompts, SAMPLE_TOKENS, self.run / "logs" / "serve.log")
        (self.run / "serve").mkdir(exist_ok=True)
        atomic_write(self.run / "serve" / "answers.json", json.dumps(answers, indent=1))
        return {"answers": answers}

    def eval_outputs(self, name: str, suites: list[str]) -> list[Path]:
        """The step's output; an earlier run that lacks one of `suites` (no full_eval then) is redone."""
        results = self.run / "eval" / name / "results.json"
        if results.is_file() and not set(suites) <= set(read_json(results)):
            self.done_file(f"eval_{name}").unlink(missing_ok=True)
        return [results]

    def placement(self) -> dict:
        """The layer-placement study (jobs/place_layers.py): searched N=15 vs even vs uniform:15."""
        c = self.cfg
        self.sh("placement", [*job("place_layers"), "--n-mla", "15", "--data-from", str(self.run),
                              "--run-dir", str(self.run / "placement"), "--steps", str(c.steps),
                              "--heldout-rows", str(c.heldout_rows), "--seq-len", str(c.seq_len),
                              "--compare", "even", "uniform:15", "--compare-steps", str(c.steps),
                              "--compare-seeds", *map(str, c.placement_seeds),
                              "--train-set", "model.activation_checkpointing=false"]
                + (["--quiet"] if c.quiet else []), ray=True)
        return read_json(self.run / "placement" / "compare.json")

    # ------------------------------------------------------------------ report
    def report(self, info: dict) -> str:
        from hylo.pipeline.train.metrics import read_metrics  # lazy: torch

        kl = {k: info[f"eval_{k}"]["kl"]["kl"] for k in ("converted", "stage1", "stage2")}
        conv = info["convert"]["summary"]
        final = info["eval_stage2"]
        rows = [
            (KV_RATIO_LABEL, f"{conv['kv_cache_ratio']:.3f}"),
            ("KL(teacher || student), after conversion", f"{kl['converted']:.4f}"),
            ("KL(teacher || student), after stage 1", f"{kl['stage1']:.4f}"),
            ("KL(teacher || student), after stage 2", f"{kl['stage2']:.4f}"),
            ("records removed by decontamination (HumanEval)", str(removed_count(self.run))),
        ]
        for who, acc in retrieval_summary(final).items():
            rows.append((f"retrieval accuracy, {who}", acc))
        rows += kv_rows(final)
        rows.append(served_row(info))
        for name, secs in self.times.items():
            rows.append((f"wall time: {name}", f"{secs:.0f} s"))
        rows.append(("wall time: all steps", f"{sum(self.times.values()):.0f} s"))
        rows.append(("wall time: this invocation (finished steps are reused)", f"{time.time() - self.t_start:.0f} s"))
        width = max(len(a) for a, _ in rows)
        table = "\n".join(f"{a:<{width}}  {b}" for a, b in rows)
        md = ["# HyLo demo: SmolLM2-135M-Instruct -> 15 MLA + 15 GDN", "",
              "| measure | value |", "|---|---|"] + [f"| {_md_cell(a)} | {_md_cell(b)} |" for a, b in rows]
        note = steps_note(self.cfg.steps, demo_batch(), self.cfg.seq_len, kl)
        md += ["", kv_ratio_note(conv), "", note]
        table += "\n\n" + textwrap.fill(note, 110)
        plots = demo_plots(self.run, kl, final, read_metrics(self.run / "stage1"), read_metrics(self.run / "stage2"))
        md += [""] + [f"![{p.stem}]({p.name})" for p in plots]
        study = self.run / "placement" / "compare.md"
        if study.is_file():
            md += ["", *("#" + line if line.startswith("# ") else line for line in study.read_text().splitlines()),
                   "", "![placement scores](placement/placement_scores.png)"]
        answers = sample_answers(info)
        if answers:
            who = list(answers[0][1])
            md += ["", "## What the models say (greedy, the same prompts)", "",
                   "| prompt | " + " | ".join(who) + " |", "|---|" + "---|" * len(who)]
            md += ["| " + " | ".join([p, *(_md_cell(a[w]) for w in who)]) + " |" for p, a in answers]
            table += "\n\nWhat the models say (greedy, printed as it comes out):"
            for prompt, by in answers:
                table += f"\n\n  {prompt}"
                table += "".join(f"\n    {w + ':':<10} {' '.join(a.split()) or '(empty)'}" for w, a in by.items())
        (self.run / "report.md").write_text("\n".join(md) + "\n")
        return table

    # ------------------------------------------------------------------ main
    def main(self) -> int:
        info: dict = {}
        r = self.run
        self.assets()
        info["decontaminate"] = self.step("decontaminate", [r / "decontam" / "clean.jsonl"], self.decontaminate)
        self.step("heldout", [r / "data" / "heldout" / "manifest.json"], self.heldout)
        for split in ("stage1", "stage2"):
            self.step(f"prepare_{split}", [r / "data" / split / "manifest.json"], lambda s=split: self.prepare(s))
        info["convert"] = self.step("convert", [r / "converted" / "hybrid_config.json"], self.convert)
        info["eval_converted"] = self.step("eval_converted", self.eval_outputs("converted", ["kl", "samples"]),
                                           lambda: self.evaluate("converted", r / "converted", ["kl", "samples"]))
        self.step("stage1", [r / "stage1" / "model" / "hybrid_config.json"], lambda: self.train(1))
        info["eval_stage1"] = self.step("eval_stage1", self.eval_outputs("stage1", ["kl", "samples"]),
                                        lambda: self.evaluate("stage1", r / "stage1" / "model", ["kl", "samples"]))
        self.step("stage2", [r / "stage2" / "model" / "hybrid_config.json"], lambda: self.train(2))
        final = self.final_suites()
        info["eval_stage2"] = self.step("eval_stage2", self.eval_outputs("stage2", final),
                                        lambda: self.evaluate("stage2", r / "stage2" / "model", final))
        python = self.serving_python()
        if python is not None:
            self.step("serve", [r / "serve" / "answers.json"], lambda: self.serve(python))
        for k in ("eval_converted", "eval_stage1", "eval_stage2"):
            # a skipped step returns its done-marker; the results live in results.json
            info[k] = read_json(r / "eval" / k.removeprefix("eval_") / "results.json")
        served = r / "serve" / "answers.json"
        info["serve"] = read_json(served) if served.is_file() and python is not None else None
        if self.cfg.placement_study:
            seeds = self.cfg.placement_seeds
            # other seeds are another step (place_layers itself reuses every run that finished)
            name = "placement" if seeds == [0] else "placement_seeds_" + "-".join(map(str, seeds))
            self.step(name, [r / "placement" / "compare.json"], self.placement)
        info["convert"] = read_json(self.done_file("convert"))
        info["decontaminate"] = read_json(self.done_file("decontaminate"))
        table = self.report(info)
        if self.cfg.update_readme:
            update_readme(self.run, ROOT / "README.md")
        print("\n" + table)
        print(f"\n[demo] report: {r / 'report.md'}")
        return 0


def demo_batch() -> int:
    """Packed rows per optimiser step of the demo's stages (configs/demo-smollm2.yaml)."""
    from hylo.pipeline.train.config import load_stage_config  # lazy: the training config

    return load_stage_config(1, config("demo-smollm2.yaml")).train.global_batch_sequences


# One optimiser step of the 64K recipes' stage 2: global_batch_sequences x data.seq_len
# (configs/llama-3.2-1b-8mla8gdn-64k.yaml, configs/llama-3.2-3b-14mla14gdn-64k.yaml)
RECIPE_STEP_TOKENS = 8 * 65536


def steps_note(steps: int, batch: int, seq_len: int, kl: dict[str, float]) -> str:
    """What the demo's few CPU steps can and cannot show, with its own figures."""
    rows = steps * batch
    tokens = rows * seq_len
    return (f"What {steps} + {steps} steps can show: each stage trains on {rows} packed rows of {seq_len} tokens "
            f"({tokens:,} tokens; one step of a 64K recipe's stage 2 reads {RECIPE_STEP_TOKENS:,}). The KL falls at "
            f"each stage ({kl['converted']:.2f} -> {kl['stage1']:.2f} -> {kl['stage2']:.2f}): the conversion, both "
            f"losses, their gradients and checkpoints work end to end and move the student toward its teacher. What "
            f"they cannot show: quality. The converted model's answers are broken, and {tokens:,} tokens do not mend "
            f"them; the stage-2 model may loop on a phrase ('The capital of the capital of ...'). Quality needs a "
            f"recipe's run on GPUs (not measured here).")


SERVED = "stage 2, vLLM"


def served_row(info: dict) -> tuple[str, str]:
    """How many of the stage-2 model's answers vLLM gave word for word, or why it did not run."""
    label = "stage-2 answers served by vLLM (bf16) equal to generate's (fp32)"
    served = info.get("serve")
    if not served:
        return label, "not run (no vLLM environment: make serve-install)"
    ours = (info["eval_stage2"].get("samples") or {}).get("model") or []
    same = sum(a["answer"] == b["answer"] for a, b in zip(served, ours))
    return label, f"{same} of {len(served)}"


def sample_answers(info: dict) -> list[tuple[str, dict[str, str]]]:
    """(prompt, {base, converted, stage 1, stage 2, stage 2 served by vLLM: answer}) from the evaluations' `samples`
    suites and the served model's answers."""
    runs = [("converted", info["eval_converted"]), ("stage 1", info["eval_stage1"]), ("stage 2", info["eval_stage2"])]
    first = runs[0][1].get("samples")
    if not first:
        return []
    out = []
    for i, item in enumerate(first["model"]):
        by = {"base": first["base"][i]["answer"]} if "base" in first else {}
        for who, res in runs:
            samples = (res.get("samples") or {}).get("model") or []
            if i < len(samples):
                by[who] = samples[i]["answer"]
        served = info.get("serve") or []
        if i < len(served) and served[i]["prompt"] == item["prompt"]:
            by[SERVED] = served[i]["answer"]
        out.append((item["prompt"], by))
    return out


def _md_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "(empty)"


def removed_count(run: Path) -> int:
    """Records the decontamination removed (dropped or cut), counted from removed.jsonl."""
    path = run / "decontam" / "removed.jsonl"
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def retrieval_summary(res: dict) -> dict[str, str]:
    """"task@length: accuracy, ..." of the hybrid and the base, from an evaluation's results."""
    out: dict[str, str] = {}
    ret = res.get("retrieval")
    if not ret:
        return out
    for who in ("model", "base"):
        part = ret.get(who)
        if not isinstance(part, dict):
            continue
        acc = part.get("accuracy", {})
        cells = []
        for task, by_len in acc.items():
            for length, cell in by_len.items():
                cells.append(f"{task}@{length}: {cell.get('accuracy', 0):.2f}")
        out["hybrid" if who == "model" else "base"] = ", ".join(cells)
    return out


# The report's KV rows. Per cached token, the hybrid keeps its MLA layers' latents (and roped keys) where the
# base keeps every layer's K and V: the converter's ratio, and what the measured growing part shows. The GDN
# layers' state is the same size at every length: the cache allocated in all (the plot) holds it too, so its
# ratio is higher at short contexts and falls toward the per-token one as the context grows.
KV_RATIO_LABEL = "KV cache per token, hybrid / base (converter: MLA latents vs K+V)"


def kv_rows(final: dict) -> list[tuple[str, str]]:
    """The measured KV rows of the report: per length, the per-token ratio of the part that grows with the
    context, then the ratio of the cache allocated in all (what kv_cache_vs_context.png plots)."""
    per_length = final.get("kvcache", {}).get("comparison", {}).get("per_length", [])
    rows = [(f"measured KV cache per token, hybrid / base, at {r['context']} tokens (MLA latents vs K+V)",
             f"{r['measured_ratio']:.3f}") for r in per_length if "measured_ratio" in r]
    rows += [(f"measured KV cache in all, hybrid / base, at {r['context']} tokens (+ GDN state, as plotted)",
              f"{r['measured_ratio_total']:.3f}") for r in per_length if "measured_ratio_total" in r]
    return rows


def kv_series(final: dict) -> dict[str, tuple[list[int], list[float]]]:
    """What kv_cache_vs_context.png plots: per model, (context lengths, KV cache allocated in all, bytes)."""
    kv = final.get("kvcache", {})
    if not (kv.get("model") and kv.get("base")):
        return {}
    return {label: ([r["context"] for r in rows], [r["total_bytes"] for r in rows])
            for rows, label in ((kv["base"], "base (GQA, 30 layers)"), (kv["model"], "HyLo (15 MLA + 15 GDN)"))}


def kv_ratio_note(conv: dict) -> str:
    """Why the demo's KV ratio is what it is, from the converter's summary (`hylo convert`'s JSON)."""
    n_mla, n_layers, ratio = conv["n_mla"], conv["n_mla"] + conv["n_linear"], conv["kv_cache_ratio"]
    mla = conv["mla_values_per_token"]
    # ratio = n_mla * mla / (n_layers * base values a layer): the base's K+V values a layer caches per token
    base = round(n_mla * mla / (ratio * n_layers))
    return (f"Why {ratio * 100:.1f} %: per token, {n_mla} MLA layers keep {mla} values each (kv_lora_rank "
            f"{conv['kv_lora_rank']} + roped key {conv['qk_rope_head_dim']}) where the base's {n_layers} layers keep "
            f"{base} each (K and V): {n_mla} x {mla} / ({n_layers} x {base}) = {ratio:.3f}. SmolLM2-135M caches "
            "little per layer (3 KV heads of 64), so an MLA layer saves little; the published recipes' bases keep "
            "1,024-2,048 values a layer and reach 3.9-7.8 % (their configs' headers). The cache in all also holds "
            "the GDN layers' fixed-size state.")


def demo_figures(kl: dict, final: dict, m1: dict, m2: dict) -> dict[str, object]:
    """The report's figures by file name: loss_curves.png, kl_per_stage.png and (when measured)
    kv_cache_vs_context.png; every axis labelled."""
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    figs: dict[str, object] = {}
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    for a, m, title, loss in ((ax[0], m1, "stage 1 (ILD loss)", "L2 distance per token, summed over layers"),
                              (ax[1], m2, "stage 2 (KL loss)", "KL(teacher || student), nats/token")):
        steps = sorted(m)
        a.plot(steps, [m[s].get("loss") for s in steps], marker="o")
        a.set_xlabel("optimiser step")
        a.set_ylabel(loss)
        a.set_title(title)
    fig.tight_layout()
    figs["loss_curves.png"] = fig
    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["converted", "stage 1", "stage 2"]
    vals = [kl["converted"], kl["stage1"], kl["stage2"]]
    ax.bar(names, vals, color=["#999", "#69c", "#36a"])
    ax.set_xlabel("student after")
    ax.set_ylabel("KL(teacher || student), nats/token")
    ax.set_title("held-out ShareGPT")
    fig.tight_layout()
    figs["kl_per_stage.png"] = fig
    series = kv_series(final)
    if series:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for label, (xs, ys) in series.items():
            ax.plot(xs, [y / 2**20 for y in ys], marker="o", label=label)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("KV cache allocated in all (MiB, fp32)")
        ax.set_title("hybrid: MLA latents + GDN state", fontsize=10)
        ax.legend()
        fig.tight_layout()
        figs["kv_cache_vs_context.png"] = fig
    return figs


def demo_plots(run: Path, kl: dict, final: dict, m1: dict, m2: dict) -> list[Path]:
    """The report's figures (`demo_figures`) written to `run`."""
    import matplotlib.pyplot as plt  # lazy: matplotlib

    out = []
    for name, fig in demo_figures(kl, final, m1, m2).items():
        fig.savefig(run / name, dpi=110)
        out.append(run / name)
    plt.close("all")
    return out


def update_readme(run: Path, readme: Path) -> None:
    """Replace the README's results block with `run`'s report table and copy its KL plot to docs/."""
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        logger.warning("[demo] README has no demo-results markers; not updated")
        return
    docs = readme.parent / "docs"
    docs.mkdir(exist_ok=True)
    shutil.copy(run / "kl_per_stage.png", docs / "demo_kl_per_stage.png")
    body: list[str] = []  # the results table: the report's first run of table lines
    for line in (run / "report.md").read_text().splitlines():
        if line.startswith("|"):
            body.append(line)
        elif body:
            break
    block = "\n".join([README_START, "", *body, "", "![KL per stage](docs/demo_kl_per_stage.png)", "", README_END])
    head, rest = text.split(README_START, 1)
    readme.write_text(head + block + rest.split(README_END, 1)[1])
    logger.info(f"[demo] README results updated from {run / 'report.md'}")


# ---------------------------------------------------------------------------------- command line
# Each shorthand flag's config key (the flags win over --config and --set).
FLAG_KEYS = {**RUNNER_FLAGS, **{name: name for name in (
    "steps", "records", "heldout", "heldout_rows", "seq_len", "full_eval", "retrieval_lengths", "kv_lengths",
    "placement_study", "placement_seeds", "update_readme")}}


def build_parser() -> argparse.ArgumentParser:
    ap = runner_parser(
        "The whole HyLo recipe on SmolLM2-135M-Instruct and real ShareGPT, on local Ray, on CPU.\n\n"
        "    hylo demo                                   # ~6 minutes on 2 cores; the table and runs/demo/report.md\n"
        "    hylo demo --steps 1 --records 40 --heldout 8 --heldout-rows 1 --seq-len 128 --run-dir runs/demo-tiny\n"
        "        # the smallest run: ~3.5 min on 2 busy cores, mostly starting Ray, DeepSpeed and the models\n"
        "    hylo demo --full-eval --set heldout_rows=16\n\n"
        "run_dir default runs/demo (relative to the current directory). Every option is a key of DemoConfig\n"
        "(pipeline/demo.py); the flags are shorthands for them.")
    ap.add_argument("--steps", type=bounded_int(1, MAX_COUNT), help="optimiser steps per training stage (steps; default 8)")
    ap.add_argument("--records", type=bounded_int(1, MAX_COUNT), help="clean ShareGPT records read for training data (records)")
    ap.add_argument("--heldout", type=bounded_int(1, MAX_COUNT), help="held-out conversations for the KL evaluation (heldout)")
    ap.add_argument("--heldout-rows", type=bounded_int(1, MAX_COUNT), help="packed held-out rows the KL is measured on")
    ap.add_argument("--seq-len", type=bounded_int(2, ROW_TOKENS_MAX), help="tokens per packed row (seq_len; default 512)")
    ap.add_argument("--full-eval", action="store_true", default=None,
                    help="after stage 2 also run the needle-in-a-haystack retrieval suite (base and hybrid) and "
                         f"the KV cache at {lengths_arg(FULL_KV_LENGTHS)} tokens: the real-run suites at CPU sizes "
                         "(a 135M model scores ~0 on them; adds about 4 minutes)")
    ap.add_argument("--retrieval-lengths", type=int_list, help="with --full-eval: NIAH context lengths, e.g. [256,512]")
    ap.add_argument("--kv-lengths", type=int_list,
                    help=f"KV-cache context lengths (default {lengths_arg(DEFAULT_KV_LENGTHS)}, "
                         f"{lengths_arg(FULL_KV_LENGTHS)} with --full-eval)")
    ap.add_argument("--placement-study", action="store_true", default=None,
                    help="also run jobs/place_layers.py: the searched 15-MLA placement vs even vs uniform:15, "
                         "each with the same stage 1 + stage 2 budget (adds about three demo runs)")
    ap.add_argument("--placement-seeds", nargs="+", type=bounded_int(0, SEED_MAX), metavar="SEED",
                    help="with --placement-study: repeat each compared placement per seed (mean, spread, paired gaps)")
    ap.add_argument("--update-readme", action="store_true", default=None,
                    help="write the results table and KL plot into README.md (maintainers)")
    return ap


def demo_config(argv: list[str] | None = None) -> DemoConfig:
    """The demo's config from its command line (`--print-config` prints it and exits)."""
    return config_from_args(DemoConfig, build_parser().parse_args(argv), FLAG_KEYS)


def run_demo(cfg: DemoConfig) -> int:
    with Demo(cfg) as demo:
        return demo.main()
