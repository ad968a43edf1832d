"""One rule for values: what a user writes (a config value, a flag, a file) is taken as written or refused in one
line before any work, never reinterpreted, ignored, or left to fail inside a worker."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
from pathlib import Path

import pytest

from hylo.json_files import MAX_JSON_DEPTH, read_json
from hylo.pipeline.config import ConfigError

from tests.helpers.cli import run_hylo, run_hylo_split

ROOT = Path(__file__).resolve().parents[2]


def one_error_line(rc: int, text: str) -> str:
    assert rc == 2, text[-2000:]
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text[-2000:]
    return lines[0]


# -------------------------------------------------------------------------- string fields keep their text
YAML_11 = ["012", "yes", "12:30", "0x1F", "1e3", "2024-01-02", "on"]


@pytest.mark.parametrize("text", YAML_11)
def test_a_string_field_keeps_an_unquoted_scalar_as_written(text, tmp_path):
    """Before: YAML 1.1 read `ray.name: 012` as 10 and the str field got '10' (yes -> 'True', 12:30 -> '750',
    0x1F -> '31'), in a file and in --set alike."""
    from hylo.pipeline.train.config import load_stage_config

    path = tmp_path / "c.yaml"
    path.write_text(f"ray:\n  name: {text}\nstage1:\n  ray:\n    storage_path: {text}\n")
    cfg = load_stage_config(1, path)
    assert (cfg.ray.name, cfg.ray.storage_path) == (text, text)
    cfg = load_stage_config(2, None, [f"ray={{storage_path: {text}}}", f"ray.name={text}"])
    assert (cfg.ray.name, cfg.ray.storage_path) == (text, text)


def test_the_convert_job_keeps_a_string_as_written_too(tmp_path):
    from hylo.jobs.convert import build_parser, load_job_config

    path = tmp_path / "c.yaml"
    path.write_text("out: 012\n")
    cfg = load_job_config(build_parser().parse_args(["--config", str(path), "--set", "base=0x1F"]))
    assert (cfg.out, cfg.base) == ("012", "0x1F")


def test_a_non_string_given_in_code_for_a_string_field_is_refused():
    """No text as written to take (a mapping built in code): an error that says to quote it, not str(True)."""
    from hylo.pipeline.config import from_dict
    from hylo.pipeline.train.config import RaySection

    with pytest.raises(ConfigError, match=r"ray\.name: expected a string, got bool True; quote it: name: 'True'"):
        from_dict(RaySection, {"name": True}, "ray")


# ------------------------------------------------------------------------------------- --config once
def test_a_second_config_is_refused(tmp_path):
    """Before: `--config A --config B` read B and ignored A silently."""
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text("train:\n  seed: 1\n")
    line = one_error_line(*run_hylo(["stage1", "--config", str(tmp_path / "a.yaml"), "--config",
                                     str(tmp_path / "b.yaml"), "--print-config"]))
    assert "argument --config: given twice" in line and "a.yaml" in line and "b.yaml" in line, line


# ------------------------------------------------------------------------------ numeric flags bounded
def test_every_numeric_flag_is_parsed_with_a_bound():
    """Every add_argument of a number uses pipeline/cli.py's bounded types (no bare type=int / type=float, whose
    value is unbounded, and float('nan') passes)."""
    bare = re.compile(r"""(type=(int|float)\b|["']type["']:\s*(int|float)\b|int_at_least\()""")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("pipeline", "jobs") for p in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if bare.search(line)]
    assert not found, found


@pytest.mark.parametrize("args,want", [
    (["--nodes", "1000000000000"], "argument --nodes: must be in [1, 1024], got 1000000000000"),
    (["--timeout", "nan"], "argument --timeout: must be a finite number in (0, 604800], got nan"),
    (["--timeout", "-5"], "argument --timeout: must be a finite number in (0, 604800], got -5"),
    (["--timeout", "0"], "argument --timeout: must be a finite number in (0, 604800], got 0"),
    (["--timeout", "inf"], "argument --timeout: must be a finite number in (0, 604800], got inf"),
    (["--gpus-per-node", "100000"], "argument --gpus-per-node: must be in [0, 64], got 100000"),
], ids=["nodes", "nan", "negative", "zero", "inf", "gpus"])
def test_rehearse_bounds_its_numbers_as_it_parses_them(args, want, capsys):
    """Before: --nodes 10^12 was accepted and the fit arithmetic grew until the OOM killer ended it (22.7 GB);
    --timeout nan / -5 / 0 / inf were accepted."""
    from hylo.pipeline.cli import _one_line_argparse_errors
    from hylo.pipeline.rehearse import build_parser

    with _one_line_argparse_errors(), pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--check-only", *args])
    assert e.value.code == 2
    assert want in capsys.readouterr().err


class _Stop(Exception):
    pass


@pytest.mark.parametrize("tokens", ["10000000000000", "4294967296"])
def test_kernels_check_bounds_tokens_before_any_work(tokens, tmp_path, monkeypatch):
    """Before: accepted, and the per-target child failed after minutes."""

    def stand_in(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr("hylo.pipeline.kernels_check.check", stand_in)
    line = one_error_line(*run_hylo(["kernels-check", "--config", "demo-smollm2", "--tokens", tokens,
                                     "--out", str(tmp_path / "o")]))
    assert f"argument --tokens: must be in [2, 16777216], got {tokens}" in line, line


# ---------------------------------------------------------------------------------------- --cluster
def test_rehearse_cluster_names_what_the_path_is(tmp_path):
    """Before: /etc/passwd gave an AttributeError traceback, a directory or /dev/null "does not exist"."""
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    want = {str(passwd): ": not a YAML mapping", str(tmp_path): ": is a directory",
            "/dev/null": " is a character device, not a regular file: nothing was read from it",
            str(fifo): " is a FIFO (named pipe), not a regular file: nothing was read from it",
            str(tmp_path / "none.yaml"): ": does not exist"}
    for path, reason in want.items():
        line = one_error_line(*run_hylo(["rehearse", "--check-only", "--cluster", path]))
        assert line.startswith(f"error: --cluster: {path}{reason}"), line


# ----------------------------------------------------------------------- rules that failed in workers
def test_a_shard_shorter_than_the_conv_window_is_refused_at_load():
    """Before: train.sequence_parallel=2 with 2-token rows passed every check, then every rank raised."""
    from hylo.pipeline.train.config import load_stage_config

    sets = ["data.source=synthetic", "data.seq_len=2", "train.sequence_parallel=2", "ray.num_workers=2",
            "train.global_batch_sequences=2"]
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel=2: data\.seq_len=2: .*shards of 1 token\(s\), "
                                          r"shorter than the linear blocks' conv window \(3 tokens"):
        load_stage_config(1, None, sets)
    assert load_stage_config(1, None, [*sets[:1], "data.seq_len=8", *sets[2:]]).train.sequence_parallel == 2


def test_a_student_checkpoints_conv_window_is_checked_before_ray(tmp_path):
    from hylo.config import HybridConfig
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.inputs import _shards_fit_the_student

    HybridConfig(n_layer=2, mla_layers=[0], gdn_conv_size=8, vocab_size=64, hidden_size=64, intermediate_size=64,
                 num_attention_heads=2, num_key_value_heads=1, kv_lora_rank=16, qk_rope_head_dim=16,
                 qk_nope_head_dim=16, v_head_dim=32, gdn_num_heads=2, gdn_head_dim=16).save_hybrid_config(tmp_path)
    cfg = load_stage_config(2, None, [f"model.student={tmp_path}", "data.source=synthetic", "data.seq_len=8",
                                      "train.sequence_parallel=2", "ray.num_workers=2", "train.global_batch_sequences=2"])
    with pytest.raises(ConfigError, match=r"shards of 4 token\(s\), shorter than .*\(7 tokens, gdn_conv_size 8 - 1\)"):
        _shards_fit_the_student(cfg, 8, "data.seq_len=8")
    _shards_fit_the_student(cfg, 16, "data.seq_len=16")


def test_estimate_refuses_a_shard_shorter_than_the_conv_window(monkeypatch):
    """Before: the step ran, and every simulated rank raised ValueError from the conv."""
    def stand_in(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr("hylo.pipeline.estimate.cli.estimate_step", stand_in)
    # (model.student unset: the demo's stage-2 student is stage 1's output, which a line would say is priced)
    line = one_error_line(*run_hylo(["estimate", "--config", "demo-smollm2", "--tokens", "8", "--set",
                                     "model.student=null", "--sequence-parallel", "4", "--world-size", "4"]))
    assert "--sequence-parallel=4: a 8-token row split over 4 ranks gives shards of 2 token(s)" in line, line


# --------------------------------------------------------------------------------------- nested input
def test_deeply_nested_json_is_refused_with_the_line(tmp_path):
    """Before: a config.json 200,000 levels deep was a RecursionError traceback (convert, the teacher)."""
    deep = tmp_path / "config.json"
    deep.write_text('{"a":\n' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(ValueError, match=rf"config.json line 2: nested more than {MAX_JSON_DEPTH} levels deep"):
        read_json(deep)
    line = one_error_line(*run_hylo(["convert", "--dry-run", "--base-config", str(deep)]))
    assert line == f"error: {deep} line 2: nested more than {MAX_JSON_DEPTH} levels deep", line
    # brackets inside strings do not nest; MAX_JSON_DEPTH levels are fine
    ok = tmp_path / "ok.json"
    ok.write_text("[" * MAX_JSON_DEPTH + '"' + "[{" * 500 + '"' + "]" * MAX_JSON_DEPTH)
    assert read_json(ok) is not None


# --------------------------------------------------------------------------------- missing model.student
def test_a_missing_student_is_named_not_an_unknown_key(tmp_path):
    """Before: a stage-2 config without model.student (and no stage-1 model.base) gave "unknown key(s) kd,
    teacher in Stage1Config" in estimate and kernels-check."""
    rc, out, err = run_hylo_split(["stage2", "--print-config"])
    assert rc == 0, err
    path = tmp_path / "s2.yaml"
    path.write_text("\n".join(x for x in out.splitlines() if not x.startswith("stage:")) + "\n")
    for argv in (["estimate", "--config", str(path), "--tokens", "64"],
                 ["kernels-check", "--config", str(path), "--out", str(tmp_path / "o")]):
        line = one_error_line(*run_hylo(argv))
        assert line.startswith("error: model.student is not set, and the config has no model.base"), line


# ---------------------------------------------------------------------------------------- configs cp
def test_configs_cp_onto_a_pipe_is_refused(tmp_path):
    """Before: `hylo configs cp NAME PIPE --force` was a SpecialFileError traceback."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    line = one_error_line(*run_hylo(["configs", "cp", "demo-smollm2", str(fifo), "--force"]))
    assert line == f"error: DEST {fifo} is a FIFO (named pipe): give the name of a file to write", line
    assert fifo.is_fifo()


# ---------------------------------------------------------------------------------------- bounded reads
@contextlib.contextmanager
def _within(seconds: float, more_bytes: int = 1 << 30):
    """Fail (not hang, not fill the machine's memory) when the block takes longer or allocates more: a read of a
    pipe blocked forever, one of /dev/zero grew to gigabytes (a MemoryError here instead)."""
    import resource

    def stop(signum, frame):
        raise TimeoutError(f"still reading after {seconds} s")

    vm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
              if line.startswith("VmSize:"))
    limits = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + more_bytes if limits[1] == resource.RLIM_INFINITY else min(vm + more_bytes, limits[1])
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    resource.setrlimit(resource.RLIMIT_AS, (cap, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _socket_file(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return s


def test_a_config_that_is_no_regular_file_is_refused_saying_what_it_is(tmp_path):
    """Issue 61: `--config /dev/zero` grew to 2 GB in 13-18 s (read_config_file read the whole file before any YAML
    limit), a FIFO blocked forever. Now every config is read only when it is a regular file, at most
    MAX_YAML_BYTES, and the error says what it is, in one line, at once."""
    fifo, sock = tmp_path / "fifo.yaml", tmp_path / "sock.yaml"
    os.mkfifo(fifo)
    server = _socket_file(sock)
    try:
        want = {"/dev/zero": "a character device", "/dev/urandom": "a character device", str(fifo): "a FIFO (named pipe)",
                str(tmp_path): "a directory", str(sock): "a socket"}
        for path, kind in want.items():
            with _within(20):
                line = one_error_line(*run_hylo(["stage1", "--config", path, "--print-config"]))
            assert line == f"error: config file {path} is {kind}, not a regular file: nothing was read from it", line
    finally:
        server.close()


def test_a_config_over_the_limit_is_refused_before_it_is_read(tmp_path):
    """A sparse 20 MB file (nothing on disk) and a 300 MB one are refused by their size, the limit named;
    /proc/self/environ (a regular file whose size the kernel says is 0) is read up to the limit and parsed."""
    from hylo.yaml_limits import MAX_YAML_BYTES

    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(20_000_000)
    with _within(20):
        line = one_error_line(*run_hylo(["stage1", "--config", str(big), "--print-config"]))
    assert line == (f"error: config file {big} is 20,000,000 bytes; a config file is read only up to "
                    f"{MAX_YAML_BYTES >> 20} MiB: nothing was parsed"), line
    with _within(20):
        line = one_error_line(*run_hylo(["stage1", "--config", "/proc/self/environ", "--print-config"]))
    assert line.startswith("error: /proc/self/environ is not valid YAML"), line


def test_read_bounded_cuts_a_file_whose_size_is_not_reported_at_the_limit(tmp_path):
    from hylo.bounded_read import read_bounded

    with _within(20):
        with pytest.raises(ConfigError, match=r"^config file /proc/self/environ holds more than 16 bytes; a config "
                                              r"file is read only up to 16 bytes: nothing was parsed$"):
            read_bounded("/proc/self/environ", 16, ConfigError, "config file")
    (tmp_path / "ok").write_bytes(b"x" * 16)
    assert read_bounded(tmp_path / "ok", 16) == b"x" * 16
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "missing", 16)


def test_every_json_reader_refuses_a_pipe_a_device_and_a_file_over_its_bound(tmp_path):
    """read_json, the one reader of a JSON file (manifests, records, model configs): the same refusals, the
    caller's error class, a missing file still FileNotFoundError; the bound of a record is smaller."""
    from hylo.ownership import OUTPUT_RECORD, read_record

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with _within(20):
        with pytest.raises(ConfigError, match=rf"^JSON file {fifo} is a FIFO \(named pipe\), not a regular file"):
            read_json(fifo, ConfigError)
        with pytest.raises(ConfigError, match=r"^JSON file /dev/zero is a character device"):
            read_json("/dev/zero", ConfigError)
        big = tmp_path / "big.json"
        big.write_text("[" + "0," * 600 + "0]")
        with pytest.raises(ConfigError, match=rf"^JSON file {big} is 1,203 bytes; a JSON file is read only up to "
                                              r"1 KiB: nothing was parsed"):
            read_json(big, ConfigError, max_bytes=1024)
        # a record that is a pipe is no record (and never blocks the check that reads it)
        (tmp_path / "out").mkdir()
        os.mkfifo(tmp_path / "out" / OUTPUT_RECORD)
        assert read_record(tmp_path / "out") is None
