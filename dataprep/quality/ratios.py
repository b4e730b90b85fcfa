"""`char_ratios`: upper bounds on the share of digits, punctuation, whitespace, brackets and
other non-alphanumeric characters, for tables of numbers, symbol soup and layout debris."""

from __future__ import annotations

import re
import unicodedata

from pydantic import Field, model_validator

from dataprep.quality.base import Drop, Fraction, Rule, RuleParams, Verdict, fmt
from dataprep.quality.text import Doc


def _category_class(prefix: str) -> str:
    """A regex character class of every code point whose Unicode category starts with
    `prefix` (`re` has no `\\p{P}`). The Basic Multilingual Plane holds all but a few
    historic scripts' punctuation and takes milliseconds to scan once at import."""
    ranges: list[tuple[int, int]] = []
    for cp in range(0x10000):
        if unicodedata.category(chr(cp)).startswith(prefix):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return "".join(
        re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
        for a, b in ranges
    )


# What each ratio counts; every share is over all characters of the document.
CLASSES = {
    "digit": re.compile(r"\d+"),  # Unicode decimal digits
    "punct": re.compile(f"[{_category_class('P')}]+"),  # Unicode punctuation, brackets too
    "whitespace": re.compile(r"\s+"),
    "bracket": re.compile(r"[()\[\]{}]+"),
    "non_alnum": re.compile(r"(?:[^\w\s]|_)+"),  # neither letter/digit nor whitespace
}


class CharRatiosParams(RuleParams):
    # No paper fixes these for general text, so every bound is off until set (None = off).
    max_digit_frac: Fraction | None = Field(default=None, description="Digits.")
    max_punct_frac: Fraction | None = Field(default=None, description=("Unicode punctuation."))
    max_whitespace_frac: Fraction | None = Field(default=None, description="Whitespace.")
    max_bracket_frac: Fraction | None = Field(default=None, description="`()[]{}`.")
    max_non_alnum_frac: Fraction | None = Field(
        default=None, description=("Characters that are neither letter, digit nor whitespace.")
    )

    @model_validator(mode="after")
    def _some_bound(self) -> CharRatiosParams:
        if all(getattr(self, k) is None for k in type(self).model_fields):
            raise ValueError(f"set at least one of {', '.join(type(self).model_fields)}")
        return self


class CharRatios(Rule[CharRatiosParams]):
    """Drops a document when one class of characters takes more than its allowed share;
    the check names the ratio, e.g. `char_ratios:max_digit_frac`."""

    name = "char_ratios"
    Params = CharRatiosParams

    def setup(self) -> None:
        p = self.params
        self._bounds = [
            (f"max_{kind}_frac", kind, regex, getattr(p, f"max_{kind}_frac"))
            for kind, regex in CLASSES.items()
            if getattr(p, f"max_{kind}_frac") is not None
        ]

    def apply(self, doc: Doc) -> Verdict:
        text = doc.text
        if not text:
            return None
        for check, kind, regex, bound in self._bounds:
            frac = (len(text) - len(regex.sub("", text))) / len(text)
            if frac > bound:
                return Drop(check, f"{kind} chars={fmt(frac)} > {bound}")
        return None
