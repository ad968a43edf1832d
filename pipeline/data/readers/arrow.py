"""Arrow containers: Parquet (row group by row group), datasets save_to_disk directories, the hub."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hylo.json_files import read_json
from hylo.pipeline.data.config import SourceError, SourceSpec
from hylo.pipeline.data.readers.raw import RawItem


def _iter_arrow_tables(batches: Iterable[Any], start: int = 0) -> Iterator[RawItem]:
    idx = start
    for batch in batches:
        for row in batch.to_pylist():
            yield idx, row, None, 0
            idx += 1


def _iter_parquet(path: Path) -> Iterator[RawItem]:
    """Row group by row group: a corrupt group is one reject standing for its rows, the rest is read."""
    import pyarrow as pa  # lazy: pyarrow
    import pyarrow.parquet as pq  # lazy: pyarrow

    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
    except (pa.ArrowException, OSError) as e:
        yield -1, "", f"unreadable Parquet file: {' '.join(str(e).split())}", None
        return
    start = 0
    for rg in range(meta.num_row_groups):
        n = meta.row_group(rg).num_rows
        done = 0
        try:
            for batch in pf.iter_batches(batch_size=1024, row_groups=[rg]):
                for row in batch.to_pylist():
                    yield start + done, row, None, 0
                    done += 1
        except (pa.ArrowException, OSError) as e:
            yield start + done, "", (f"unreadable Parquet row group {rg} (rows {start + done}..{start + n - 1} "
                                     f"of {meta.num_rows}): {' '.join(str(e).split())}"), n - done
        start += n


def _arrow_batches(path: Path) -> Iterator[Any]:
    import pyarrow as pa  # lazy: pyarrow

    with pa.memory_map(str(path)) as src:
        try:
            reader = pa.ipc.open_stream(src)
        except pa.ArrowInvalid:
            src.seek(0)
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        yield from reader


def _hf_disk_files(root: Path, split: str, source: str) -> list[Path]:
    if (root / "dataset_dict.json").is_file():
        splits = read_json(root / "dataset_dict.json", SourceError, mapping=True).get("splits", [])
        if split not in splits:
            raise SourceError(f"source {source!r}: split {split!r} not in {root} (splits: {splits})")
        root = root / split
    state = root / "state.json"
    if not state.is_file():
        raise SourceError(f"source {source!r}: {root} is not a datasets save_to_disk directory "
                          f"(no state.json or dataset_dict.json)")
    files = [root / d["filename"] for d in read_json(state, SourceError, mapping=True).get("_data_files", [])]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise SourceError(f"source {source!r}: {root}/state.json lists missing files {missing}")
    return files


def _iter_hf_arrow(path: Path) -> Iterator[RawItem]:
    import pyarrow as pa  # lazy: pyarrow

    # An Arrow IPC stream cannot be resynchronised after a corrupt batch: the rest of the file is lost
    # (count unknown), what came before it is kept.
    n = 0
    try:
        for item in _iter_arrow_tables(_arrow_batches(path)):
            yield item
            n += 1
    except (pa.ArrowException, OSError) as e:
        yield (n if n else -1), "", f"unreadable Arrow file after {n} rows: {' '.join(str(e).split())}", None


def _iter_hub(spec: SourceSpec) -> Iterator[RawItem]:
    try:
        import datasets  # lazy: datasets
    except ImportError:
        raise SourceError(
            f"source {spec.name!r}: reading hub dataset {spec.path!r} needs the `datasets` package "
            f"(pip install datasets) and network access to the hub; or save it with save_to_disk and "
            f"point `path` at that directory"
        ) from None
    name = spec.path.removeprefix("hub:")
    ds = datasets.load_dataset(name, spec.subset, split=spec.split, streaming=True)
    for idx, row in enumerate(ds):
        yield idx, row, None, 0
