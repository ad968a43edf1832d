"""A prepared dataset's manifest names only files of its own directory, each once: a shard entry that points
outside it (`..`, an absolute path, a link to another dataset's shard) or lists one shard twice is refused by
every reader (training, evaluation, placement, the teacher cache's fingerprint) before any row is read, with an
error naming the manifest, the entry and why (`hylo.manifest_paths.confined_paths`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hylo.pipeline.data.rowfile import DataFormatError
from hylo.pipeline.data.shards import MANIFEST, ShardWriter, read_manifest, write_manifest
from hylo.pipeline.eval.kl import iter_eval_rows
from hylo.pipeline.placement import load_rows
from hylo.pipeline.teacher.cache import data_fingerprint
from hylo.pipeline.train.config import DataSection
from hylo.pipeline.train.row_sources import open_rows

from tests.helpers.teacher import make_packed_row

V = 96


def _dataset(d: Path, seed: int) -> list[dict]:
    """A prepared split of two one-row shards; returns its manifest's shard entries."""
    w = ShardWriter(d, rows_per_shard=1, row_group_rows=1)
    for i in range(2):
        w.add(make_packed_row([4, 3], V, seed=seed + i))
    shards = w.finish()
    write_manifest(d, {"split": "stage2", "max_len": 64, "config_hash": "c", "shards": shards})
    return shards


def _hostile(root: Path, how: str) -> tuple[Path, str, str]:
    """Dataset `root/mine` whose manifest names a shard it does not own (`how`), beside dataset `root/other`;
    returns (the dataset, the hostile entry, the reason the error must give)."""
    mine, other = root / "mine", root / "other"
    shards = _dataset(mine, 0)
    _dataset(other, 100)
    if how == "dotdot":
        entry, why = "../other/shard-00000.parquet", "climbs out of its directory ('..')"
    elif how == "absolute":
        entry, why = str(other / "shard-00000.parquet"), "is an absolute path"
    elif how == "twice":
        entry, why = "shard-00000.parquet", "is the same file as entry 'shard-00000.parquet' (listed twice)"
    elif how == "dot":  # issue 61: 'shard/.' was accepted as the shard
        entry, why = "shard-00001.parquet/.", "has a '.' or an empty part"
    elif how in ("fifo", "dir"):  # issue 61: reported as "listed in manifest.json but missing"
        (mine / "shard-00001.parquet").unlink()
        os.mkfifo(mine / "shard-00001.parquet") if how == "fifo" else (mine / "shard-00001.parquet").mkdir()
        entry, why = "shard-00001.parquet", "is a FIFO (named pipe), not a file" if how == "fifo" else \
            "is a directory, not a file"
    else:  # a shard of this dataset replaced by a link to the other dataset's
        (mine / "shard-00001.parquet").unlink()
        (mine / "shard-00001.parquet").symlink_to(other / "shard-00000.parquet")
        entry, why = "shard-00001.parquet", f"is a symbolic link to {other / 'shard-00000.parquet'}, outside"
    if how not in ("link", "fifo", "dir"):
        shards[1] = {**shards[1], "file": entry}
    m = json.loads((mine / MANIFEST).read_text())
    (mine / MANIFEST).write_text(json.dumps({**m, "shards": shards}))
    return mine, entry, why


@pytest.mark.parametrize("how", ["dotdot", "absolute", "twice", "link", "dot", "fifo", "dir"])
def test_every_reader_refuses_a_shard_outside_the_dataset_before_reading_a_row(tmp_path, how):
    mine, entry, why = _hostile(tmp_path, how)
    readers = {
        "manifest": lambda: read_manifest(mine),
        "training": lambda: list(open_rows(DataSection(source="parquet", path=str(mine), split="stage2"), 0, 0, 1)),
        "eval": lambda: list(iter_eval_rows(mine)),
        "placement": lambda: load_rows(mine, max_rows=4),
        "teacher cache": lambda: data_fingerprint(mine),
    }
    for name, read in readers.items():
        with pytest.raises(DataFormatError) as e:
            read()
        msg = str(e.value)
        assert msg.startswith(f"{mine / MANIFEST}: shards[1] {entry!r} {why}"), (name, msg)
        assert "a manifest may name only files inside its own directory" in msg, (name, msg)


def test_a_dataset_reached_through_a_link_and_links_inside_it_are_read(tmp_path):
    """What stays allowed: the dataset directory given as a link, and a shard that is a link to a file of the
    same dataset (listed once)."""
    mine = tmp_path / "mine"
    _dataset(mine, 0)
    (mine / "store").mkdir()
    os.replace(mine / "shard-00001.parquet", mine / "store" / "s1.parquet")
    (mine / "shard-00001.parquet").symlink_to(Path("store") / "s1.parquet")
    (tmp_path / "alias").symlink_to(mine)
    rows = list(open_rows(DataSection(source="parquet", path=str(tmp_path / "alias"), split="stage2"), 0, 0, 1))
    assert len(rows) == 2


def test_a_manifest_that_is_a_link_to_another_datasets_is_refused_as_such(tmp_path):
    """Issue 61: a manifest.json linked to another dataset's was followed (refused only because a shard was
    absent). Now every reader refuses it as what it is, naming where it leads, before reading a row."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    _dataset(mine, 0)
    _dataset(other, 100)
    for p in mine.glob("shard-*"):
        p.unlink()
    (mine / MANIFEST).unlink()
    (mine / MANIFEST).symlink_to(other / MANIFEST)
    readers = {
        "manifest": lambda: read_manifest(mine),
        "training": lambda: list(open_rows(DataSection(source="parquet", path=str(mine), split="stage2"), 0, 0, 1)),
        "eval": lambda: list(iter_eval_rows(mine)),
        "placement": lambda: load_rows(mine, max_rows=4),
        "teacher cache": lambda: data_fingerprint(mine),
    }
    for name, read in readers.items():
        with pytest.raises(DataFormatError) as e:
            read()
        assert str(e.value).startswith(f"{mine / MANIFEST}: the manifest is a symbolic link to {other / MANIFEST}, "
                                       f"outside {mine}"), (name, str(e.value))
