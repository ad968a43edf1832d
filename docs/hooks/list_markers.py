"""mkdocs hook: a list the site shows as a run-on paragraph with literal `*` is an error of `mkdocs build --strict`.

The site renders with Python-Markdown, which is stricter than CommonMark about lists: a list right after a
paragraph line, or a block inside a list item indented by fewer than 4 spaces (a table, a second paragraph),
ends up as paragraph text that starts lines with `* `. The Markdown check of `make docs` (pymarkdown,
pyproject.toml [tool.pymarkdown]) catches the first case in the source, but it reads CommonMark, where a
2-space indent is enough; this hook looks at what Python-Markdown actually made of every page.
"""

from __future__ import annotations

import html
import logging
import re
from typing import Any

# under "mkdocs.": `--strict` counts this logger's warnings as errors
log = logging.getLogger("mkdocs.hooks.list_markers")

_PARAGRAPH = re.compile(r"<p\b[^>]*>(.*?)</p>", re.S)
_TAG = re.compile(r"<[^>]+>")
# a line of a paragraph that starts like a list item: `* `, `- `, `+ `, `1. `
_MARKER = re.compile(r"^\s*(?:[*+-]|\d+[.)])\s")


def list_markers(page_html: str) -> list[str]:
    """Each paragraph line of `page_html` that starts with a list marker (its text, tags removed)."""
    found = []
    for paragraph in _PARAGRAPH.finditer(page_html):
        for line in paragraph.group(1).split("\n"):
            text = html.unescape(_TAG.sub("", line))
            if _MARKER.match(text):
                found.append(text.strip())
    return found


def on_page_content(page_html: str, page: Any, **kwargs: Any) -> str:
    for text in list_markers(page_html):
        log.warning("%s: a list shown as paragraph text (a blank line before the list? 4 spaces of indent inside "
                    "a list item?): %.80s", page.file.src_uri, text)
    return page_html
