"""`make docs`: the site built by `mkdocs build --strict` into a new directory beside site/, swapped in when complete.

mkdocs empties its `--site-dir` before it builds, links followed: a `site` linked to a folder of the user's, or a
file of the user's in site/, would be deleted. Here mkdocs only ever cleans a fresh staging directory, and
`hylo.outputs.atomic_dir` (the rule every job's output follows) replaces site/ only when it is missing or our own
earlier build: its record `.hylo-output.json` lists every entry. Anything else is refused, named, and left alone.

    python docs/hooks/build_site.py [SITE]    # default: site/ beside mkdocs.yml
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script of the checkout: its hylo/, installed or not
    sys.path.insert(0, str(REPO))

from hylo.outputs import atomic_dir  # noqa: E402
from hylo.ownership import ForeignOutputError, recorded_entries  # noqa: E402

# what every mkdocs-material build writes besides a folder per page
BUILD_ENTRIES = {"404.html", "index.html", "assets", "search", "sitemap.xml", "sitemap.xml.gz", "configuration"}


def legacy_entries(site: Path, docs: Path = REPO / "docs") -> set[str]:
    """The entries of a site/ built before the record (a mkdocs build of these docs: its search index and the
    generated configuration page): what such a build writes, owned as ours. Empty for anything else."""
    if recorded_entries(site) is not None or not ((site / "search" / "search_index.json").is_file()
                                                 and (site / "configuration" / "index.html").is_file()):
        return set()
    pages = {p.stem if p.suffix == ".md" else p.name for p in docs.iterdir() if p.name not in ("hooks", "index.md")}
    return BUILD_ENTRIES | pages


def build(site: Path, run: Callable[[Path], None]) -> None:
    """`run(staging)` builds the site into `staging`, which then replaces `site` (see the module docstring)."""
    with atomic_dir(site, "site directory", owned=legacy_entries(site)) as staging:
        run(staging)


def mkdocs(staging: Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                    "--site-dir", str(staging)], check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    site = Path(args[0]) if args else REPO / "site"
    try:
        build(site, mkdocs)
    except ForeignOutputError as e:
        print(f"make docs: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        # mkdocs printed why; site/ is as it was
        return e.returncode or 1
    print(f"make docs: the site is in {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
