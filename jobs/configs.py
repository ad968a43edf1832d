r"""The shipped config files: list them, print one, copy one out to edit (as torchtune's `tune ls` / `tune cp`).

    hylo configs                                     # every shipped config with what it is
    hylo configs show demo-smollm2.yaml              # print one
    hylo configs cp demo-smollm2.yaml my-demo.yaml   # copy one out; then: hylo stage1 --config my-demo.yaml

Any job reads a shipped config by its name (`--config demo-smollm2.yaml`, with or without `.yaml`) when no
file of that name is in the current directory; a path reads that file. Paths inside a config are relative
to the directory the command runs in (docs/config-guide.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.logs import add_log_level_flag
from hylo.outputs import check_output_file, write_output_file
from hylo.ownership import output_target
from hylo.pipeline.cli import BadArgument, job_main
from hylo.pipeline.config import shipped_config, shipped_configs
from hylo.rules import suggest


def summary(path: Path) -> str:
    """What a config file is: its leading comment lines up to the first that ends a sentence (a blank comment
    line, or the end of the comment, ends it before)."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or not text:
            break
        words.append(text)
        if text.endswith((".", ".)")):
            break
    return " ".join(words)


def find(name: str) -> Path:
    found = shipped_config(name)
    if found is None:
        names = list(shipped_configs())
        raise BadArgument(f"no shipped config {name!r}{suggest(name, names) or ';'} the shipped configs are "
                          f"{', '.join(names)}")
    return found


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    add_log_level_flag(p)
    sub = p.add_subparsers(dest="action", metavar="{ls,show,cp}")
    ls = sub.add_parser("ls", help="list the shipped configs (the default)", allow_abbrev=False)
    add_log_level_flag(ls)
    show = sub.add_parser("show", help="print one", allow_abbrev=False)
    add_log_level_flag(show)
    show.add_argument("name")
    cp = sub.add_parser("cp", help="copy one to DEST (a file or a directory; default: the current directory)",
                        allow_abbrev=False)
    cp.add_argument("name")
    cp.add_argument("dest", nargs="?", default=".")
    cp.add_argument("--force", action="store_true", help="replace an existing DEST file this project did not write")
    add_log_level_flag(cp)
    return p


@job_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action in (None, "ls"):
        found = shipped_configs()
        width = max(map(len, found))
        # each description whole, wrapped to the terminal beside the names (at least 40 columns of text)
        columns = max(shutil.get_terminal_size().columns, width + 2 + 40)
        for name, path in found.items():
            lines = textwrap.wrap(summary(path), columns - width - 2) or [""]
            print("\n".join([f"{name:<{width}}  {lines[0]}", *(f"{'':<{width}}  {ln}" for ln in lines[1:])]))
        return 0
    src = find(args.name)
    if args.action == "show":
        sys.stdout.write(src.read_text(encoding="utf-8"))
        return 0
    dest = Path(args.dest).expanduser()
    if dest.is_dir():
        dest = dest / src.name
    if not output_target(dest).parent.is_dir():
        raise BadArgument(f"{output_target(dest).parent} is not a directory")
    # the rule of every file a command writes at a path the user named (hylo.outputs.check_output_file): never
    # the shipped config itself, never a non-regular file, a file not ours only with --force, a link followed
    check_output_file(dest, "DEST", [("the shipped config", src)], force=args.force)
    written = write_output_file(dest, src.read_bytes())
    print(f"copied {src.name} to {dest}" + (f" (a link to {written})" if written != dest else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
