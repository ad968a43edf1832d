"""The file helpers of hylo/: atomic writes (hylo/atomic.py), an output's ownership, checks and leftovers
(hylo/ownership.py, hylo/outputs.py, hylo/leftovers.py), the one JSON-or-error reader (hylo/json_files.py),
the files a manifest names (hylo/manifest_paths.py), and the readers of the project's JSON files that go
through them."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from hylo import atomic, leftovers, manifest_paths, outputs, ownership
from hylo.atomic import atomic_path, atomic_write, replace_dir
from hylo.json_files import read_json
from hylo.outputs import atomic_dir


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------ atomic files
def test_atomic_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    p = tmp_path / "a.json"
    atomic_write(p, "old")
    atomic_write(p, "né\n")
    atomic_write(tmp_path / "b.bin", b"\x00\xff")
    assert p.read_bytes() == "né\n".encode() and (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    assert _leftovers(tmp_path) == []


def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "state.json"
    p.write_text("complete old content")
    real_write = Path.write_bytes

    def disk_full(self: Path, data: bytes) -> int:
        # a real partial file, then the error a full disk gives
        real_write(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", disk_full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(p, "new content " * 100)
    assert p.read_text() == "complete old content"
    assert _leftovers(tmp_path) == []


def test_atomic_path_renames_what_a_library_wrote_only_when_the_block_ends(tmp_path):
    p = tmp_path / "t.bin"
    with atomic_path(p) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".t.bin.tmp-")
        tmp.write_bytes(b"x")
        assert not p.exists()
    assert p.read_bytes() == b"x"
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("writer crashed")
    assert p.read_bytes() == b"x" and _leftovers(tmp_path) == []


def test_fsync_flushes_the_temporary_file_before_the_rename(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    atomic_write(tmp_path / "a", b"1")
    assert events == ["replace"]
    events.clear()
    atomic_write(tmp_path / "a", b"2", fsync=True)
    assert events == ["fsync", "replace"] and (tmp_path / "a").read_bytes() == b"2"


def test_atomic_dir_swaps_a_complete_directory_in_and_deletes_a_failed_one(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_dir(out) as tmp:
        (tmp / "w").write_text("1")
        assert not out.exists()
    assert (out / "w").read_text() == "1"
    with atomic_dir(out) as tmp:
        (tmp / "w").write_text("2")
    assert (out / "w").read_text() == "2" and _leftovers(tmp_path) == []
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "w").write_text("partial")
        raise RuntimeError("crash while writing")
    assert sorted(p.name for p in out.iterdir()) == [".hylo-output.json", "w"] and (out / "w").read_text() == "2"
    assert _leftovers(tmp_path) == []


def test_replace_dir_puts_the_old_directory_back_when_the_swap_fails(tmp_path, monkeypatch):
    out, new = tmp_path / "data", tmp_path / ".data.tmp-1"
    out.mkdir()
    (out / "old").write_text("old")
    new.mkdir()
    real_replace = os.replace

    def second_rename_fails(a, b):
        if Path(a) == new:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(a, b)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(OSError, match="cross-device"):
        replace_dir(new, out)
    assert (out / "old").read_text() == "old"
    assert _leftovers(tmp_path) == [".data.tmp-1"]


# ------------------------------------------------------------------------------------ JSON reader
def test_read_json_names_the_file_for_bad_json_non_utf8_and_a_non_object(tmp_path):
    class MyError(ValueError):
        pass

    p = tmp_path / "x.json"
    p.write_text('{"a": [1, 2]}')
    assert read_json(p, MyError, mapping=True) == {"a": [1, 2]}
    p.write_text('{"a": ')
    with pytest.raises(MyError, match=rf"^{p}: not valid JSON \("):
        read_json(p, MyError)
    p.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(MyError, match=rf"^{p}: not valid JSON \(.*utf-8"):
        read_json(p, MyError)
    p.write_text("[1, 2]")
    assert read_json(p, MyError) == [1, 2]
    with pytest.raises(MyError, match=rf"^{p}: the top level must be an object"):
        read_json(p, MyError, mapping=True)
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json", MyError)


def _hybrid_config(d: Path) -> None:
    from hylo.config import HybridConfig

    HybridConfig.from_hybrid_json(d)


# ------------------------------------------------------------------------------------ files a manifest names
@pytest.mark.parametrize("entry,why", [
    ("", "is not a relative file name"),
    (7, "is not a relative file name"),
    (".", "names the directory itself"),
    ("a/../../x", "climbs out of its directory"),
    ("./a", "has a '.' or an empty part"),
    ("a/.", "has a '.' or an empty part"),
    ("b//c", "has a '.' or an empty part"),
])
def test_confined_paths_names_the_manifest_the_entry_and_why(tmp_path, entry, why):
    with pytest.raises(ValueError, match=rf"^{tmp_path}/m\.json: files\[1\] .* {why}"):
        manifest_paths.confined_paths(tmp_path, ["a", entry], tmp_path / "m.json", "files")
    assert manifest_paths.confined_paths(tmp_path, ["a", "b/c"], tmp_path / "m.json", "files") == [tmp_path / "a", tmp_path / "b/c"]


def test_a_released_index_naming_a_shard_outside_its_directory_is_refused(tmp_path):
    """model.safetensors.index.json names only files of its own directory (each tensor's file)."""
    import json

    import torch
    from safetensors.torch import save_file

    from hylo.released.layout import ReleasedLayoutError
    from hylo.released.reading import read_released_tensors

    mine, other = tmp_path / "mine", tmp_path / "other"
    for d in (mine, other):
        d.mkdir()
        save_file({"w": torch.zeros(2)}, str(d / "model-00001-of-00001.safetensors"))
    index = mine / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors",
                                                "v": "../other/model-00001-of-00001.safetensors"}}))
    with pytest.raises(ReleasedLayoutError, match=rf"^{index}: weight_map\[1\] '\.\./other/.*' climbs out"):
        read_released_tensors(mine)
    index.write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    assert set(read_released_tensors(mine)) == {"w"}


def _released(d: Path) -> None:
    from hylo.released import released_hybrid_config

    released_hybrid_config(d)


def _base(d: Path) -> None:
    from hylo.upcycle import load_base_model

    load_base_model(d)


def _data_manifest(d: Path) -> None:
    from hylo.pipeline.data.shards import read_manifest

    read_manifest(d)


def _teacher_cache(d: Path) -> None:
    from hylo.pipeline.teacher.cache import load_manifest

    load_manifest(d)


def _checkpoint(d: Path) -> None:
    from hylo.pipeline.train.checkpoint.layout import read_json as read_checkpoint_json

    read_checkpoint_json(d / "state.json")


def _tokenizer(d: Path) -> None:
    from hylo.pipeline.teacher.model import tokenizer_fingerprint

    tokenizer_fingerprint(d)


# reader, the file it reads in its directory, its error class (module, name), whether it needs an object
READERS = {
    "hybrid_config": (_hybrid_config, "hybrid_config.json", ("hylo.config", "HybridConfigError"), True),
    "released": (_released, "config.json", ("hylo.released", "ReleasedLayoutError"), True),
    "base_model": (_base, "config.json", ("hylo.upcycle", "UpcycleError"), True),
    "data_manifest": (_data_manifest, "manifest.json", ("hylo.pipeline.data.rowfile", "DataFormatError"), False),
    "teacher_cache": (_teacher_cache, "manifest.json", ("hylo.pipeline.teacher.cache", "CacheFormatError"), True),
    "checkpoint": (_checkpoint, "state.json", ("hylo.pipeline.train.checkpoint.layout", "CheckpointError"), False),
    "tokenizer": (_tokenizer, "tokenizer.json", ("builtins", "ValueError"), False),
}


BAD = {"truncated": b'{"vocab_size": ', "not-utf8": b'{"vocab_size": "\xff\xfe"}', "a-list": b"[1, 2]"}


@pytest.mark.parametrize("reader,bad", [(r, b) for r in sorted(READERS) for b in BAD
                                        if b != "a-list" or READERS[r][3] or r == "data_manifest"])
def test_every_json_reader_names_the_file_of_a_bad_json_file(tmp_path, reader, bad):
    import importlib

    fn, name, (module, cls), _ = READERS[reader]
    error = getattr(importlib.import_module(module), cls)
    (tmp_path / name).write_bytes(BAD[bad])
    with pytest.raises(error, match=str(tmp_path / name).replace(".", r"\.")) as info:
        fn(tmp_path)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"


def test_convert_dry_run_names_a_base_config_that_is_not_utf8(tmp_path, capsys):
    from hylo.jobs import convert as job

    bad = tmp_path / "config.json"
    bad.write_bytes(b'{"model_type": "llama\xff"}')
    assert job.main(["--dry-run", "--base-config", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and str(bad) in err[-1] and "not valid JSON" in err[-1]


def test_temp_names_are_hidden_unique_and_carry_the_pid(tmp_path):
    a, b = atomic.temp_name(tmp_path / "x"), atomic.temp_name(tmp_path / "x")
    assert a != b and a.parent == tmp_path and a.name.startswith(f".x.tmp-{os.getpid()}-")


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_saved_weights_get_the_mode_of_the_umask_not_the_temporary_files(tmp_path, mask):
    """Every atomic write and directory swap gives model.safetensors the umask's mode, in the asset cache
    and every saved model (safetensors >= 0.8 writes through a 0600 temporary file and renames it, which
    left it unreadable to the other users of a shared cluster)."""
    import stat

    import torch
    from safetensors.torch import save_file

    from hylo.config import HybridConfig
    from hylo.io import save_hylo
    from hylo.modeling import HyLoForCausalLM

    saved = os.umask(mask)
    try:
        want = 0o666 & ~mask
        with atomic_path(tmp_path / "w.safetensors") as tmp:
            save_file({"w": torch.zeros(4)}, str(tmp))
        assert stat.S_IMODE((tmp_path / "w.safetensors").stat().st_mode) == want
        cfg = HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=64, n_layer=2, mla_layers=[0],
                           num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=8, gdn_num_heads=2, gdn_head_dim=8)
        out = save_hylo(HyLoForCausalLM(cfg), tmp_path / "model")
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
        assert modes["model.safetensors"] == want and set(modes.values()) == {want}, modes
        # a file someone made private on purpose (not the temporary files' 0600) keeps its mode
        (tmp_path / "mine").write_text("x")
        os.chmod(tmp_path / "mine", 0o640)
        atomic.honour_umask(tmp_path / "mine")
        assert stat.S_IMODE((tmp_path / "mine").stat().st_mode) == 0o640
    finally:
        os.umask(saved)


# ------------------------------------------------------------------------------------ outputs: links, errors, leftovers
def test_a_linked_output_is_followed_and_checked_where_it_points(tmp_path):
    """`--out LINK` with LINK -> a directory was refused as "exists and is not a directory" (the wrong reason);
    the link is followed: the directory it points to is checked and replaced, the link stays."""
    target, link = tmp_path / "runs" / "2026-12-03", tmp_path / "latest"
    with atomic_dir(target) as tmp:
        (tmp / "w").write_text("1")
    link.symlink_to(target, target_is_directory=True)
    with atomic_dir(link, "--out") as tmp:
        (tmp / "w").write_text("2")
    assert link.is_symlink() and (target / "w").read_text() == "2" and _leftovers(target.parent) == []
    # a link to a directory of the user's is refused for that reason, naming the link and where it points
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ownership.ForeignOutputError, match=rf"--out {link} \(a link to {target}\) holds 1 entry this "
                                                           r"project did not write as it is: notes.txt \(not in its "
                                                           r"record\); it only ever replaces"):
        with atomic_dir(link, "--out"):
            pass
    assert (target / "notes.txt").read_text() == "mine" and link.is_symlink()
    # the link itself is never an input's way around the overlap check
    with pytest.raises(outputs.OutputConflictError, match=rf"--out {link} is the input --model {target} "
                                                          rf"\({target} and {target}, links followed\)"):
        outputs.check_not_an_input(link, [("--model", target), ("--data", None)])


def test_an_unwritable_output_is_named_as_given_not_by_its_temporary_name(tmp_path, monkeypatch):
    """A directory the job may not write into (simulated: the tests run as root, who may write anywhere) was
    reported under the internal `.OUT.tmp-<pid>-<hex>` name; the error names --out as the user gave it."""
    from hylo.pipeline.cli import input_error_message

    parent = tmp_path / "ro"
    parent.mkdir()
    out = parent / "model"
    real_access, real_mkdir = os.access, Path.mkdir

    def access(p, mode, **kw):
        return False if Path(p) == parent else real_access(p, mode, **kw)

    def mkdir(self, *a, **kw):
        if self.parent == parent:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(OSError) as ei:
        with atomic_dir(out, "--out"):
            pass
    message = input_error_message(ei.value)
    assert message == f"--out {out}: cannot write it: its directory {parent} is not writable (Permission denied)"
    assert ".tmp-" not in message and list(parent.iterdir()) == []


@pytest.mark.slow
def test_only_provable_leftovers_of_finished_jobs_are_swept(tmp_path):
    """`sweep_stale` removes a staging directory that carries our staging record of a process that is gone,
    and keeps one whose process runs (ours, here), one without our record and a file of the same name pattern."""
    import json

    out = tmp_path / "model"
    gone = subprocess_pid_that_exited()
    with atomic_dir(out) as tmp:
        record = json.loads((tmp / ownership.OUTPUT_RECORD).read_text())
        assert record["staging"] is True and record["pid"] == os.getpid()
        assert leftovers.stale_leftovers(out) == ([], [tmp])  # the running job's own staging directory
        dead = tmp_path / f".model.tmp-{gone}-1234abcd"
        dead.mkdir()
        (dead / ownership.OUTPUT_RECORD).write_text(json.dumps({**record, "pid": gone}))
        (dead / "model.safetensors").write_bytes(b"partial")
        unmarked = tmp_path / f".model.tmp-{gone}-5678abcd"
        unmarked.mkdir()
        (unmarked / "model.safetensors").write_bytes(b"partial")
        a_file = tmp_path / f".model.tmp-{gone}-9999abcd"
        a_file.write_text("a user's file")
        assert leftovers.sweep_stale(out) == [(dead, "removed")]
        (tmp / "w").write_text("1")
    assert not dead.exists() and unmarked.is_dir() and a_file.read_text() == "a user's file"
    assert (out / "w").read_text() == "1"


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_write_error_naming_no_file_names_the_outputs_file_not_the_staging_name(tmp_path):
    """A full disk while writing an open file raises an OSError without a file name; the one-line error would
    find the file in the traceback: the staging directory's. atomic_dir names it by the output's name."""
    import errno

    def write(path):
        with atomic_path(path) as tmp, open(tmp, "w") as f:
            f.write("x")
            raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "dc"
    with pytest.raises(OSError) as info:
        with atomic_dir(out, "out") as staging:
            write(staging / "clean.jsonl")
    assert info.value.filename == str(out / "clean.jsonl") and not out.exists()
    with pytest.raises(OSError) as info:
        with atomic_dir(out, "out"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.filename == str(out)  # the output itself, never the staging name


def test_leftovers_beside_an_output_whose_name_holds_glob_characters_are_swept(tmp_path, monkeypatch):
    """The leftovers of a killed job are matched by the output's name literally: `o[1]` is no glob pattern
    (it matched `.o1.tmp-*`, so a killed `--out o[1]` left its staging directory for ever)."""
    import json
    import socket

    gone = 4_000_000_001
    monkeypatch.setattr(leftovers, "_pid_alive", lambda pid: pid != gone)
    out = tmp_path / "o[1]"
    dead = tmp_path / f".o[1].tmp-{gone}-1234abcd"
    dead.mkdir()
    (dead / ownership.OUTPUT_RECORD).write_text(json.dumps({"written_by": ownership.WRITTEN_BY, "staging": True, "pid": gone,
                                                            "host": socket.gethostname(), "entries": []}))
    (dead / "model.safetensors").write_bytes(b"partial")
    assert leftovers.stale_leftovers(out) == ([dead], [])
    assert leftovers.sweep_stale(out) == [(dead, "removed")] and not dead.exists()


def test_a_failed_atomic_write_names_the_file_as_given_not_its_temporary_name(tmp_path):
    target = tmp_path / "missing" / "est.json"
    with pytest.raises(FileNotFoundError) as info:
        atomic_write(target, "{}")
    assert info.value.filename == str(target)


def test_an_output_file_is_refused_when_it_is_the_users_an_input_or_a_directory(tmp_path):
    """`check_output_file`, the rule for every file a command writes at a path the user named: a file of the
    user's is refused unless forced, ours (a JSON that says so, or listed by its directory's record) is not,
    an input or a directory never is; nothing is touched."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ownership.ForeignOutputError, match=rf"--json {notes} exists and this project did not write it"
                                                           r".*or pass --force to replace it"):
        outputs.check_output_file(notes, "--json")
    assert notes.read_text() == "mine"
    outputs.check_output_file(notes, "--json", force=True)
    ours = tmp_path / "est.json"
    ours.write_text('{"written_by": "hylo-pipeline", "estimates": []}')
    outputs.check_output_file(ours, "--json")
    ownership.record_files(tmp_path, ["notes.txt"])
    outputs.check_output_file(notes, "--json")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage: 2\n")
    with pytest.raises(outputs.OutputConflictError, match="is the input --config"):
        outputs.check_output_file(cfg, "--json", [("--config", cfg)], force=True)
    with pytest.raises(ownership.ForeignOutputError, match="is a directory"):
        outputs.check_output_file(tmp_path, "--json", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ownership.OUTPUT_RECORD, "c.yaml", "est.json", "notes.txt"]


def _link_tree(d: Path) -> dict[str, str]:
    return {p.name: (f"-> {os.readlink(p)}" if p.is_symlink() else p.read_text() if p.is_file() else "dir")
            for p in sorted(d.iterdir())}


def test_one_rule_for_links_every_output_file_follows_a_link_dangling_or_not(tmp_path):
    """Issue 61: `hylo configs cp` replaced a user's dangling link without --force while `estimate --json` refused
    any link even to its own report. Now one rule (`output_target`): a link at the output path is followed,
    dangling or not; what it points to is checked as if named (ours, the user's with --force, never an input)
    and written; the link itself is never replaced."""
    ours, mine = tmp_path / "est.json", tmp_path / "mine.json"
    ours.write_text('{"written_by": "hylo-pipeline"}')
    mine.write_text("{}")
    (tmp_path / "to-ours").symlink_to(ours)
    (tmp_path / "to-mine").symlink_to(mine)
    (tmp_path / "dangling").symlink_to(tmp_path / "new.json")
    (tmp_path / "to-input").symlink_to(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("stage: 2\n")
    assert outputs.check_output_file(tmp_path / "to-ours", "--json") == ours
    assert outputs.check_output_file(tmp_path / "dangling", "--json") == tmp_path / "new.json"
    with pytest.raises(ownership.ForeignOutputError, match=rf"--json {tmp_path / 'to-mine'} \(a link to {mine}\) "
                                                           r"exists and this project did not write it"):
        outputs.check_output_file(tmp_path / "to-mine", "--json")
    with pytest.raises(outputs.OutputConflictError, match=rf"is the input --config {tmp_path / 'c.yaml'}"):
        outputs.check_output_file(tmp_path / "to-input", "--json", [("--config", tmp_path / "c.yaml")], force=True)
    before = _link_tree(tmp_path)
    outputs.write_output_file(tmp_path / "dangling", '{"written_by": "hylo-pipeline", "n": 1}')
    outputs.write_output_file(tmp_path / "to-ours", '{"written_by": "hylo-pipeline", "n": 2}')
    after = _link_tree(tmp_path)
    assert after.pop("new.json") == '{"written_by": "hylo-pipeline", "n": 1}'
    assert after.pop("est.json") == '{"written_by": "hylo-pipeline", "n": 2}'
    assert {k: v for k, v in before.items() if k != "est.json"} == after  # every link and file else as it was


def test_an_output_file_that_cannot_be_written_is_refused_up_front_under_its_own_name(tmp_path):
    """/proc takes no new file (even for root): the error names --json as given, never `.NAME.tmp-PID-HEX`."""
    from hylo.pipeline.cli import input_error_message

    with pytest.raises(OSError) as info:
        outputs.check_output_file("/proc/hylo-est.json", "--json")
    assert input_error_message(info.value) == "--json /proc/hylo-est.json: cannot write it (No such file or directory)"
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(OSError, match=f"--json {a_file}/est.json"):
        outputs.check_output_file(a_file / "est.json", "--json")
