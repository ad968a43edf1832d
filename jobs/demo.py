"""The whole HyLo recipe on SmolLM2-135M-Instruct and real ShareGPT, on local Ray, on CPU.

    python jobs/demo.py [--run-dir runs/demo] [--steps 16] [--records 1500] [--force]

fetch assets -> decontaminate ShareGPT against HumanEval -> prepare stage-1 / stage-2 rows ->
convert (MLA on even layers, GDN elsewhere) -> stage 1 (Enhanced-ILD) -> stage 2 (KL from the teacher)
-> evaluate (KL to the teacher before and after each stage, retrieval, KV cache vs context).

Each step runs the project's own job as a subprocess (the same command a user would type) and logs to
<run-dir>/logs/<step>.log. A finished step leaves <run-dir>/done/<step>.json; re-running skips it after
checking its outputs still exist. The run ends with a table on stdout and <run-dir>/report.md with PNG
plots (loss curves, KL per stage, KV-cache bytes per token vs context).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PY = sys.executable


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run = Path(args.run_dir).resolve()
        (self.run / "logs").mkdir(parents=True, exist_ok=True)
        (self.run / "done").mkdir(parents=True, exist_ok=True)
        self.times: dict[str, float] = {}
        self.t_start = time.time()

    # ------------------------------------------------------------------ step bookkeeping
    def done_file(self, name: str) -> Path:
        return self.run / "done" / f"{name}.json"

    def finished(self, name: str, outputs: list[Path]) -> dict | None:
        f = self.done_file(name)
        if self.args.force or not f.is_file():
            return None
        info = json.loads(f.read_text())
        missing = [str(p) for p in outputs if not Path(p).exists()]
        if missing:
            print(f"[demo] {name}: marked done but {missing[0]} is missing; running it again", flush=True)
            return None
        print(f"[demo] {name}: already done ({info.get('seconds', 0):.0f} s), reusing its outputs", flush=True)
        self.times[name] = info.get("seconds", 0.0)
        return info

    def mark(self, name: str, seconds: float, **info) -> None:
        tmp = self.done_file(name).with_suffix(".tmp")
        tmp.write_text(json.dumps({"seconds": seconds, **info}, indent=1))
        tmp.replace(self.done_file(name))
        self.times[name] = seconds

    def sh(self, name: str, cmd: list[str], env: dict | None = None) -> str:
        """Run one job, streaming its output to the console and to logs/<name>.log; return stdout."""
        log = self.run / "logs" / f"{name}.log"
        print(f"\n[demo] === {name}: {' '.join(cmd)}", flush=True)
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        out_lines: list[str] = []
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1)
            assert proc.stdout is not None
            for line in proc.stdout:
                fh.write(line)
                out_lines.append(line)
                if not self.args.quiet:
                    sys.stdout.write(f"  | {line}")
            rc = proc.wait()
        if rc != 0:
            tail = "".join(out_lines[-30:])
            raise SystemExit(f"[demo] {name} failed (exit {rc}); full log: {log}\n{tail}")
        return "".join(out_lines)

    def step(self, name: str, outputs: list[Path], fn) -> dict:
        info = self.finished(name, outputs)
        if info is not None:
            return info
        t0 = time.time()
        info = fn() or {}
        self.mark(name, time.time() - t0, **info)
        return info

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

    def prepare(self, split: str) -> dict:
        out = self.run / "data" / split
        clean = self.run / "decontam" / "clean.jsonl"
        self.sh(f"prepare_{split}", [
            PY, "jobs/prepare_data.py", "--config", f"configs/data_{split}.yaml",
            "--set", f"split={split}",
            "--set", f"mixture.sources=[{{name: sharegpt, path: '{clean}', limit: {self.args.records}}}]",
            "--set", f"packing.max_len={self.args.seq_len}",
            "--set", f"output.dir={out}", "--set", "output.overwrite=true",
        ])
        manifest = json.loads((out / "manifest.json").read_text())
        return {"manifest_counts": manifest.get("counts", {})}

    def convert(self) -> dict:
        out = self.run / "converted"
        text = self.sh("convert", [PY, "jobs/convert.py", "--base", str(self.base), "--out", str(out),
                                   "--mla-layers", "even", "--kv-lora-rank", "256"])
        start = 0 if text.startswith("{") else text.index("\n{") + 1
        summary = json.loads(text[start:text.rindex("}") + 1])
        return {"summary": summary}

    def train(self, stage: int) -> dict:
        name = f"stage{stage}"
        student = self.run / ("converted" if stage == 1 else "stage1/model")
        self.sh(name, [
            PY, f"jobs/stage{stage}.py", "--config", "configs/demo-smollm2.yaml",
            "--set", f"ray.storage_path={self.run}",
            "--set", f"model.student={student}",
            "--set", f"data.path={self.run / 'data' / name}",
            "--set", f"data.seq_len={self.args.seq_len}",
            "--set", f"train.total_steps={self.args.steps}",
            "--set", f"checkpoint.every_steps={max(1, self.args.steps // 2)}",
        ])
        return {"model": str(self.run / name / "model")}

    def evaluate(self, name: str, model: Path, suites: str) -> dict:
        out = self.run / "eval" / name
        cmd = [PY, "jobs/eval.py", "--model", str(model), "--teacher", str(self.base), "--base", str(self.base),
               "--data", str(self.run / "data" / "heldout"), "--out", str(out), "--suite", suites, "--quiet",
               "--set", f"kl.max_rows={self.args.heldout_rows}",
               "--set", f"retrieval.lengths={self.args.retrieval_lengths}",
               "--set", "retrieval.samples_per_length=4",
               "--set", f"kvcache.lengths={self.args.kv_lengths}", "--set", "kvcache.decode_tokens=8"]
        self.sh(f"eval_{name}", cmd)
        return json.loads((out / "results.json").read_text())

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
        rows.append(("wall time: total (this invocation)", f"{time.time() - self.t_start:.0f} s"))
        width = max(len(a) for a, _ in rows)
        table = "\n".join(f"{a:<{width}}  {b}" for a, b in rows)
        md = ["# HyLo demo: SmolLM2-135M-Instruct -> 15 MLA + 15 GDN", "",
              "| measure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
        plots = self.plots(kl, final, read_metrics(self.run / "stage1"), read_metrics(self.run / "stage2"))
        md += [""] + [f"![{p.stem}]({p.name})" for p in plots]
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
        body = [line for line in (self.run / "report.md").read_text().splitlines()
                if line.startswith("|")]
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
        info["eval_converted"] = self.step("eval_converted", [r / "eval" / "converted" / "results.json"],
                                           lambda: self.evaluate("converted", r / "converted", "kl"))
        self.step("stage1", [r / "stage1" / "model" / "hybrid_config.json"], lambda: self.train(1))
        info["eval_stage1"] = self.step("eval_stage1", [r / "eval" / "stage1" / "results.json"],
                                        lambda: self.evaluate("stage1", r / "stage1" / "model", "kl"))
        self.step("stage2", [r / "stage2" / "model" / "hybrid_config.json"], lambda: self.train(2))
        info["eval_stage2"] = self.step("eval_stage2", [r / "eval" / "stage2" / "results.json"],
                                        lambda: self.evaluate("stage2", r / "stage2" / "model",
                                                              "kl,retrieval,kvcache"))
        for k in ("eval_converted", "eval_stage1", "eval_stage2"):
            # a skipped step returns its done-marker; the results live in results.json
            info[k] = json.loads((r / "eval" / k.removeprefix("eval_") / "results.json").read_text())
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="runs/demo")
    ap.add_argument("--steps", type=int, default=16, help="optimiser steps per training stage")
    ap.add_argument("--records", type=int, default=1500, help="clean ShareGPT records read for training data")
    ap.add_argument("--heldout", type=int, default=64, help="held-out conversations for the KL evaluation")
    ap.add_argument("--heldout-rows", type=int, default=12, help="packed held-out rows the KL is measured on")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per packed row")
    ap.add_argument("--retrieval-lengths", default="[256,512,1024]")
    ap.add_argument("--kv-lengths", default="[1024,2048,4096]")
    ap.add_argument("--force", action="store_true", help="redo every step")
    ap.add_argument("--quiet", action="store_true", help="do not echo the jobs' output")
    ap.add_argument("--update-readme", action="store_true",
                    help="write the results table and KL plot into README.md (maintainers)")
    return Demo(ap.parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
