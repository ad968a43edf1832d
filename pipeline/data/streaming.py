"""The streaming half of data preparation: mixture records -> render/tokenise on a Ray Data actor pool ->
documents -> best-fit packed rows, as a generator the prepare job writes from.

Legend: T = tokens of a row, N = segments of a row (documents, plus the padding tail if any).

Design choices:
* Render + tokenise is the expensive, parallel part: a `map_batches` actor pool (each actor loads
  the tokenizer once), streaming. The input is the mixture as Arrow blocks of JSON-encoded records
  (JSON keeps arbitrary nested content intact through Arrow). `preserve_order` is on, so the
  documents come back in mixture order whatever the pool size, and the same seed gives the same
  rows.
* Packing is sequential by nature (each placement depends on the open rows) and cheap; it runs in
  the consumer (the driver here) over the streamed batches.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from hylo.pipeline.data.packing import BestFitPacker, Document
from hylo.pipeline.data.render import ChatRenderer, Encoded


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


def actor_count(records: int, num_actors: int, batch_size: int) -> int:
    """The tokenizer actors worth starting: `num_actors`, but no more than there are blocks of `batch_size`
    records (an actor beyond that gets no block, yet starts a process and loads the tokenizer)."""
    return max(1, min(num_actors, -(-records // batch_size)))


def tokenize_dataset(
    records: list[dict[str, Any]], renderer_spec: dict[str, Any], num_actors: int = 2, batch_size: int = 64,
) -> Any:
    """A streaming `ray.data.Dataset` of tokenised documents in mixture order (Ray must be up); at most
    `num_actors` tokenizer actors (`actor_count`)."""
    import ray.data  # lazy: ray

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
        compute=ray.data.ActorPoolStrategy(size=actor_count(len(records), num_actors, batch_size)),
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


# ------------------------------------------------------------------------------ the stream
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
