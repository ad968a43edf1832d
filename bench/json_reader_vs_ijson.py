"""Could `ijson` replace the readers' own streaming JSON array parser? The same files through both.

    pip install ijson    # not a dependency of the project: this script is the reason it is not one
    python bench/json_reader_vs_ijson.py [--sharegpt PATH]

Cases (100 small ShareGPT-style records each): a valid array, one cut mid-record, a missing comma in
record 40, invalid UTF-8 bytes in record 10, record 5 over the size limit (1 MiB here, 64 MiB in the
reader); then the speed of both on ShareGPT (the asset, 125 MB, itself cut mid-record at its end).
Measured 2026-12-01 on the shared 2-core build machine (ijson 3.6.0, yajl2_c backend):
* valid array, truncated file: both 100 / 50 records (ijson ends with IncompleteJSONError, which would
  make the one "truncated" reject);
* missing comma: ours 99 records + 1 reject; ijson stops: 40 records, the other 59 lost;
* invalid UTF-8: ours 100 records (the bad one rejected later as undecodable); ijson stops after 10;
* oversize: ours steps over it without buffering (99 + 1 reject); ijson builds it whole: its single
  3 MiB string arrives as one event, so no size check can come before the memory is spent;
* ShareGPT (three runs, machine shared, load ~7 on 2 cores): ours 17,671 records in 1.2-1.3 s
  (~100 MB/s), ijson 17,671 in 0.6-0.8 s (155-204 MB/s).
So ijson is ~1.5x faster on clean data but does not do the job: one bad record or byte loses the rest of
the file, and a record's size cannot be bounded. Kept ours (reading is not the data job's bottleneck:
tokenising is, bench/packing.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.data.readers import json_stream  # noqa: E402


def ours(path: Path) -> tuple[int, list[str]]:
    items = list(json_stream._iter_json_array(path))
    return sum(err is None for _, _, err, _ in items), [err for _, _, err, _ in items if err]


def theirs(path: Path) -> tuple[int, list[str]]:
    import ijson  # optional: ijson

    n = 0
    try:
        with open(path, "rb") as f:
            for _ in ijson.items(f, "item"):
                n += 1
    except ijson.JSONError as e:
        return n, [f"{type(e).__name__}: {' '.join(str(e).split())[:60]}"]
    return n, []


def record(i: int) -> dict:
    return {"id": str(i), "conversations": [{"from": "human", "value": f"q{i} é"}, {"from": "gpt", "value": "a" * 50}]}


def cases(tmp: Path) -> dict[str, Path]:
    good = [json.dumps(record(i)) for i in range(100)]
    out = {"valid array": "[" + ",".join(good) + "]"}
    out["cut mid-record"] = out["valid array"][: len(out["valid array"]) // 2]
    broken = list(good)
    broken[40] = broken[40].replace(', "conversations"', ' "conversations"')
    out["missing comma in record 40"] = "[" + ",".join(broken) + "]"
    big = record(5)
    big["conversations"][1]["value"] = "x" * (3 << 20)
    out["record 5 over 1 MiB"] = "[" + ",".join([*good[:5], json.dumps(big), *good[6:]]) + "]"
    paths = {}
    for k, (name, text) in enumerate(out.items()):
        paths[name] = tmp / f"case{k}.json"
        paths[name].write_text(text, encoding="utf-8")
    bad = ("[" + ",".join(good[:10]) + ",").encode() + b'{"id": "bad", "conversations": [{"from": "human", ' \
        b'"value": "\xff\xfe"}]},' + (",".join(good[11:]) + "]").encode()
    paths["invalid UTF-8 in record 10"] = tmp / "bad_utf8.json"
    paths["invalid UTF-8 in record 10"].write_bytes(bad)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--sharegpt", default=str(Path.home() / ".cache/hylo/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        limit = json_stream.MAX_RECORD_CHARS
        json_stream.MAX_RECORD_CHARS = 1 << 20
        try:
            for name, path in cases(Path(tmp)).items():
                (n_ours, e_ours), (n_ij, e_ij) = ours(path), theirs(path)
                print(f"{name}: ours {n_ours} records, rejects {[e[:60] for e in e_ours]}; ijson {n_ij}, errors {e_ij}")
        finally:
            json_stream.MAX_RECORD_CHARS = limit
    sg = Path(args.sharegpt)
    if sg.is_file():
        for name, fn in (("ours", ours), ("ijson", theirs)):
            t = time.perf_counter()
            n, _ = fn(sg)
            dt = time.perf_counter() - t
            print(f"ShareGPT, {name}: {n} records in {dt:.1f} s ({sg.stat().st_size / dt / 1e6:.0f} MB/s)")


if __name__ == "__main__":
    main()
