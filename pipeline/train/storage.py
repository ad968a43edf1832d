"""Where a training run lives: a local directory or a cloud URI, behind one small API.

    loc = run_location("s3://bucket/runs", "stage2")     # or "/mnt/hylo/runs", "runs" (relative)
    loc / "step_00000008" / "manifest.json"              # Loc: a path on a pyarrow filesystem

Design choices:
* One code path serves both. A local run is a `Loc` on pyarrow's local filesystem, a URI one on the
  filesystem pyarrow resolves. Ray Train's `RunConfig` takes the same, so both agree on where checkpoints are.
* Local writes are atomic (temp file + rename); an object store's single PUT is atomic already.
* Checkpoints go through Ray Train's report with our upload function (`upload_with_retries`). It retries a
  storage outage `checkpoint.upload_retries` times with back-off, then fails with one line. The manifest is
  written after the upload, so a checkpoint cut short is never resumed from.
* A relative `ray.storage_path` is refused inside `ray job submit`: Ray deletes that working directory.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from hylo.atomic import atomic_write
from hylo.logs import get_logger

logger = get_logger(__name__)

URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Set by Ray's job supervisor for the entry point of `ray job submit` (runtime env + job metadata).
JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


class StorageError(RuntimeError):
    """A storage path or URI that cannot be used; the message says which and why."""


class CheckpointUploadError(StorageError):
    """A checkpoint could not be uploaded within `checkpoint.upload_retries`; names it, the storage and the cause."""


def is_uri(path: str | os.PathLike) -> bool:
    return bool(URI.match(str(path)))


def submitted_job() -> dict[str, Any] | None:
    """The job config of a `ray job submit` entry point (None when not running as one)."""
    raw = os.environ.get(JOB_ENV)
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {}


def check_storage_path(storage_path: str, launcher: str) -> None:
    """Refuse storage paths that would put the run somewhere unexpected (see module docstring)."""
    if is_uri(storage_path):
        if launcher == "torchrun":
            raise StorageError(
                f"ray.storage_path={storage_path!r}: URIs need ray.launcher=ray (Ray Train uploads the "
                f"checkpoints); under torchrun use a local or shared-filesystem path")
        return
    job = submitted_job()
    if job is not None and not Path(storage_path).expanduser().is_absolute():
        wd = (job.get("runtime_env") or {}).get("working_dir")
        where = f"Ray's temporary copy of the working directory ({wd})" if wd else "the job's working directory"
        raise StorageError(
            f"ray.storage_path={storage_path!r} is relative, and this is a `ray job submit` job: the run would "
            f"land in {where}, which Ray deletes; give an absolute path (e.g. --set ray.storage_path=$PWD/"
            f"{storage_path}) or a URI (s3://bucket/runs)")


def _from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as first:  # pyarrow.ArrowInvalid is a ValueError
        try:
            import fsspec.core  # lazy: fsspec
        except ImportError:
            raise StorageError(f"{uri}: pyarrow cannot open this URI ({first})") from None
        try:
            fs, path = fsspec.core.url_to_fs(uri)
        except (ValueError, ImportError) as e:
            raise StorageError(f"{uri}: neither pyarrow nor fsspec can open this URI ({first}; {e})") from None
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


class Loc:
    """A file or directory on a pyarrow filesystem (local disk or a cloud bucket)."""

    def __init__(self, fs: pafs.FileSystem, path: str, scheme: str = "", query: str = "") -> None:
        self.fs, self.path, self.scheme, self.query = fs, path.rstrip("/") or "/", scheme, query

    @classmethod
    def of(cls, where: str | os.PathLike | Loc) -> Loc:
        if isinstance(where, Loc):
            return where
        s = str(where)
        if is_uri(s):
            fs, path = _from_uri(s)
            scheme = s.split("://", 1)[0]
            if scheme == "file":
                return cls(pafs.LocalFileSystem(), path)
            return cls(fs, path, scheme, s.partition("?")[2])
        return cls(pafs.LocalFileSystem(), str(Path(s).expanduser().resolve()))

    # ---------------------------------------------------------------- naming
    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def local(self) -> Path:
        if not self.is_local:
            raise StorageError(f"{self} is not on the local filesystem")
        return Path(self.path)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> Loc:
        return Loc(self.fs, self.path.rsplit("/", 1)[0] or "/", self.scheme, self.query)

    def __truediv__(self, rel: str) -> Loc:
        return Loc(self.fs, f"{self.path}/{str(rel).strip('/')}", self.scheme, self.query)

    def __str__(self) -> str:
        """For messages: the URI without its query (which may hold credentials)."""
        return f"{self.scheme}://{self.path}" if self.scheme else self.path

    def uri(self) -> str:
        """The full URI (with the query options it was opened with): `Loc.of(loc.uri())` reopens it."""
        if not self.scheme:
            return self.path
        return f"{self.scheme}://{self.path}" + (f"?{self.query}" if self.query else "")

    def __repr__(self) -> str:
        return f"Loc({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, os.PathLike) and self.is_local:
            return Path(self.path) == Path(other).resolve()
        return isinstance(other, Loc) and (self.scheme, self.path) == (other.scheme, other.path)

    def __hash__(self) -> int:
        return hash((self.scheme, self.path))

    # ---------------------------------------------------------------- queries
    def _info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self._info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self._info().type == pafs.FileType.Directory

    def is_file(self) -> bool:
        return self._info().type == pafs.FileType.File

    def children(self) -> list[Loc]:
        """Entries one level down (empty when missing)."""
        if not self.is_dir():
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return [Loc(self.fs, i.path, self.scheme) for i in infos]

    def files(self) -> dict[str, int]:
        """Every file below this directory: relative POSIX path -> size in bytes."""
        if not self.is_dir():
            return {}
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True, allow_not_found=True))
        n = len(self.path) + 1
        return {i.path[n:]: int(i.size) for i in infos if i.type == pafs.FileType.File}

    # ---------------------------------------------------------------- read / write
    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def iter_chunks(self, chunk: int = 8 << 20) -> Iterator[bytes]:
        with self.fs.open_input_stream(self.path) as f:
            while True:
                b = f.read(chunk)
                if not b:
                    return
                yield b

    def sha256(self) -> str:
        h = hashlib.sha256()
        for b in self.iter_chunks():
            h.update(b)
        return h.hexdigest()

    def write_bytes(self, data: bytes) -> None:
        """Atomic: a reader sees the old content or the new one, never a part."""
        if self.is_local:
            p = self.local()
            p.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(p, data, fsync=True)
            return
        self.fs.create_dir(self.parent.path, recursive=True)
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    def rmtree(self) -> None:
        info = self._info()
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.path)

    def rename(self, dst: Loc) -> None:
        self.fs.move(self.path, dst.path)

    def move_dir(self, dst: Loc) -> None:
        """Move this directory to `dst` (same filesystem): a rename where the filesystem has one (local),
        else (object stores, which have no directories to rename) a copy, then the source is deleted."""
        self.fs.create_dir(dst.parent.path, recursive=True)
        if self.is_local:
            os.replace(self.local(), dst.local())
            return
        pafs.copy_files(self.path, dst.path, source_filesystem=self.fs, destination_filesystem=self.fs,
                        use_threads=not isinstance(self.fs, pafs.S3FileSystem))
        self.rmtree()

    def download(self, dst: Path) -> Path:
        """Copy this directory's files into local `dst` (created); returns `dst`."""
        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(self.path, str(dst), source_filesystem=self.fs,
                        destination_filesystem=pafs.LocalFileSystem())
        return dst

    def upload_dir(self, src: Path) -> None:
        """Copy local directory `src` into this directory (files with the same names are replaced)."""
        self.fs.create_dir(self.path, recursive=True)
        pafs.copy_files(str(src), self.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs,
                        use_threads=not isinstance(self.fs, pafs.S3FileSystem))


def upload_with_retries(src: Path, target: Loc, retries: int, backoff_s: float, who: str = "") -> None:
    """Copy local directory `src` into `target`, retrying a failed copy `retries` times after
    `backoff_s`, 2 x, 4 x ... seconds (files already there are replaced); raises `CheckpointUploadError`."""
    for attempt in range(retries + 1):
        try:
            target.upload_dir(src)
            return
        except OSError as e:  # pyarrow reports network and service errors as OSError
            if e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e):
                # a full disk does not empty itself: reported at once, naming the file and the space left
                raise
            lines = str(e).strip().splitlines()
            # Ray Train retries an upload whose error text holds "AWS Error <code>" 3 more times on its
            # own; the retries here are the configured ones, so the cause is quoted without that token.
            cause = f"{type(e).__name__}: {lines[0] if lines else ''}".replace("AWS Error ", "AWS ")
            if attempt == retries:
                raise CheckpointUploadError(
                    f"uploading checkpoint {target} failed {attempt + 1} time(s) "
                    f"(checkpoint.upload_retries={retries}): {cause}. The earlier checkpoints are intact; "
                    f"once the storage is back, --resume continues from the newest of them") from None
            wait = backoff_s * 2 ** attempt
            logger.warning(f"[checkpoint] {who}uploading {target.name} failed ({cause}); "
                           f"retry {attempt + 1} of {retries} in {wait:g} s")
            time.sleep(wait)


def run_location(storage_path: str, name: str) -> Loc:
    """`<storage_path>/<name>` (a nested name a/b is two levels)."""
    return Loc.of(storage_path) / name


def run_loc(cfg: Any) -> Loc:
    """Where the run of config `cfg` lives: `<ray.storage_path>/<ray.name>` (a local directory or a URI)."""
    return run_location(cfg.ray.storage_path, cfg.ray.name)


def run_dir(cfg: Any) -> Path:
    """The run's local directory: `run_loc(cfg)` itself, or its local mirror when the run lives at a URI."""
    return local_mirror(run_loc(cfg))


def local_mirror(loc: Loc) -> Path:
    """A local directory for the run's files that are written locally first (same path for local runs)."""
    if loc.is_local:
        return loc.local()
    key = hashlib.sha256(loc.uri().encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", loc.name)[:40]
    return Path(tempfile.gettempdir()) / "hylo-runs" / f"{safe}-{key}"


def fresh_local_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def sweep_local_scratch(prefix: str) -> list[Path]:
    """Remove the directories `<prefix>...-p<pid>-<random>` of the temporary directory whose process is gone
    (`fresh_local_dir(f"{prefix}...-p{os.getpid()}-")`): scratch a killed process of this host left. A directory
    of a live process, or of another pattern, is left alone. Returns what was removed."""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(f"{glob.escape(prefix)}*"):
        m = re.search(r"-p(\d+)-[^-/]+$", d.name)
        if m is None or not d.is_dir() or d.is_symlink():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or another user's: left alone)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def local_copy(where: str | os.PathLike) -> Path:
    """A local directory with the content of `where`: the path itself, or a download of a URI (cached
    per URI; a finished download carries a marker file, so an interrupted one is redone)."""
    if not is_uri(where):
        return Path(where).expanduser()
    loc = Loc.of(where)
    if loc.is_local:
        return loc.local()
    dst = local_mirror(loc).with_name(local_mirror(loc).name + "-input")
    marker = dst / ".hylo-download-complete"
    if not marker.is_file():
        shutil.rmtree(dst, ignore_errors=True)
        if not loc.is_dir():
            raise StorageError(f"{loc}: no such directory")
        loc.download(dst)
        marker.write_text(str(loc) + "\n")
    return dst


def remove_local(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
