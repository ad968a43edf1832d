"""Offline top-k teacher cache: shards written by a Ray Data actor pool, read back by stage 2.

Legend: T tokens of a row, K top-k.

Layout of a cache directory:
    manifest.json              schema, teacher id, tokenizer hash, k, dtypes, data fingerprint, shard plan
    shards/shard-00000.parquet one row per packed row: row_id, num_tokens, logprobs, indices, tail_logmass

Design choices:
* The unit of work, of atomic writes and of resume is a shard = a fixed row range of one input
  Parquet file (the plan is a pure function of the input files and `rows_per_shard`). A shard is
  written under a temporary name and renamed into place, so after a kill a shard file either
  exists complete or not at all; a rerun skips existing shards and sweeps temporary leftovers.
* The manifest is written first (with the plan) and rewritten when every shard exists; a rerun
  whose teacher, tokenizer, k, dtype or data differ from the manifest's fails, naming the field,
  instead of mixing two caches in one directory.
* Tensors are stored as raw little-endian bytes in `large_binary` columns (zstd-compressed):
  exact round trip of fp16/bf16, no per-element boxing. The guarantee is about storage: the reader
  returns bit for bit what the teacher computed for the row inside its shard's batch. The teacher is
  not batch-invariant (batch shape, thread count and CPU kind change the last bits), so a direct
  forward of one row agrees with the cache within float tolerance, not bit for bit; near-ties may
  swap order or top-k membership, and a tail of the top-k mass may be -inf or a tiny finite log. Indices are stored as uint16 when the
  vocabulary fits (halving their size), int32 otherwise; the reader always returns int32.
* Every shard carries the cache header in its Parquet metadata too, so a shard copied into the
  wrong cache is detected. Shards are written with Parquet page checksums and read with their
  verification on (`rowfile.PAGE_CHECKSUMS`): a changed byte is an error naming the shard and row group,
  never a changed teacher distribution (a cache written before carries none and reads unverified).
* A shard's rows are read by the one reader of packed rows (`hylo.pipeline.data.reader.RowReader`, from
  the shard's first row), so the teacher is given the same checked `PackedRow`s as training.
* A token range of a row (a sequence-parallel rank's tokens) reads the row's row group and decompresses its
  values whole (each tensor is one binary value: the file holds no slice of it), then converts only the
  range's bytes into tensors (`TopKCacheReader._read`).
* The manifest names only files of the cache's own `shards/`, each once (`hylo.manifest_paths.confined_paths`, when it
  is read): a shard name with `..`, or a shard that is a link out of the cache, is refused before any read.
* Row ids are the data's `row_id` column when present, else a content hash of the row
  (`hylo.pipeline.data.rows.PackedRow.row_id`), so `get_for_row(row)` also proves the row is the same data.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hylo.atomic import atomic_path, atomic_write
from hylo.json_files import read_json
from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.leftovers import sweep_temp_files
from hylo.manifest_paths import confined_paths, own_file
from hylo.outputs import check_not_an_input
from hylo.ownership import OUTPUT_RECORD, check_own_directory, output_target, record_files
from hylo.pipeline.config import from_dict, to_dict
from hylo.pipeline.data.prepare import resolve_tokenizer
from hylo.pipeline.data.reader import ParquetRows, RowReader
from hylo.pipeline.data.rowfile import PAGE_CHECKSUMS, damage, open_parquet
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.data.shards import read_manifest
from hylo.pipeline.paths import job_inputs
from hylo.pipeline.teacher.config import TeacherModelConfig
from hylo.pipeline.teacher.model import (
    TeacherModel,
    model_fingerprint,
    resolve_model_path,
    tokenizer_fingerprint,
)
from hylo.pipeline.teacher.protocol import TargetSpec, check_token_range, unsupported

SCHEMA = "hylo-teacher-topk"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
META_KEY = b"hylo_teacher_cache"
# Fields that must agree between a cache and whoever writes into or reads from it.
HEADER_FIELDS = ("schema", "schema_version", "teacher_id", "tokenizer_hash", "k", "dtype", "index_dtype",
                 "vocab_size", "data_fingerprint", "rows_per_shard")
_NP_DTYPES = {"float16": np.float16, "float32": np.float32, "int32": np.int32, "uint16": np.uint16}


class CacheMismatchError(ValueError):
    """The cache was made with another teacher, tokenizer, k, dtype or data; names the field."""


class CacheFormatError(ValueError):
    """A cache file is missing, unreadable or of an unknown schema; names the file."""


@dataclass(frozen=True)
class ShardPlan:
    name: str
    file: str
    start: int
    end: int


def list_data_files(data_dir: str | Path) -> list[Path]:
    d = Path(data_dir)
    if not d.is_dir():
        raise CacheFormatError(f"data directory {d} does not exist")
    files = sorted(p for p in d.rglob("*.parquet") if not p.name.startswith("."))
    if not files:
        raise CacheFormatError(f"data directory {d} holds no .parquet files")
    return files


def data_fingerprint(data_dir: str | Path) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(hash, files, info) of a packed dataset.

    With the data pipeline's manifest.json, the files are its shards in its order and `info` holds
    its tokenizer (name, hash) and config hash; otherwise every *.parquet under the directory,
    sorted. The hash covers relative paths, sizes, row counts and the manifest's hashes.
    """
    d = Path(data_dir)
    info: dict[str, Any] = {}
    if (d / "manifest.json").is_file():
        m = read_manifest(d)
        paths = [d / s["file"] for s in m["shards"]]
        info = {k: m.get(k) for k in ("format", "tokenizer", "tokenizer_hash", "config_hash")}
    else:
        paths = list_data_files(d)
    entries = []
    for p in paths:
        try:
            rows = pq.ParquetFile(p).metadata.num_rows
        except Exception as e:
            raise CacheFormatError(f"{p}: not a readable Parquet file ({e})") from None
        entries.append({"path": str(p.relative_to(d)), "bytes": p.stat().st_size, "rows": rows})
    blob = json.dumps([entries, info], sort_keys=True).encode()
    return "data-" + hashlib.sha256(blob).hexdigest()[:16], entries, info


def plan_shards(files: list[dict[str, Any]], rows_per_shard: int) -> list[ShardPlan]:
    plan = []
    for f in files:
        for s in range(0, f["rows"], rows_per_shard):
            plan.append(ShardPlan(f"shard-{len(plan):05d}", f["path"], s, min(s + rows_per_shard, f["rows"])))
    return plan


def index_dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def make_header(teacher_id: str, tokenizer_hash: str, k: int, dtype: str, vocab_size: int,
                data_fp: str, rows_per_shard: int) -> dict[str, Any]:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "teacher_id": teacher_id,
            "tokenizer_hash": tokenizer_hash, "k": k, "dtype": dtype, "index_dtype": index_dtype_for(vocab_size),
            "vocab_size": vocab_size, "data_fingerprint": data_fp, "rows_per_shard": rows_per_shard}


def check_header(found: Mapping[str, Any], expected: Mapping[str, Any], where: str,
                 fields: tuple[str, ...] = HEADER_FIELDS) -> None:
    for f in fields:
        if f in expected and expected[f] is not None and found.get(f) != expected[f]:
            raise CacheMismatchError(f"{where}: {f} is {found.get(f)!r} but {expected[f]!r} is expected "
                                     f"(a cache made with another {f.replace('_', ' ')}; use a new cache directory)")


# ---------------------------------------------------------------------- tensors <-> bytes
def _to_bytes(t: torch.Tensor, dtype: str) -> bytes:
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype(np.dtype(_NP_DTYPES[dtype]).newbyteorder("<")).tobytes()


def _from_bytes(b: Any, dtype: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor:
    """A tensor of `shape` stored as raw bytes `b` (bytes or a pyarrow buffer); `rows=(s, e)`: only the leading
    rows s..e of it, converted from their bytes alone (the rest of `b` is not copied)."""
    s, e = rows or (0, shape[0])
    per_row = int(np.prod(shape[1:], dtype=np.int64))
    wire = np.dtype("<i2") if dtype == "bfloat16" else np.dtype(_NP_DTYPES[dtype]).newbyteorder("<")
    arr = np.frombuffer(b, dtype=wire, count=(e - s) * per_row, offset=s * per_row * wire.itemsize)
    out = (e - s, *shape[1:])
    if dtype == "bfloat16":
        return torch.from_numpy(arr.astype(np.int16).reshape(out)).view(torch.bfloat16)
    return torch.from_numpy(arr.astype(_NP_DTYPES[dtype]).reshape(out))


def write_shard(path: Path, header: Mapping[str, Any], plan: ShardPlan, row_ids: list[str],
                records: list[TeacherTopK]) -> int:
    """Write one shard atomically; returns its size in bytes."""
    k, dt, idt = header["k"], header["dtype"], header["index_dtype"]
    for rid, rec in zip(row_ids, records):
        if rec.logprobs.shape[1] != k:
            raise ValueError(f"shard {plan.name}: row {rid} has k={rec.logprobs.shape[1]}, the cache k={k}")
    table = pa.table({
        "row_id": pa.array(row_ids, pa.string()),
        "num_tokens": pa.array([int(r.logprobs.shape[0]) for r in records], pa.int32()),
        "logprobs": pa.array([_to_bytes(r.logprobs, dt) for r in records], pa.large_binary()),
        "indices": pa.array([_to_bytes(r.indices, idt) for r in records], pa.large_binary()),
        "tail_logmass": pa.array([_to_bytes(r.tail_logmass, "float32") for r in records], pa.large_binary()),
    })
    meta = {**header, "shard": plan.name, "file": plan.file, "start": plan.start, "end": plan.end}
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    # One packed row per row group: a reader fetches one row without decoding its neighbours.
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", row_group_size=1, **PAGE_CHECKSUMS)
    return path.stat().st_size


def read_shard_meta(path: Path) -> dict[str, Any]:
    try:
        md = pq.ParquetFile(path).schema_arrow.metadata or {}
    except Exception as e:
        raise CacheFormatError(f"{path}: unreadable shard ({e})") from None
    if META_KEY not in md:
        raise CacheFormatError(f"{path}: not a teacher-cache shard (no {META_KEY.decode()} metadata)")
    return json.loads(md[META_KEY])


# ---------------------------------------------------------------------- writing (one shard)
def compute_shard(teacher: Any, data_dir: str | Path, out_dir: str | Path, header: Mapping[str, Any],
                  plan: ShardPlan) -> dict[str, Any]:
    """Run `teacher` (a TeacherModel) over one shard's rows and write it; returns a summary."""
    t0 = time.perf_counter()
    # the shard's rows through the one reader of packed rows, from its first row on (each row checked)
    reader = RowReader(ParquetRows([Path(data_dir) / plan.file]), start=plan.start, drop_last=False)
    prows = list(itertools.islice(reader, plan.end - plan.start))
    records = teacher.topk_batch(prows, header["k"], dtype=header["dtype"])
    path = Path(out_dir) / SHARD_DIR / f"{plan.name}.parquet"
    size = write_shard(path, header, plan, [r.row_id for r in prows], records)
    return {"shard": plan.name, "rows": len(prows), "tokens": sum(r.num_tokens for r in prows),
            "bytes": size, "seconds": time.perf_counter() - t0}


class _ShardWorker:
    """Ray Data actor: one teacher per actor, one shard per call."""

    def __init__(self, model_cfg: dict[str, Any], data_dir: str, out_dir: str, header: dict[str, Any]) -> None:
        self.teacher = TeacherModel.from_config(from_dict(TeacherModelConfig, model_cfg))
        check_header({"teacher_id": self.teacher.teacher_id, "tokenizer_hash": self.teacher.tokenizer_hash,
                      "vocab_size": self.teacher.vocab_size}, header, f"teacher actor for {out_dir}",
                     ("teacher_id", "tokenizer_hash", "vocab_size"))
        self.data_dir, self.out_dir, self.header = data_dir, out_dir, header

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for i in range(len(batch["name"])):
            plan = ShardPlan(str(batch["name"][i]), str(batch["file"][i]), int(batch["start"][i]), int(batch["end"][i]))
            for key, v in compute_shard(self.teacher, self.data_dir, self.out_dir, self.header, plan).items():
                out.setdefault(key, []).append(v)
        return out


def _teacher_identity(model_cfg: Any) -> tuple[str, str, int]:
    """teacher id, tokenizer hash and vocabulary size, without loading the weights."""
    path = resolve_model_path(model_cfg.path)
    cfg = read_json(path / "config.json", CacheFormatError, mapping=True)
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int):
        raise CacheFormatError(f"{path}/config.json has no integer vocab_size")
    return model_fingerprint(path), tokenizer_fingerprint(model_cfg.tokenizer or path), vocab


def _check_data_tokenizer(data_info: Mapping[str, Any], teacher_tok_hash: str, cfg: Any) -> None:
    """The data must be tokenized with the teacher's tokenizer (when the data manifest names it)."""
    name = data_info.get("tokenizer")
    if not name:
        return

    try:
        data_tok = tokenizer_fingerprint(resolve_tokenizer(name))
    except FileNotFoundError:
        return
    if data_tok != teacher_tok_hash:
        raise CacheMismatchError(f"{cfg.data}: the data was tokenized with {name!r} ({data_tok}), the teacher "
                                 f"{cfg.teacher.model.path!r} uses another tokenizer ({teacher_tok_hash})")


def sweep_cache_leftovers(out: str | Path, plan: Sequence[ShardPlan] | None = None) -> list[Path]:
    """Remove what killed writers left in cache `out` (a shard, the manifest or the record half written under
    its temporary name, `hylo.leftovers.sweep_temp_files`: only those, of a process that is gone); `plan`: the
    shards, default the manifest's. Run by every run of the cache, and by `hylo clean OUT`."""
    out = Path(out)
    if plan is None:
        try:
            names = [str(p["name"]) for p in load_manifest(out).get("shards", [])]
        except (CacheFormatError, OSError, TypeError, KeyError):
            names = []
    else:
        names = [p.name for p in plan]
    return (sweep_temp_files(out / SHARD_DIR, [f"{n}.parquet" for n in names])
            + sweep_temp_files(out, [MANIFEST, OUTPUT_RECORD]))


def check_cache_output(cfg: Any) -> None:
    """Before any work: `out` is none of what the job reads (its config file, the data, the teacher or its
    tokenizer, nor inside or around one of them: `hylo.outputs.check_not_an_input`), and, when it exists, it is a
    cache a run of this project made (its `.hylo-output.json` lists every entry; a directory is never taken for a
    cache by its manifest's name): a rerun resumes its own cache, it never writes into a directory of the user's."""
    check_not_an_input(cfg.out, job_inputs(cfg), "out")
    check_own_directory(cfg.out, "out", listed_only=True)


def prepare_cache(cfg: Any) -> tuple[dict[str, Any], list[ShardPlan], list[ShardPlan]]:
    """Check or write the manifest; returns (header, full plan, shards still to do)."""
    out = output_target(cfg.out)
    if not cfg.data or not cfg.out:
        raise CacheFormatError("teacher cache: both `data` and `out` must be set")
    check_cache_output(cfg)
    teacher_id, tok_hash, vocab = _teacher_identity(cfg.teacher.model)
    if cfg.teacher.k > vocab:
        raise CacheMismatchError(f"teacher.k={cfg.teacher.k} exceeds the teacher's vocabulary ({vocab})")
    data_fp, files, data_info = data_fingerprint(cfg.data)
    _check_data_tokenizer(data_info, tok_hash, cfg)
    header = make_header(teacher_id, tok_hash, cfg.teacher.k, cfg.dtype, vocab, data_fp, cfg.rows_per_shard)
    plan = plan_shards(files, cfg.rows_per_shard)
    mpath = out / MANIFEST
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    # the cache is ours from now on: a rerun resumes it, `check_cache_output` refuses anything else
    record_files(out, [MANIFEST, SHARD_DIR])
    if mpath.is_file():
        found = load_manifest(out)
        check_header(found, header, str(mpath))
    else:
        manifest = {**header, "data_dir": str(Path(cfg.data).resolve()), "data_info": data_info, "data_files": files,
                    "shards": [p.__dict__ for p in plan], "complete": False, "created": time.time()}
        atomic_write(mpath, json.dumps(manifest, indent=1), fsync=True)
    sweep_cache_leftovers(out, plan)
    todo = []
    for p in plan:
        path = out / SHARD_DIR / f"{p.name}.parquet"
        if path.is_file():
            meta = read_shard_meta(path)
            check_header(meta, header, str(path))
            if (meta["file"], meta["start"], meta["end"]) != (p.file, p.start, p.end):
                raise CacheMismatchError(f"{path}: covers {meta['file']} rows {meta['start']}..{meta['end']}, "
                                         f"the plan says {p.file} rows {p.start}..{p.end}")
        else:
            todo.append(p)
    return header, plan, todo


def finalize_cache(out_dir: str | Path, plan: list[ShardPlan]) -> bool:
    """Mark the manifest complete (with totals) when every planned shard exists."""
    out = Path(out_dir)
    paths = [out / SHARD_DIR / f"{p.name}.parquet" for p in plan]
    if not all(p.is_file() for p in paths):
        return False
    manifest = load_manifest(out)
    rows = tokens = 0
    for p in paths:
        t = pq.read_table(p, columns=["num_tokens"], page_checksum_verification=True)
        rows += t.num_rows
        tokens += int(np.asarray(t.column("num_tokens")).sum())
    size = sum(p.stat().st_size for p in paths)
    manifest.update(complete=True, rows=rows, tokens=tokens, bytes=size,
                    bytes_per_token=size / max(tokens, 1), finished=time.time())
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=1), fsync=True)
    return True


def run_cache_job(cfg: Any, log: Any = print) -> dict[str, Any]:
    """Compute the missing shards with a Ray Data actor pool; resumable. Needs `ray.init()` done."""
    import ray  # lazy: ray

    header, plan, todo = prepare_cache(cfg)
    already = len(plan) - len(todo)
    if cfg.max_new_shards:
        todo = todo[:cfg.max_new_shards]
    log(f"teacher cache {cfg.out}: {len(plan)} shards planned, {already} already done, {len(todo)} to compute")
    done = []
    if todo:
        ds = ray.data.from_items([p.__dict__ for p in todo], override_num_blocks=len(todo))
        ds = ds.map_batches(
            _ShardWorker,
            fn_constructor_kwargs={"model_cfg": to_dict(cfg.teacher.model), "data_dir": str(cfg.data),
                                   "out_dir": str(cfg.out), "header": header},
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=min(cfg.num_actors, len(todo))),
            num_cpus=cfg.cpus_per_actor,
            num_gpus=cfg.gpus_per_actor,
        )
        for summary in ds.iter_rows():
            done.append(summary)
            log(f"  {summary['shard']}: {summary['rows']} rows, {summary['tokens']} tokens, "
                f"{summary['bytes'] / max(summary['tokens'], 1):.0f} B/token, {summary['seconds']:.1f} s")
    complete = finalize_cache(cfg.out, plan)
    return {"planned": len(plan), "computed": sorted(s["shard"] for s in done), "complete": complete}


def load_manifest(cache_dir: str | Path, expect_k: int | None = None) -> dict[str, Any]:
    """A cache's manifest; `expect_k` (stage 2's teacher.k): a cache of another k is refused."""
    # the cache's own manifest: never another cache's through a link, never a pipe or a directory
    path = own_file(cache_dir, MANIFEST, CacheFormatError)
    if not path.is_file():
        raise CacheFormatError(f"{cache_dir}: no {MANIFEST}; not a teacher cache")
    m = read_json(path, CacheFormatError, mapping=True)
    if m.get("schema") != SCHEMA:
        raise CacheFormatError(f"{path}: schema {m.get('schema')!r} is not {SCHEMA!r}")
    if m.get("schema_version") != SCHEMA_VERSION:
        raise CacheFormatError(f"{path}: schema_version {m.get('schema_version')!r}; this reader knows "
                               f"{SCHEMA_VERSION}")
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in shards):
        raise CacheFormatError(f"{path}: field 'shards' must be a list of {{name, ...}}")
    # every shard a file of this cache's shards/, each once: never another cache's records read as this one's
    confined_paths(cache_dir, [f"{SHARD_DIR}/{s['name']}.parquet" for s in shards], path, "shards",
                   CacheFormatError)
    if expect_k is not None and m.get("k") != expect_k:
        raise CacheMismatchError(
            f"teacher cache {cache_dir}: it holds top-{m.get('k')} records, k={expect_k} is expected (stage 2's "
            f"teacher.k): set teacher.k to {m.get('k')}, or write a cache with teacher.k={expect_k} into a new "
            f"directory")
    return m


# ---------------------------------------------------------------------- reading
class TopKCacheReader:
    """Stage 2's view of a finished cache: `targets(rows, spec)` (protocol.TeacherSource), `get(row_id)`,
    `get_for_row(row)` or iteration in data order. `expect_k`: stage 2's teacher.k (another k is refused)."""

    def __init__(
        self,
        cache_dir: str | Path,
        expect_k: int | None = None,
        expect_tokenizer_hash: str | None = None,
        expect_teacher_id: str | None = None,
        expect_data: str | Path | None = None,
        allow_incomplete: bool = False,
    ) -> None:
        self.dir = Path(cache_dir)
        self.manifest = load_manifest(self.dir, expect_k)
        where = str(self.dir / MANIFEST)
        if not self.manifest.get("complete") and not allow_incomplete:
            raise CacheFormatError(f"{where}: the cache is incomplete (rerun jobs/teacher_cache.py to finish it)")
        expected: dict[str, Any] = {"tokenizer_hash": expect_tokenizer_hash,
                                    "teacher_id": expect_teacher_id}
        if expect_data is not None:
            data_fp, _, data_info = data_fingerprint(expect_data)
            cache_info = self.manifest.get("data_info") or {}
            if data_info.get("tokenizer_hash") != cache_info.get("tokenizer_hash"):
                raise CacheMismatchError(
                    f"{where}: the data in {expect_data} was tokenized with tokenizer hash "
                    f"{data_info.get('tokenizer_hash')!r}, the cache was made from data with "
                    f"{cache_info.get('tokenizer_hash')!r}")
            expected["data_fingerprint"] = data_fp
        check_header(self.manifest, expected, where)
        self.k = int(self.manifest["k"])
        self.dtype = self.manifest["dtype"]
        self.index_dtype = self.manifest["index_dtype"]
        self._files: list[Path] = []
        self._index: dict[str, tuple[int, int]] = {}
        self.row_ids: list[str] = []
        for sh in self.manifest["shards"]:
            path = self.dir / SHARD_DIR / f"{sh['name']}.parquet"
            if not path.is_file():
                if allow_incomplete:
                    continue
                raise CacheFormatError(f"{path}: shard listed in the manifest is missing")
            check_header(read_shard_meta(path), self.manifest, str(path))
            fi = len(self._files)
            self._files.append(path)
            try:
                ids = pq.read_table(path, columns=["row_id"], page_checksum_verification=True).column(
                    "row_id").to_pylist()
            except (pa.ArrowException, OSError) as e:
                raise CacheFormatError(f"{path}: unreadable cache shard ({damage(e)})") from None
            for j, rid in enumerate(ids):
                self._index.setdefault(rid, (fi, j))
                self.row_ids.append(rid)
        self._open: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return len(self.row_ids)

    def __contains__(self, row_id: str) -> bool:
        return row_id in self._index

    def _read(self, fi: int, j: int, rng: tuple[int, int] | None = None) -> tuple[str, int, TeacherTopK]:
        """(row_id, the row's stored token count, its record of tokens rng = [start, end), default all).

        What is read: the row's row group (one per packed row), i.e. its three tensors as one zstd-compressed
        binary value each, decompressed whole: the format stores a row's tensor as one value, so no slice of it
        can be read from the file. Only the range's bytes are then converted into tensors (zero-copy views of
        the decompressed values, `_from_bytes`), so what is returned and kept is the range's records alone."""
        try:
            if self._open is None or self._open[0] != fi:
                self._open = (fi, open_parquet(self._files[fi]))
            t = self._open[1].read_row_group(j)
        except (pa.ArrowException, OSError) as e:
            raise CacheFormatError(f"{self._files[fi]} row group {j}: unreadable cache shard ({damage(e)}); "
                                   f"compute that shard again (delete it and rerun jobs/teacher_cache.py)") from None
        rid = t.column("row_id")[0].as_py()
        n = int(t.column("num_tokens")[0].as_py())
        if rng is not None and not 0 <= rng[0] < rng[1] <= n:
            raise CacheMismatchError(f"{self._files[fi]} row group {j}: row {rid} holds {n} tokens, token range "
                                     f"({rng[0]}, {rng[1]}) is asked for")

        def blob(name: str) -> Any:
            return t.column(name)[0].as_buffer()

        rec = TeacherTopK(
            _from_bytes(blob("logprobs"), self.dtype, (n, self.k), rng),
            _from_bytes(blob("indices"), self.index_dtype, (n, self.k), rng).to(torch.int32),
            _from_bytes(blob("tail_logmass"), "float32", (n,), rng),
        )
        return rid, n, rec

    def get(self, row_id: str, token_range: tuple[int, int] | None = None) -> TeacherTopK:
        loc = self._index.get(row_id)
        if loc is None:
            raise KeyError(f"{self.dir}: row_id {row_id!r} is not in the cache (made from other data?)")
        return self._read(*loc, token_range)[2]

    def get_for_row(self, prow: PackedRow, token_range: tuple[int, int] | None = None) -> TeacherTopK:
        """The record of a (checked) packed row, checked against its id and length; `token_range`: of tokens
        [start, end) only (checked against the row: protocol.check_token_range)."""
        rng = check_token_range(token_range, [prow], f"teacher cache {self.dir}")
        loc = self._index.get(prow.row_id)
        if loc is None:
            raise CacheMismatchError(f"{self.dir}: row {prow.row_id} ({prow.num_tokens} tokens) is not in the "
                                     f"cache; the cache was made from other data or another packing")
        _, n, rec = self._read(*loc, rng)
        if n != prow.num_tokens:
            raise CacheMismatchError(f"{self.dir}: row {prow.row_id} has {prow.num_tokens} tokens, the cache "
                                     f"holds {n}")
        return rec

    def targets(self, rows: Sequence[PackedRow], spec: TargetSpec,
                token_range: tuple[int, int] | None = None) -> Iterator[dict[str, Any]]:
        """The fused KL's teacher arguments of each row (protocol.TeacherSource): the stored top-k records, of
        tokens [start, end) only when `token_range` is given (see `_read` for what is read)."""
        if spec.form != "topk" or spec.k != self.k:
            raise unsupported(f"offline (k={self.k}, {self.dir})", spec)
        rng = check_token_range(token_range, rows, f"teacher cache {self.dir}")
        for row in rows:
            yield {"teacher_topk": self.get_for_row(row, rng)}

    def __iter__(self) -> Iterator[tuple[str, TeacherTopK]]:
        """(row_id, record) in data order."""
        for fi, path in enumerate(self._files):
            for j in range(pq.ParquetFile(path).metadata.num_row_groups):
                rid, _, rec = self._read(fi, j)
                yield rid, rec
