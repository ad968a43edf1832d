"""What Parquet page checksums cost the row reader, and what they catch (pipeline/data/rowfile.py).

Writes one shard of packed rows twice with the project's `ShardWriter` settings (zstd, row groups of
`--row-group` rows), once without page checksums (a dataset prepared before they were written) and once
with them, then reads every row through `PackedRowFile` (what training's `RowReader` does) with and
without verification, alternating, `--repeats` times each. Then flips one bit at `--flips` offsets spread
over the token-id pages of each file and counts what the reader did: an error, the same rows, or other
rows without a word.

    python bench/shard_checksums.py [--rows 64] [--T 8192] [--row-group 8] [--repeats 5] [--flips 200]

Prints one JSON line: median read seconds per case, the ratio verified / unverified (side by side in one
run, so other load on the machine cancels out), write seconds and file sizes, and the flip counts. The
rows are random token ids of a 49,152-entry vocabulary (incompressible, like real ids).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.data.rowfile import PAGE_CHECKSUMS, PackedRowFile, rows_to_table  # noqa: E402


def make_rows(n: int, T: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        cuts = np.sort(rng.choice(np.arange(1, T), size=7, replace=False))
        cu = np.concatenate([[0], cuts, [T]]).astype(np.int32)
        pos = np.concatenate([np.arange(e - s) for s, e in zip(cu[:-1], cu[1:])]).astype(np.int32)
        rows.append({"input_ids": rng.integers(0, 49152, T).astype(np.int32), "position_ids": pos,
                     "cu_seqlens": cu, "loss_mask": rng.random(T) < 0.5, "doc_ids": [f"d{i}" for i in range(8)]})
    return rows


def read_all(path: Path, verify: bool) -> int:
    f = PackedRowFile(path)
    if not verify:
        f.pf = pq.ParquetFile(path)  # the reader as it was: no verification
    return sum(len(r["input_ids"]) for r in f.rows())


def flips(path: Path, n: int, verify: bool) -> dict[str, int]:
    good = path.read_bytes()
    md = pq.ParquetFile(path).metadata
    spans = [(c.dictionary_page_offset or c.data_page_offset, c.total_compressed_size)
             for c in (md.row_group(rg).column(0) for rg in range(md.num_row_groups))]
    offsets = [s + int(i * size / max(1, n // len(spans))) for s, size in spans for i in range(max(1, n // len(spans)))]
    want = [r["input_ids"].tobytes() for r in PackedRowFile(path).rows()]
    counts = {"error": 0, "same rows": 0, "other rows, no error": 0}
    with tempfile.TemporaryDirectory() as d:
        bad_path = Path(d) / path.name
        for off in offsets:
            bad = bytearray(good)
            bad[off] ^= 0x10
            bad_path.write_bytes(bytes(bad))
            try:
                f = PackedRowFile(bad_path)
                if not verify:
                    f.pf = pq.ParquetFile(bad_path)
                got = [r["input_ids"].tobytes() for r in f.rows()]
            except Exception:  # noqa: BLE001 - any error is a detection
                counts["error"] += 1
                continue
            counts["same rows" if got == want else "other rows, no error"] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--T", type=int, default=8192, help="tokens per row")
    ap.add_argument("--row-group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flips", type=int, default=200)
    args = ap.parse_args()
    table = rows_to_table(make_rows(args.rows, args.T))
    out: dict = {"rows": args.rows, "tokens_per_row": args.T, "row_group_rows": args.row_group}
    with tempfile.TemporaryDirectory() as d:
        paths = {"without": Path(d) / "plain.parquet", "with": Path(d) / "crc.parquet"}
        write_s = {}
        for name, path in paths.items():
            opts = PAGE_CHECKSUMS if name == "with" else {}
            t0 = time.perf_counter()
            pq.write_table(table, path, row_group_size=args.row_group, compression="zstd", **opts)
            write_s[name] = time.perf_counter() - t0
        cases = {"unverified (before)": (paths["without"], False), "verified, file without checksums":
                 (paths["without"], True), "verified, file with checksums (now)": (paths["with"], True)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeats + 1):
            for name, (path, verify) in cases.items():
                t0 = time.perf_counter()
                read_all(path, verify)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        out["read_s_median"] = {k: round(v, 4) for k, v in med.items()}
        out["read_ratio_now_vs_before"] = round(med["verified, file with checksums (now)"] / med["unverified (before)"], 3)
        out["read_tokens_per_s_now"] = round(args.rows * args.T / med["verified, file with checksums (now)"])
        out["write_s"] = {k: round(v, 4) for k, v in write_s.items()}
        out["file_bytes"] = {k: p.stat().st_size for k, p in paths.items()}
        out["one_bit_flips_in_token_id_pages"] = {
            "without checksums (before)": flips(paths["without"], args.flips, verify=False),
            "with checksums (now)": flips(paths["with"], args.flips, verify=True)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
