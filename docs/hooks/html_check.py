"""mkdocs hook: markup that the site shows otherwise than it was written is an error of `mkdocs build --strict`.

* Every page: a tag that is no HTML element. `<run dir>` or `<name>` written outside a code span is read as a
  tag, and the browser shows neither the brackets nor the name (the configuration reference lost 18 such
  names before it escaped them; docs/hooks/config_reference.py checks that page cell by cell).
* The API reference (api.md, built from docstrings by mkdocstrings): emphasis. The docstrings use none; a `*` in
  `a*b*c` or an `_x_` outside a code span becomes `<em>` there, and the characters disappear.

The pages' Markdown is checked before the build (pymarkdown); this hook checks what Python-Markdown and
mkdocstrings made of it.
"""

from __future__ import annotations

import logging
from html.parser import HTMLParser
from typing import Any

# under "mkdocs.": `--strict` counts this logger's warnings as errors
log = logging.getLogger("mkdocs.hooks.html_check")

# the pages generated from docstrings
DOCSTRING_PAGES = {"api.md"}
EMPHASIS = {"em", "strong", "i", "b"}
# HTML's elements (WHATWG), the SVG ones the theme inlines, and mkdocs-autorefs' placeholder (a link once resolved)
HTML_ELEMENTS = set("""
a abbr address area article aside audio b base bdi bdo blockquote body br button canvas caption cite code col
colgroup data datalist dd del details dfn dialog div dl dt em embed fieldset figcaption figure footer form h1 h2 h3
h4 h5 h6 head header hgroup hr html i iframe img input ins kbd label legend li link main map mark menu meta meter
nav noscript object ol optgroup option output p param picture pre progress q rp rt ruby s samp script search
section select slot small source span strong style sub summary sup table tbody td template textarea tfoot th thead
time title tr track u ul var video wbr
svg path g circle rect line polyline polygon ellipse defs use symbol title desc lineargradient stop clippath
autoref
""".split())


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, str]] = []  # (tag, the text right after it)

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        text = self.get_starttag_text() or tag
        self.tags.append((tag, text))


def stray_markup(page_html: str, docstrings: bool = False) -> list[str]:
    """Each tag of `page_html` that is no HTML element (as written: `<run dir>`), and with `docstrings` each
    emphasis tag: what the site would show otherwise than the source says."""
    parser = _Tags()
    parser.feed(page_html)
    found = [f"{text} is not HTML: the browser hides it (write it in a code span or as &lt;...&gt;)"
             for tag, text in parser.tags if tag not in HTML_ELEMENTS]
    if docstrings:
        found += [f"<{tag}> in a docstring: a `*` or `_` read as emphasis (write it in a code span or escape it)"
                  for tag, _ in parser.tags if tag in EMPHASIS]
    return found


def on_page_content(page_html: str, page: Any, **kwargs: Any) -> str:
    for problem in stray_markup(page_html, docstrings=page.file.src_uri in DOCSTRING_PAGES):
        log.warning("%s: %s", page.file.src_uri, problem)
    return page_html
