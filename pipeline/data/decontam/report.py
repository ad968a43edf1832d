"""The per-suite reports (JSON + Markdown) and the job summary."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

from hylo.atomic import atomic_write
from hylo.pipeline.data.config import DecontamJobConfig
from hylo.pipeline.data.decontam.decide import Decision
from hylo.pipeline.data.decontam.index import BenchmarkIndex
from hylo.pipeline.data.readers import Record


def write_reports(cfg: DecontamJobConfig, index: BenchmarkIndex, dec: Decision, records: list[Record],
             removed: list[dict], rejects: list[dict], n_clean: int,
             bench_skipped: dict[str, dict[str, int]], out: Path) -> dict[str, Any]:
    flags = dataclasses.asdict(cfg.match)
    suites = sorted({it.suite for it in index.items})
    action_of = {r["id"] + "\0" + r["source"]: r["action"] for r in removed}
    (out / "reports").mkdir(exist_ok=True)
    per_suite = {}
    for s in suites:
        docs: dict[int, set[str]] = {}
        item_docs: Counter = Counter()
        example: dict[str, str] = {}
        for d, ms in dec.flagged.items():
            ids = {m.item_id for m in ms if m.suite == s}
            if ids:
                docs[d] = ids
                item_docs.update(ids)
                for m in ms:
                    if m.suite == s:
                        example.setdefault(m.item_id, m.ngram)
        actions = Counter(action_of[records[d]["id"] + "\0" + records[d]["source"]] for d in docs)
        boiler = sorted(((dec.entry_df[e], spared, " ".join(index.entries[e].words))
                         for e, spared in dec.boilerplate.items()
                         if any(index.items[i].suite == s for i in index.entries[e].items)), reverse=True)
        rep = {
            "suite": s,
            "flags": flags,
            "index": index.suite_stats.get(s, {}),
            "benchmark_rows_skipped": bench_skipped.get(s, {}),
            "documents_scanned": len(records),
            "documents_matched": len(docs),
            "documents_dropped": actions.get("drop", 0),
            "documents_cut": actions.get("cut", 0),
            "items_matched": len(item_docs),
            "matched_items": [{"item_id": i, "documents": c, "example_ngram": example[i]}
                              for i, c in item_docs.most_common()],
            "removed_documents": [records[d]["id"] for d in sorted(docs)][:1000],
            "boilerplate_ignored": [{"ngram": g, "documents": df, "documents_spared": sp}
                                    for df, sp, g in boiler[:100]],
        }
        per_suite[s] = rep
        atomic_write(out / "reports" / f"{s}.json", json.dumps(rep, indent=1))
        atomic_write(out / "reports" / f"{s}.md", _markdown(rep))
    return {
        "documents_in": len(records) + len(rejects),
        "documents_rejected": len(rejects),
        "documents_scanned": len(records),
        "documents_out": n_clean,
        "documents_dropped": sum(r["action"] == "drop" for r in removed),
        "documents_cut": sum(r["action"] == "cut" for r in removed),
        "scanner": cfg.scanner,
        "flags": flags,
        "suites": {s: {k: per_suite[s][k] for k in ("documents_matched", "items_matched")} for s in suites},
    }


def _markdown(rep: dict[str, Any]) -> str:
    lines = [
        f"# Decontamination report: {rep['suite']}", "",
        f"* documents scanned: {rep['documents_scanned']}",
        f"* documents matched: {rep['documents_matched']} (dropped {rep['documents_dropped']}, "
        f"cut {rep['documents_cut']})",
        f"* benchmark items matched: {rep['items_matched']}",
        f"* index: {', '.join(f'{k} {v}' for k, v in sorted(rep['index'].items()))}",
        f"* flags: {', '.join(f'{k}={v}' for k, v in rep['flags'].items())}", "",
    ]
    if rep["matched_items"]:
        lines += ["| item | documents | example n-gram |", "|---|---|---|"]
        lines += [f"| {m['item_id']} | {m['documents']} | `{m['example_ngram'][:120]}` |"
                  for m in rep["matched_items"][:50]]
        lines.append("")
    if rep["boilerplate_ignored"]:
        lines += ["Ignored as boilerplate (frequent in the mixture):", "",
                  "| n-gram | documents | spared |", "|---|---|---|"]
        lines += [f"| `{b['ngram'][:120]}` | {b['documents']} | {b['documents_spared']} |"
                  for b in rep["boilerplate_ignored"][:30]]
    return "\n".join(lines) + "\n"
