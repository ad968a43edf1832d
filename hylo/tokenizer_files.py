"""The files of a Hugging Face tokenizer directory, copied as files (nothing is loaded or executed).

Both checkpoint layouts (hylo/io.py and hylo/released/export.py) write them with `copy_tokenizer_files`.
A leaf: it imports nothing of the project.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# What a Hugging Face tokenizer directory may hold (copied as files; nothing is loaded or executed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "added_tokens.json")


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files of directory `src` into `dst`; returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
