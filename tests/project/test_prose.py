"""The docs read quickly: bench/code_shape.py's sentence counter counts Markdown as its docstring says, and the
pages rewritten for short sentences stay under 22 words a sentence on average."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_MEAN = 22
# README.md and the docs/ pages held to MAX_MEAN (docs/results.md, the measurement log, is not prose to read)
# every page a newcomer reads: README.md and docs/ (docs/results.md is the dated measurement log, apart)
SHORT_PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")
                                    if p.name != "results.md")]


def _code_shape():
    """bench/code_shape.py (a script, not a package module)."""
    name = "hylo_bench_code_shape"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "code_shape.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_PAGE = """---
hide:
  - toc
---

# A page title

The first sentence has six words. The second one, e.g. this, runs on (i.e. it never ends at an
abbreviation) vs. what follows, until here!

```bash
hylo demo --steps 1   # a code block: not prose. Never counted. At all.
```

| a table | is left out. Entirely. |
|---|---|
| one | two |

<!-- a comment. Left out too. -->

* A list item ends a sentence
* `hylo configs` and [a link text](demo.md) count as their words
1. Numbered: one too

Is this a question? "Quoted starts" split too.
"""


def test_the_counter_counts_a_known_page():
    """Front matter, fenced code, tables and HTML comments left out; a heading, each list item and each paragraph
    end a sentence; e.g., i.e. and vs. do not; a link or a code span counts as the words of its text."""
    cs = _code_shape()
    assert cs.sentences(_PAGE) == [
        3,   # "A page title"
        6,   # "The first sentence has six words."
        19,  # "The second one, e.g. this, runs on (i.e. it never ends at an abbreviation) vs. what follows, until here!"
        6,   # "A list item ends a sentence"
        10,  # "hylo configs and a link text count as their words" (`hylo configs`: 2 words; link text: 3)
        3,   # "Numbered: one too"
        4,   # "Is this a question?"
        4,   # '"Quoted starts" split too.'
    ]


@pytest.mark.parametrize("text, expected", [
    ("One two three. Four five.", [3, 2]),
    ("Ends with a number 3. 4 starts the next.", [5, 4]),
    ("No split after e.g. Capital or i.e. Capital.", [8]),
    ("- item one\n- item two words\n\nA paragraph\nover two lines.", [2, 3, 5]),
    ("~~~\nfenced. With tildes.\n~~~\nAfter.", [1]),
])
def test_the_counter_on_small_snippets(text, expected):
    assert _code_shape().sentences(text) == expected


@pytest.mark.parametrize("page", SHORT_PAGES)
def test_the_pages_a_newcomer_reads_average_at_most_22_words_a_sentence(page):
    figures = _code_shape().prose(REPO)[page]
    assert figures["mean"] <= MAX_MEAN, f"{page}: {figures['mean']} words a sentence (longest {figures['longest']})"
