"""The prepare job's report as Markdown (`report.md`, beside `report.json`): counts, sources, repairs,
read losses, decontamination and reject reasons."""

from __future__ import annotations

from typing import Any


def report_markdown(r: dict[str, Any]) -> str:
    c = r["counts"]
    lines = [
        f"# Data preparation report: {r['split']} (rows of {r['max_len']} tokens)",
        "",
        f"config hash `{r['config_hash']}`, tokenizer `{r['tokenizer']}` (hash `{r['tokenizer_hash']}`)",
        "",
    ]
    if r.get("warnings"):
        lines += ["## Warnings", ""] + [f"* {w}" for w in r["warnings"]] + [""]
    lines += ["| what | count |", "| --- | ---: |"]
    for k in ("records_read", "read_rejects", "records_lost", "unknown_losses", "repaired_records",
              "decontaminated", "mixture_records", "render_rejects", "final_turn_only", "documents",
              "document_tokens", "rows", "tokens_packed", "loss_tokens", "pad_tokens", "docs_split",
              "docs_truncated", "tokens_truncated", "docs_dropped", "tokens_dropped", "pieces_without_loss",
              "tokens_without_loss"):
        lines.append(f"| {k.replace('_', ' ')} | {c.get(k, 0):,} |")
    lines += [
        f"| packing efficiency | {100 * c['efficiency']:.2f} % |",
        f"| tokenize + pack throughput | {r['throughput']['tokens_per_s']:,.0f} tokens/s |",
        "",
        "## Sources",
        "",
        "| source | read | rejected | records lost | repaired | decontaminated | in split | out (weighted) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in r["mixture"]["sources"].items():
        lost = f"{s.get('records_lost', 0):,}" + (f" + {s['unknown_losses']} unknown" if s.get("unknown_losses") else "")
        lines.append(f"| {name} | {s['read']:,} | {s.get('rejected', 0):,} | {lost} | {s.get('repaired', 0):,} | "
                     f"{s.get('decontaminated', 0):,} | {s['in_split']:,} | {s['out']:,} |")
    repairs = {(n, k): v for n, s in r["mixture"]["sources"].items() for k, v in s.get("repairs", {}).items()}
    if repairs:
        lines += ["", "## Repairs (records, by kind)", "", "| source | repair | records |", "| --- | --- | ---: |"]
        lines += [f"| {n} | {k} | {v:,} |" for (n, k), v in sorted(repairs.items())]
    if r.get("read_losses"):
        lines += ["", "## Read losses by file (each record is named in rejects.jsonl)", "",
                  "| file | rejects | records lost | unknown |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {f['file']} | {f['rejects']:,} | {f['records_lost']:,} | {f['unknown_losses']:,} |"
                  for f in r["read_losses"]]
    if r.get("decontam"):
        d = r["decontam"]
        lines += ["", f"## Decontamination ({d['mode']}, decided on the whole mixture; removed.jsonl)", "",
                  f"{d['documents_scanned']:,} documents scanned against {', '.join(d['suites'])}: "
                  f"{d['documents_dropped']:,} dropped, {d['documents_cut']:,} cut.", "",
                  "| suite | documents |", "| --- | ---: |"]
        lines += [f"| {k} | {v:,} |" for k, v in sorted(d["documents_by_suite"].items())]
    if r["reject_reasons"]:
        lines += ["", "## Reject reasons", "", "| reason | count |", "| --- | ---: |"]
        lines += [f"| {k} | {v:,} |" for k, v in r["reject_reasons"].items()]
    return "\n".join(lines) + "\n"
