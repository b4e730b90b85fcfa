"""Words where whitespace does not separate them: Chinese, Japanese, Thai, Lao, Khmer,
Burmese, Tibetan. ICU's word break iterator (dictionary-based for these scripts, the
segmentation browsers and CLDR use) cuts them into words, through PyICU with ICU bundled
in its wheel (pyicu-wheels), so it runs offline and needs no system library. One library
for all of them, where datatrove picks a tokenizer per language (spaCy's jieba/sudachi
back-ends, pythainlp).

Which documents: those the `language` rule labelled with one of these languages, or,
with no label, those whose letters are at least `SCRIPT_SHARE` in one of these scripts.
Every other document keeps its tokenizer (spaCy's English rules, or the regex for other
labelled languages), so nothing changes for space-separated text."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

# Language codes (fastText lid.176's, ISO 639-1 where one exists) whose script writes no
# spaces between words.
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "km", "my", "bo", "wuu", "yue"})
# The share of a document's letters in a no-space script above which it is segmented
# when no language is known. Japanese or Chinese text quoting English stays above it; an
# English page with a few CJK names stays below.
SCRIPT_SHARE = 0.3
_SAMPLE = 2000  # characters looked at to tell the script
# The scripts written without spaces: code-point ranges and the language (or "han":
# Chinese unless kana come with it) each says; the pre-check regex is made from them.
_SCRIPTS: tuple[tuple[int, int, str], ...] = (
    (0x3040, 0x30FF, "ja"),
    (0x31F0, 0x31FF, "ja"),
    (0xFF66, 0xFF9D, "ja"),  # kana
    (0x4E00, 0x9FFF, "han"),
    (0x3400, 0x4DBF, "han"),
    (0x20000, 0x2FA1F, "han"),
    (0xF900, 0xFAFF, "han"),
    (0x0E00, 0x0E7F, "th"),
    (0x0E80, 0x0EFF, "lo"),
    (0x1780, 0x17FF, "km"),
    (0x1000, 0x109F, "my"),
    (0x0F00, 0x0FFF, "bo"),
)
_ANY_NO_SPACE = re.compile("[" + "".join(f"{chr(a)}-{chr(b)}" for a, b, _ in _SCRIPTS) + "]")
# A sentence ends at a run of terminal punctuation (full-width or not) and any closing
# quotes or brackets, where more text follows; no space needs to follow, as none does in
# these scripts. Thai marks sentences with spaces only, which this does not see.
_SENTENCE_END = re.compile(r"[。！？!?．…]+[」』”’）)\]\"']*(?=\s*\S)")


def _script_of(ch: str) -> str | None:
    o = ord(ch)
    for lo, hi, script in _SCRIPTS:
        if lo <= o <= hi:
            return script
    return None


def script_language(text: str) -> str | None:
    """The no-space language a document's script says it is in, or None: Han with kana is
    Japanese, Han alone Chinese."""
    if _ANY_NO_SPACE.search(text, 0, _SAMPLE) is None:  # the common case, at C speed
        return None
    counts: dict[str, int] = {}
    letters = 0
    for ch in text[:_SAMPLE]:
        if not ch.isalpha():
            continue
        letters += 1
        s = _script_of(ch)
        if s is not None:
            counts[s] = counts.get(s, 0) + 1
    if not letters or sum(counts.values()) < SCRIPT_SHARE * letters:
        return None
    if counts.get("ja"):
        return "ja"
    best = max(counts, key=counts.__getitem__)
    return "zh" if best == "han" else best


def base_language(code: str) -> str:
    """A language label's language part, as lid.176 writes it: "zh-Hant", "zh_TW" and
    FineWeb-2's "cmn_Hani" are "zh"."""
    base = code.replace("_", "-").split("-")[0].lower()
    return _ISO3.get(base, base)


_ISO3 = {"cmn": "zh", "jpn": "ja", "tha": "th", "lao": "lo", "khm": "km", "mya": "my", "bod": "bo"}


@lru_cache(maxsize=16)
def _iterator(lang: str) -> Any:
    import icu  # pyicu-wheels: imported only when a document needs it

    return icu.BreakIterator.createWordInstance(icu.Locale(lang))


def words(text: str, lang: str) -> list[str]:
    """ICU's word segments of `text` that are not whitespace: words, numbers and
    punctuation tokens, as the English tokenizer also returns punctuation (Gopher counts
    symbol tokens in its ratios, not as words)."""
    it = _iterator(lang)
    it.setText(text)
    out = []
    start = it.first()
    for end in it:
        seg = text[start:end]
        start = end
        if not seg.isspace():
            out.append(seg)
    return out


def count_sentences(text: str) -> int:
    """Sentences in one line of text in these scripts: one, plus a sentence end that
    more text follows; 0 for blank text."""
    return 1 + len(_SENTENCE_END.findall(text)) if text.strip() else 0
