"""Gopher quality and repetition rules (Rae et al. 2021, "Scaling Language Models: Methods,
Analysis & Insights from Training Gopher", appendix A.1.1 and table A1)."""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable
from itertools import compress, count
from typing import Annotated, Any

from pydantic import Field

from dataprep.quality.base import Drop, Fraction, Rule, RuleParams, Verdict, fmt
from dataprep.quality.text import HAS_ALPHA, SYMBOLS, Doc, dup_count_and_chars

# The eight English stop words listed by Gopher (appendix A.1.1); datatrove's STOP_WORDS
# is the same list.
STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")

Count = Annotated[int, Field(ge=0)]

# Languages written without spaces, whose words ICU segments (Doc.word_language): the
# English thresholds would drop every document (a Chinese word is 1-2 characters; none of
# the English stop words occur). FineWeb-2's thresholds and stop words for them
# (huggingface/fineweb-2 configs/cmn_Hani.yml, jpn_Jpan.yml, tha_Thai.yml), applied to a
# document in that language unless the config sets the parameter itself.
LANGUAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    "zh": {
        "min_avg_word_length": 1,
        "max_avg_word_length": 5,
        "min_alpha_words_ratio": 0.735,
        "stop_words": (
            "的",
            "年",
            "在",
            "月",
            "是",
            "和",
            "日",
            "了",
            "於",
            "·",
            "為",
            "有",
            "被",
            "人",
            "中",
            "为",
            "他",
            "與",
            "後",
            "也",
            "而",
            "由",
        ),
    },
    "ja": {
        "min_avg_word_length": 1,
        "max_avg_word_length": 5,
        "min_alpha_words_ratio": 0.759,
        "stop_words": (
            "の",
            "に",
            "を",
            "は",
            "た",
            "て",
            "が",
            "と",
            "で",
            "年",
            "し",
            "・",
            "月",
            "れ",
            "さ",
        ),
    },
    "th": {
        "min_avg_word_length": 2,
        "max_avg_word_length": 10,
        "min_alpha_words_ratio": 0.9,
        "stop_words": ("ใน", "ที่", "และ", "ของ", "เป็น", "มี", "การ", "ได้"),
    },
}


class GopherQualityParams(RuleParams):
    # Every default is the Gopher paper's (appendix A.1.1) and equals datatrove 0.10's
    # GopherQualityFilter default; None switches a check off.
    min_doc_words: Count | None = Field(default=50, description="Fewest words.")
    max_doc_words: Count | None = Field(default=100_000, description="Most words.")
    min_avg_word_length: float | None = Field(
        default=3, ge=0, description=("Shortest mean word length (characters).")
    )
    max_avg_word_length: float | None = Field(
        default=10, ge=0, description=("Longest mean word length.")
    )
    max_symbol_word_ratio: float | None = Field(
        default=0.1, ge=0, description=("'#' per word and ('...' + '…') per word.")
    )
    max_bullet_lines_ratio: Fraction | None = Field(
        default=0.9, description=("Lines starting with a bullet ('•' or '-', as datatrove).")
    )
    max_ellipsis_lines_ratio: Fraction | None = Field(
        default=0.3, description=("Lines ending in an ellipsis.")
    )
    # datatrove calls this max_non_alpha_words_ratio (its own TODO says to rename it).
    min_alpha_words_ratio: Fraction | None = Field(
        default=0.8,
        description=('"80% of words in a document contain at least one alphabetic character".'),
    )
    min_stop_words: Count | None = Field(default=2, description=("Fewest words from stop_words."))
    stop_words: tuple[str, ...] = Field(
        default=STOP_WORDS, description=("The stop words (Gopher's).")
    )


class GopherQuality(Rule[GopherQualityParams]):
    """Document-level heuristics for natural-language prose; drops menus, tables, lists,
    word salad and non-prose. Word counts use the shared spaCy-like split (`Doc.words`):
    symbol tokens count in the per-word ratios but not in the word-count and length tests,
    as in datatrove."""

    name = "gopher_quality"
    Params = GopherQualityParams

    def setup(self) -> None:
        self._stop_words = frozenset(self.params.stop_words)
        # The parameters for each language with defaults of its own: the config's where it
        # sets them, else the language's.
        given = self.params.model_fields_set
        self._by_language = {}
        for lang, defaults in LANGUAGE_DEFAULTS.items():
            params = self.params.model_copy(
                update={k: v for k, v in defaults.items() if k not in given}
            )
            self._by_language[lang] = (params, frozenset(params.stop_words))

    def apply(self, doc: Doc) -> Verdict:
        p, stop_words = self._by_language.get(
            doc.word_language or "", (self.params, self._stop_words)
        )
        text = doc.text
        words = doc.words
        n_words = len(words)
        # Symbol tokens count as words in the ratios below but not in the word count and
        # mean length, as in datatrove: a symbol is made only of datatrove's punctuation.
        # (isalpha first: most words are letters only, none of which are in SYMBOLS.)
        content = [w for w in words if w.isalpha() or w.strip(SYMBOLS)]
        n_content = len(content)
        stats = doc.stats
        stats["gopher_quality.words"] = n_content

        if p.min_doc_words is not None and n_content < p.min_doc_words:
            return Drop("min_doc_words", f"words={n_content} < {p.min_doc_words}")
        if p.max_doc_words is not None and n_content > p.max_doc_words:
            return Drop("max_doc_words", f"words={n_content} > {p.max_doc_words}")

        if n_content:
            avg = sum(map(len, content)) / n_content
            stats["gopher_quality.mean_word_length"] = avg
            if p.min_avg_word_length is not None and avg < p.min_avg_word_length:
                return Drop(
                    "min_avg_word_length", f"mean word length={fmt(avg)} < {p.min_avg_word_length}"
                )
            if p.max_avg_word_length is not None and avg > p.max_avg_word_length:
                return Drop(
                    "max_avg_word_length", f"mean word length={fmt(avg)} > {p.max_avg_word_length}"
                )

        if n_words and p.max_symbol_word_ratio is not None:
            ratio = text.count("#") / n_words
            if ratio > p.max_symbol_word_ratio:
                return Drop(
                    "hash_word_ratio", f"'#' per word={fmt(ratio)} > {p.max_symbol_word_ratio}"
                )
            ratio = (text.count("...") + text.count("…")) / n_words
            if ratio > p.max_symbol_word_ratio:
                return Drop(
                    "ellipsis_word_ratio",
                    f"ellipses per word={fmt(ratio)} > {p.max_symbol_word_ratio}",
                )

        lines = doc.lines
        if lines:
            if p.max_bullet_lines_ratio is not None:
                n = sum(1 for s in lines if s.lstrip().startswith(("•", "-")))
                if n / len(lines) > p.max_bullet_lines_ratio:
                    return Drop(
                        "max_bullet_lines_ratio",
                        f"bullet lines={n}/{len(lines)} > {p.max_bullet_lines_ratio}",
                    )
            if p.max_ellipsis_lines_ratio is not None:
                n = sum(1 for s in lines if s.rstrip().endswith(("...", "…")))
                if n / len(lines) > p.max_ellipsis_lines_ratio:
                    return Drop(
                        "max_ellipsis_lines_ratio",
                        f"lines ending in an ellipsis={n}/{len(lines)} > "
                        f"{p.max_ellipsis_lines_ratio}",
                    )

        if n_words and p.min_alpha_words_ratio is not None:
            # str.isalpha() settles most words in C; only the rest need the regex.
            others = [w for w in words if not w.isalpha()]
            n_alpha = n_words - len(others) + sum(1 for w in others if HAS_ALPHA.search(w))
            stats["gopher_quality.alpha_words_ratio"] = n_alpha / n_words
            if n_alpha / n_words < p.min_alpha_words_ratio:
                return Drop(
                    "min_alpha_words_ratio",
                    f"words with a letter={fmt(n_alpha / n_words)} < {p.min_alpha_words_ratio}",
                )

        # Exact, case-sensitive matches ("The" is not "the"), as in datatrove.
        if p.min_stop_words is not None:
            found = len(stop_words.intersection(words))
            stats["gopher_quality.stop_words"] = found
            if found < p.min_stop_words:
                return Drop("min_stop_words", f"distinct stop words={found} < {p.min_stop_words}")
        return None


NGramThresholds = tuple[tuple[Annotated[int, Field(ge=1)], Fraction], ...]


class GopherRepetitionParams(RuleParams):
    # Table A1 of the Gopher paper; datatrove 0.10's GopherRepetitionFilter has the same
    # defaults. Line/paragraph fractions count duplicate elements; *_char_frac counts
    # their characters over the whole text.
    dup_line_frac: Fraction | None = Field(
        default=0.3, description=("Most fraction of lines that are duplicates (by count).")
    )
    dup_para_frac: Fraction | None = Field(
        default=0.3, description=("Most fraction of paragraphs that are duplicates (by count).")
    )
    dup_line_char_frac: Fraction | None = Field(
        default=0.2, description=("Most fraction of characters in duplicate lines.")
    )
    dup_para_char_frac: Fraction | None = Field(
        default=0.2, description=("Most fraction of characters in duplicate paragraphs.")
    )
    top_n_grams: NGramThresholds = Field(
        default=((2, 0.2), (3, 0.18), (4, 0.16)),
        description=("(n, most fraction of characters in the most frequent n-gram)."),
    )
    dup_n_grams: NGramThresholds = Field(
        default=(
            (5, 0.15),
            (6, 0.14),
            (7, 0.13),
            (8, 0.12),
            (9, 0.11),
            (10, 0.10),
        ),
        description="(n, most fraction of characters in n-grams that repeat an earlier one).",
    )


_PARAGRAPH_SPLIT = re.compile(r"\n{2,}")
_LINE_SPLIT = re.compile(r"\n+")


class GopherRepetition(Rule[GopherRepetitionParams]):
    """Repetition within one document, counted exactly as datatrove's
    GopherRepetitionFilter: paragraphs split on blank lines, lines on newlines, n-grams
    over the shared word split; every denominator is the document's length in characters.
    """

    name = "gopher_repetition"
    Params = GopherRepetitionParams

    def apply(self, doc: Doc) -> Verdict:
        p = self.params
        text = doc.text
        if not text:
            return Drop("empty", "no text")
        size = len(text)

        paragraphs = _PARAGRAPH_SPLIT.split(text.strip())
        n_dup, dup_chars = dup_count_and_chars(paragraphs)
        stats = doc.stats
        stats["gopher_repetition.dup_para_frac"] = n_dup / len(paragraphs)
        if p.dup_para_frac is not None and n_dup / len(paragraphs) > p.dup_para_frac:
            return Drop(
                "dup_para_frac",
                f"duplicate paragraphs={n_dup}/{len(paragraphs)} > {p.dup_para_frac}",
            )
        if p.dup_para_char_frac is not None and dup_chars / size > p.dup_para_char_frac:
            return Drop(
                "dup_para_char_frac",
                f"duplicate paragraph chars={fmt(dup_chars / size)} > {p.dup_para_char_frac}",
            )

        lines = _LINE_SPLIT.split(text)
        n_dup, dup_chars = dup_count_and_chars(lines)
        stats["gopher_repetition.dup_line_frac"] = n_dup / len(lines)
        if p.dup_line_frac is not None and n_dup / len(lines) > p.dup_line_frac:
            return Drop(
                "dup_line_frac", f"duplicate lines={n_dup}/{len(lines)} > {p.dup_line_frac}"
            )
        if p.dup_line_char_frac is not None and dup_chars / size > p.dup_line_char_frac:
            return Drop(
                "dup_line_char_frac",
                f"duplicate line chars={fmt(dup_chars / size)} > {p.dup_line_char_frac}",
            )

        cum = doc.word_len_cumsum
        for n, max_frac in p.top_n_grams:
            hashes = doc.ngram_hashes(n)
            if not hashes:
                continue
            counts = Counter(hashes)
            top = max(counts.values())
            # datatrove takes Counter.most_common(1): among equally frequent n-grams, the
            # one seen first, with its " "-joined length.
            first = next(g for g, c in counts.items() if c == top)
            i = hashes.index(first)
            frac = (cum[i + n] - cum[i] + n - 1) * top / size
            stats[f"gopher_repetition.top_{n}_gram_frac"] = frac
            if frac > max_frac:
                return Drop(f"top_{n}_gram", f"top {n}-gram chars={fmt(frac)} > {max_frac}")

        repeats = _RepeatedNGrams(doc)
        for n, max_frac in p.dup_n_grams:
            # Upper bound first: the greedy count takes disjoint n-grams that each repeat
            # an earlier one, so it cannot exceed what all such repeats cover.
            if repeats.repeat_chars(n) / size <= max_frac:
                continue
            frac = _greedy_dup_chars(doc.ngram_hashes(n), cum, n) / size
            if frac > max_frac:
                return Drop(f"dup_{n}_gram", f"duplicate {n}-gram chars={fmt(frac)} > {max_frac}")
        return None


class _RepeatedNGrams:
    """The positions of n-grams that occur more than once, for growing n.

    A repeated (n+1)-gram starts with a repeated n-gram, so after the first n only those
    positions (a few percent of a typical document) are hashed and counted again, instead
    of every position for each n from 5 to 10."""

    def __init__(self, doc: Doc) -> None:
        self.doc = doc
        self.n = 0
        self.positions: list[int] = []  # ascending start positions of repeated n-grams
        self.keys: list[int] = []  # the n-gram hash at each of them

    def _keep_repeated(self, positions: Iterable[int], keys: list[int]) -> None:
        counts = Counter(keys)
        repeated = list(map((1).__lt__, map(counts.__getitem__, keys)))
        self.positions = list(compress(positions, repeated))
        self.keys = list(compress(keys, repeated))

    def _go_to(self, n: int) -> None:
        if self.n == 0 or n < self.n:  # start (or restart) from every position
            self._keep_repeated(count(), self.doc.ngram_hashes(n))
            self.n = n
            return
        words = self.doc.words
        while self.n < n:
            if not self.positions:  # no repeated n-gram: none for larger n either
                self.n = n
                return
            m = self.n  # extend each m-gram by the word at i + m
            cut = bisect_left(self.positions, len(words) - m)
            positions = self.positions[:cut]
            nxt = map(words.__getitem__, map(m.__add__, positions))
            self._keep_repeated(positions, list(map(hash, zip(self.keys[:cut], nxt, strict=True))))
            self.n = m + 1

    def repeat_chars(self, n: int) -> int:
        """Characters (words joined without spaces) covered by n-gram occurrences that
        repeat an earlier one, overlaps counted once."""
        self._go_to(n)
        if not self.positions:
            return 0
        cum = self.doc.word_len_cumsum
        firsts = set(dict(zip(reversed(self.keys), reversed(self.positions), strict=True)).values())
        covered, end = 0, 0
        for i in self.positions:
            if i not in firsts:  # spans all have n words, so each ends past the last one
                covered += cum[i + n] - cum[max(i, end)]
                end = i + n
        return covered


def _greedy_dup_chars(hashes: list[int], cum: list[int], n: int) -> int:
    """datatrove's `find_all_duplicate`: scan left to right; an n-gram seen before adds its
    characters (words joined without spaces) and the scan jumps past it, so overlapping
    repeats are not counted twice; a jumped-over n-gram is not remembered."""
    seen: set[int] = set()
    i, end, repeated = 0, len(hashes), 0
    while i < end:
        g = hashes[i]
        if g in seen:
            repeated += cum[i + n] - cum[i]
            i += n
        else:
            seen.add(g)
            i += 1
    return repeated
