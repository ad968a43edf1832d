"""The prepare job (jobs/prepare_data.py): mixture -> (decontamination) -> tokenise + pack on Ray ->
shards, manifest, rejects and report, built beside the output directory and swapped in when complete.

Design choices:
* Everything that can be checked before Ray starts is (output directory, sources, tokenizer,
  benchmarks); a failure at any point leaves the previous dataset untouched (`hylo.outputs.atomic_dir`).
* Nothing is lost silently: every record read but not packed is in rejects.jsonl (read and render
  stages, with reasons) or removed.jsonl (decontamination), and counted in the report.
* The manifest's `max_len` is `packing.max_len`: the one length of the rows, which training takes from it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hylo.assets import resolve_path_or_asset
from hylo.atomic import atomic_write
from hylo.leftovers import sweep_stale
from hylo.logs import get_logger
from hylo.outputs import atomic_dir, check_not_an_input
from hylo.ownership import check_replaceable
from hylo.pipeline.config import config_hash, to_dict
from hylo.pipeline.data.config import UNHASHED_KEYS
from hylo.pipeline.data.decontam import build_index, cut_record, scan_and_decide
from hylo.pipeline.data.mixture import build_mixture, resolve_asset_path, restrict
from hylo.pipeline.data.packing import BestFitPacker, Document
from hylo.pipeline.data.readers import resolve_files
from hylo.pipeline.data.render import ChatRenderer, token_table, token_table_hash, tokenizer_hash
from hylo.pipeline.data.report import report_markdown
from hylo.pipeline.data.shards import MANIFEST, ShardWriter, write_manifest
from hylo.pipeline.data.streaming import PackedRun, actor_count, make_packer, stream_packed_rows
from hylo.pipeline.paths import job_inputs
from hylo.pipeline.ray_init import check_ray_address, init_ray

logger = get_logger(__name__)


def resolve_tokenizer(name_or_dir: str) -> Path:
    """A tokenizer directory, or an asset (`asset:NAME` or NAME, fetched on first use; hylo.assets' rule)."""
    return resolve_path_or_asset(name_or_dir, "tokenize.tokenizer", directory=True, progress=False)


def reason_key(reason: str) -> str:
    """Group reject reasons for the report: numbers and quoted values folded ("turn N: ...")."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", reason))[:120]


def rows_config_hash(cfg: Any) -> str:
    """Hash of what decides the rows: every key of the config but `UNHASHED_KEYS` (output paths, Ray
    pools, progress). The `tokenize` keys it keeps sit at the top level of the hashed mapping, as they
    always have (datasets prepared before keep their fingerprint)."""
    d = to_dict(cfg)
    for key in UNHASHED_KEYS:
        *parents, last = key.split(".")
        node = d
        for p in parents:
            node = node[p]
        del node[last]
    d.update(d.pop("tokenize"))
    return config_hash(d)


class PrepareError(ValueError):
    """prepare_data cannot produce a dataset (nothing to write, an output dir it must not replace)."""


def _check_output(out: Path, overwrite: bool) -> None:
    """Refuse to clobber: an existing dataset needs overwrite, a directory is replaced only when its record proves
    all it holds ours, as written (`hylo.ownership.check_replaceable`; never by the names it holds, a manifest's
    included).

    Also removes what a killed run left beside `out` and puts back a dataset a crash between the two renames
    of a swap left aside (`hylo.leftovers.sweep_stale`: only what provably is ours).
    """
    sweep_stale(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise PrepareError(f"output.dir {out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    check_replaceable(out, "output.dir")
    if not overwrite:
        raise FileExistsError(f"{out / MANIFEST} exists; set output.overwrite=true to replace it")


def _warn(report_warnings: list[str], text: str) -> None:
    report_warnings.append(text)
    logger.warning(f"warning: {text}")


def prepare(cfg: Any) -> dict[str, Any]:
    """Run the whole job for a `PrepareDataConfig`; returns the report (also written to disk).

    Writes into `cfg.output.dir`: shard-*.parquet, manifest.json, rejects.jsonl, report.json,
    report.md (and removed.jsonl with decontamination). Everything is checked first (output
    directory, sources, tokenizer, benchmarks), then built in a sibling directory that replaces
    the old dataset only once complete: a failure at any point leaves the old one untouched.
    Uses the running Ray if there is one, else starts a local one.
    """
    from transformers import AutoTokenizer  # lazy: transformers

    out = Path(cfg.output.dir)
    _check_output(out, cfg.output.overwrite)
    # the cluster it packs on answers (a stale RAY_ADDRESS is named now, not after the mixture is read)
    check_ray_address(cfg.ray.address)
    # Fail fast on a wrong path or tokenizer before anything slow starts (and before touching out).
    if not cfg.mixture.sources:
        raise PrepareError("mixture.sources is empty")
    inputs: list[tuple[str, str | Path | None]] = []
    for i, src in enumerate(cfg.mixture.sources):
        spec = resolve_asset_path(src)
        if not (spec.container == "hub" or spec.path.startswith("hub:")):
            inputs += [(f"mixture.sources[{i}] ({spec.name})", f) for f, _ in resolve_files(spec)]
    tok_dir = resolve_tokenizer(cfg.tokenize.tokenizer)
    # the rows are never written over (or around) what they are made from, nor the config that says how
    check_not_an_input(out, job_inputs(cfg, extra=[*inputs, ("tokenize.tokenizer", tok_dir)]), "output.dir")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    renderer = ChatRenderer.from_hf(tok, cfg.tokenize.mask_method, cfg.tokenize.chat_template_kwargs)
    pad_id = cfg.packing.pad_id
    if pad_id is None:
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad_id is None:
        raise PrepareError(f"tokenizer {tok_dir} has neither a pad nor an EOS token; set packing.pad_id")
    index = None
    if cfg.decontam.benchmarks:
        try:
            index, _ = build_index(cfg.decontam.benchmarks, cfg.decontam.match)
        except ValueError as e:
            raise PrepareError(f"decontam: {e}") from None

    # Built beside `out` and swapped in when complete; the previous dataset is deleted only after.
    with atomic_dir(out, "output.dir") as staging:
        report = _prepare_into(cfg, staging, out, renderer, pad_id, index)
    return report


class _Rejects:
    """rejects.jsonl as it is written, and the counts the report gives of it (by reason, by file)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.read_rejects = 0
        self.reasons: dict[str, int] = {}
        self.by_file: dict[str, dict[str, int]] = {}

    def _count(self, reason: str) -> None:
        key = reason_key(reason)
        self.reasons[key] = self.reasons.get(key, 0) + 1

    def read(self, r: dict[str, Any]) -> None:
        """A record lost while reading a source file (`on_reject` of the mixture)."""
        self.read_rejects += 1
        self._count(r["reason"])
        f = self.by_file.setdefault(r["file"], {"rejects": 0, "records_lost": 0, "unknown_losses": 0})
        f["rejects"] += 1
        if r.get("lost") is None:
            f["unknown_losses"] += 1
        else:
            f["records_lost"] += int(r["lost"])
        self.f.write(json.dumps({"stage": "read", **r}, ensure_ascii=False) + "\n")

    def render(self, doc_id: str, reason: str) -> None:
        self._count(reason)
        self.f.write(json.dumps({"stage": "render", "source": doc_id.split(":", 1)[0], "doc_id": doc_id,
                                 "reason": reason}, ensure_ascii=False) + "\n")


def _mixture(cfg: Any, index: Any, staging: Path, rejects: _Rejects,
             warnings: list[str]) -> tuple[list[dict[str, Any]], Any, dict[str, Any] | None]:
    """The split's records (decontaminated when `index` is given), with the warnings they call for."""
    m = cfg.mixture
    decontam = None
    if index is None:
        records, mix_stats = build_mixture(m, cfg.split, rejects.read)
    else:
        # Decide on the whole mixture, so both stages remove the same records.
        full, full_stats = build_mixture(m, "all", rejects.read)
        if cfg.decontam.scanner == "ray":
            init_ray(cfg.ray.address, cfg.ray.num_cpus)
        records, mix_stats, decontam = _decontaminate(cfg, index, full, full_stats, staging)
        del full
    for name, c in mix_stats.sources.items():
        if c.read == 0:
            _warn(warnings, f"source {name!r} contributed no records (allow_empty is set)")
        elif c.out == 0:
            _warn(warnings, f"source {name!r}: {c.read} records read, none in the {cfg.split} split "
                            f"(weight {next(s.weight for s in m.sources if s.name == name)})")
    if not records:
        raise PrepareError(f"the {cfg.split} split of the mixture is empty "
                           f"({sum(c.read for c in mix_stats.sources.values())} records read); nothing written")
    return records, mix_stats, decontam


def _pack_into_shards(cfg: Any, records: list[dict[str, Any]], renderer: ChatRenderer, packer: BestFitPacker,
                      run: PackedRun, staging: Path) -> tuple[list[dict[str, Any]], float]:
    """Tokenise on Ray, pack and write the shards, with a bar of records, tokens and rows as they flow;
    returns the shards and the seconds tokenising and packing took (Ray's start-up left out)."""
    init_ray(cfg.ray.address, cfg.ray.num_cpus)
    import ray.data  # lazy: ray

    # Our own bar counts documents; Ray's per-operator bars would interleave with it.
    ray.data.DataContext.get_current().enable_progress_bars = False
    rg_rows = cfg.output.row_group_rows or max(1, (1 << 20) // cfg.packing.max_len)
    writer = ShardWriter(staging, cfg.output.rows_per_shard, rg_rows)
    t0 = run.elapsed
    # Nothing arrives until the tokenizer actors have started (each loads the tokenizer; seconds to tens
    # of seconds), which the bar says instead of sitting at 0.
    desc = f"prepare {cfg.split}"
    actors = actor_count(len(records), cfg.tokenize.num_actors, cfg.tokenize.batch_size)
    with tqdm(total=len(records), desc=f"{desc} (starting {actors} tokenizer actor(s))",
              unit="rec", disable=not cfg.progress, dynamic_ncols=True) as bar:
        seen = 0

        def flowing(doc: Document | None = None) -> None:
            nonlocal seen
            if seen == 0:
                bar.set_description_str(desc, refresh=False)
            done = run.documents + len(run.render_rejects)
            bar.update(done - seen)
            seen = done
            bar.set_postfix_str(f"{run.doc_tokens:,} tokens, {writer.rows:,} rows", refresh=False)

        for row in stream_packed_rows(records, renderer.spec(), cfg.tokenize, packer, run, on_document=flowing):
            writer.add(row)
        bar.set_description_str(desc, refresh=False)
        flowing()
    shards = writer.finish()
    return shards, run.elapsed - t0


def _counts(records: list[dict[str, Any]], mix_stats: Any, rejects: _Rejects, run: PackedRun,
            packer: BestFitPacker) -> dict[str, Any]:
    srcs = mix_stats.sources.values()
    return {
        "records_read": sum(c.read for c in srcs) + rejects.read_rejects,
        "read_rejects": rejects.read_rejects,
        "records_lost": sum(c.records_lost for c in srcs),
        "unknown_losses": sum(c.unknown_losses for c in srcs),
        "repaired_records": sum(c.repaired for c in srcs),
        "decontaminated": sum(c.decontaminated for c in srcs),
        "mixture_records": len(records),
        "render_rejects": len(run.render_rejects),
        "final_turn_only": run.final_only,
        "documents": run.documents,
        "document_tokens": run.doc_tokens,
        **{k: v for k, v in packer.stats.to_dict().items() if k not in ("max_len", "documents")},
    }


def _prepare_into(cfg: Any, staging: Path, out: Path, renderer: ChatRenderer, pad_id: int,
                  index: Any) -> dict[str, Any]:
    run = PackedRun()
    warnings: list[str] = []
    packer = make_packer(cfg.packing, pad_id)
    with open(staging / "rejects.jsonl", "w") as rej_f:
        rejects = _Rejects(rej_f)
        records, mix_stats, decontam = _mixture(cfg, index, staging, rejects, warnings)
        t_read = run.elapsed
        if renderer.date_dependent:
            _warn(warnings, "the chat template writes today's date (strftime_now): set "
                            "tokenize.chat_template_kwargs.date_string for reproducible tokens")
        shards, t_pack = _pack_into_shards(cfg, records, renderer, packer, run, staging)
        for doc_id, reason in run.render_rejects:
            rejects.render(doc_id, reason)
    if not shards:
        top = sorted(rejects.reasons.items(), key=lambda kv: -kv[1])[:3]
        raise PrepareError(f"no rows: every one of the {len(records)} mixture records was rejected or dropped "
                           f"({len(run.render_rejects)} render rejects, {pst_dropped(packer)} pieces dropped by "
                           f"packing; top reasons {top}); nothing written")
    manifest = {
        "split": cfg.split,
        "max_len": cfg.packing.max_len,
        "config_hash": rows_config_hash(cfg),
        "tokenizer": str(cfg.tokenize.tokenizer),
        "tokenizer_hash": tokenizer_hash(renderer),
        # which token each id stands for: training checks its student's tokenizer against it
        "token_table": token_table_hash(token_table(renderer.spec()["tokenizer_json"])),
        "pad_id": int(pad_id),
        "counts": _counts(records, mix_stats, rejects, run, packer),
        "mixture": mix_stats.to_dict(),
        # Every file that lost records while reading; the records are named in rejects.jsonl.
        "read_losses": [{"file": f, **v} for f, v in sorted(rejects.by_file.items())],
        "decontam": decontam,
        "warnings": warnings,
        "shards": shards,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_manifest(staging, manifest)
    report = {
        **manifest,
        "output_dir": str(out),
        "reject_reasons": dict(sorted(rejects.reasons.items(), key=lambda kv: -kv[1])),
        "seconds": {"read_and_mix": t_read, "tokenize_and_pack": t_pack, "total": run.elapsed},
        "throughput": {"tokens_per_s": run.doc_tokens / t_pack if t_pack else 0.0,
                       "documents_per_s": run.documents / t_pack if t_pack else 0.0},
    }
    report.pop("format", None)
    atomic_write(staging / "report.json", json.dumps(report, indent=1))
    atomic_write(staging / "report.md", report_markdown(report))
    return report


def pst_dropped(packer: BestFitPacker) -> int:
    st = packer.stats
    return st.docs_dropped + st.pieces_without_loss


def _decontaminate(cfg: Any, index: Any, full: list[dict[str, Any]], full_stats: Any,
                   staging: Path) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """Remove (or cut) contaminated documents of the whole mixture, then narrow it to the split."""
    dc, m = cfg.decontam, cfg.mixture
    uniq = [r for r in full if r["doc_id"] == r["doc_base"]]
    dec = scan_and_decide(index, [[t["content"] for t in r["messages"]] for r in uniq], dc.scanner,
                          dc.batch_size, cfg.progress, cfg.ray)
    removed: set[str] = set()
    replaced: dict[str, dict[str, Any]] = {}
    by_suite: dict[str, int] = {}
    with open(staging / "removed.jsonl", "w") as f:
        for d, matches in sorted(dec.flagged.items()):
            rec = uniq[d]
            new = cut_record(rec, matches) if dc.match.mode == "cut" else None
            if new is not None:
                replaced[rec["doc_base"]] = new
            else:
                removed.add(rec["doc_base"])
            for suite in sorted({mt.suite for mt in matches}):
                by_suite[suite] = by_suite.get(suite, 0) + 1
            f.write(json.dumps({"doc_id": rec["doc_base"], "source": rec["source"], "id": rec["id"],
                                "action": "cut" if new is not None else "drop",
                                "matches": [asdict(mt) for mt in matches]}, ensure_ascii=False) + "\n")
    records, stats = restrict(full, full_stats, cfg.split, m.stage1_fraction, m.split_salt, m.stage2,
                              removed, replaced)
    summary = {"suites": sorted({it.suite for it in index.items}), "documents_scanned": len(uniq),
               "documents_dropped": len(removed), "documents_cut": len(replaced), "documents_by_suite": by_suite,
               "boilerplate_ngrams_ignored": len(dec.boilerplate), "mode": dc.match.mode}
    return records, stats, summary
