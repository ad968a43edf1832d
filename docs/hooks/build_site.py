"""`make docs`: the site built by `mkdocs build --strict` into a new directory beside site/, swapped in when complete.

mkdocs empties its `--site-dir` before it builds, links followed: a `site` linked to a folder of the user's, or a
file of the user's in site/, would be deleted. Here mkdocs only ever cleans a fresh staging directory, and
`hylo.outputs.atomic_dir` (the rule every job's output follows) replaces site/ only when it is missing, empty or
our own earlier build as we wrote it: its record `.hylo-output.json` lists every file with its size and hash.
Anything else is refused, named, and left alone; a site/ is never taken for a build by the names it holds (a
build from before the record is removed by hand once). site/ is never docs/ or mkdocs.yml, nor around them.

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

from hylo.outputs import OutputConflictError, atomic_dir  # noqa: E402
from hylo.ownership import ForeignOutputError  # noqa: E402


def build(site: Path, run: Callable[[Path], None]) -> None:
    """`run(staging)` builds the site into `staging`, which then replaces `site` (see the module docstring)."""
    with atomic_dir(site, "site directory", inputs=[("docs", REPO / "docs"), ("mkdocs.yml", REPO / "mkdocs.yml")]) \
            as staging:
        run(staging)


def mkdocs(staging: Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                    "--site-dir", str(staging)], check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    site = Path(args[0]) if args else REPO / "site"
    try:
        build(site, mkdocs)
    except (ForeignOutputError, OutputConflictError) as e:
        print(f"make docs: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        # mkdocs printed why; site/ is as it was
        return e.returncode or 1
    print(f"make docs: the site is in {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
