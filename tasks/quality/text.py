"""One document's text with its word, line and n-gram views computed once and shared by
every rule, so a chain of rules tokenises a document a single time."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping
from functools import cached_property
from itertools import accumulate, pairwise
from typing import Any


def _mark_ranges() -> list[tuple[int, int]]:
    # Python's `\w` leaves out combining marks (Mn/Mc/Me), which would cut Devanagari,
    # Arabic or decomposed Latin words in two; the BMP holds all but a few rare scripts'
    # marks and takes ~5 ms to scan once at import.
    ranges: list[tuple[int, int]] = []
    for cp in range(0x10000):
        if unicodedata.category(chr(cp))[0] == "M":
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return ranges


_MARK_RANGES = _mark_ranges()
MARKS = frozenset(chr(c) for a, b in _MARK_RANGES for c in range(a, b + 1))
_M = "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in _MARK_RANGES)
MARK_CLASS = _M  # the combining marks, as the inside of a regex character class

# Words as spaCy's English tokenizer roughly sees them (datatrove splits with spaCy, and
# the Gopher and FineWeb thresholds are applied to such splits), in one regex pass that is
# ~50x faster than spaCy. A whitespace-separated chunk loses its leading and trailing
# punctuation, one token per character ("...", "--" runs stay whole), and what is left
# from its first to its last letter/digit is one word ("8:30pm", "and/or", "e.g", URLs),
# except that dashes split it ("well-known" is three tokens) and English clitics are
# tokens of their own ("that" "'s", "do" "n't").
_ALNUM = rf"(?:[^\W_]|[{_M}])"  # letter, digit or combining mark
# A clitic that ends a word: "that|'s", "we|'re", "do|n't" (not "o'clock", "rock'n'roll").
_CLITIC = rf"(?i:n['’]t|['’](?:s|m|d|re|ve|ll))(?!{_ALNUM})"
# A word: from a letter/digit to the last letter/digit before whitespace or a dash, never
# taking in a final clitic, and ending where the letters end or where a clitic starts.
_WORD = (
    rf"(?!{_CLITIC}){_ALNUM}"
    rf"(?:(?:(?!{_CLITIC})[^\s\-–—])*(?!{_CLITIC}){_ALNUM})?"
    rf"(?:(?!{_ALNUM})|(?={_CLITIC}))"
)
WORD_RE = re.compile(rf"{_WORD}|{_CLITIC}|\.{{2,}}|-{{2,}}|[^\w\s{_M}]|_")


# A letter: a word character that is neither a digit nor '_' (Python's `\w` is
# letters + numbers + '_').
HAS_ALPHA = re.compile(r"[^\W\d_]")


class Doc:
    """A document's text plus lazily built views; rules read these instead of re-splitting.

    A rule that edits the text gets a fresh `Doc` for the next rule (views of the old
    text would be wrong)."""

    def __init__(
        self,
        text: str,
        meta: str | Mapping[str, Any] | None = None,
        redacted: dict[str, int] | None = None,
        annotations: dict[str, Any] | None = None,
        stats: dict[str, float] | None = None,
    ) -> None:
        self.text = text
        # What rules replaced so far, by kind ({"email": 2}): a redacting rule adds to it,
        # and the chain hands the same dict to the edited text's Doc.
        self.redacted: dict[str, int] = {} if redacted is None else redacted
        # Fields a rule adds to the kept document's metadata (`language`: {"language": "en",
        # "language_score": 0.93}); handed on like `redacted`, read by later rules here.
        self.annotations: dict[str, Any] = {} if annotations is None else annotations
        # What the rules measured on the way ({"gopher_quality.words": 412, ...}): kept with
        # the document's provenance, so one can see why it was kept. Handed on like
        # `redacted`; a rule records only values it computes for its checks anyway.
        self.stats: dict[str, float] = {} if stats is None else stats
        # The record's metadata as the quality stage has it (a JSON object string) or a
        # mapping; parsed only when a rule reads `meta`.
        self.raw_meta = meta
        self._ngram_hashes: dict[int, list[int]] = {}

    @cached_property
    def meta(self) -> Mapping[str, Any]:
        """The record's metadata fields (e.g. its `url`); empty when none were given."""
        m = self.raw_meta
        if isinstance(m, str):
            try:
                m = json.loads(m)
            except ValueError:  # ingest writes valid JSON; anything else has no fields
                m = None
        return m if isinstance(m, Mapping) else {}

    @cached_property
    def words(self) -> list[str]:
        return split_words(self.text)

    @cached_property
    def lines(self) -> list[str]:
        # str.splitlines(), as datatrove's Gopher quality and C4 filters use.
        return self.text.splitlines()

    @property
    def has_words(self) -> bool:
        """Whether `words` is already computed (a rule may then prefer it to a shortcut)."""
        return "words" in self.__dict__

    @cached_property
    def non_space_chars(self) -> int:
        # Every non-space character is in exactly one word token.
        if self.has_words:
            return self.word_len_cumsum[-1]
        return sum(map(len, self.text.split()))

    @cached_property
    def word_len_cumsum(self) -> list[int]:
        """cum[i] = total length of words[:i]; the length of words[i:j] is cum[j] - cum[i]."""
        return list(accumulate(map(len, self.words), initial=0))

    def ngram_hashes(self, n: int) -> list[int]:
        """One int per n-gram position: a hash of the word sequence words[i:i+n].

        Built incrementally (the n-gram hash is hash((hash of the (n-1)-gram, next
        word))), so every n costs one pass of C-level zip/map/hash, and no n-gram string
        or tuple is kept. Two different n-grams colliding on 64 bits is negligible next to
        the heuristics' own noise."""
        cache = self._ngram_hashes
        if n in cache:
            return cache[n]
        words = self.words
        if n == 1:
            out = list(map(hash, words))
        elif n == 2:
            out = list(map(hash, pairwise(words)))
        else:
            prev = self.ngram_hashes(n - 1)
            out = list(map(hash, zip(prev, words[n - 1 :], strict=False)))
        cache[n] = out
        return out


def split_words(text: str) -> list[str]:
    """`WORD_RE.findall(text)`, ~3x faster: no token crosses whitespace, so each chunk is
    split alone, and the two commonest shapes skip the regex: letters and digits only
    ("word", one token) and those followed by one symbol ("word,", two tokens)."""
    out: list[str] = []
    append, extend, findall = out.append, out.extend, WORD_RE.findall
    for chunk in text.split():
        if chunk.isalnum():
            append(chunk)
        elif chunk[:-1].isalnum() and chunk[-1] not in MARKS:
            append(chunk[:-1])
            append(chunk[-1])
        else:
            extend(findall(chunk))
    return out


def dup_count_and_chars(items: list[str]) -> tuple[int, int]:
    """How many items repeat an earlier one, and their total length (datatrove's
    `find_duplicates`: every occurrence after the first counts), without a Python loop."""
    unique = set(items)
    return len(items) - len(unique), sum(map(len, items)) - sum(map(len, unique))
