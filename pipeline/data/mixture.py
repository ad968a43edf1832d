"""Weighted mixture of chat sources, with a deterministic stage-1 / stage-2 split by record id.

Design choices:
* The split is a pure function of (split_salt, source name, record id): a record hashes to u in
  [0, 1) and belongs to stage 1 when u < stage1_fraction. Stage 2 reads the whole mixture
  (`stage2="all"`, the published recipe: stage 1 distils on a 20 % sample, stage 2 on everything)
  or only the records not in stage 1 (`stage2="rest"`, disjoint stages). It ignores the mixture
  seed, the weights and the read order, so stage 1 is the same sample for any seeds (and, with
  "rest", the stages are disjoint), and a record keeps its split when other sources are added.
* A weight is a sampling proportion: weight w gives every record floor(w) copies plus one more
  with probability frac(w) (2.0 repeats every record, 0.5 keeps about half). The extra copy is
  decided by a hash of (seed, doc id), so it is deterministic for a seed.
* Order: every copy gets the key hash(seed, doc id); the mixture is sorted by that key (ties by
  source position and read order). That is a global shuffle that depends on the seed only, never
  on how many workers read what. It is done in driver memory: fine for the datasets here (a
  million conversations is a few GB); a bigger mixture would sort the keys only and fetch records
  by offset.
* Every output record carries `doc_id` = "<source>:<id>" (copies: "~k" suffix; a repeated id in
  one source gets "#dupN"), the id that follows the document into packed rows, and `doc_base`, the
  doc id without the copy suffix (what decontamination and the split decide on).
* Per source the stats count what was read, rejected (and how many records those rejects stand
  for), repaired (by kind), removed by decontamination, in the split and written (with copies).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hylo.assets import expand_asset
from hylo.pipeline.data.config import SPLITS, STAGE2_MODES
from hylo.pipeline.data.readers import iter_records


def _unit(*parts: str) -> float:
    """A uniform value in [0, 1) from a stable hash of the parts (not Python's salted hash)."""
    h = hashlib.blake2b("\0".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def split_of(source: str, record_id: str, stage1_fraction: float, salt: str) -> str:
    """"stage1" for the stage-1 sample, else "stage2" (the rest; stage 2 may read everything)."""
    return "stage1" if _unit(salt, source, record_id) < stage1_fraction else "stage2"


def in_split(split: str, source: str, record_id: str, stage1_fraction: float, salt: str,
             stage2: str = "all") -> bool:
    if split == "all" or (split == "stage2" and stage2 == "all"):
        return True
    return split_of(source, record_id, stage1_fraction, salt) == split


def n_copies(weight: float, doc_id: str, seed: int) -> int:
    whole = math.floor(weight)
    frac = weight - whole
    return whole + (1 if frac > 0 and _unit("copy", str(seed), doc_id) < frac else 0)


@dataclass
class SourceCounts:
    # Records read (normalised), and rejects: how many, and how many records they stand for
    # (`records_lost`; `unknown_losses` counts rejects of unknown size such as unreadable files).
    read: int = 0
    rejected: int = 0
    records_lost: int = 0
    unknown_losses: int = 0
    repaired: int = 0
    repairs: dict[str, int] = field(default_factory=dict)
    duplicate_ids: int = 0
    decontaminated: int = 0
    in_split: int = 0
    out: int = 0

    def count_reject(self, reject: dict[str, Any]) -> None:
        self.rejected += 1
        lost = reject.get("lost", 1)
        if lost is None:
            self.unknown_losses += 1
        else:
            self.records_lost += int(lost)


@dataclass
class MixtureStats:
    split: str = "all"
    sources: dict[str, SourceCounts] = field(default_factory=dict)

    @property
    def out(self) -> int:
        return sum(c.out for c in self.sources.values())

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "out": self.out, "sources": {k: asdict(v) for k, v in self.sources.items()}}


def mix(
    streams: Sequence[tuple[str, float, Iterable[dict[str, Any]]]],
    split: str,
    seed: int,
    stage1_fraction: float = 0.2,
    split_salt: str = "hylo-split-v1",
    stage2: str = "all",
) -> tuple[list[dict[str, Any]], MixtureStats]:
    """Mix (name, weight, records) streams into one seeded order of the chosen split.

    Records are `{"id", "source", "messages"}` (as the readers give them); returned records are
    shallow copies with `doc_id` and `doc_base` added.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    if stage2 not in STAGE2_MODES:
        raise ValueError(f"stage2 {stage2!r} is not one of {STAGE2_MODES}")
    if not 0.0 <= stage1_fraction <= 1.0:
        raise ValueError(f"stage1_fraction must be in [0, 1], got {stage1_fraction}")
    stats = MixtureStats(split=split)
    keyed: list[tuple[float, int, int, dict[str, Any]]] = []
    for s_idx, (name, weight, records) in enumerate(streams):
        if weight < 0:
            raise ValueError(f"source {name!r}: weight must be >= 0, got {weight}")
        counts = stats.sources.setdefault(name, SourceCounts())
        seen: dict[str, int] = {}
        for rec in records:
            counts.read += 1
            if rec.get("repairs"):
                counts.repaired += 1
                for kind in rec["repairs"]:
                    counts.repairs[kind] = counts.repairs.get(kind, 0) + 1
            rid = str(rec["id"])
            base = f"{name}:{rid}"
            dup = seen.get(base, 0)
            seen[base] = dup + 1
            if dup:
                counts.duplicate_ids += 1
                base = f"{base}#dup{dup}"
            if not in_split(split, name, base[len(name) + 1:], stage1_fraction, split_salt, stage2):
                continue
            counts.in_split += 1
            for k in range(n_copies(weight, base, seed)):
                doc_id = base if k == 0 else f"{base}~{k}"
                keyed.append((_unit("order", str(seed), doc_id), s_idx, counts.out,
                              {**rec, "doc_id": doc_id, "doc_base": base}))
                counts.out += 1
    keyed.sort(key=lambda t: t[:3])
    return [t[3] for t in keyed], stats


def restrict(
    records: list[dict[str, Any]], stats: MixtureStats, split: str, stage1_fraction: float, split_salt: str,
    stage2: str = "all", removed: set[str] | None = None, replaced: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], MixtureStats]:
    """Records of a `mix(..., "all")` result narrowed to `split`, without the `removed` doc bases and
    with `replaced` ones (doc base -> new record) swapped in; counts updated, order kept.

    Lets decontamination decide on the whole mixture, so stage 1 and stage 2 remove the same records.
    """
    removed, replaced = removed or set(), replaced or {}
    out_stats = MixtureStats(split=split, sources={k: dataclasses.replace(v, repairs=dict(v.repairs), in_split=0,
                                                                         out=0, decontaminated=0)
                                                   for k, v in stats.sources.items()})
    kept = []
    for rec in records:
        base, src = rec["doc_base"], rec["source"]
        counts = out_stats.sources[src]
        first = rec["doc_id"] == base
        if base in removed:
            counts.decontaminated += first
            continue
        if not in_split(split, src, base[len(src) + 1:], stage1_fraction, split_salt, stage2):
            continue
        counts.in_split += first
        counts.out += 1
        new = replaced.get(base)
        kept.append(rec if new is None else {**rec, "messages": new["messages"]})
    return kept, out_stats


def resolve_asset_path(spec: Any) -> Any:
    """`path: asset:NAME` (or NAME where no such path exists) -> the local file of that `hylo.assets` asset
    (fetched on first use); any other path as it is."""
    return dataclasses.replace(spec, path=expand_asset(spec.path, progress=False))


def build_mixture(
    cfg: Any, split: str, on_reject: Callable[[dict[str, Any]], None]
) -> tuple[list[dict[str, Any]], MixtureStats]:
    """Read every source of a `MixtureConfig` with the readers and mix them; rejects go to `on_reject`
    and are counted per source. A source without any usable record raises EmptySourceError (from the
    reader) unless the source sets `allow_empty`."""
    tallies: dict[str, SourceCounts] = {s.name: SourceCounts() for s in cfg.sources}

    def counted(name: str) -> Callable[[dict[str, Any]], None]:
        def cb(r: dict[str, Any]) -> None:
            tallies[name].count_reject(r)
            on_reject(r)
        return cb

    streams = [(s.name, s.weight, iter_records(resolve_asset_path(s), counted(s.name))) for s in cfg.sources]
    records, stats = mix(streams, split, cfg.seed, cfg.stage1_fraction, cfg.split_salt, cfg.stage2)
    for name, t in tallies.items():
        c = stats.sources.setdefault(name, SourceCounts())
        c.rejected, c.records_lost, c.unknown_losses = t.rejected, t.records_lost, t.unknown_losses
    return records, stats
