"""The web quality chain through the native kernel (native/quality.cpp): the kernel
measures every document of a text column in one pass; this module turns its integer
counters into the decisions, drop reasons, details and statistics that the Python rules
(the reference: gopher.py, c4.py, fineweb.py, simple.py) give, checks in the same order,
ratios by the same integer-over-integer divisions.

A chain runs natively only when every rule is one of NATIVE_RULES and English text is
split by spaCy's rules (text.use_english_splitter); a document the kernel declines
(`fallback`: a chunk whose tokens depend on its neighbours, a script written without
spaces, U+0130 or U+212A) goes through the Python rules. The tests hold the two paths to
the same outcome on every shared corpus and on random text.
"""

from __future__ import annotations

import json
import sys
import threading
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import pyarrow as pa

from dataprep import native
from dataprep.quality import spacy_en, text
from dataprep.quality.base import Rule, fmt
from dataprep.quality.c4 import C4
from dataprep.quality.fineweb import TERMINAL_PUNCTUATION, FineWeb
from dataprep.quality.gopher import GopherQuality, GopherRepetition
from dataprep.quality.segment import _SCRIPTS
from dataprep.quality.simple import CharRepetition, Length

NATIVE_RULES: dict[str, type] = {
    "char_repetition": CharRepetition,
    "length": Length,
    "gopher_quality": GopherQuality,
    "gopher_repetition": GopherRepetition,
    "c4": C4,
    "fineweb": FineWeb,
}
# Distinct chunks the kernel remembers per process (~120 bytes each with their tokens and
# table slots: ~120 MB per worker at most); a full cache starts over.
CACHE_MAX = 1_000_000


@cache
def _tables() -> dict[str, list[int]]:
    """The Unicode sets the kernel needs, from this Python's own Unicode data."""
    cps = range(sys.maxunicode + 1)
    return {
        "space": [c for c in cps if chr(c).isspace()],
        "decimal": [c for c in cps if unicodedata.category(chr(c)) == "Nd"],
        "terminal": sorted(map(ord, TERMINAL_PUNCTUATION)),
        "no_space": [c for a, b, _ in _SCRIPTS for c in range(a, b + 1)],
    }


def _flags(token: str) -> int:
    """A token's properties as the kernel's TokenFlag bits (native/quality_text.h)."""
    alpha = token.isalpha()
    content = alpha or bool(token.strip(text.SYMBOLS))
    has_alpha = alpha or text.HAS_ALPHA.search(token) is not None
    # The sentencizer's view (spacy_en.sentencize): a sentence-final token, or one made
    # only of punctuation.
    final = token in spacy_en.SENTENCE_PUNCT
    punct_only = not token.strip(spacy_en._PUNCT)
    return (
        int(alpha)
        | int(content) << 1
        | int(has_alpha) << 2
        | int(final) << 3
        | int(punct_only) << 4
    )


def _resolve(chunk: str) -> tuple[list[int], list[int], list[int], str, bool]:
    """A chunk's spaCy tokens as the kernel caches them: UTF-8 lengths, lengths, flags,
    sentencizer classes, and whether its tokens depend on its neighbours (spacy_en's
    _MERGED chunks: then the tokens are those before special cases are merged back, which
    the kernel merges in context, and the classes are unused)."""
    tokens = spacy_en._CACHE.get(chunk) or spacy_en._tokens_of(chunk)
    merged = tokens is None
    classes = ""
    if tokens is None:
        tokens = spacy_en._pre_tokens(chunk)
    else:
        cached = spacy_en._CLASSES.get(chunk)
        classes = cached if cached is not None else spacy_en._classes_of(chunk) or ""
    return (
        [len(t.encode("utf-8")) for t in tokens],
        [len(t) for t in tokens],
        [_flags(t) for t in tokens],
        classes,
        merged,
    )


def _matcher() -> list[tuple[list[str], list[int], list[int], list[int]]]:
    """spacy_en._MATCHER flattened for the kernel: each run of tokens that spells a
    special case, with the special case's own tokens (UTF-8 lengths, lengths, flags)."""
    out = []
    for runs in spacy_en._MATCHER.values():
        for run, special in runs:
            toks = spacy_en.SPECIAL[special]
            out.append(
                (
                    list(run),
                    [len(t.encode("utf-8")) for t in toks],
                    [len(t) for t in toks],
                    [_flags(t) for t in toks],
                )
            )
    return out


def supported(rules: Sequence[Rule[Any]]) -> bool:
    """Whether the kernel can run this chain (every rule ported, spaCy English words)."""
    return (
        native.module() is not None
        and bool(rules)
        and text._ENGLISH[0] == "spacy"
        and all(type(r) is NATIVE_RULES.get(r.name) for r in rules)
    )


@dataclass
class Outcomes:
    """A column's outcomes: per document, kept / dropped / left to Python, the reason and
    detail of a drop, the kept text where C4 changed it, and the statistics."""

    fallback: np.ndarray  # bool: the Python rules decide this document
    reason: list[str | None]  # "<rule>:<check>" of a dropped document
    detail: list[str]
    edited: dict[int, str]  # row -> C4's cleaned text, for kept documents it changed
    stats: dict[str, np.ndarray]  # float64, NaN where the chain did not measure it
    cache_misses: int  # chunks the Python reference tokenised for the kernel
    doc_resolves: int  # lines whose sentences it counted over their whole token run

    @property
    def kept(self) -> np.ndarray:
        return ~self.fallback & np.array([r is None for r in self.reason], dtype=bool)

    def stats_of(self, row: int) -> dict[str, float]:
        return {k: float(v[row]) for k, v in self.stats.items() if not np.isnan(v[row])}


class NativeChain:
    """One rule chain, built once and run over many columns (the chunk cache persists)."""

    def __init__(self, rules: Sequence[Rule[Any]]) -> None:
        m = native.module()
        if m is None or not supported(rules):
            raise ValueError("native quality chain: unsupported rules or no native module")
        self.rules = list(rules)
        # One run at a time: the kernel's buffers and chunk cache are the chain's own, and
        # a run calls back into Python (new chunks), where the interpreter may switch to
        # another thread running this chain (Prefect's thread task runner does).
        self._lock = threading.Lock()
        specs = [(r.name, r.params.model_dump(), f"{i}.") for i, r in enumerate(self.rules)]
        self._chain = m.QualityChain(
            _tables(),
            _resolve,
            sorted(spacy_en.SPECIAL),
            _matcher(),
            spacy_en._RUN_MAX,
            specs,
            CACHE_MAX,
        )

    def run(self, column: pa.Array | pa.ChunkedArray) -> Outcomes:
        with self._lock:
            out = self._chain.run(native.text_column(column))
        n = len(column)
        j = _Judge(n, out["fallback"].astype(bool))
        for i, rule in enumerate(self.rules):
            c = {k.split(".", 1)[1]: v for k, v in out.items() if k.startswith(f"{i}.")}
            _JUDGES[rule.name](j, rule, c, out)
        offsets, data = out["edited_offsets"], out["edited_bytes"]
        edited = {
            int(i): data[offsets[i] : offsets[i + 1]].decode("utf-8")
            for i in np.flatnonzero(out["edited"] & j.alive)
        }
        return Outcomes(
            fallback=out["fallback"].astype(bool),
            reason=j.reason,
            detail=j.detail,
            edited=edited,
            stats={k: v for k, v in j.stats.items() if not np.isnan(v[j.alive]).all()},
            cache_misses=int(out["cache_misses"]),
            doc_resolves=int(out["doc_resolves"]),
        )


_CHAINS: dict[str, NativeChain] = {}


def chain_for(rules: Sequence[Rule[Any]]) -> NativeChain | None:
    """The process's native chain for these rules (built once: its chunk cache is what
    makes it fast), or None when the kernel cannot run them."""
    if not supported(rules):
        return None
    key = json.dumps([(r.name, r.params.model_dump(mode="json")) for r in rules], sort_keys=True)
    chain = _CHAINS.get(key)
    if chain is None:
        if len(_CHAINS) >= 8:  # a process sees a handful of chains; bound it anyway
            _CHAINS.clear()
        chain = _CHAINS[key] = NativeChain(rules)
    return chain


class _Judge:
    """The documents still in the chain, and what the rules decided so far."""

    def __init__(self, n: int, fallback: np.ndarray) -> None:
        self.alive = ~fallback
        self.reason: list[str | None] = [None] * n
        self.detail = [""] * n
        self.stats: dict[str, np.ndarray] = {}
        self.n = n

    def drop(self, name: str, mask: np.ndarray, detail: Callable[[int], str]) -> None:
        hit = self.alive & mask
        for i in np.flatnonzero(hit):
            self.reason[i] = name
            self.detail[i] = detail(int(i))
        self.alive &= ~hit

    def stat(self, key: str, mask: np.ndarray, values: np.ndarray) -> None:
        col = self.stats.setdefault(key, np.full(self.n, np.nan))
        at = self.alive & mask
        col[at] = values[at]


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b as float64 (exactly Python's int / int below 2**53); 0 where b is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = a.astype(np.float64) / b.astype(np.float64)
    return np.where(b != 0, r, 0.0)


def _judge_char_repetition(j: _Judge, rule: Any, c: dict, out: dict) -> None:
    p, name = rule.params, rule.name
    if p.max_run is not None:
        run_len, run_cp = c["run_len"], c["run_cp"]
        j.drop(
            f"{name}:max_run",
            run_len > 0,
            lambda i: f"run of {run_len[i]} {chr(run_cp[i])!r} > {p.max_run}",
        )
    if p.max_char_frac is not None:
        n_chars, top, cp = c["n_chars"], c["top_count"], c["top_cp"]
        measured = (n_chars >= p.min_chars) & (n_chars > 0)
        frac = _ratio(top, n_chars)
        j.stat(f"{name}.top_char_frac", measured, frac)
        j.drop(
            f"{name}:max_char_frac",
            measured & (frac > p.max_char_frac),
            lambda i: (
                f"{chr(cp[i])!r} is {fmt(int(top[i]) / int(n_chars[i]))} of non-space chars "
                f"> {p.max_char_frac}"
            ),
        )


def _judge_length(j: _Judge, rule: Any, c: dict, out: dict) -> None:
    p, name = rule.params, rule.name
    n = c["chars"]
    j.stat(f"{name}.chars", np.ones(j.n, dtype=bool), n.astype(np.float64))
    if p.min_chars is not None:
        j.drop(f"{name}:min_chars", n < p.min_chars, lambda i: f"chars={n[i]} < {p.min_chars}")
    if p.max_chars is not None:
        j.drop(f"{name}:max_chars", n > p.max_chars, lambda i: f"chars={n[i]} > {p.max_chars}")
    if p.min_words is not None:
        w = c["words"]
        j.drop(f"{name}:min_words", w < p.min_words, lambda i: f"words={w[i]} < {p.min_words}")


def _judge_gopher_quality(j: _Judge, rule: Any, c: dict, out: dict) -> None:
    p, name = rule.params, rule.name
    every = np.ones(j.n, dtype=bool)
    content, words = c["content"], c["words"]
    j.stat(f"{name}.words", every, content.astype(np.float64))
    if p.min_doc_words is not None:
        j.drop(
            f"{name}:min_doc_words",
            content < p.min_doc_words,
            lambda i: f"words={content[i]} < {p.min_doc_words}",
        )
    if p.max_doc_words is not None:
        j.drop(
            f"{name}:max_doc_words",
            content > p.max_doc_words,
            lambda i: f"words={content[i]} > {p.max_doc_words}",
        )
    has = content > 0
    avg = _ratio(c["content_len"], content)
    j.stat(f"{name}.mean_word_length", has, avg)

    def mean(i: int) -> str:
        return fmt(int(c["content_len"][i]) / int(content[i]))

    if p.min_avg_word_length is not None:
        j.drop(
            f"{name}:min_avg_word_length",
            has & (avg < p.min_avg_word_length),
            lambda i: f"mean word length={mean(i)} < {p.min_avg_word_length}",
        )
    if p.max_avg_word_length is not None:
        j.drop(
            f"{name}:max_avg_word_length",
            has & (avg > p.max_avg_word_length),
            lambda i: f"mean word length={mean(i)} > {p.max_avg_word_length}",
        )
    any_words = words > 0
    if p.max_symbol_word_ratio is not None:
        for key, counter, label in (
            ("hash_word_ratio", "hashes", "'#' per word"),
            ("ellipsis_word_ratio", "ellipses", "ellipses per word"),
        ):
            k = c[counter]
            ratio = _ratio(k, words)
            j.drop(
                f"{name}:{key}",
                any_words & (ratio > p.max_symbol_word_ratio),
                lambda i, k=k, label=label: (
                    f"{label}={fmt(int(k[i]) / int(words[i]))} > {p.max_symbol_word_ratio}"
                ),
            )
    lines = c["lines"]
    has_lines = lines > 0
    if p.max_bullet_lines_ratio is not None:
        b = c["bullet_lines"]
        j.drop(
            f"{name}:max_bullet_lines_ratio",
            has_lines & (_ratio(b, lines) > p.max_bullet_lines_ratio),
            lambda i: f"bullet lines={b[i]}/{lines[i]} > {p.max_bullet_lines_ratio}",
        )
    if p.max_ellipsis_lines_ratio is not None:
        e = c["ellipsis_lines"]
        j.drop(
            f"{name}:max_ellipsis_lines_ratio",
            has_lines & (_ratio(e, lines) > p.max_ellipsis_lines_ratio),
            lambda i: (
                f"lines ending in an ellipsis={e[i]}/{lines[i]} > {p.max_ellipsis_lines_ratio}"
            ),
        )
    if p.min_alpha_words_ratio is not None:
        alpha = c["alpha"]
        ratio = _ratio(alpha, words)
        j.stat(f"{name}.alpha_words_ratio", any_words, ratio)
        j.drop(
            f"{name}:min_alpha_words_ratio",
            any_words & (ratio < p.min_alpha_words_ratio),
            lambda i: (
                f"words with a letter={fmt(int(alpha[i]) / int(words[i]))} "
                f"< {p.min_alpha_words_ratio}"
            ),
        )
    if p.min_stop_words is not None:
        stop = c["stop"]
        j.stat(f"{name}.stop_words", every, stop.astype(np.float64))
        j.drop(
            f"{name}:min_stop_words",
            stop < p.min_stop_words,
            lambda i: f"distinct stop words={stop[i]} < {p.min_stop_words}",
        )


def _judge_gopher_repetition(j: _Judge, rule: Any, c: dict, out: dict) -> None:
    p, name = rule.params, rule.name
    size = c["size"]
    j.drop(f"{name}:empty", size == 0, lambda i: "no text")
    for unit, label, frac_p, chars_p in (
        ("para", "paragraph", p.dup_para_frac, p.dup_para_char_frac),
        ("line", "line", p.dup_line_frac, p.dup_line_char_frac),
    ):
        total, dups, chars = c[f"{unit}s"], c[f"{unit}_dups"], c[f"{unit}_dup_chars"]
        frac = _ratio(dups, total)
        plural = "paragraphs" if unit == "para" else "lines"
        j.stat(f"{name}.dup_{unit}_frac", np.ones(j.n, dtype=bool), frac)
        if frac_p is not None:
            j.drop(
                f"{name}:dup_{unit}_frac",
                frac > frac_p,
                lambda i, dups=dups, total=total, plural=plural, frac_p=frac_p: (
                    f"duplicate {plural}={dups[i]}/{total[i]} > {frac_p}"
                ),
            )
        if chars_p is not None:
            j.drop(
                f"{name}:dup_{unit}_char_frac",
                _ratio(chars, size) > chars_p,
                lambda i, chars=chars, label=label, chars_p=chars_p: (
                    f"duplicate {label} chars={fmt(int(chars[i]) / int(size[i]))} > {chars_p}"
                ),
            )
    for n, max_frac in p.top_n_grams:
        top, length = c[f"top{n}_count"], c[f"top{n}_len"]
        has = top >= 0
        frac = _ratio(length * top, size)
        j.stat(f"{name}.top_{n}_gram_frac", has, frac)
        j.drop(
            f"{name}:top_{n}_gram",
            has & (frac > max_frac),
            lambda i, top=top, length=length, n=n, max_frac=max_frac: (
                f"top {n}-gram chars={fmt(int(length[i]) * int(top[i]) / int(size[i]))} "
                f"> {max_frac}"
            ),
        )
    for n, max_frac in p.dup_n_grams:
        dup = c[f"dup{n}_chars"]
        j.drop(
            f"{name}:dup_{n}_gram",
            _ratio(dup, size) > max_frac,
            lambda i, dup=dup, n=n, max_frac=max_frac: (
                f"duplicate {n}-gram chars={fmt(int(dup[i]) / int(size[i]))} > {max_frac}"
            ),
        )


def _judge_c4(j: _Judge, rule: Any, c: dict, out: dict) -> None:
    p, name = rule.params, rule.name
    verdict = c["verdict"]
    excerpts = out["excerpts"]
    ex = c.get("excerpt", np.full(j.n, -1))

    def line(i: int) -> str:
        return repr(excerpts[ex[i]])

    j.drop(f"{name}:lorem_ipsum", verdict == 1, lambda i: f"'lorem ipsum' in line {line(i)}")
    j.drop(f"{name}:curly_bracket", verdict == 2, lambda i: f"'{{' in line {line(i)}")
    sentences, kept = c["sentences"], c["kept_lines"]
    if p.min_num_sentences is not None:
        j.drop(
            f"{name}:min_num_sentences",
            sentences < p.min_num_sentences,
            lambda i: f"sentences={sentences[i]} in {kept[i]} kept lines < {p.min_num_sentences}",
        )
    every = np.ones(j.n, dtype=bool)
    j.stat(f"{name}.lines_removed", every, (c["lines"] - kept).astype(np.float64))
    j.stat(f"{name}.sentences", every, sentences.astype(np.float64))
    j.drop(f"{name}:empty", c["empty"] == 1, lambda i: "no line survived cleaning")


def _judge_fineweb(j: _Judge, rule: Any, c: dict, out: dict) -> None:
    p, name = rule.params, rule.name
    n = c["lines"]
    j.drop(f"{name}:empty", n == 0, lambda i: "no non-blank line")
    if p.line_punct_thr is not None:
        punct = c["punct"]
        ratio = _ratio(punct, n)
        j.stat(f"{name}.line_punct_ratio", np.ones(j.n, dtype=bool), ratio)
        low = ratio < p.line_punct_thr
        if p.line_punct_exclude_zero:
            low &= ratio != 0
        j.drop(
            f"{name}:line_punct_thr",
            low,
            lambda i: f"lines ending in punctuation={punct[i]}/{n[i]} < {p.line_punct_thr}",
        )
    if p.short_line_thr is not None:
        short = c["short"]
        j.drop(
            f"{name}:short_line_thr",
            _ratio(short, n) > p.short_line_thr,
            lambda i: f"short lines={short[i]}/{n[i]} > {p.short_line_thr}",
        )
    newlines = c["newlines"]
    if p.char_duplicates_ratio is not None:
        dup, chars = c["dup_chars"], c["chars"]
        ratio = _ratio(dup, chars - newlines)
        j.stat(f"{name}.char_duplicates_ratio", np.ones(j.n, dtype=bool), ratio)
        j.drop(
            f"{name}:char_duplicates_ratio",
            ratio > p.char_duplicates_ratio,
            lambda i: (
                f"chars in repeated lines={fmt(int(dup[i]) / int(chars[i] - newlines[i]))} "
                f"> {p.char_duplicates_ratio}"
            ),
        )
    if p.new_line_ratio is not None:
        words = c.get("words", np.full(j.n, -1))
        has = (newlines > 0) & (words > 0)
        j.drop(
            f"{name}:new_line_ratio",
            has & (_ratio(newlines, words) > p.new_line_ratio),
            lambda i: (
                f"newlines per word={fmt(int(newlines[i]) / int(words[i]))} > {p.new_line_ratio}"
            ),
        )


_JUDGES: dict[str, Callable[[_Judge, Any, dict, dict], None]] = {
    "char_repetition": _judge_char_repetition,
    "length": _judge_length,
    "gopher_quality": _judge_gopher_quality,
    "gopher_repetition": _judge_gopher_repetition,
    "c4": _judge_c4,
    "fineweb": _judge_fineweb,
}
