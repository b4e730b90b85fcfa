"""The native quality kernel against the Python rules (the reference): the same kept text,
drop reason, detail and statistics for every document it does not hand back to Python,
on the shared corpora, on hand-made edge cases and on 100,000 random texts; and the
quality stage's files byte for byte with BALLAST_NATIVE=0 and 1."""

from __future__ import annotations

import json
import random
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from dataprep import native
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from dataprep.quality import filter_document, native_chain, parse_rules
from tests.support.helpers import SHARED

WEB = ["char_repetition", "length", "gopher_quality", "gopher_repetition", "c4", "fineweb"]
# Parameters away from the defaults: every switch of C4 flipped, n-gram lists with n=1,
# a word-count length test, FineWeb's zero exclusion; the rules in another order.
VARIANTS: list[list[Any]] = [
    WEB,
    [
        {"c4": {"remove_citations": False, "filter_no_terminal_punct": False,
                "min_num_sentences": None, "filter_policy": False, "max_word_length": 12}},
        {"gopher_repetition": {"top_n_grams": [[1, 0.3], [2, 0.2]],
                               "dup_n_grams": [[1, 0.5], [3, 0.2]]}},
        {"length": {"min_words": 5, "max_chars": 3000}},
        {"fineweb": {"line_punct_exclude_zero": True, "short_line_length": 5,
                     "new_line_ratio": 0.05}},
        {"gopher_quality": {"min_doc_words": 3, "stop_words": ["the", "and", "ça"]}},
        {"char_repetition": {"max_run": 3, "min_chars": 5, "max_char_frac": 0.2}},
    ],
]  # fmt: skip


def outcomes(rules: list[Any], texts: list[str]) -> tuple[list[tuple], list[tuple], int]:
    """(native, reference) outcomes of the documents the kernel decided, and how many it
    handed back to Python."""
    chain = native_chain.NativeChain(rules)
    o = chain.run(pa.array(texts, pa.string()))
    mine, ref = [], []
    for i, t in enumerate(texts):
        if o.fallback[i]:
            continue
        r = filter_document(rules, t)
        kept = o.reason[i] is None
        mine.append((i, o.edited.get(i, t) if kept else None, o.reason[i], o.detail[i],
                     o.stats_of(i) if kept else {}))  # fmt: skip
        ref.append((i, r.text, r.reason, r.detail, dict(r.stats) if r.reason is None else {}))
    return mine, ref, int(o.fallback.sum())


def assert_same(rules: list[Any], texts: list[str], max_fallback: float = 0.05) -> Counter:
    mine, ref, fell_back = outcomes(rules, texts)
    diffs = [(a, b) for a, b in zip(mine, ref, strict=True) if a != b]
    assert not diffs, f"{len(diffs)} differences; first: {diffs[0]}"
    assert fell_back <= max_fallback * len(texts), f"{fell_back} of {len(texts)} went to Python"
    return Counter(r[2] for r in ref)


def test_module_runs_the_web_chain() -> None:
    assert native.module() is not None
    assert native_chain.supported(parse_rules(WEB))
    assert not native_chain.supported(parse_rules([*WEB, "url"]))


CORPORA = sorted(p.name for p in SHARED.glob("*.jsonl")) if SHARED.is_dir() else []


@pytest.mark.skipif(not CORPORA, reason=f"shared corpora not found under {SHARED}")
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_shared_corpora_match_the_reference(variant: int) -> None:
    rules = parse_rules(VARIANTS[variant])
    reasons: Counter = Counter()
    for name in CORPORA:
        texts = []
        for line in (SHARED / name).open(encoding="utf-8"):
            t = json.loads(line).get("text")
            if isinstance(t, str):
                texts.append(t)
        if texts:
            # Code corpora hold many special cases spelt across chunks; they still match.
            reasons += assert_same(rules, texts, max_fallback=0.1)
    # The corpora exercise both outcomes and several checks of several rules.
    assert reasons[None] > 100
    assert len({r.split(":")[0] for r in reasons if r}) >= 3


EDGE_CASES = [
    "",
    " ",
    "\n\n\n",
    "word",
    "a" * 600 + " tail",
    "x " * 300,
    "Hello world. " * 30,
    "The cat and the dog. It was good to see them with the others.\n" * 8,
    "Line one is here.\nLine one is here.\nLine one is here.\nAnother line ends well.",
    "Para one here.\n\nPara one here.\n\nPara two is different and ends.",
    "lorem ipsum dolor sit amet, consectetur.\nThe next line is fine.",
    "This line has a brace { in it.\nThe end of the text is here.",
    "Enable JavaScript to view this page.\nWe use cookies, see our privacy policy.",
    "Cite this [1] and [edit] and [citation needed] and [١٢] and [x].\nMore text here.",
    "Kelvin: 5 \u212a is cold.\nThe İstanbul line ends here.",
    "日本語のテキストです。これは文です。" * 20,
    "• item one\n• item two\n- item three\n• item four\n",
    "Wait...\nAnd then…\nNothing more...\nThe end.",
    "Don't can't won't: it's the U.S. way, e.g. at 8 a.m. :) and C++ (╯°□°）╯︵┻━┻ ok.",
    "x) :) y right): done.\nend. \t ) next.\n\"Quoted.\" 'Single.' (Paren.)",
    "tabs\there\x0bvertical\x0cfeed\x1cfile\x1dgroup\x1erecord\x85next\u2028line\u2029para",
    "\r\nWindows line.\r\nAnother one.\r\n\r\nAfter a blank.\r\n",
    "NBSP\xa0between\u3000ideographic\u2009thin\u202fnarrow words here.",
    "#hash #tags #every #where in #this #text",
    "a " * 10 + "\n" * 40 + "b " * 10,
    "😀 emoji 👍🏽 and combining é and ﬁ ligature and ß and ２０２４.",
    "http://example.com/a/b?c=d&e=f www.example.org user@example.com (see https://x.y/z).",
]


def test_edge_cases_match_the_reference() -> None:
    for spec in VARIANTS:
        assert_same(parse_rules(spec), EDGE_CASES, max_fallback=0.2)


PIECES = (
    # words, stop words, capitalised and numeric
    "the", "and", "of", "to", "with", "that", "have", "be", "word", "Text", "data", "THE",
    "Model", "running", "x", "I", "a", "42", "3.14", "1,000", "2024", "8:30pm", "and/or",
    # punctuation, clitics, special cases, symbols
    ",", ".", "...", "…", "!", "?", ";", ":", "'s", "n't", "don't", "(", ")", '"', "“", "”",
    "‘", "’", "-", "--", "—", "#", "{", "}", "[1]", "[edit]", "[citation needed]", "[١]",
    "•", "C++", ":)", ":-)", "a.m.", "U.S.", "e.g.", "etc.", "Mr.", "'", "&", "%", "$5",
    "(╯°□°）╯︵┻━┻", "right):", "x)", "<3", "->", "_", "__init__", "~",
    # URLs and phrases C4 looks for
    "http://a.b/c", "www.x.org", "lorem ipsum", "javascript", "privacy policy",
    "cookie policy", "terms of use",
    # other scripts and characters
    "Ελληνικά", "Привет", "עברית", "हिन्दी", "é", "ß",
    "２０２４", "١٢٣", "😀", "e\u0301", "ﬁ", "\x00", "\u200b", "ǅ",
)  # fmt: skip
# What the kernel hands to Python (scripts written without spaces, the two characters whose
# lower case is ASCII): rare, so that most documents test the kernel.
RARE = ("日本語", "中文", "ไทย", "İ", "\u212a")
SPACES = (" ",) * 12 + ("  ", "\n", "\n", "\n\n", "\t", "\r\n", "\xa0", "\u2028", "\u3000", "\x0b")


PROSE = (
    "the", "the", "and", "of", "to", "with", "that", "have", "be", "a", "in", "is", "was",
    "model", "data", "training", "people", "river", "city", "good", "long", "small",
    "because", "however", "water", "light", "history", "which", "their", "it", "they",
)  # fmt: skip


def prose(rng: random.Random) -> str:
    """Lines of plausible sentences (most pass the web chain), with a random piece here and
    there, so that C4 removes some lines and the other rules see edited text."""
    lines = []
    for _ in range(rng.randint(1, 14)):
        words = [rng.choice(PROSE) for _ in range(rng.randint(2, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), rng.choice(PIECES))
        end = rng.choice((".", ".", ".", "!", "?", "", ":", '."', "..."))
        lines.append(" ".join(words).capitalize() + end)
    return rng.choice(("\n", "\n", "\n\n", " ")).join(lines)


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.4:
            out.append(prose(rng))
            continue
        k = rng.choice((0, 1, 3, 8, 20, 40, 80, 160))
        # A few documents repeat a line or a phrase (the repetition rules' input).
        pieces = [rng.choice(RARE if rng.random() < 0.001 else PIECES) for _ in range(k)]
        if rng.random() < 0.2 and pieces:
            pieces = pieces * rng.randint(2, 4)
        out.append("".join(p + rng.choice(SPACES) for p in pieces).strip(rng.choice(("", " "))))
    return out


def test_random_texts_match_the_reference() -> None:
    texts = random_texts(100_000)
    reasons = assert_same(parse_rules(WEB), texts, max_fallback=0.1)
    assert reasons[None] > 1000
    assert len([r for r in reasons if r]) >= 12  # many different checks fired
    # A second chain, parameters off their defaults, over part of them.
    assert_same(parse_rules(VARIANTS[1]), texts[:20_000], max_fallback=0.1)


def test_cache_bound_does_not_change_outcomes(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cache that empties every few chunks must give the same answers, only slower.
    monkeypatch.setattr(native_chain, "CACHE_MAX", 50)
    assert_same(parse_rules(WEB), random_texts(3000, seed=1), max_fallback=0.1)


def test_threads_share_a_chain() -> None:
    # Prefect's thread task runner runs shards of the quality stage in threads of one
    # process, which share the process's chain; a run that calls back into Python for a
    # new chunk lets another thread in. Both must get what a run alone gets.
    rules = parse_rules(WEB)
    chain = native_chain.NativeChain(rules)
    columns = [pa.array(random_texts(3000, seed=s), pa.string()) for s in (11, 12)]
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = chain.run(columns[i]).reason
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert not errors, errors
    alone = [native_chain.NativeChain(rules).run(c).reason for c in columns]
    assert results == alone


def run_quality_stage(tmp_path: Path, name: str, texts: list[str]) -> dict[str, bytes]:
    # One input file for both runs: its path is part of every document's location.
    data = tmp_path / "corpus.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    out = tmp_path / name
    cfg = {
        "output": str(out),
        "workers": 1,
        "sources": [{"name": "web", "paths": [str(data)], "format": "jsonl"}],
        "ingest": {"shard_docs": 800},
        "dedup": {"exact": True, "near": None},
        "quality": WEB,
        "tokenizer": {"kind": "bytes"},
    }
    run_prep(parse_config(cfg), until="quality", progress=False)
    skip = {"_run.json", "report.json"}
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in skip and p.parent.name != "_versions"
    }


def test_stage_files_are_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = random_texts(3000, seed=2) + EDGE_CASES
    monkeypatch.setenv("BALLAST_NATIVE", "0")
    reference = run_quality_stage(tmp_path, "python", texts)
    monkeypatch.setenv("BALLAST_NATIVE", "1")
    fast = run_quality_stage(tmp_path, "native", texts)
    assert sorted(fast) == sorted(reference)
    differ = [k for k in reference if fast[k] != reference[k]]
    assert not differ, f"files differ: {differ[:5]}"
    assert any("quality" in k for k in reference)
