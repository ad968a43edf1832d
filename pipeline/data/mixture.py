"""Weighted mixture of chat sources, with a deterministic stage-1 / stage-2 split by record id.

Design choices:
* The split is a pure function of (split_salt, source name, record id): a record hashes to u in
  [0, 1) and goes to stage 1 when u < stage1_fraction, else to stage 2. It ignores the mixture
  seed, the weights and the read order, so the two stages are disjoint for any seeds, and a record
  keeps its split when other sources are added.
* A weight is a sampling proportion: weight w gives every record floor(w) copies plus one more
  with probability frac(w) (2.0 repeats every record, 0.5 keeps about half). The extra copy is
  decided by a hash of (seed, doc id), so it is deterministic for a seed.
* Order: every copy gets the key hash(seed, doc id); the mixture is sorted by that key (ties by
  source position and read order). That is a global shuffle that depends on the seed only, never
  on how many workers read what. It is done in driver memory: fine for the datasets here (a
  million conversations is a few GB); a bigger mixture would sort the keys only and fetch records
  by offset.
* Every output record carries `doc_id` = "<source>:<id>" (copies: "~k" suffix; a repeated id in
  one source gets "#dupN"), the id that follows the document into packed rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SPLITS = ("stage1", "stage2", "all")


def _unit(*parts: str) -> float:
    """A uniform value in [0, 1) from a stable hash of the parts (not Python's salted hash)."""
    h = hashlib.blake2b("\0".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def split_of(source: str, record_id: str, stage1_fraction: float, salt: str) -> str:
    return "stage1" if _unit(salt, source, record_id) < stage1_fraction else "stage2"


def n_copies(weight: float, doc_id: str, seed: int) -> int:
    whole = math.floor(weight)
    frac = weight - whole
    return whole + (1 if frac > 0 and _unit("copy", str(seed), doc_id) < frac else 0)


@dataclass
class SourceCounts:
    read: int = 0
    in_split: int = 0
    out: int = 0
    duplicate_ids: int = 0


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
) -> tuple[list[dict[str, Any]], MixtureStats]:
    """Mix (name, weight, records) streams into one seeded order of the chosen split.

    Records are `{"id", "source", "messages"}` (as the readers give them); returned records are
    shallow copies with `doc_id` added.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
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
            rid = str(rec["id"])
            base = f"{name}:{rid}"
            dup = seen.get(base, 0)
            seen[base] = dup + 1
            if dup:
                counts.duplicate_ids += 1
                base = f"{base}#dup{dup}"
            if split != "all" and split_of(name, base[len(name) + 1:], stage1_fraction, split_salt) != split:
                continue
            counts.in_split += 1
            for k in range(n_copies(weight, base, seed)):
                doc_id = base if k == 0 else f"{base}~{k}"
                keyed.append((_unit("order", str(seed), doc_id), s_idx, counts.out, {**rec, "doc_id": doc_id}))
                counts.out += 1
    keyed.sort(key=lambda t: t[:3])
    return [t[3] for t in keyed], stats


def resolve_asset_path(spec: Any) -> Any:
    """`path: asset:NAME` -> the local file of that `hylo.assets` asset (fetched on first use)."""
    if not str(spec.path).startswith("asset:"):
        return spec
    from hylo.assets import fetch_asset

    return dataclasses.replace(spec, path=str(fetch_asset(spec.path.removeprefix("asset:"), progress=False)))


def build_mixture(
    cfg: Any, split: str, on_reject: Callable[[dict[str, Any]], None]
) -> tuple[list[dict[str, Any]], MixtureStats]:
    """Read every source of a `MixtureConfig` with the readers and mix them; rejects go to `on_reject`."""
    from pipeline.data.readers import iter_records

    streams = [(s.name, s.weight, iter_records(resolve_asset_path(s), on_reject)) for s in cfg.sources]
    return mix(streams, split, cfg.seed, cfg.stage1_fraction, cfg.split_salt)
