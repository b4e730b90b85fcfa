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

from dataprep.quality import segment, spacy_en


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

# English text (and text of no known language) is split by spacy_en: spaCy's own English
# rules, as datatrove splits it (the Gopher and FineWeb thresholds were set on such
# splits). Text that a `language` rule labelled otherwise keeps this regex, an
# approximation of those rules in one pass ~50x faster than spaCy: a whitespace-separated
# chunk loses its leading and trailing punctuation, one token per character ("...", "--"
# runs stay whole), and what is left from its first to its last letter/digit is one word
# ("8:30pm", "and/or", "e.g", URLs), except that dashes split it ("well-known" is three
# tokens) and English clitics are tokens of their own ("that" "'s", "do" "n't").
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


# Sentence boundaries inside one line for text labelled with another language (English
# gets spaCy's sentencizer, spacy_en.count_sentences): terminal punctuation and any
# closing quotes or brackets, then whitespace and something that is not more punctuation,
# or directly a capital letter ("Birds.”A"). The punctuation must follow a letter/digit
# or a closing bracket/quote, and not a lone letter: one-letter abbreviations ("U.S.",
# "e.g.", "J. Doe") stay whole, as spaCy's tokenizer exceptions keep them.
_SENTENCE_BREAK = re.compile(
    r"(?:(?<=[^\W_])(?<![.\s][^\W\d_])(?<!^[^\W\d_])|(?<=[)\]\"'”’]))"
    r"[.!?…。！？]+[\"'”’)\]]*"
    r"(?:\s+(?=[\"'“‘(\[*]*[^\s.!?…])|(?=[\"'“‘(\[*]*[A-Z]))"
)

# datatrove's PUNCTUATION_SET (datatrove/utils/text.py, 0.10.1, Apache-2.0): a word made
# only of these is a symbol, which Gopher's word count and mean word length leave out.
SYMBOLS = (
    "\x00\x01\x02\x03\x04\x05\x06\x07\x08\x0b\x0c\r\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17"
    "\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\x7f\x80\x81\x82\x83"
    "\x84\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x90\x91\x92\x93\x94\x95\x96\x97\x98"
    "\x99\x9a\x9b\x9c\x9d\x9e\x9f\xab\xb4\xbb\u0589\u061d\u061e\u061f\u06d4\u0700\u0701"
    "\u0702\u07f9\u0837\u0839\u083d\u083e\u0964\u0965\u104a\u104b\u1362\u1367\u1368\u166e"
    "\u1735\u1736\u17d4\u17d5\u17d6\u17d9\u17da\u1803\u1809\u1944\u1945\u1aa8\u1aa9\u1aaa"
    "\u1aab\u1b5a\u1b5b\u1b5e\u1b5f\u1b7d\u1b7e\u1c3b\u1c3c\u1c7e\u1c7f\u2013\u2014\u2019"
    "\u201c\u201d\u201e\u2026\u203c\u203d\u2047\u2048\u2049\u2236\u2501\u25ba\u2e2e\u2e3c"
    "\u2e53\u2e54\u3001\u3002\u3008\u3009\u300a\u300b\u300c\u300d\u3010\u3011\ua4ff\ua60e"
    "\ua60f\ua6f3\ua6f7\ua876\ua877\ua8ce\ua8cf\ua92f\ua9c8\ua9c9\uaa5d\uaa5e\uaa5f\uaaf0"
    "\uaaf1\uabeb\ufe52\ufe56\ufe57\uff01\uff05\uff08\uff09\uff0c\uff0e\uff11\uff1a\uff1b"
    "\uff1f\uff5e\uff61\U00010a56\U00010a57\U00010f55\U00010f56\U00010f57\U00010f58"
    "\U00010f59\U00010f86\U00010f87\U00010f88\U00010f89\U00011047\U00011048\U000110be"
    "\U000110bf\U000110c0\U000110c1\U00011141\U00011142\U00011143\U000111c5\U000111c6"
    "\U000111cd\U000111de\U000111df\U00011238\U00011239\U0001123b\U0001123c\U000112a9"
    "\U0001144b\U0001144c\U000115c2\U000115c3\U000115c9\U000115ca\U000115cb\U000115cc"
    "\U000115cd\U000115ce\U000115cf\U000115d0\U000115d1\U000115d2\U000115d3\U000115d4"
    "\U000115d5\U000115d6\U000115d7\U00011641\U00011642\U0001173c\U0001173d\U0001173e"
    "\U00011944\U00011946\U00011a42\U00011a43\U00011a9b\U00011a9c\U00011c41\U00011c42"
    "\U00011ef7\U00011ef8\U00011f43\U00011f44\U00016a6e\U00016a6f\U00016af5\U00016b37"
    "\U00016b38\U00016b44\U00016e98\U0001bc9f\U0001da88"
)


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

    @property
    def language(self) -> str | None:
        """The language a `language` rule earlier in the chain found ("en"), else None."""
        lang = self.annotations.get("language")
        return lang if isinstance(lang, str) else None

    @cached_property
    def word_language(self) -> str | None:
        """The language words are split by: the `language` rule's label, else, for text
        in a script written without spaces (Chinese, Japanese, Thai, ...), the language
        its script says (dataprep/quality/segment.py); None for unlabelled other text."""
        lang = self.language
        return (
            segment.base_language(lang) if lang is not None else segment.script_language(self.text)
        )

    @cached_property
    def words(self) -> list[str]:
        return split_words(self.text, self.word_language)

    def count_sentences(self, text: str) -> int:
        """Sentences in `text` (a line of this document), by this document's language."""
        return count_sentences(text, self.word_language)

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


# Which splitter English text gets: "spacy" (spacy_en, the default) or "regex" (the
# older approximation, WORD_RE and _SENTENCE_BREAK); benchmarks/quality.py times both.
_ENGLISH = ["spacy"]


def use_english_splitter(name: str) -> str:
    """Select the splitter for English text ("spacy" or "regex"); returns the previous."""
    if name not in ("spacy", "regex"):
        raise ValueError(f"english splitter: expected 'spacy' or 'regex' (got {name!r})")
    prev, _ENGLISH[0] = _ENGLISH[0], name
    return prev


def _english(language: str | None) -> bool:
    return (language is None or language == "en") and _ENGLISH[0] == "spacy"


def split_words(text: str, language: str | None = None) -> list[str]:
    """The words of `text` as datatrove's `split_into_words` gives them: for English or
    an unknown language (None) spaCy's English tokens (spacy_en.tokenize), for a language
    written without spaces ICU's word segments (segment.words), otherwise
    `split_words_regex`."""
    if language in segment.NO_SPACE_LANGUAGES:
        return segment.words(text, language)
    return spacy_en.tokenize(text) if _english(language) else split_words_regex(text)


def count_sentences(text: str, language: str | None = None) -> int:
    """Sentences in `text` as datatrove's `split_into_sentences` counts them: for English
    or an unknown language spaCy's sentencizer (spacy_en.count_sentences), otherwise one
    plus the sentence breaks that _SENTENCE_BREAK finds."""
    if _english(language):
        return spacy_en.count_sentences(text)
    if language in segment.NO_SPACE_LANGUAGES:
        return segment.count_sentences(text)
    return 1 + len(_SENTENCE_BREAK.findall(text)) if text else 0


def split_words_regex(text: str) -> list[str]:
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
