"""C4's line cleaning and page rules (Raffel et al. 2020, "Exploring the Limits of Transfer
Learning with a Unified Text-to-Text Transformer", section 2.2), as datatrove's
C4QualityFilter and the original TFDS c4_utils implement them."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

from dataprep.quality.base import Drop, Rule, RuleParams, Verdict
from dataprep.quality.text import Doc

CITATION_RE = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
END_PUNCTUATION = (".", "?", "!", '"', "'")
POLICY_SUBSTRINGS = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)

Limit = Annotated[int, Field(ge=1)]


class C4Params(RuleParams):
    # Defaults are C4's (section 2.2 and TFDS c4_utils) and equal datatrove 0.10's
    # C4QualityFilter defaults; datatrove's -1 ("disabled") is None here.
    remove_citations: bool = Field(
        default=True, description=('Remove Wikipedia-style "[1]", "[edit]", "[citation needed]".')
    )
    filter_no_terminal_punct: bool = Field(
        default=True, description=("Keep only lines ending in . ? ! \" '.")
    )
    min_num_sentences: Limit | None = Field(
        default=5, description=("After line removal; fewer drops the page.")
    )
    min_words_per_line: Limit | None = Field(
        default=3, description=("A line with fewer words is removed.")
    )
    max_word_length: Limit | None = Field(
        default=1000, description=("A line with a longer word is removed.")
    )
    filter_lorem_ipsum: bool = Field(default=True, description=('"lorem ipsum" drops the page.'))
    filter_javascript: bool = Field(
        default=True, description=("A line mentioning javascript is removed.")
    )
    filter_curly_bracket: bool = Field(
        default=True, description=("A '{' drops the page ('{' marks code).")
    )
    filter_policy: bool = Field(
        default=True, description=("Cookie / privacy / terms-of-use lines are removed.")
    )


class C4(Rule[C4Params]):
    """Removes lines that are not prose and returns the cleaned text; drops the page when
    it has 'lorem ipsum' or '{' on a kept line, or too few sentences (or nothing) remain.
    As in C4, the page-level tests see only lines that survived the line tests before
    them, so a '{' on a line without end punctuation is removed with its line."""

    name = "c4"
    Params = C4Params

    def apply(self, doc: Doc) -> Verdict:
        p = self.params
        max_len = p.max_word_length
        min_words = p.min_words_per_line or 0
        num_sentences = 0
        kept: list[str] = []
        for raw in doc.lines:
            line = raw.strip()
            words = line.split()
            # A line no longer than the limit cannot hold a longer word; skip the scan.
            if max_len is not None and len(line) > max_len and any(len(w) > max_len for w in words):
                continue
            if p.remove_citations and "[" in line:
                line = CITATION_RE.sub("", line)
            if p.filter_no_terminal_punct and (
                not line.endswith(END_PUNCTUATION) or line.endswith("...")
            ):
                continue
            # Words are counted before citation removal, as datatrove does.
            if len(words) < min_words:
                continue
            lower = line.lower()
            if p.filter_lorem_ipsum and "lorem ipsum" in lower:
                return Drop("lorem_ipsum", f"'lorem ipsum' in line {line[:60]!r}")
            if p.filter_javascript and "javascript" in lower:
                continue
            if p.filter_curly_bracket and "{" in line:
                return Drop("curly_bracket", f"'{{' in line {line[:60]!r}")
            if p.filter_policy and any(s in lower for s in POLICY_SUBSTRINGS):
                continue
            if p.min_num_sentences is not None:
                # spaCy's sentencizer on the line, as datatrove (Doc.count_sentences)
                num_sentences += doc.count_sentences(line)
            kept.append(line)
        if p.min_num_sentences is not None and num_sentences < p.min_num_sentences:
            return Drop(
                "min_num_sentences",
                f"sentences={num_sentences} in {len(kept)} kept lines < {p.min_num_sentences}",
            )
        cleaned = "\n".join(kept).strip()
        doc.stats["c4.lines_removed"] = len(doc.lines) - len(kept)
        doc.stats["c4.sentences"] = num_sentences
        if not cleaned:
            return Drop("empty", "no line survived cleaning")
        return None if cleaned == doc.text else cleaned
