"""FineWeb's line-based rules (Penedo et al. 2024, "The FineWeb Datasets: Decanting the Web
for the Finest Text Data at Scale"), counted as datatrove's FineWebQualityFilter."""

from __future__ import annotations

from pydantic import Field

from dataprep.quality.base import Drop, Fraction, Rule, RuleParams, Verdict, fmt
from dataprep.quality.text import Doc, dup_count_and_chars

# Code points with the Unicode Sentence_Terminal property, as inclusive ranges; this is the
# set datatrove uses as FineWeb's `stop_chars` (TERMINAL_PUNCTUATION, 159 characters).
_STERM_RANGES = (
    (0x21, 0x21), (0x2E, 0x2E), (0x3F, 0x3F), (0x589, 0x589), (0x61D, 0x61F),
    (0x6D4, 0x6D4), (0x700, 0x702), (0x7F9, 0x7F9), (0x837, 0x837), (0x839, 0x839),
    (0x83D, 0x83E), (0x964, 0x965), (0x104A, 0x104B), (0x1362, 0x1362), (0x1367, 0x1368),
    (0x166E, 0x166E), (0x1735, 0x1736), (0x17D4, 0x17D6), (0x17D9, 0x17DA), (0x1803, 0x1803),
    (0x1809, 0x1809), (0x1944, 0x1945), (0x1AA8, 0x1AAB), (0x1B5A, 0x1B5B), (0x1B5E, 0x1B5F),
    (0x1B7D, 0x1B7E), (0x1C3B, 0x1C3C), (0x1C7E, 0x1C7F), (0x203C, 0x203D), (0x2047, 0x2049),
    (0x2E2E, 0x2E2E), (0x2E3C, 0x2E3C), (0x2E53, 0x2E54), (0x3002, 0x3002), (0xA4FF, 0xA4FF),
    (0xA60E, 0xA60F), (0xA6F3, 0xA6F3), (0xA6F7, 0xA6F7), (0xA876, 0xA877), (0xA8CE, 0xA8CF),
    (0xA92F, 0xA92F), (0xA9C8, 0xA9C9), (0xAA5D, 0xAA5F), (0xAAF0, 0xAAF1), (0xABEB, 0xABEB),
    (0xFE52, 0xFE52), (0xFE56, 0xFE57), (0xFF01, 0xFF01), (0xFF0E, 0xFF0E), (0xFF1F, 0xFF1F),
    (0xFF61, 0xFF61), (0x10A56, 0x10A57), (0x10F55, 0x10F59), (0x10F86, 0x10F89),
    (0x11047, 0x11048), (0x110BE, 0x110C1), (0x11141, 0x11143), (0x111C5, 0x111C6),
    (0x111CD, 0x111CD), (0x111DE, 0x111DF), (0x11238, 0x11239), (0x1123B, 0x1123C),
    (0x112A9, 0x112A9), (0x1144B, 0x1144C), (0x115C2, 0x115C3), (0x115C9, 0x115D7),
    (0x11641, 0x11642), (0x1173C, 0x1173E), (0x11944, 0x11944), (0x11946, 0x11946),
    (0x11A42, 0x11A43), (0x11A9B, 0x11A9C), (0x11C41, 0x11C42), (0x11EF7, 0x11EF8),
    (0x11F43, 0x11F44), (0x16A6E, 0x16A6F), (0x16AF5, 0x16AF5), (0x16B37, 0x16B38),
    (0x16B44, 0x16B44), (0x16E98, 0x16E98), (0x1BC9F, 0x1BC9F), (0x1DA88, 0x1DA88),
)  # fmt: skip
TERMINAL_PUNCTUATION = frozenset(chr(c) for a, b in _STERM_RANGES for c in range(a, b + 1))


class FineWebParams(RuleParams):
    # Defaults are datatrove 0.10's FineWebQualityFilter defaults, the code FineWeb was
    # built with (Penedo et al. 2024, section 3, "custom filters"). Lines are the
    # non-blank "\n"-separated lines; None switches a check off.
    line_punct_thr: Fraction | None = Field(
        default=0.12, description=("Least fraction of lines ending in terminal punctuation.")
    )
    line_punct_exclude_zero: bool = Field(
        default=False, description=("true: a page with no such line is not dropped.")
    )
    short_line_thr: Fraction | None = Field(
        default=0.67, description=("Most fraction of lines of <= short_line_length characters.")
    )
    short_line_length: int = Field(
        default=30, ge=0, description=("What a short line is, in characters.")
    )
    char_duplicates_ratio: Fraction | None = Field(
        default=0.01, description=("Most fraction of characters in repeated lines.")
    )
    new_line_ratio: float | None = Field(default=0.3, ge=0, description=("Most newlines per word."))


class FineWeb(Rule[FineWebParams]):
    """Drops list-like, menu-like and boilerplate-heavy pages by their line statistics."""

    name = "fineweb"
    Params = FineWebParams

    def apply(self, doc: Doc) -> Verdict:
        p = self.params
        text = doc.text
        lines = [line for line in text.split("\n") if line.strip()]
        if not lines:
            return Drop("empty", "no non-blank line")
        n = len(lines)
        stats = doc.stats

        if p.line_punct_thr is not None:
            n_punct = sum(1 for line in lines if line[-1] in TERMINAL_PUNCTUATION)
            ratio = n_punct / n
            stats["fineweb.line_punct_ratio"] = ratio
            if ratio < p.line_punct_thr and not (ratio == 0 and p.line_punct_exclude_zero):
                return Drop(
                    "line_punct_thr",
                    f"lines ending in punctuation={n_punct}/{n} < {p.line_punct_thr}",
                )

        if p.short_line_thr is not None:
            n_short = sum(1 for line in lines if len(line) <= p.short_line_length)
            if n_short / n > p.short_line_thr:
                return Drop("short_line_thr", f"short lines={n_short}/{n} > {p.short_line_thr}")

        n_newlines = text.count("\n")
        if p.char_duplicates_ratio is not None:
            ratio = dup_count_and_chars(lines)[1] / (len(text) - n_newlines)
            stats["fineweb.char_duplicates_ratio"] = ratio
            if ratio > p.char_duplicates_ratio:
                return Drop(
                    "char_duplicates_ratio",
                    f"chars in repeated lines={fmt(ratio)} > {p.char_duplicates_ratio}",
                )

        if p.new_line_ratio is not None and n_newlines:
            # Each whitespace-separated chunk holds at least one word, so the chunk count
            # can clear a document without splitting words (C4's cleaned text is new).
            n_words = len(doc.words) if doc.has_words else len(text.split())
            if n_newlines / n_words > p.new_line_ratio:
                n_words = len(doc.words)
            ratio = n_newlines / n_words  # a non-blank line holds at least one word
            if ratio > p.new_line_ratio:
                return Drop(
                    "new_line_ratio", f"newlines per word={fmt(ratio)} > {p.new_line_ratio}"
                )
        return None
