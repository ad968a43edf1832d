"""Text normalisation shared by the decontamination job and its reference.

normalize_words(text): Unicode NFKC, lowercase, every run of punctuation / symbols / underscores /
whitespace folded to one separator, split into words. So "Has_Close_Elements(numbers)" and
"has close elements ( NUMBERS )" give the same words, and re-cased or re-spaced copies of a
benchmark item normalise identically.

Design choices:
* ASCII text (most of any mixture) skips NFKC (a no-op on ASCII) and folds punctuation with one
  bytes.translate, which is several times faster than the regex path used for other text; both
  paths give identical words (tested). `fold_many` returns the folded UTF-8 bytes of a whole batch
  themselves, which the vectorised scan splits into words in numpy without a Python object per word.
* Underscores are separators, not word characters: identifiers written snake_case or spaced match.
* `content_words` counts words that carry information (not a stopword, not a single character,
  not a pure number); index n-grams with too few are dropped as boilerplate.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

import numpy as np

_NON_WORD = re.compile(r"[\W_]+")
# bytes.translate table: ASCII letters and digits stay, everything else becomes a space.
_ASCII_FOLD = bytes(c if chr(c).isalnum() and c < 128 else 32 for c in range(256))

STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further had
    has have having he her here hers herself him himself his how i if in into is it its itself just
    me more most my myself no nor not now of off on once only or other our ours ourselves out over
    own same she should so some such than that the their theirs them themselves then there these
    they this those through to too under until up very was we were what when where which while who
    whom why will with would you your yours yourself yourselves let s t""".split()
)


# fold_many: ASCII bytes through one table (letters lowered, digits kept, the rest -> space);
# bytes >= 0x80 pass and are decided per character below.
_LUT = np.array([ord(chr(c).lower()) if chr(c).isalnum() else 32 for c in range(128)] + list(range(128, 256)),
                dtype=np.uint8)
_ALNUM: dict[int, bool] = {}


def fold_many(texts: Sequence[str], sep: bytes = b" \n ") -> bytes:
    """`sep` + the texts joined by `sep`, each folded (NFKC, lowercase, every character that is not a letter
    or digit -> a space), as UTF-8 bytes, computed for the whole batch at once.

    Python does only what needs Unicode tables (NFKC + lowercase, and only for non-ASCII text);
    punctuation folding runs in numpy: a byte table for ASCII, and for each non-ASCII character
    (decoded from its UTF-8 bytes in numpy) a cached `str.isalnum` verdict. `sep` must be space,
    newline, space-like ASCII; its non-space bytes are kept as they are.
    """
    parts = [t.encode("ascii") if t.isascii() else
             unicodedata.normalize("NFKC", t).lower().encode("utf-8", "surrogatepass") for t in texts]
    raw = sep + sep.join(parts)
    # Three spare bytes so a 4-byte character at the very end can be read without bounds checks.
    a = np.frombuffer(raw + b"   ", dtype=np.uint8)
    out = _LUT[a[:len(raw)]]
    lead = np.flatnonzero(a[:len(raw)] >= 0xC0)
    if len(lead):
        b0 = a[lead].astype(np.int64)
        b1, b2, b3 = ((a[lead + k] & 0x3F).astype(np.int64) for k in (1, 2, 3))
        n = np.where(b0 >= 0xF0, 4, np.where(b0 >= 0xE0, 3, 2))
        cp = np.where(n == 2, ((b0 & 0x1F) << 6) | b1,
                      np.where(n == 3, ((b0 & 0x0F) << 12) | (b1 << 6) | b2,
                               ((b0 & 0x07) << 18) | (b1 << 12) | (b2 << 6) | b3))
        uniq, inv = np.unique(cp, return_inverse=True)
        for c in uniq.tolist():
            if c not in _ALNUM:
                _ALNUM[c] = chr(c).isalnum()
        drop = ~np.array([_ALNUM[c] for c in uniq.tolist()], dtype=bool)[inv]
        for k in range(4):
            sel = drop & (n > k)
            out[lead[sel] + k] = 32
    # Restore the separators' non-space bytes (the table folded them).
    offsets = np.cumsum([0] + [len(p) + len(sep) for p in parts[:-1]], dtype=np.int64)
    for k, ch in enumerate(sep):
        if ch != 32:
            out[offsets + k] = ch
    return out.tobytes()


def normalize_words(text: str) -> list[str]:
    """NFKC + lowercase + punctuation/whitespace folding, then split into words."""
    if text.isascii():
        return text.lower().encode("ascii").translate(_ASCII_FOLD).decode("ascii").split()
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).split()


def normalize_words_plain(text: str) -> list[str]:
    """The same words as normalize_words, computed the plain way (the reference scan uses it)."""
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).split()


def is_content_word(w: str) -> bool:
    return len(w) > 1 and not w.isdigit() and w not in STOPWORDS


def content_words(words: Sequence[str]) -> int:
    return sum(1 for w in words if is_content_word(w))
