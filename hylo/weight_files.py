"""Cheap checks of weight files: a truncated or corrupt .safetensors file is named before anything loads it.

`check_safetensors(path)` reads only the 8-byte length and the JSON header of a .safetensors file and checks
that the tensors it lists cover the file exactly (what safetensors itself requires, but its error names no
file). `check_weights_dir(dir)` does it for every .safetensors file of a model directory.
"""

from __future__ import annotations

from pathlib import Path

from hylo.json_files import loads_json

# safetensors refuses headers above 100 MB; a larger length means the file is not safetensors.
MAX_HEADER_BYTES = 100_000_000


class WeightsFileError(ValueError):
    """A weights file is truncated or corrupt; the message names the file."""


def check_safetensors(path: str | Path) -> None:
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsFileError(f"{p}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise WeightsFileError(f"{p}: not a complete safetensors file (header of {n} bytes, file of {size} "
                                   "bytes): truncated or corrupt; download or convert it again")
        try:
            header = loads_json(f.read(n), "header", ValueError)
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise WeightsFileError(f"{p}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    need = 8 + n + max(ends, default=0)
    if need != size:
        what = "truncated" if need > size else "has trailing bytes"
        raise WeightsFileError(f"{p}: {what}: its tensors need {need} bytes, the file has {size}; "
                               "download or convert it again")


def check_weights_dir(directory: str | Path) -> None:
    """Check every .safetensors file of a model directory (a missing directory is left to the loader)."""
    d = Path(directory)
    if d.is_dir():
        for f in sorted(d.glob("*.safetensors")):
            check_safetensors(f)
