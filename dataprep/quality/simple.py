"""Two cheap rules of this project's own: `char_repetition` (documents made of one repeated
character) and `length` (document size bounds)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Annotated

from pydantic import Field, model_validator

from dataprep.quality.base import Drop, Fraction, Rule, RuleParams, Verdict, fmt
from dataprep.quality.text import Doc

Size = Annotated[int, Field(ge=0)]


class CharRepetitionParams(RuleParams):
    # No paper sets these. OPT's logbook (Zhang et al. 2022) traces a loss spike to a
    # document of about a million '/' characters, which the word-based rules above can
    # miss (one "word"), so this looks at characters.
    # Measured on shared/data: the highest share is 0.29 (hex literals in Java), prose
    # stays under 0.17.
    max_char_frac: Fraction | None = Field(
        default=0.5, description=("Largest share one non-whitespace character may have.")
    )
    min_chars: Size = Field(
        default=100,
        description=(
            'The share test needs this many non-whitespace characters ("!!!" is not a problem).'
        ),
    )
    # Code rulers ('=' * 80) and web separators must pass: the longest run on shared/data
    # is a 304-dash rule in an OpenWebText page, so the limit sits well above it.
    max_run: Annotated[int, Field(ge=1)] | None = Field(
        default=500, description=("Longest allowed run of one non-whitespace character.")
    )


class CharRepetition(Rule[CharRepetitionParams]):
    """Drops text dominated by one character, or holding one absurdly long run of it."""

    name = "char_repetition"
    Params = CharRepetitionParams

    def apply(self, doc: Doc) -> Verdict:
        p = self.params
        text = doc.text
        stats = doc.stats
        if p.max_run is not None:
            run = _long_run(text, p.max_run)
            if run is not None:
                char, length = run
                return Drop("max_run", f"run of {length} {char!r} > {p.max_run}")
        if p.max_char_frac is not None:
            n_chars = doc.non_space_chars
            if n_chars >= p.min_chars and n_chars:
                char, count = _most_common_char(text)
                stats["char_repetition.top_char_frac"] = count / n_chars
                if count / n_chars > p.max_char_frac:
                    return Drop(
                        "max_char_frac",
                        f"{char!r} is {fmt(count / n_chars)} of non-space chars "
                        f"> {p.max_char_frac}",
                    )
        return None


def _long_run(text: str, max_run: int) -> tuple[str, int] | None:
    """The first run of one non-whitespace character longer than `max_run`, if any.

    Any window of max_run + 1 characters holds two consecutive multiples of
    k = (max_run + 1) // 2, so a long run shows up as two equal neighbours in text[::k];
    only those few spots are searched, instead of testing every character."""
    k = max(1, (max_run + 1) // 2)
    sample = text[::k]
    for j in range(len(sample) - 1):
        c = sample[j]
        if c == sample[j + 1] and not c.isspace():
            pos = text.find(c * (max_run + 1), max(0, j * k - max_run), (j + 1) * k + max_run + 1)
            if pos >= 0:
                m = re.compile(re.escape(c) + "+").match(text, pos)
                assert m is not None
                return c, len(m.group())
    return None


def _most_common_char(text: str) -> tuple[str, int]:
    """The most frequent non-whitespace character and its exact count.

    Counting every character of every document is a large share of a fast chain, so the
    candidates come from ~500 evenly spread characters (two coprime strides, so that a
    periodic text cannot hide its dominant character from both) and only they are counted
    exactly. A character holding more than half the text is always among them in practice;
    a document is never dropped on a sampled count."""
    k = len(text) // 256 + 1
    sample = Counter(text[::k])
    if k > 1:
        sample.update(text[k // 2 :: k + 1])
    best, best_count = "", 0
    for c, _ in sample.most_common(4):
        if c.isspace():
            continue
        count = text.count(c)
        if count > best_count:
            best, best_count = c, count
    return best, best_count


class LengthParams(RuleParams):
    # Sizes in characters of the stripped text. min_chars=1 drops empty and
    # whitespace-only documents. max_chars=1,000,000 sits above Gopher's 100,000-word cap
    # (~600k characters of English) and far below ingest's 16 MiB quarantine: larger
    # "documents" are dumps, logs or data, and one of them can dominate a shard.
    min_chars: Size | None = Field(
        default=1,
        description=(
            "Fewest characters of the stripped text (1 drops empty and whitespace-only documents)."
        ),
    )
    max_chars: Size | None = Field(default=1_000_000, description="Most characters.")
    min_words: Size | None = Field(
        default=None, description=("Fewest whitespace-separated words; off by default.")
    )

    @model_validator(mode="after")
    def _ordered(self) -> LengthParams:
        lo, hi = self.min_chars, self.max_chars
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_chars={lo} > max_chars={hi}")
        return self


class Length(Rule[LengthParams]):
    """Drops documents outside the configured size bounds."""

    name = "length"
    Params = LengthParams

    def apply(self, doc: Doc) -> Verdict:
        p = self.params
        n = len(doc.text.strip())
        doc.stats["length.chars"] = n
        if p.min_chars is not None and n < p.min_chars:
            return Drop("min_chars", f"chars={n} < {p.min_chars}")
        if p.max_chars is not None and n > p.max_chars:
            return Drop("max_chars", f"chars={n} > {p.max_chars}")
        if p.min_words is not None:
            n_words = len(doc.text.split())
            if n_words < p.min_words:
                return Drop("min_words", f"words={n_words} < {p.min_words}")
        return None
