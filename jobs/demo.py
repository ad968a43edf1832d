"""The whole HyLo recipe on SmolLM2-135M-Instruct and real ShareGPT, on local Ray, on CPU.

    python jobs/demo.py [--run-dir runs/demo] [--steps 8] [--records 300] [--force] [--full-eval]

fetch assets -> decontaminate ShareGPT against HumanEval -> prepare stage-1 / stage-2 rows ->
convert (MLA on even layers, GDN elsewhere) -> stage 1 (Enhanced-ILD) -> stage 2 (KL from the teacher)
-> evaluate (KL to the teacher and perplexity before and after each stage; KV cache and decode speed vs
context after stage 2). `--full-eval` adds the needle-in-a-haystack retrieval suite, which a 135M model
does not pass at any length (it is there for real models), and longer KV-cache contexts.

Each step runs the project's own job as a subprocess (the same command a user would type) and logs to
<run-dir>/logs/<step>.log. A finished step leaves <run-dir>/done/<step>.json; re-running skips it after
checking its outputs still exist. The run ends with a table on stdout and <run-dir>/report.md with PNG
plots (loss curves, KL per stage, KV-cache bytes per token vs context).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hylo.files import atomic_write  # noqa: E402
from pipeline.cli import int_at_least, job_main  # noqa: E402
from pipeline.runner import PY, StepRunner, convert_cmd, eval_cmd, last_json_object, train_cmd  # noqa: E402

# The KV cache grows linearly: three short contexts show the measured ratio as well as long ones.
DEFAULT_KV_LENGTHS = "[512,1024,2048]"
FULL_KV_LENGTHS = "[1024,2048,4096]"


class Demo(StepRunner):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args.run_dir, force=args.force, quiet=args.quiet, tag="demo")
        self.args = args

    # ------------------------------------------------------------------ steps
    def assets(self) -> dict:
        from hylo.assets import fetch_asset

        self.base = fetch_asset("smollm2-135m-instruct")
        self.sharegpt = fetch_asset("sharegpt")
        fetch_asset("humaneval")
        return {"base": str(self.base)}

    def decontaminate(self) -> dict:
        out = self.run / "decontam"
        self.sh("decontaminate", [PY, "jobs/decontaminate.py", "--input", f"sharegpt={self.sharegpt}",
                                  "--benchmark", "humaneval", "--out", str(out),
                                  "--set", "output_format=jsonl"])
        summary = json.loads((out / "summary.json").read_text())
        return {"summary": summary}

    def heldout(self) -> dict:
        """Held-out chat records for the KL evaluation: clean records after the ones training reads."""
        clean = self.run / "decontam" / "clean.jsonl"
        lines = clean.read_text().splitlines()
        start = min(self.args.records, max(0, len(lines) - self.args.heldout))
        keep = lines[start : start + self.args.heldout]
        path = self.run / "heldout.jsonl"
        path.write_text("\n".join(keep) + "\n")
        # packed like the training rows, so the evaluation cost is bounded by rows x seq_len
        self.sh("prepare_heldout", [
            PY, "jobs/prepare_data.py", "--config", "configs/data_stage2.yaml", "--set", "split=all",
            "--set", f"mixture.sources=[{{name: heldout, path: '{path}'}}]",
            "--set", f"packing.max_len={self.args.seq_len}",
            "--set", f"output.dir={self.run / 'data' / 'heldout'}", "--set", "output.overwrite=true",
        ])
        return {"records": len(keep), "first_index": start}

    def training_records(self) -> Path:
        """The first `--records` clean records in a file of their own, so each prepare job reads only those."""
        path = self.run / f"train-{self.args.records}.jsonl"
        if not path.is_file():
            with open(self.run / "decontam" / "clean.jsonl") as f:
                lines = [line for _, line in zip(range(self.args.records), f)]
            atomic_write(path, "".join(lines))
        return path

    def prepare(self, split: str) -> dict:
        out = self.run / "data" / split
        train = self.training_records()
        self.sh(f"prepare_{split}", [
            PY, "jobs/prepare_data.py", "--config", f"configs/data_{split}.yaml",
            "--set", f"split={split}",
            "--set", f"mixture.sources=[{{name: sharegpt, path: '{train}'}}]",
            "--set", f"packing.max_len={self.args.seq_len}",
            "--set", f"output.dir={out}", "--set", "output.overwrite=true",
        ])
        manifest = json.loads((out / "manifest.json").read_text())
        return {"manifest_counts": manifest.get("counts", {})}

    def convert(self) -> dict:
        out = self.run / "converted"
        text = self.sh("convert", convert_cmd(self.base, out, "even", 256))
        return {"summary": last_json_object(text)}

    def train(self, stage: int) -> dict:
        name = f"stage{stage}"
        student = self.run / ("converted" if stage == 1 else "stage1/model")
        # 512-token rows need no activation checkpointing; without it a CPU step is ~1/4 faster
        self.sh(name, train_cmd(stage, "configs/demo-smollm2.yaml", self.run, name, student,
                                self.run / "data" / name, self.args.seq_len, self.args.steps,
                                ["--set", "model.activation_checkpointing=false"]))
        return {"model": str(self.run / name / "model")}

    def final_suites(self) -> list[str]:
        """Suites after stage 2: KL and the KV cache; with --full-eval also needle-in-a-haystack retrieval."""
        return ["kl", "retrieval", "kvcache"] if self.args.full_eval else ["kl", "kvcache"]

    def kv_lengths(self) -> str:
        return self.args.kv_lengths or (FULL_KV_LENGTHS if self.args.full_eval else DEFAULT_KV_LENGTHS)

    def evaluate(self, name: str, model: Path, suites: list[str]) -> dict:
        out = self.run / "eval" / name
        # the teacher (the base model) is the same for all three evaluations: its forward on the held-out
        # rows runs once and later evaluations reuse its hidden states
        extra = ["--set", "kvcache.decode_tokens=8",
                 "--set", f"kl.teacher_cache={self.run / 'eval' / 'teacher_states.safetensors'}"]
        if "retrieval" in suites:
            extra += ["--set", f"retrieval.lengths={self.args.retrieval_lengths}",
                      "--set", "retrieval.samples_per_length=4"]
        if "kvcache" in suites:
            extra += ["--set", f"kvcache.lengths={self.kv_lengths()}"]
        cmd = eval_cmd(model, self.base, self.run / "data" / "heldout", out, ",".join(suites),
                       self.args.heldout_rows, extra)
        self.sh(f"eval_{name}", cmd)
        return json.loads((out / "results.json").read_text())

    def eval_outputs(self, name: str, suites: list[str]) -> list[Path]:
        """The step's output; an earlier run that lacks one of `suites` (no --full-eval then) is redone."""
        results = self.run / "eval" / name / "results.json"
        if results.is_file() and not set(suites) <= set(json.loads(results.read_text())):
            self.done_file(f"eval_{name}").unlink(missing_ok=True)
        return [results]

    def placement(self) -> dict:
        """The layer-placement study (jobs/place_layers.py): searched N=15 vs even vs uniform:15."""
        a = self.args
        self.sh("placement", [PY, "jobs/place_layers.py", "--n-mla", "15", "--data-from", str(self.run),
                              "--run-dir", str(self.run / "placement"), "--steps", str(a.steps),
                              "--heldout-rows", str(a.heldout_rows), "--seq-len", str(a.seq_len),
                              "--compare", "even", "uniform:15", "--compare-steps", str(a.steps),
                              "--compare-seeds", *map(str, a.placement_seeds),
                              "--train-set", "model.activation_checkpointing=false"]
                + (["--quiet"] if a.quiet else []))
        return json.loads((self.run / "placement" / "compare.json").read_text())

    # ------------------------------------------------------------------ report
    def report(self, info: dict) -> str:
        from pipeline.train.metrics import read_metrics

        kl = {k: info[f"eval_{k}"]["kl"]["kl"] for k in ("converted", "stage1", "stage2")}
        conv = info["convert"]["summary"]
        final = info["eval_stage2"]
        removed = _removed_count(self.run)
        rows = [
            ("KV-cache ratio (hybrid / base, converter)", f"{conv['kv_cache_ratio']:.3f}"),
            ("KL(teacher || student), after conversion", f"{kl['converted']:.4f}"),
            ("KL(teacher || student), after stage 1", f"{kl['stage1']:.4f}"),
            ("KL(teacher || student), after stage 2", f"{kl['stage2']:.4f}"),
            ("records removed by decontamination (HumanEval)", str(removed)),
        ]
        for who, acc in _retrieval_summary(final).items():
            rows.append((f"retrieval accuracy, {who}", acc))
        comp = final.get("kvcache", {}).get("comparison", {})
        for r in comp.get("per_length", []):
            if "measured_ratio" in r:
                rows.append((f"measured KV bytes/token ratio at {r['context']} tokens", f"{r['measured_ratio']:.3f}"))
        for name, secs in self.times.items():
            rows.append((f"wall time: {name}", f"{secs:.0f} s"))
        rows.append(("wall time: all steps", f"{sum(self.times.values()):.0f} s"))
        rows.append(("wall time: this invocation (finished steps are reused)", f"{time.time() - self.t_start:.0f} s"))
        width = max(len(a) for a, _ in rows)
        table = "\n".join(f"{a:<{width}}  {b}" for a, b in rows)
        md = ["# HyLo demo: SmolLM2-135M-Instruct -> 15 MLA + 15 GDN", "",
              "| measure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
        plots = self.plots(kl, final, read_metrics(self.run / "stage1"), read_metrics(self.run / "stage2"))
        md += [""] + [f"![{p.stem}]({p.name})" for p in plots]
        study = self.run / "placement" / "compare.md"
        if study.is_file():
            md += ["", *("#" + line if line.startswith("# ") else line for line in study.read_text().splitlines()),
                   "", "![placement scores](placement/placement_scores.png)"]
        (self.run / "report.md").write_text("\n".join(md) + "\n")
        return table

    def plots(self, kl: dict, final: dict, m1: dict, m2: dict) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = []
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        for a, m, title in ((ax[0], m1, "stage 1 (ILD loss)"), (ax[1], m2, "stage 2 (KL loss)")):
            steps = sorted(m)
            a.plot(steps, [m[s].get("loss") for s in steps], marker="o")
            a.set_xlabel("optimiser step")
            a.set_title(title)
        fig.tight_layout()
        p = self.run / "loss_curves.png"
        fig.savefig(p, dpi=110)
        out.append(p)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        names = ["converted", "stage 1", "stage 2"]
        vals = [kl["converted"], kl["stage1"], kl["stage2"]]
        ax.bar(names, vals, color=["#999", "#69c", "#36a"])
        ax.set_ylabel("KL(teacher || student), nats/token")
        ax.set_title("held-out ShareGPT")
        fig.tight_layout()
        p = self.run / "kl_per_stage.png"
        fig.savefig(p, dpi=110)
        out.append(p)
        kv = final.get("kvcache", {})
        if kv.get("model") and kv.get("base"):
            fig, ax = plt.subplots(figsize=(5, 3.5))
            for rows, label in ((kv["base"], "base (GQA, 30 layers)"), (kv["model"], "HyLo (15 MLA + 15 GDN)")):
                xs = [r["context"] for r in rows]
                ax.plot(xs, [r["total_bytes"] / 2**20 for r in rows], marker="o", label=label)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("KV cache allocated (MiB, fp32)")
            ax.legend()
            fig.tight_layout()
            p = self.run / "kv_cache_vs_context.png"
            fig.savefig(p, dpi=110)
            out.append(p)
        plt.close("all")
        return out

    def update_readme(self) -> None:
        """Replace the README's results block with this run's report and copy its KL plot to docs/."""
        import shutil

        readme = ROOT / "README.md"
        text = readme.read_text()
        start, end = "<!-- demo-results:start -->", "<!-- demo-results:end -->"
        if start not in text or end not in text:
            print("[demo] README has no demo-results markers; not updated", flush=True)
            return
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copy(self.run / "kl_per_stage.png", ROOT / "docs" / "demo_kl_per_stage.png")
        body: list[str] = []  # the results table: the report's first run of table lines
        for line in (self.run / "report.md").read_text().splitlines():
            if line.startswith("|"):
                body.append(line)
            elif body:
                break
        block = "\n".join([start, "", *body, "", "![KL per stage](docs/demo_kl_per_stage.png)", "", end])
        head, rest = text.split(start, 1)
        readme.write_text(head + block + rest.split(end, 1)[1])
        print(f"[demo] README results updated from {self.run / 'report.md'}", flush=True)

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
        info["eval_converted"] = self.step("eval_converted", self.eval_outputs("converted", ["kl"]),
                                           lambda: self.evaluate("converted", r / "converted", ["kl"]))
        self.step("stage1", [r / "stage1" / "model" / "hybrid_config.json"], lambda: self.train(1))
        info["eval_stage1"] = self.step("eval_stage1", self.eval_outputs("stage1", ["kl"]),
                                        lambda: self.evaluate("stage1", r / "stage1" / "model", ["kl"]))
        self.step("stage2", [r / "stage2" / "model" / "hybrid_config.json"], lambda: self.train(2))
        final = self.final_suites()
        info["eval_stage2"] = self.step("eval_stage2", self.eval_outputs("stage2", final),
                                        lambda: self.evaluate("stage2", r / "stage2" / "model", final))
        for k in ("eval_converted", "eval_stage1", "eval_stage2"):
            # a skipped step returns its done-marker; the results live in results.json
            info[k] = json.loads((r / "eval" / k.removeprefix("eval_") / "results.json").read_text())
        if self.args.placement_study:
            seeds = self.args.placement_seeds
            # other seeds are another step (place_layers itself reuses every run that finished)
            name = "placement" if seeds == [0] else "placement_seeds_" + "-".join(map(str, seeds))
            self.step(name, [r / "placement" / "compare.json"], self.placement)
        info["convert"] = json.loads(self.done_file("convert").read_text())
        info["decontaminate"] = json.loads(self.done_file("decontaminate").read_text())
        table = self.report(info)
        if self.args.update_readme:
            self.update_readme()
        print("\n" + table)
        print(f"\n[demo] report: {r / 'report.md'}")
        return 0


def _removed_count(run: Path) -> int:
    """Records the decontamination removed (dropped or cut), counted from removed.jsonl."""
    path = run / "decontam" / "removed.jsonl"
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def _retrieval_summary(res: dict) -> dict[str, str]:
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="runs/demo")
    ap.add_argument("--steps", type=int_at_least(1), default=8, help="optimiser steps per training stage")
    ap.add_argument("--records", type=int_at_least(1), default=300, help="clean ShareGPT records read for training data")
    ap.add_argument("--heldout", type=int_at_least(1), default=64, help="held-out conversations for the KL evaluation")
    ap.add_argument("--heldout-rows", type=int_at_least(1), default=8, help="packed held-out rows the KL is measured on")
    ap.add_argument("--seq-len", type=int_at_least(2), default=512, help="tokens per packed row")
    ap.add_argument("--full-eval", action="store_true",
                    help="after stage 2 also run the needle-in-a-haystack retrieval suite (base and hybrid) and "
                         f"the KV cache at {FULL_KV_LENGTHS} tokens: the real-run suites at CPU sizes "
                         "(a 135M model scores ~0 on them; adds about 4 minutes)")
    ap.add_argument("--retrieval-lengths", default="[256,512,1024]", help="with --full-eval: NIAH context lengths")
    ap.add_argument("--kv-lengths", default=None,
                    help=f"KV-cache context lengths (default {DEFAULT_KV_LENGTHS}, {FULL_KV_LENGTHS} with --full-eval)")
    ap.add_argument("--placement-study", action="store_true",
                    help="also run jobs/place_layers.py: the searched 15-MLA placement vs even vs uniform:15, "
                         "each with the same stage 1 + stage 2 budget (adds about three demo runs)")
    ap.add_argument("--placement-seeds", nargs="+", type=int_at_least(0), default=[0], metavar="SEED",
                    help="with --placement-study: repeat each compared placement per seed (mean, spread, paired gaps)")
    ap.add_argument("--force", action="store_true", help="redo every step")
    ap.add_argument("--quiet", action="store_true", help="do not echo the jobs' output")
    ap.add_argument("--update-readme", action="store_true",
                    help="write the results table and KL plot into README.md (maintainers)")
    return ap


@job_main
def main(argv: list[str] | None = None) -> int:
    return Demo(build_parser().parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
