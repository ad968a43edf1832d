"""The packed row (pipeline/data/rows.py, read from Parquet by pipeline/data/rowfile.py; its boundaries'
rule in kernels/varlen.py): one rule everywhere, one reader, and cu_seqlens read to the host once per forward."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hylo.config import HybridConfig
from hylo.kernels.varlen import BoundaryError
from hylo.modeling import HyLoForCausalLM
from hylo.pipeline.data.rowfile import DataFormatError, PackedRowFile
from hylo.pipeline.data.rows import PackedRowError, check_row

# Tensor methods that copy values to the host: on a GPU each one waits for the device (a sync).
_HOST_READS = {"tolist", "item", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__"}


class HostReads(torch.Tensor):
    """An integer tensor that logs every read of its values, or of an integer tensor computed from it
    (lengths, positions, masks), back to the host. Float results (activations) are left plain."""

    log: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        # a data-dependent output size is a sync too (repeat_interleave without output_size, nonzero)
        sized = (name == "repeat_interleave" and kwargs.get("output_size") is None) or name == "nonzero"
        if name in _HOST_READS or to_cpu or sized:
            cls.log.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        # a host copy is host data (reading it further costs nothing); float results are activations
        if to_cpu or name == "cpu" or out.is_floating_point() or out.is_complex():
            return out.as_subclass(torch.Tensor)
        return out.as_subclass(cls)


def tiny_model(linear_type: str, **over) -> HyLoForCausalLM:
    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=64, n_layer=4, mla_layers=[0, 3],
                       num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8, gdn_num_heads=2, gdn_head_dim=8, gdn_chunk_size=8,
                       linear_type=linear_type, **over)
    return HyLoForCausalLM(cfg).double()


BOUNDS = [0, 7, 8, 30, 41]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("linear_type", ["gdn", "mamba2"])
def test_cu_seqlens_is_read_to_the_host_once_per_forward(linear_type, checkpointing):
    model = tiny_model(linear_type)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 64, (1, BOUNDS[-1]))
    HostReads.log = []
    cu = torch.tensor(BOUNDS, dtype=torch.int32).as_subclass(HostReads)
    out = model(ids, cu_seqlens=cu)
    out.logits.float().square().mean().backward()
    # the model's entry reads the boundaries once; no layer (nor its recompute) reads them again
    assert HostReads.log == ["tolist"], f"{len(HostReads.log)} host reads of cu_seqlens: {HostReads.log}"


def test_the_host_read_counter_sees_a_layer_read():
    # guards the test above: a read of cu_seqlens, or of a tensor derived from it, is logged
    HostReads.log = []
    cu = torch.tensor(BOUNDS, dtype=torch.int32).as_subclass(HostReads)
    lengths = cu[1:] - cu[:-1]
    int(lengths.max())
    lengths.to(torch.long).cpu()
    assert HostReads.log == ["__int__", "cpu"]


# ----------------------------------------------------------------------------------------- one rule
def test_a_row_and_the_model_refuse_bad_boundaries_with_the_same_words():
    # the row check (training streams, teacher, evaluation) and the model's entry apply the one rule
    ids = torch.randint(0, 64, (BOUNDS[-1],))
    cu = torch.tensor([0, 7, 7, BOUNDS[-1]], dtype=torch.int32)
    words = r"cu_seqlens must be strictly increasing \(every document holds a token\); document 1 spans \[7, 7\)"
    with pytest.raises(PackedRowError, match=r"^data.parquet row 3: " + words):
        check_row({"input_ids": ids, "cu_seqlens": cu}, "data.parquet row 3")
    with pytest.raises(BoundaryError, match=words):
        tiny_model("gdn")(ids[None], cu_seqlens=cu)


def test_check_row_copies_what_it_is_given():
    # a read-only array (a Parquet buffer) is taken without a warning, and the checked row is its own copy
    ids = np.arange(BOUNDS[-1], dtype=np.int64)
    ids.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        row = check_row({"input_ids": ids, "cu_seqlens": np.array(BOUNDS, np.int32)})
    ids = ids.copy()
    row = check_row({"input_ids": ids, "cu_seqlens": np.array(BOUNDS, np.int32)})
    ids[0] = 5
    assert int(row.input_ids[0]) == 0 and row.position_ids.tolist()[6:9] == [6, 0, 0]


# ----------------------------------------------------------------------------------------- one reader
def _rows_table(n: int) -> pa.Table:
    cu = [0, 3, 5]
    return pa.table({"input_ids": [list(range(i, i + 5)) for i in range(n)], "cu_seqlens": [cu] * n,
                     "row_id": [f"r{i}" for i in range(n)]})


def test_packed_row_file_reads_rows_across_row_groups(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(_rows_table(7), path, row_group_size=3)
    f = PackedRowFile(path)
    assert len(f) == 7 and f.pf.num_row_groups == 3
    rows = list(f.rows(2, 6))
    assert [r["row_id"] for r in rows] == ["r2", "r3", "r4", "r5"]
    assert rows[2]["input_ids"].tolist() == [4, 5, 6, 7, 8] and rows[2]["cu_seqlens"].tolist() == [0, 3, 5]
    assert f.row(6)["input_ids"].tolist() == [6, 7, 8, 9, 10] and check_row(f.row(0)).row_id == "r0"


def test_packed_row_file_names_what_is_wrong(tmp_path):
    with pytest.raises(DataFormatError, match=r"nope.parquet: no such file"):
        PackedRowFile(tmp_path / "nope.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataFormatError, match=r"junk.parquet: not a readable Parquet file"):
        PackedRowFile(tmp_path / "junk.parquet")
    table = _rows_table(3)
    cu = pa.array([[0, 3, 5], None, [0, 5]], pa.list_(pa.int32()))
    pq.write_table(table.set_column(1, "cu_seqlens", cu), tmp_path / "null.parquet")
    f = PackedRowFile(tmp_path / "null.parquet")
    assert f.row(2)["cu_seqlens"].tolist() == [0, 5]
    with pytest.raises(DataFormatError, match=r"null.parquet row 1: field 'cu_seqlens' is null"):
        f.row(1)


def test_a_received_packed_row_is_checked_again_whatever_its_type():
    """A PackedRow that crossed a process boundary (the teacher client sends PackedRows) is checked field by
    field with `received=True`, its host boundaries against cu_seqlens and its ids against the vocabulary;
    in-process, a PackedRow is the reader's checked row and is returned as is."""
    from hylo.pipeline.data.rows import PackedRow

    good = check_row({"input_ids": [1, 2, 3, 4], "cu_seqlens": [0, 2, 4]})
    assert check_row(good) is good
    again = check_row(good, received=True, vocab_size=5)
    assert again.host == good.host and torch.equal(again.input_ids, good.input_ids)
    lying = PackedRow(good.input_ids, good.cu_seqlens, good.position_ids, host=(0, 1, 4))
    assert check_row(lying) is lying
    with pytest.raises(PackedRowError, match=r"r: its document boundaries \[0, 1, 4\] disagree with field "
                                             r"'cu_seqlens' \[0, 2, 4\]"):
        check_row(lying, "r", received=True)
    with pytest.raises(PackedRowError, match=r"token id 4 at token 3, outside the vocabulary \[0, 4\)"):
        check_row(good, "r", received=True, vocab_size=4)
    short = PackedRow(torch.arange(20), torch.tensor([0, 10], dtype=torch.int32), torch.arange(20))
    with pytest.raises(PackedRowError, match="cu_seqlens"):
        check_row(short, received=True)
