"""spaCy's English tokenizer and sentencizer (`spacy.blank("en")` with the `sentencizer`
pipe, what datatrove counts words and sentences with) in plain Python, over spaCy's own
rules (spacy_en_rules.py), so the Gopher, C4 and FineWeb thresholds meet the splits they
were set on without spaCy installed.

The algorithm is spaCy's `Tokenizer` (spacy/tokenizer.pyx, 3.8): split on whitespace;
a chunk that is a special case ("U.S.", "don't", ":)") becomes its tokens; otherwise
prefixes and suffixes are peeled off one at a time, stopping early at a special case,
what remains is one token if it is a URL, else it is cut at the infixes; last, token runs
that spell a special case containing affixes are merged back. Each chunk's tokens are
cached, as spaCy caches them, which makes the whole ~5x faster than spaCy."""

from __future__ import annotations

import re
import sys
import unicodedata
from itertools import chain

from dataprep.quality.spacy_en_rules import (
    INFIX,
    PREFIX,
    SENTENCE_PUNCT,
    SPLIT,
    SUFFIX,
    URL,
    WHOLE,
)

_prefix = re.compile(PREFIX).search
_suffix = re.compile(SUFFIX).search
_infixes = re.compile(INFIX).finditer
_url = re.compile(URL).match

SPECIAL: dict[str, tuple[str, ...]] = {**{w: (w,) for w in WHOLE}, **SPLIT}


def _affix_len(m: re.Match[str] | None) -> int:
    return m.end() - m.start() if m is not None else 0


def _split(chunk: str, special: dict[str, tuple[str, ...]]) -> list[str]:
    """spaCy's `_split_affixes` + `_attach_tokens` for one chunk (no whitespace in it)."""
    prefixes: list[str] = []
    suffixes: list[str] = []
    string = chunk
    last = -1
    while string and len(string) != last:
        if string in special:
            break
        last = len(string)
        pre_len = _affix_len(_prefix(string))
        if pre_len:
            prefix, minus_pre = string[:pre_len], string[pre_len:]
            if minus_pre in special:
                string = minus_pre
                prefixes.append(prefix)
                break
        suf_len = _affix_len(_suffix(string[pre_len:]))
        if suf_len:
            # spaCy takes the suffix from the whole string, prefix included
            suffix, minus_suf = string[-suf_len:], string[:-suf_len]
            if minus_suf in special:
                string = minus_suf
                suffixes.append(suffix)
                break
        if pre_len and suf_len and pre_len + suf_len <= len(string):
            string = string[pre_len:-suf_len]
            prefixes.append(prefix)
            suffixes.append(suffix)
        elif pre_len:
            string = minus_pre
            prefixes.append(prefix)
        elif suf_len:
            string = minus_suf
            suffixes.append(suffix)
    tokens = prefixes
    if string:
        if string in special:
            tokens.extend(special[string])
        elif _url(string):
            tokens.append(string)
        else:
            start = 0
            for m in _infixes(string):
                a, b = m.start(), m.end()
                if a == 0:  # an infix at the very start is no split
                    continue
                if a != start:
                    tokens.append(string[start:a])
                if a != b:
                    tokens.append(string[a:b])
                start = b
            if string[start:]:
                tokens.append(string[start:])
    tokens.extend(reversed(suffixes))
    return tokens


def _affix_specials() -> dict[str, list[tuple[tuple[str, ...], str]]]:
    """The special cases that spaCy's PhraseMatcher looks for after affix splitting (those
    that a prefix, suffix or infix pattern would cut: "C++", ":-)", "a.m."), as the token
    runs that affix splitting without special cases makes of them, by first token."""
    out: dict[str, list[tuple[tuple[str, ...], str]]] = {}
    for s in SPECIAL:
        if _affix_len(_prefix(s)) or _affix_len(_suffix(s)) or next(_infixes(s), None):
            run = tuple(_split(s, {}))
            out.setdefault(run[0], []).append((run, s))
    return out


_MATCHER = _affix_specials()


def _select(found: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """spaCy's `_filter_special_spans`: matches in order of length, longest first, then of
    start; one is kept when neither its first nor its last token is in a match looked at
    before (kept or not), so whether a match is kept depends only on the matches before
    it. Returns the kept ones by start."""
    found.sort(key=lambda f: (f[0] - f[1], f[0]))
    seen: set[int] = set()
    keep = []
    for a, b, s in found:
        if a not in seen and b - 1 not in seen:
            keep.append((a, b, s))
        seen.update(range(a, b))
    keep.sort()
    return keep


def _find(tokens: list[str]) -> list[tuple[int, int, str]]:
    """The runs of `tokens` that spell a special case containing affixes (spaCy's
    PhraseMatcher over the affix-split tokens), as (start, end, special case)."""
    found = []
    for i, t in enumerate(tokens):
        for run, s in _MATCHER.get(t, ()):
            n = len(run)
            if tuple(tokens[i : i + n]) == run:
                found.append((i, i + n, s))
    return found


def _merge_specials(tokens: list[str]) -> list[str]:
    """spaCy's `_apply_special_cases` within one chunk: the kept runs are replaced by their
    special case's tokens."""
    found = _find(tokens)
    if not found:
        return tokens
    out: list[str] = []
    i = 0
    for a, b, s in _select(found):
        out.extend(tokens[i:a])
        out.extend(SPECIAL[s])
        i = b
    out.extend(tokens[i:])
    return out


def affix_tokens(chunk: str) -> list[str]:
    """The tokens of one whitespace-free chunk before special cases are merged back
    (spaCy's `_tokenize_affixes`)."""
    return list(SPECIAL[chunk]) if chunk in SPECIAL else _split(chunk, SPECIAL)


def chunk_tokens(chunk: str) -> list[str]:
    """The tokens of one whitespace-free chunk alone, uncached."""
    return _merge_specials(affix_tokens(chunk))


# chunk -> its tokens. Web text repeats most chunks, so almost every lookup hits. Two
# generations bound it (~60 MB per process at most): when the current one is full it
# becomes the old one, and a chunk found only there moves back, so the chunks in use stay
# cached across the switch (emptying it whole cost 10% of the quality chain over 100k
# documents: the common words were computed again after every clear).
_CACHE: dict[str, list[str]] = {}
_OLD: dict[str, list[str]] = {}
CACHE_MAX = 200_000


def _remember(chunk: str, tokens: list[str]) -> None:
    global _CACHE, _OLD
    if len(_CACHE) >= CACHE_MAX:
        _OLD, _CACHE = _CACHE, {}
    _CACHE[chunk] = tokens


# Chunks whose tokens a merged special case changes ("right):" -> "right" ")" ":" ->
# "right" "):"), by their tokens before the merge. spaCy matches special cases over the
# whole text, where a run across a single space (") :" in "x) :)") spells no special
# case but still takes its tokens from later, shorter runs; so a text with such a chunk
# is tokenised as a whole (`doc_tokens`). Seen in ~5% of web documents.
_MERGED: dict[str, list[str]] = {}


def _tokens_of(chunk: str) -> list[str] | None:
    """The cached tokens of `chunk`, or None when the chunk's tokens depend on its
    neighbours (see _MERGED)."""
    if chunk in _MERGED:
        return None
    old = _OLD.get(chunk)
    if old is not None:
        _remember(chunk, old)
        return old
    if chunk.isalpha() and chunk not in SPECIAL:
        # Letters only (60% of the new chunks of web text): no prefix, suffix or infix rule
        # matches such a chunk (each needs a symbol, digit, apostrophe or period;
        # tests/unit/dataprep/quality/test_spacy_en.py checks it against the full path), so
        # it is one token.
        tokens = [chunk]
        _remember(chunk, tokens)
        return tokens
    pre = affix_tokens(chunk)
    tokens = _merge_specials(pre)
    if tokens != pre:
        if len(_MERGED) >= CACHE_MAX:
            _MERGED.clear()
        _MERGED[chunk] = pre
        return None
    _remember(chunk, tokens)
    return tokens


def _pre_tokens(chunk: str) -> list[str]:
    """The tokens of `chunk` before special cases are merged back, cached."""
    tokens = _CACHE.get(chunk) or _tokens_of(chunk)  # unmerged: the same
    return tokens if tokens is not None else _MERGED.get(chunk) or affix_tokens(chunk)


# A whitespace run and the chunk after it.
_RUNS = re.compile(r"(\s*)(\S+)")
# The most tokens a special case's run has ("(╯°□°）╯︵┻━┻": 11).
_RUN_MAX = max(len(run) for runs in _MATCHER.values() for run, _ in runs)


def doc_tokens(text: str) -> list[str]:
    """spaCy's tokens of `text`, whitespace tokens included: a whitespace run is a token
    less the single " " that ends the token before it (at the very start the whole run
    is one), and special cases are matched over the whole text."""
    tokens: list[str] = []
    owner: list[int] = []  # the chunk each token comes from; -1 for whitespace
    for k, m in enumerate(_RUNS.finditer(text)):
        space, chunk = m.groups()
        if space and k and space[0] == " ":
            space = space[1:]
        if space:
            tokens.append(space)
            owner.append(-1)
        pre = _pre_tokens(chunk)
        tokens.extend(pre)
        owner.extend([k] * len(pre))
    tail = text[len(text.rstrip()) :] if text.strip() else text
    if tail and text.strip() and tail[0] == " ":
        tail = tail[1:]
    if tail:
        tokens.append(tail)
        owner.append(-1)
    found = _find(tokens)
    if not found:
        return tokens
    out: list[str] = []
    i = 0
    for a, b, s in _select(found):
        if owner[a] != owner[b - 1] or owner[a] < 0:
            continue  # across whitespace: no special case is spelt, the tokens stay
        out.extend(tokens[i:a])
        out.extend(SPECIAL[s])
        i = b
    out.extend(tokens[i:])
    return out


def _in_context(pre: list[list[str]], pairs: list[tuple[str, str]], k: int) -> list[str]:
    """The tokens of chunk k (a _MERGED one) as spaCy's matching over the whole text makes
    them. `pre` holds every chunk's tokens before merging, `pairs` the whitespace before
    each chunk. A run that could take one of chunk k's tokens lies within _RUN_MAX - 1
    tokens of it, behind single spaces only (other whitespace is a token, which no run
    crosses), and whether a run is kept depends only on runs that share a token with it;
    so matching over that window decides chunk k as matching over the text would."""
    j = k
    left: list[str] = []
    while j > 0 and pairs[j][0] == " " and len(left) < _RUN_MAX - 1:
        j -= 1
        left = pre[j] + left
    right: list[str] = []
    j = k
    while j + 1 < len(pre) and pairs[j + 1][0] == " " and len(right) < _RUN_MAX - 1:
        j += 1
        right += pre[j]
    tokens = left + pre[k] + right
    start, end = len(left), len(left) + len(pre[k])
    out: list[str] = []
    i = start
    for a, b, s in _select(_find(tokens)):
        if a >= start and b <= end:  # runs across a space spell no special case
            out.extend(tokens[i:a])
            out.extend(SPECIAL[s])
            i = b
    out.extend(tokens[i:end])
    return out


def tokenize(text: str) -> list[str]:
    """datatrove's English `split_into_words`: spaCy's tokens without whitespace tokens."""
    chunks = text.split()
    parts = list(map(_CACHE.get, chunks))  # one C-level pass when every chunk is cached
    if None in parts:
        merged = []
        for i, tokens in enumerate(parts):
            if tokens is None:
                tokens = _tokens_of(chunks[i])
                if tokens is None:
                    merged.append(i)
                else:
                    parts[i] = tokens
        if merged:
            pre = [
                p if p is not None else _pre_tokens(c) for p, c in zip(parts, chunks, strict=True)
            ]
            pairs = _RUNS.findall(text)
            for k in merged:
                parts[k] = _in_context(pre, pairs, k)
    return list(chain.from_iterable(parts))  # type: ignore[arg-type]


# Every punctuation character (Unicode category P*): spaCy's `is_punct` is true for a
# token made only of these.
_PUNCT = "".join(
    c for c in map(chr, range(sys.maxunicode + 1)) if unicodedata.category(c)[0] == "P"
)


def sentencize(tokens: list[str]) -> int:
    """The number of sentences spaCy's sentencizer makes of `tokens` (spaCy's tokens,
    whitespace tokens included): one starts at the first token and at every token that
    is not punctuation after a token that is one of the sentence-final characters."""
    n = 1 if tokens else 0
    seen_end = False
    for t in tokens:
        if t in SENTENCE_PUNCT:
            seen_end = True
        elif seen_end and t.strip(_PUNCT):
            n += 1
            seen_end = False
    return n


# What a chunk means to the sentencizer: its tokens as classes, "P" (a sentence-final
# character), "W" (not punctuation) or nothing (other punctuation), repeats merged ("Hi!"
# -> "WP", "...)" -> "", "end.”" -> "WP"). Over a whole text the sentencizer starts a
# sentence at the first token and at every "PW", so the count is 1 + "PW"s in the joined
# classes (joining keeps the count: "WP" + "PW" = "WPPW" has one). Whitespace runs share
# the table: a single " " belongs to the token before it, any other run is a "W" token.
_CLASSES: dict[str, str] = {"": "", " ": ""}
# Whitespace runs, kept by re.split.
_SPACE = re.compile(r"(\s+)")


def _classes_of(piece: str) -> str | None:
    """The classes of a chunk or whitespace run, cached; None for a _MERGED chunk, whose
    tokens depend on its neighbours."""
    if piece.isspace():
        return "W"  # not " ", which is in the table
    tokens = _CACHE.get(piece) or _tokens_of(piece)
    if tokens is None:
        return None
    out = ""
    for t in tokens:
        c = "P" if t in SENTENCE_PUNCT else "W" if t.strip(_PUNCT) else ""
        if c and not out.endswith(c):
            out += c
    if len(_CLASSES) >= CACHE_MAX:
        _CLASSES.clear()
        _CLASSES.update({"": "", " ": ""})
    _CLASSES[piece] = out
    return out


def count_sentences(text: str) -> int:
    """How many sentences spaCy's sentencizer finds in `text` (datatrove's
    `len(split_into_sentences(text))` for English): a sentence starts at the first token
    and at each token that is not punctuation after a token that is exactly one of the
    sentence-final characters. Whitespace other than the one space after a token is a
    token too (so a line "end. \t )" has two sentences). 0 for empty text."""
    if not text:
        return 0
    # Only single spaces as whitespace (the common line): str.split does; else the runs
    # are kept, each looked up like a chunk.
    simple = text.isprintable() and "  " not in text
    pieces = text.split(" ") if simple else _SPACE.split(text)
    classes = list(map(_CLASSES.get, pieces))
    if None in classes:
        for i, c in enumerate(classes):
            if c is None:
                c = classes[i] = _classes_of(pieces[i])
                if c is None:
                    return sentencize(doc_tokens(text))
    return 1 + "".join(classes).count("PW")  # type: ignore[arg-type]
