"""The Ray Data pipeline (mixture -> render/tokenise on an actor pool -> best-fit packing), Parquet
shards with a manifest, and the resumable row reader that training workers use.

Legend: T = tokens of a row, N = segments of a row (documents, plus the padding tail if any).

Design choices:
* Render + tokenise is the expensive, parallel part: a `map_batches` actor pool (each actor loads
  the tokenizer once), streaming. The input is the mixture as Arrow blocks of JSON-encoded records
  (JSON keeps arbitrary nested content intact through Arrow). `preserve_order` is on, so the
  documents come back in mixture order whatever the pool size, and the same seed gives the same
  rows.
* Packing is sequential by nature (each placement depends on the open rows) and cheap; it runs in
  the consumer (the driver here) over the streamed batches.
* Shards: `shard-00000.parquet`, ... (list columns: input_ids int32, position_ids int32,
  cu_seqlens int32, loss_mask bool, doc_ids string), each written to a temp name and renamed; the
  manifest (`manifest.json`) is written last, so a directory with a manifest is complete.
* `RowReader(dir, rank, world_size, start)`: rank r reads global rows r, r + W, r + 2W, ... (the
  tail that does not divide by W is dropped so every rank takes the same number of steps) and
  exposes `.position`, the number of its rows consumed: saving it and passing it back as `start`
  resumes at exactly the next row (Ray Data iterators do not resume mid-epoch). Each shard is read
  through `rowfile.PackedRowFile`, the one Parquet reader of packed rows.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hylo.pipeline.data.packing import BestFitPacker, Document
from hylo.pipeline.data.render import ChatRenderer, Encoded
from hylo.pipeline.data.rowfile import DataFormatError, PackedRowFile
from hylo.pipeline.ray_init import init_ray

from hylo.files import atomic_dir, atomic_path, atomic_write, read_json

MANIFEST = "manifest.json"
FORMAT = "hylo-packed-rows/1"


# ----------------------------------------------------------------------------------- tokenising
def _list_array(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def encoded_to_table(results: list[Any]) -> pa.Table:
    """Render results -> Arrow: doc_id, input_ids list<int32>, assistant_mask list<bool>, reject, final_only."""
    empty_i, empty_b = np.zeros(0, np.int32), np.zeros(0, np.bool_)
    ids = [r.input_ids if isinstance(r, Encoded) else empty_i for r in results]
    masks = [r.assistant_mask if isinstance(r, Encoded) else empty_b for r in results]
    return pa.table({
        "doc_id": pa.array([r.doc_id for r in results], pa.string()),
        "input_ids": _list_array(ids, pa.int32()),
        "assistant_mask": _list_array(masks, pa.bool_()),
        "reject": pa.array(["" if isinstance(r, Encoded) else r.reason for r in results], pa.string()),
        "final_only": pa.array([isinstance(r, Encoded) and r.final_only for r in results], pa.bool_()),
    })


class TokenizeUDF:
    """Ray Data actor: JSON records -> tokenised documents (or rejects), one output row per input."""

    def __init__(self, renderer_spec: dict[str, Any]) -> None:
        self.renderer = ChatRenderer.from_spec(renderer_spec)

    def __call__(self, batch: pa.Table) -> pa.Table:
        records = []
        for doc_id, blob in zip(batch.column("doc_id").to_pylist(), batch.column("record").to_pylist()):
            rec = json.loads(blob)
            rec["doc_id"] = doc_id
            records.append(rec)
        return encoded_to_table(self.renderer.encode_batch(records))


def records_to_blocks(records: list[dict[str, Any]], block_records: int) -> list[pa.Table]:
    doc_ids = [r["doc_id"] for r in records]
    blobs = [json.dumps({"id": r.get("id"), "source": r.get("source"), "messages": r.get("messages")},
                        ensure_ascii=False) for r in records]
    table = pa.table({"doc_id": pa.array(doc_ids, pa.string()), "record": pa.array(blobs, pa.large_string())})
    return [table.slice(i, block_records) for i in range(0, max(len(records), 1), block_records)]


def tokenize_dataset(
    records: list[dict[str, Any]], renderer_spec: dict[str, Any], num_actors: int = 2, batch_size: int = 64,
) -> Any:
    """A streaming `ray.data.Dataset` of tokenised documents in mixture order (Ray must be up)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    # One batch per block: a block's output is delivered only when its task ends, so small blocks
    # keep the stream flowing (the first packed rows come after the first batch, not the first quarter).
    blocks = records_to_blocks(records, block_records=batch_size)
    ds = ray.data.from_arrow(blocks)
    return ds.map_batches(
        TokenizeUDF,
        fn_constructor_kwargs={"renderer_spec": renderer_spec},
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        num_cpus=1,
    )


def iter_documents(
    batches: Iterable[pa.Table], on_reject: Callable[[str, str], None],
    on_final_only: Callable[[str], None] | None = None,
) -> Iterator[Document]:
    """Tokenised Arrow batches -> Documents; rejected rows go to `on_reject(doc_id, reason)`, documents
    whose loss covers only the final reply to `on_final_only(doc_id)`."""
    for b in batches:
        doc_ids = b.column("doc_id").to_pylist()
        rejects = b.column("reject").to_pylist()
        if on_final_only is not None and "final_only" in b.column_names:
            for doc_id, fo in zip(doc_ids, b.column("final_only").to_pylist()):
                if fo:
                    on_final_only(doc_id)
        ids_col, mask_col = b.column("input_ids").combine_chunks(), b.column("assistant_mask").combine_chunks()
        offs = ids_col.offsets.to_numpy()
        ids_vals = ids_col.values.to_numpy()
        mask_vals = mask_col.values.to_numpy(zero_copy_only=False)
        for k, (doc_id, rej) in enumerate(zip(doc_ids, rejects)):
            if rej:
                on_reject(doc_id, rej)
                continue
            s, e = offs[k], offs[k + 1]
            yield Document(doc_id, ids_vals[s:e], mask_vals[s:e])


def make_packer(pcfg: Any, pad_id: int) -> BestFitPacker:
    return BestFitPacker(
        max_len=pcfg.max_len, window=pcfg.window, max_open_rows=pcfg.max_open_rows,
        close_slack=pcfg.close_slack, long_doc_policy=pcfg.long_doc_policy,
        pad_id=pad_id, pad_to_max_len=pcfg.pad_to_max_len, min_loss_tokens=pcfg.min_loss_tokens,
    )


# ------------------------------------------------------------------------------------- shards
ROW_SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("position_ids", pa.list_(pa.int32())),
    ("cu_seqlens", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.bool_())),
    ("doc_ids", pa.list_(pa.string())),
])


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    cols = {}
    for name in ("input_ids", "position_ids", "cu_seqlens", "loss_mask"):
        typ = ROW_SCHEMA.field(name).type
        arrays = [np.asarray(r[name]) for r in rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        vals = np.concatenate(arrays) if arrays else np.zeros(0)
        cols[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(vals, type=typ.value_type))
    cols["doc_ids"] = pa.array([list(r["doc_ids"]) for r in rows], ROW_SCHEMA.field("doc_ids").type)
    return pa.table(cols, schema=ROW_SCHEMA)


class ShardWriter:
    """Buffers rows and writes `shard-NNNNN.parquet` files atomically; `finish()` returns their list."""

    def __init__(self, directory: str | Path, rows_per_shard: int, row_group_rows: int) -> None:
        if rows_per_shard < 1 or row_group_rows < 1:
            raise ValueError("rows_per_shard and row_group_rows must be >= 1")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows_per_shard = rows_per_shard
        self.row_group_rows = row_group_rows
        self.shards: list[dict[str, Any]] = []
        self._buf: list[dict[str, Any]] = []
        # rows added so far (written or buffered)
        self.rows = 0

    def add(self, row: dict[str, Any]) -> None:
        self._buf.append(row)
        self.rows += 1
        if len(self._buf) >= self.rows_per_shard:
            self._write()

    def finish(self) -> list[dict[str, Any]]:
        if self._buf:
            self._write()
        return self.shards

    def _write(self) -> None:
        rows, self._buf = self._buf, []
        name = f"shard-{len(self.shards):05d}.parquet"
        with atomic_path(self.dir / name) as tmp:
            pq.write_table(rows_to_table(rows), tmp, row_group_size=self.row_group_rows, compression="zstd")
        self.shards.append({
            "file": name,
            "rows": len(rows),
            "tokens": int(sum(len(r["input_ids"]) for r in rows)),
        })


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> Path:
    path = Path(directory) / MANIFEST
    atomic_write(path, json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=False))
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataFormatError(f"{path} not found: not a packed-data directory, or its job did not finish")
    m = read_json(path, DataFormatError)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataFormatError(f"{path}: format is {m.get('format') if isinstance(m, dict) else m!r}, expected {FORMAT}")
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and "file" in s and "rows" in s for s in shards):
        raise DataFormatError(f"{path}: field 'shards' must be a list of {{file, rows}}")
    return m


# ---------------------------------------------------------------------------------- reading
class RowReader:
    """Deterministic, resumable reader of a shard directory for one training worker.

    Yields dicts of torch tensors (input_ids [T] int64, position_ids [T] int64, cu_seqlens [N+1]
    int32, loss_mask [T] bool) plus doc_ids (list[str]); `as_numpy=True` yields numpy arrays.
    """

    def __init__(self, directory: str | Path, rank: int = 0, world_size: int = 1, start: int = 0,
                 drop_last: bool = True, as_numpy: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir)
        self.rank, self.world_size, self.as_numpy = rank, world_size, as_numpy
        self._cum = [0]
        for s in self.manifest["shards"]:
            self._cum.append(self._cum[-1] + int(s["rows"]))
        total = self._cum[-1]
        self.num_rows = total // world_size if drop_last else max(0, (total - rank + world_size - 1) // world_size)
        if not 0 <= start <= self.num_rows:
            raise ValueError(f"start {start} outside [0, {self.num_rows}] rows for rank {rank}/{world_size}")
        self.position = start
        self._files: dict[int, PackedRowFile] = {}
        # the shard whose row group is cached (one row group in memory at a time)
        self._current: PackedRowFile | None = None

    def __len__(self) -> int:
        return self.num_rows

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "rank": self.rank, "world_size": self.world_size,
                "config_hash": self.manifest.get("config_hash")}

    def _file(self, k: int) -> PackedRowFile:
        if k not in self._files:
            meta = self.manifest["shards"][k]
            path = self.dir / meta["file"]
            if not path.is_file():
                raise DataFormatError(f"{path}: listed in {self.dir / MANIFEST} but missing")
            f = PackedRowFile(path, noun="shard", remedy="restore the shard or rerun jobs/prepare_data.py")
            if f.num_rows != int(meta["rows"]):
                raise DataFormatError(f"{path}: has {f.num_rows} rows, manifest says {meta['rows']}")
            self._files[k] = f
        return self._files[k]

    def check_shards(self) -> None:
        """Open every shard's footer: a missing, truncated or miscounted shard is named now, before a run."""
        for k in range(len(self.manifest["shards"])):
            self._file(k)

    def read_global(self, g: int) -> dict[str, Any]:
        k = bisect.bisect_right(self._cum, g) - 1
        f = self._file(k)
        if self._current is not None and self._current is not f:
            self._current.drop_cache()
        self._current = f
        row = f.row(g - self._cum[k])
        if self.as_numpy:
            return row
        import torch

        return {
            "input_ids": torch.from_numpy(row["input_ids"].astype(np.int64)),
            "position_ids": torch.from_numpy(row["position_ids"].astype(np.int64)),
            "cu_seqlens": torch.from_numpy(row["cu_seqlens"].astype(np.int32)),
            "loss_mask": torch.from_numpy(row["loss_mask"].astype(np.bool_)),
            "doc_ids": row["doc_ids"],
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.position < self.num_rows:
            row = self.read_global(self.position * self.world_size + self.rank)
            self.position += 1
            yield row


def read_packed_dataset(directory: str | Path) -> Any:
    """The shards as a `ray.data.Dataset` in manifest order, for Ray Train's own dataset ingestion.

    Ray Data iterators do not resume mid-epoch: use `RowReader` when the data position must be saved.
    """
    import ray.data

    m = read_manifest(directory)
    paths = [str(Path(directory) / s["file"]) for s in m["shards"]]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise DataFormatError(f"{Path(directory) / MANIFEST} lists missing shard(s): {missing}")
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    return ray.data.read_parquet(paths, schema=ROW_SCHEMA)


# ------------------------------------------------------------------------------ whole pipeline
class PackedRun:
    """Counts of one prepare run, filled while streaming (documents, rejects, rows, timing)."""

    def __init__(self) -> None:
        self.render_rejects: list[tuple[str, str]] = []
        self.final_only = 0
        self.documents = 0
        self.doc_tokens = 0
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def stream_packed_rows(
    records: list[dict[str, Any]], renderer_spec: dict[str, Any], tcfg: Any, packer: BestFitPacker,
    run: PackedRun, on_document: Callable[[Document], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Mixture records -> Ray Data tokenise -> best-fit rows, streamed (Ray must be initialised)."""
    ds = tokenize_dataset(records, renderer_spec, tcfg.num_actors, tcfg.batch_size)
    batches = ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=4)

    def reject(doc_id: str, reason: str) -> None:
        run.render_rejects.append((doc_id, reason))

    def final_only(doc_id: str) -> None:
        run.final_only += 1

    for doc in iter_documents(batches, reject, final_only):
        run.documents += 1
        run.doc_tokens += len(doc.input_ids)
        if on_document is not None:
            on_document(doc)
        yield from packer.add(doc)
    yield from packer.flush()


# ------------------------------------------------------------------------------ the prepare job
def resolve_tokenizer(name_or_dir: str) -> Path:
    """A tokenizer directory, or an asset (`asset:NAME` or NAME, fetched on first use; hylo.assets' rule)."""
    from hylo.assets import resolve_path_or_asset

    return resolve_path_or_asset(name_or_dir, "tokenize.tokenizer", directory=True, progress=False)


def reason_key(reason: str) -> str:
    """Group reject reasons for the report: numbers and quoted values folded ("turn N: ...")."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", reason))[:120]


def rows_config_hash(cfg: Any) -> str:
    """Hash of what decides the rows: every key of the config but `UNHASHED_KEYS` (output paths, Ray
    pools, progress). The `tokenize` keys it keeps sit at the top level of the hashed mapping, as they
    always have (datasets prepared before keep their fingerprint)."""
    from hylo.pipeline.config import config_hash, to_dict
    from hylo.pipeline.data.config import UNHASHED_KEYS

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


# Files a prepare run writes into its output directory (anything else there is not ours to delete).
_OUTPUT_FILES = re.compile(r"(shard-\d+\.parquet|manifest\.json|rejects\.jsonl|removed\.jsonl|report\.(json|md)"
                           r"|\..*\.tmp-\d+(-[0-9a-f]+)?)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_output(out: Path, overwrite: bool) -> None:
    """Refuse to clobber: an existing dataset needs overwrite, a foreign directory is never replaced.

    Also finishes what a crash between the two renames of a swap left: the old dataset comes back.
    """
    leftovers = sorted(out.parent.glob(f".{out.name}.old-*")) if out.parent.is_dir() else []
    if not out.exists() and leftovers:
        leftovers[-1].rename(out)
    for d in out.parent.glob(f".{out.name}.tmp-*") if out.parent.is_dir() else []:
        # hylo.files.temp_name: .<name>.tmp-<pid>-<hex>
        pid = d.name.removeprefix(f".{out.name}.tmp-").split("-")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
    if not out.exists():
        return
    if not out.is_dir():
        raise PrepareError(f"output.dir {out} exists and is not a directory")
    if (out / MANIFEST).exists():
        if not overwrite:
            raise FileExistsError(f"{out / MANIFEST} exists; set output.overwrite=true to replace it")
        return
    foreign = sorted(p.name for p in out.iterdir() if not _OUTPUT_FILES.fullmatch(p.name))
    if foreign:
        raise PrepareError(f"output.dir {out} exists and is not a prepared dataset (holds {foreign[:5]}); "
                           f"choose another output.dir or empty it")




def _warn(report_warnings: list[str], text: str) -> None:
    report_warnings.append(text)
    print(f"warning: {text}", file=sys.stderr, flush=True)


def prepare(cfg: Any) -> dict[str, Any]:
    """Run the whole job for a `PrepareDataConfig`; returns the report (also written to disk).

    Writes into `cfg.output.dir`: shard-*.parquet, manifest.json, rejects.jsonl, report.json,
    report.md (and removed.jsonl with decontamination). Everything is checked first (output
    directory, sources, tokenizer, benchmarks), then built in a sibling directory that replaces
    the old dataset only once complete: a failure at any point leaves the old one untouched.
    Uses the running Ray if there is one, else starts a local one.
    """
    from hylo.pipeline.data.mixture import resolve_asset_path
    from hylo.pipeline.data.readers import resolve_files
    from transformers import AutoTokenizer

    out = Path(cfg.output.dir)
    _check_output(out, cfg.output.overwrite)
    # Fail fast on a wrong path or tokenizer before anything slow starts (and before touching out).
    if not cfg.mixture.sources:
        raise PrepareError("mixture.sources is empty")
    for src in cfg.mixture.sources:
        spec = resolve_asset_path(src)
        if not (spec.container == "hub" or spec.path.startswith("hub:")):
            resolve_files(spec)
    tok_dir = resolve_tokenizer(cfg.tokenize.tokenizer)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    renderer = ChatRenderer.from_hf(tok, cfg.tokenize.mask_method, cfg.tokenize.chat_template_kwargs)
    pad_id = cfg.packing.pad_id
    if pad_id is None:
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad_id is None:
        raise PrepareError(f"tokenizer {tok_dir} has neither a pad nor an EOS token; set packing.pad_id")
    index = None
    if cfg.decontam.benchmarks:
        from hylo.pipeline.data.decontam import build_index

        try:
            index, _ = build_index(cfg.decontam.benchmarks, cfg.decontam.match)
        except ValueError as e:
            raise PrepareError(f"decontam: {e}") from None

    # Built beside `out` and swapped in when complete; the previous dataset is deleted only after.
    with atomic_dir(out) as staging:
        report = _prepare_into(cfg, staging, out, renderer, pad_id, index)
    return report


def _prepare_into(cfg: Any, staging: Path, out: Path, renderer: ChatRenderer, pad_id: int,
                  index: Any) -> dict[str, Any]:
    from hylo.pipeline.data.mixture import build_mixture
    from hylo.pipeline.data.render import tokenizer_hash
    from tqdm import tqdm

    run = PackedRun()
    warnings: list[str] = []
    n_read_rejects = 0
    reasons: dict[str, int] = {}
    by_file: dict[str, dict[str, int]] = {}
    decontam: dict[str, Any] | None = None
    with open(staging / "rejects.jsonl", "w") as rej_f:

        def on_read_reject(r: dict[str, Any]) -> None:
            nonlocal n_read_rejects
            n_read_rejects += 1
            key = reason_key(r["reason"])
            reasons[key] = reasons.get(key, 0) + 1
            f = by_file.setdefault(r["file"], {"rejects": 0, "records_lost": 0, "unknown_losses": 0})
            f["rejects"] += 1
            if r.get("lost") is None:
                f["unknown_losses"] += 1
            else:
                f["records_lost"] += int(r["lost"])
            rej_f.write(json.dumps({"stage": "read", **r}, ensure_ascii=False) + "\n")

        m = cfg.mixture
        if index is None:
            records, mix_stats = build_mixture(m, cfg.split, on_read_reject)
        else:
            # Decide on the whole mixture, so both stages remove the same records.
            full, full_stats = build_mixture(m, "all", on_read_reject)
            if cfg.decontam.scanner == "ray":
                init_ray(cfg.ray.address, cfg.ray.num_cpus)
            records, mix_stats, decontam = _decontaminate(cfg, index, full, full_stats, staging)
            del full
        t_read = run.elapsed
        for name, c in mix_stats.sources.items():
            if c.read == 0:
                _warn(warnings, f"source {name!r} contributed no records (allow_empty is set)")
            elif c.out == 0:
                _warn(warnings, f"source {name!r}: {c.read} records read, none in the {cfg.split} split "
                                f"(weight {next(s.weight for s in m.sources if s.name == name)})")
        if renderer.date_dependent:
            _warn(warnings, "the chat template writes today's date (strftime_now): set "
                            "tokenize.chat_template_kwargs.date_string for reproducible tokens")
        if not records:
            raise PrepareError(f"the {cfg.split} split of the mixture is empty "
                               f"({sum(c.read for c in mix_stats.sources.values())} records read); nothing written")

        init_ray(cfg.ray.address, cfg.ray.num_cpus)
        import ray.data

        # Our own bar counts documents; Ray's per-operator bars would interleave with it.
        ray.data.DataContext.get_current().enable_progress_bars = False
        packer = make_packer(cfg.packing, pad_id)
        rg_rows = cfg.output.row_group_rows or max(1, (1 << 20) // cfg.packing.max_len)
        writer = ShardWriter(staging, cfg.output.rows_per_shard, rg_rows)
        t_tok0 = run.elapsed
        # Records, tokens and rows as they flow. Nothing arrives until the tokenizer actors have started
        # (each loads the tokenizer; seconds to tens of seconds), which the bar says instead of sitting at 0.
        desc = f"prepare {cfg.split}"
        with tqdm(total=len(records), desc=f"{desc} (starting {cfg.tokenize.num_actors} tokenizer actor(s))",
                  unit="rec", disable=not cfg.progress, dynamic_ncols=True) as bar:
            seen = 0

            def flowing(doc: Document) -> None:
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
            bar.set_postfix_str(f"{run.doc_tokens:,} tokens, {writer.rows:,} rows", refresh=False)
            bar.update(run.documents + len(run.render_rejects) - seen)
        shards = writer.finish()
        t_pack = run.elapsed - t_tok0
        for doc_id, reason in run.render_rejects:
            key = reason_key(reason)
            reasons[key] = reasons.get(key, 0) + 1
            rej_f.write(json.dumps({"stage": "render", "source": doc_id.split(":", 1)[0], "doc_id": doc_id,
                                    "reason": reason},
                                   ensure_ascii=False) + "\n")
    if not shards:
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
        raise PrepareError(f"no rows: every one of the {len(records)} mixture records was rejected or dropped "
                           f"({len(run.render_rejects)} render rejects, {pst_dropped(packer)} pieces dropped by "
                           f"packing; top reasons {top}); nothing written")

    pst = packer.stats
    srcs = mix_stats.sources.values()
    counts = {
        "records_read": sum(c.read for c in srcs) + n_read_rejects,
        "read_rejects": n_read_rejects,
        "records_lost": sum(c.records_lost for c in srcs),
        "unknown_losses": sum(c.unknown_losses for c in srcs),
        "repaired_records": sum(c.repaired for c in srcs),
        "decontaminated": sum(c.decontaminated for c in srcs),
        "mixture_records": len(records),
        "render_rejects": len(run.render_rejects),
        "final_turn_only": run.final_only,
        "documents": run.documents,
        "document_tokens": run.doc_tokens,
        **{k: v for k, v in pst.to_dict().items() if k not in ("max_len", "documents")},
    }
    manifest = {
        "split": cfg.split,
        "max_len": cfg.packing.max_len,
        "config_hash": rows_config_hash(cfg),
        "tokenizer": str(cfg.tokenize.tokenizer),
        "tokenizer_hash": tokenizer_hash(renderer),
        "pad_id": int(pad_id),
        "counts": counts,
        "mixture": mix_stats.to_dict(),
        # Every file that lost records while reading; the records are named in rejects.jsonl.
        "read_losses": [{"file": f, **v} for f, v in sorted(by_file.items())],
        "decontam": decontam,
        "warnings": warnings,
        "shards": shards,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_manifest(staging, manifest)
    report = {
        **manifest,
        "output_dir": str(out),
        "reject_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
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
    from dataclasses import asdict

    from hylo.pipeline.data.decontam import cut_record, scan_and_decide
    from hylo.pipeline.data.mixture import restrict

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
