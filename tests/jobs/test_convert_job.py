"""jobs/convert.py: dry-run accounting from a config.json alone, and a real SmolLM2 conversion."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hylo.jobs import convert

from tests.helpers.models import LLAMA_1B, LLAMA_3B

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], capsys) -> tuple[int, dict | None, str]:
    try:
        rc = convert.main(argv)
    except SystemExit as e:  # a flag out of its range: argparse's one line, as `hylo convert` exits
        rc = e.code
    cap = capsys.readouterr()
    # libraries may log to stdout before the summary (DeepSpeed's accelerator notice): take the JSON block
    text = cap.out if cap.out.startswith("{") else cap.out[cap.out.find("\n{") + 1:]
    return rc, (json.loads(text) if rc == 0 else None), cap.err


@pytest.mark.parametrize("cfg,rope,ratio", [(LLAMA_3B, 64, 0.047), (LLAMA_1B, 32, 0.078)], ids=["3B", "1B"])
def test_dry_run_reproduces_published_ratios(tmp_path, capsys, cfg, rope, ratio):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, summary, _ = _run(["--dry-run", "--base-config", str(path), "--mla-layers", "even", "--kv-lora-rank", "128",
                           "--qk-rope-head-dim", str(rope)], capsys)
    assert rc == 0
    assert round(summary["kv_cache_ratio"], 3) == ratio
    assert summary["n_mla"] == cfg["num_hidden_layers"] // 2
    assert summary["base_kv_bytes_per_token"] == cfg["num_hidden_layers"] * 2 * 8 * cfg["head_dim"] * 2
    assert summary["hybrid_parameters"] > 0 and summary["base_parameters"] > 0


def test_dry_run_errors(tmp_path, capsys):
    rc, _, err = _run(["--dry-run", "--base-config", str(tmp_path / "missing.json")], capsys)
    assert rc == 2 and "does not exist" in err
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_1B, "model_type": "gpt_neox"}))
    rc, _, err = _run(["--dry-run", "--base-config", str(path)], capsys)
    assert rc == 2 and "'gpt_neox' is not supported" in err
    path.write_text(json.dumps(LLAMA_1B))
    rc, _, err = _run(["--dry-run", "--base-config", str(path), "--mla-layers", "0,16"], capsys)
    assert rc == 2 and "out of range" in err


@pytest.mark.slow
def test_real_smollm2_convert_reload_generate(tmp_path):
    """Convert SmolLM2-135M-Instruct with MLA on even layers; reload; greedy generate gives text."""
    from transformers import AutoTokenizer

    from hylo.assets import fetch_asset
    from hylo.io import load_hylo

    base = fetch_asset("smollm2-135m-instruct")
    out = tmp_path / "hylo"
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "convert.py"), "--base", str(base), "--out", str(out),
                           "--mla-layers", "even"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # libraries may log to stdout before the summary (DeepSpeed's accelerator notice): take the JSON block
    text = proc.stdout
    summary = json.loads(text if text.startswith("{") else text[text.index("\n{") + 1 :])
    assert summary["n_mla"] == 15 and summary["n_linear"] == 15
    # defaults for SmolLM2: kv_lora_rank 256, 3 rope-key blocks of 16 -> 15 * (256 + 48) / (30 * 2 * 3 * 64)
    assert summary["kv_cache_ratio"] == pytest.approx(15 * 304 / 11520)
    model = load_hylo(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    # the untrained conversion may pick EOS first; -1 (no such token) makes it decode all 12 steps
    gen = model.generate(ids, max_new_tokens=12, eos_token_id=-1)
    text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
    assert gen.shape[1] == ids.shape[1] + 12 and len(text) > 0
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("args,needle", [
    (["--kv-lora-rank", "4096"], "--kv-lora-rank) = 4096 is larger than the hidden size 2048"),
    (["--mla-layers", "all", "--kv-lora-rank", "2040"], "more per token than the attention"),
    (["--q-lora-rank", "4096"], "--q-lora-rank) = 4096 is larger than the hidden size"),
    (["--gdn-num-heads", "0"], "--gdn-num-heads"),
    (["--gdn-head-dim", "-8"], "--gdn-head-dim"),
    (["--max-position-embeddings", "0"], "--max-position-embeddings"),
    (["--q-lora-rank", "0"], "--q-lora-rank"),
    (["--gdn-expand-v", "0"], "--gdn-expand-v"),
], ids=["kv-rank-gt-hidden", "mla-caches-more", "q-rank-gt-hidden", "gdn-heads-0", "gdn-head-dim-neg",
        "max-pos-0", "q-rank-0", "expand-v-0"])
def test_impossible_shapes_are_refused_naming_the_option(tmp_path, capsys, args, needle):
    """Options that cannot hold are refused, naming the option (never silently replaced by defaults, never
    a hybrid that caches more than its base)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_1B))
    rc, _, err = _run(["--dry-run", "--base-config", str(path), *args], capsys)
    assert rc == 2, err
    assert err.startswith("error:") and needle in err, err


# ------------------------------------------------------------------------- one conversion, one config
TINY_OPTIONS = {"mla_layers": "even", "kv_lora_rank": 16, "gdn_head_dim": 8, "gdn_num_heads": 4, "seed": 5}


def _stage1_config(tmp_path, base, **convert_options):
    from hylo.pipeline.train.config import load_stage_config

    options = ", ".join(f"{k}: {v}" for k, v in convert_options.items())
    return load_stage_config(1, None, [f"ray.storage_path={tmp_path / 'runs'}", "ray.name=s1", f"model.base={base}",
                                       "data.source=synthetic", f"model.convert={{{options}}}"])


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(Path(directory) / "model.safetensors")


def test_driver_and_job_convert_to_the_same_calibrated_weights(tmp_path, capsys, monkeypatch):
    """The training driver (stage 1 with model.convert) and jobs/convert.py run one conversion, the same code."""
    import hylo.upcycle
    from hylo.pipeline.train.driver import convert_if_needed
    from hylo.upcycle import ConvertConfig
    from hylo.upcycle.model import convert as real_convert

    calls = []

    def spy(base, options=None, **kw):
        calls.append((str(base), dataclasses.asdict(options), kw.get("calibration_ids")))
        return real_convert(base, options, **kw)

    monkeypatch.setattr(hylo.upcycle, "convert", spy)
    base = _tiny_base(tmp_path / "base", tokenizer=True)
    flags = ["--mla-layers", "even", "--kv-lora-rank", "16", "--gdn-head-dim", "8", "--gdn-num-heads", "4",
             "--seed", "5"]
    rc, _, err = _run(["--base", str(base), "--out", str(tmp_path / "job"), *flags], capsys)
    assert rc == 0, err
    cfg = convert_if_needed(_stage1_config(tmp_path, base, **TINY_OPTIONS))
    assert cfg.model.student == str(tmp_path / "runs" / "s1" / "converted")
    # both through hylo.upcycle.convert, with the same options and its own (default) calibration
    assert calls == [(str(base), dataclasses.asdict(ConvertConfig(**TINY_OPTIONS)), None)] * 2
    job, driver = _weights(tmp_path / "job"), _weights(cfg.model.student)
    assert job.keys() == driver.keys()
    for name in job:
        assert torch.equal(job[name], driver[name]), name
    # both calibrated: every row of a GDN gate is the same fitted direction (random rows otherwise)
    gate = driver["model.layers.1.mixer.g_proj.weight"]
    assert torch.equal(gate, gate[:1].expand_as(gate))


def test_a_base_without_tokenizer_is_refused_unless_calibration_is_turned_off(tmp_path, capsys):
    """A conversion (the driver's too) that cannot calibrate the gates stops, never skips the calibration
    without a word; `calibrate: false` / --no-calibrate is the only way to skip it."""
    from hylo.pipeline.train.driver import convert_if_needed
    from hylo.upcycle import UpcycleError

    base = _tiny_base(tmp_path / "base", tokenizer=False)
    with pytest.raises(UpcycleError, match="(?s)no tokenizer could be loaded.*calibrate: false"):
        convert_if_needed(_stage1_config(tmp_path, base, **TINY_OPTIONS))
    assert not (tmp_path / "runs" / "s1" / "converted").exists()
    rc, _, err = _run(["--base", str(base), "--out", str(tmp_path / "job")], capsys)
    assert rc == 2 and "--no-calibrate" in err and not (tmp_path / "job").exists()
    cfg = convert_if_needed(_stage1_config(tmp_path, base, **TINY_OPTIONS, calibrate=False))
    gate = _weights(cfg.model.student)["model.layers.1.mixer.g_proj.weight"]
    assert not torch.equal(gate, gate[:1].expand_as(gate))
    rc, _, err = _run(["--base", str(base), "--out", str(tmp_path / "job"), "--no-calibrate"], capsys)
    assert rc == 0, err


def _tiny_base(out: Path, tokenizer: bool) -> Path:
    """A random 2-layer Llama directory, with a word-level tokenizer.json or none."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(out)
    if tokenizer:
        Tokenizer(WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0")).save(str(out / "tokenizer.json"))
    return out


def test_options_come_from_the_config_file_flags_and_set_in_that_order(tmp_path, capsys):
    import yaml

    cfg = tmp_path / "convert.yaml"
    cfg.write_text("base_config: {}\ndry_run: true\nconvert:\n  mla_layers: odd\n  kv_lora_rank: 64\n  seed: 3\n"
                   .format(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    with pytest.raises(SystemExit) as e:
        convert.main(["--config", str(cfg), "--kv-lora-rank", "96", "--set", "convert.seed=4", "--print-config"])
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["convert"]["mla_layers"] == "odd" and printed["convert"]["kv_lora_rank"] == 96
    assert printed["convert"]["seed"] == 4 and printed["convert"]["calibrate"] is True
    rc, summary, _ = _run(["--config", str(cfg), "--set", "convert.qk_rope_head_dim=32"], capsys)
    assert rc == 0 and summary["mla_layers"] == list(range(1, 16, 2)) and summary["kv_lora_rank"] == 64
    # a value's error says where it came from: the file's line, the flag, or the override
    cfg.write_text(cfg.read_text().replace("seed: 3", "seed: -3"))
    rc, _, err = _run(["--config", str(cfg)], capsys)
    assert rc == 2 and f"{cfg} line 6: convert.seed=-3: must be in [0, 4294967295]" in err, err
    rc, _, err = _run(["--config", str(cfg), "--seed", "-1"], capsys)
    assert rc == 2 and "argument --seed: must be in [0, 4294967295], got -1" in err, err
    rc, _, err = _run(["--config", str(cfg), "--set", "convert.seed=-2"], capsys)
    assert rc == 2 and "command line: convert.seed=-2" in err, err
    rc, _, err = _run(["--config", str(cfg), "--set", "convert.kv_lora_rnak=8"], capsys)
    assert rc == 2 and "unknown key(s) convert.kv_lora_rnak" in err and "kv_lora_rank" in err, err


def _damage_weights(base: Path, how: str) -> str:
    """Rewrite a base's model.safetensors without one tensor, with an extra one, or with one mis-shaped;
    returns the tensor's name."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(base / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    if how == "missing":
        del sd[name]
    elif how == "unexpected":
        name = "model.layers.1.self_attn.k_norm.weight"
        sd[name] = torch.ones(8)
    else:
        sd[name] = sd[name][:-1].clone()
    save_file(sd, str(base / "model.safetensors"), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("how", ["missing", "unexpected", "misshaped"])
def test_a_base_whose_tensors_do_not_match_its_config_is_refused_naming_them(tmp_path, capsys, how):
    """A missing, unexpected or mis-shaped tensor of a base is refused, naming it (a base without
    `model.layers.1.self_attn.k_proj.weight` must not convert with exit 0 and a random k_proj in its GDN layer).
    The same rule holds wherever a model is loaded: the teacher and the evaluated model."""
    from hylo.io import CheckpointMismatchError
    from hylo.pipeline.eval.decode import EvalError, load_model
    from hylo.pipeline.teacher.model import _load_model

    base = _tiny_base(tmp_path / "base", tokenizer=True)
    name = _damage_weights(base, how)
    kind = {"missing": "missing", "unexpected": "unexpected", "misshaped": "shape mismatch"}[how]
    rc, _, err = _run(["--base", str(base), "--out", str(tmp_path / "job"), "--mla-layers", "0"], capsys)
    assert rc == 2 and f"{kind}: {name}" in err, err
    assert not (tmp_path / "job").exists()
    with pytest.raises(CheckpointMismatchError, match=f"{kind}: {name}"):
        _load_model(base, torch.float32, None)
    with pytest.raises(EvalError, match=f"{kind}: {name}"):
        load_model(str(base))


def test_out_holding_a_users_file_is_refused_naming_it_and_nothing_is_deleted(tmp_path, capsys):
    """`convert --out DIR` with DIR holding the user's notes.txt is refused and deletes nothing: only a
    directory whose record (.hylo-output.json, written with every output) lists all it holds is replaced."""
    base = _tiny_base(tmp_path / "base", tokenizer=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    capsys.readouterr()
    rc, _, err = _run(["--base", str(base), "--out", str(out)], capsys)
    assert rc == 2 and err.startswith(f"error: --out {out} holds 1 entry this project did not write (notes.txt; it has "
                                      f"no .hylo-output.json") and err.count("\n") == 1, err
    assert (out / "notes.txt").read_text() == "my notes" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # the same directory, emptied, is ours once written, and converting into it again replaces it
    (out / "notes.txt").unlink()
    assert _run(["--base", str(base), "--out", str(out)], capsys)[0] == 0
    assert "model.safetensors" in json.loads((out / ".hylo-output.json").read_text())["entries"]
    assert _run(["--base", str(base), "--out", str(out), "--seed", "3"], capsys)[0] == 0
    # a file dropped into our output later is named too; the released export goes by the same rule
    (out / "eval-notes.md").write_text("keep me")
    rc, _, err = _run(["--base", str(base), "--out", str(out)], capsys)
    assert rc == 2 and "did not write as it is: eval-notes.md (not in its record); " in err, err
    released = tmp_path / "released"
    released.mkdir()
    (released / "notes.txt").write_text("x")
    (out / "eval-notes.md").unlink()
    rc, _, err = _run(["--to-released", str(out), "--out", str(released)], capsys)
    assert rc == 2 and f"--out {released} holds 1 entry this project did not write (notes.txt;" in err, err
    assert (released / "notes.txt").read_text() == "x"


def test_a_conversion_shows_one_progress_bar_of_its_steps(tmp_path, capsys):
    """A conversion shows one progress bar that counts every step (load, build, each layer, calibrate) and
    names the one running, instead of saying nothing while it loads, builds and calibrates."""
    base = _tiny_base(tmp_path / "base", tokenizer=True)
    rc, summary, err = _run(["--base", str(base), "--out", str(tmp_path / "out"), "--mla-layers", "0"], capsys)
    assert rc == 0, err
    bars = [ln for ln in re.split(r"[\r\n]", err) if ln.startswith("converting base")]
    assert bars and "5/5" in bars[-1], err[-2000:]  # load + build + 2 layers + calibrate
    for what in ("loading the base model", "building the hybrid", "layer 0 (mla)", "layer 1 (gdn)", "calibrating on"):
        assert any(what in ln for ln in bars), (what, bars)


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_an_output_that_is_or_holds_or_lies_inside_the_input_is_refused_and_the_input_kept(tmp_path, capsys):
    """`convert --to-released M --out M` replaced the model M with its own export (exit 0), and
    `--from-released R --out R` the same: an output equal to an input, inside one, or holding one is refused
    with one line naming both, before anything is written."""
    base = _tiny_base(tmp_path / "base", tokenizer=True)
    model, released = tmp_path / "m", tmp_path / "r"
    assert _run(["--base", str(base), "--out", str(model), "--mla-layers", "0", "--no-calibrate",
                 "--rope-key-groups", "1"], capsys)[0] == 0
    assert _run(["--to-released", str(model), "--out", str(released)], capsys)[0] == 0
    before = {d: _tree(d) for d in (model, released)}
    for argv, given in [(["--to-released", str(model), "--out", str(model)], "--to-released"),
                        (["--from-released", str(released), "--out", str(released)], "--from-released"),
                        (["--to-released", str(model), "--out", str(model / "export")], "--to-released"),
                        (["--from-released", str(released), "--out", str(released) + "/./"], "--from-released"),
                        (["--base", str(base), "--out", str(base)], "--base")]:
        rc, _, err = _run(argv, capsys)
        assert rc == 2 and err.count("\n") == 1 and err.startswith(f"error: --out {Path(argv[3])} ") and given in err, err
        assert "is the input" in err or "inside the input" in err, err
    assert {d: _tree(d) for d in (model, released)} == before
    assert not (model / "export").exists()
    # a linked --out is followed: a link to the input is the input; a link to an output of ours is written through
    link = tmp_path / "latest"
    link.symlink_to(released, target_is_directory=True)
    rc, _, err = _run(["--from-released", str(released), "--out", str(link)], capsys)
    assert rc == 2 and f"--out {link} is the input --from-released {released} ({released} and {released}, links " \
                      "followed)" in err, err
    link.unlink()
    link.symlink_to(tmp_path / "r2", target_is_directory=True)
    assert _run(["--to-released", str(model), "--out", str(link)], capsys)[0] == 0
    assert link.is_symlink() and _tree(tmp_path / "r2") == _tree(released)
    # an output that holds an input (the model inside what would be replaced) is refused the same way
    outer = tmp_path / "outer"
    assert _run(["--base", str(base), "--out", str(outer), "--mla-layers", "0", "--no-calibrate",
                 "--rope-key-groups", "1"], capsys)[0] == 0
    (outer / ".hylo-output.json").write_text(json.dumps({"entries": sorted(p.name for p in outer.iterdir()) + ["m"]}))
    model.rename(outer / "m")
    rc, _, err = _run(["--to-released", str(outer / "m"), "--out", str(outer)], capsys)
    assert rc == 2 and "holds the input --to-released" in err, err
    assert _tree(outer / "m") == before[model]


def _killed_staging(out: Path, payload: int = 1 << 20) -> Path:
    """Run `atomic_dir(out)` (what every export and import writes through) in a child process, let it write a
    partial model.safetensors into its staging directory and SIGKILL it there: what a killed convert leaves."""
    import signal
    import textwrap

    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from hylo.outputs import atomic_dir
        with atomic_dir({str(out)!r}, "--out") as tmp:
            (tmp / "model.safetensors").write_bytes(bytes({payload}))
            print(tmp, flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    staging = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert staging.name.startswith(f".{out.name}.tmp-") and (staging / "model.safetensors").stat().st_size == payload
    return staging


@pytest.mark.slow
def test_a_killed_exports_staging_directory_is_removed_by_the_next_run_and_nothing_else(tmp_path, capsys):
    """A killed `--to-released` export left `.OUT.tmp-*` (up to 687 MB) that nothing removed: the next run of the
    same output removes it (it carries our staging record and its process is gone), and leaves a look-alike
    the user made, one of a process that still runs, and one without our record."""
    base = _tiny_base(tmp_path / "base", tokenizer=True)
    model, out = tmp_path / "m", tmp_path / "rel"
    assert _run(["--base", str(base), "--out", str(model), "--mla-layers", "0", "--no-calibrate",
                 "--rope-key-groups", "1"], capsys)[0] == 0
    staging = _killed_staging(out)
    users = tmp_path / f".{out.name}.tmp-1-notes"
    users.mkdir()
    (users / "mine.txt").write_text("keep")
    live = tmp_path / f".{out.name}.tmp-{os.getpid()}-00000000"
    live.mkdir()
    (live / ".hylo-output.json").write_text(json.dumps({"written_by": "hylo-pipeline", "staging": True,
                                                        "pid": os.getpid(), "host": socket.gethostname()}))
    assert _run(["--to-released", str(model), "--out", str(out)], capsys)[0] == 0
    assert not staging.exists() and (out / "model.safetensors").is_file()
    assert (users / "mine.txt").read_text() == "keep" and live.is_dir()
    # and `hylo clean OUT` does the same at once, listing what it leaves
    from hylo.jobs import clean

    staging = _killed_staging(out)
    assert clean.main([str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out == f"removed {staging}\n" and not staging.exists(), cap
    assert f"left {users}:" in cap.err and f"left {live}:" in cap.err and users.is_dir() and live.is_dir()
    assert (out / "model.safetensors").is_file()
