"""spacy_en (spaCy's English tokenizer and sentencizer in plain Python) against spaCy's own
answers, recorded in tests/fixtures/spacy_en_cases.json by `benchmarks/spacy_reference.py
fixture` in .venv-spacy; spaCy itself is not needed here."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from dataprep.quality import spacy_en
from dataprep.quality.spacy_en_rules import SPACY_VERSION
from dataprep.quality.text import count_sentences, split_words, split_words_regex
from tests.support.helpers import FIXTURES

FIXTURE = FIXTURES / "spacy_en_cases.json"
REFERENCE = json.loads(FIXTURE.read_text(encoding="utf-8"))
CASES: list[dict[str, Any]] = REFERENCE["cases"]


def test_fixture_and_rules_come_from_the_same_spacy():
    assert REFERENCE["spacy"] == SPACY_VERSION


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"][:30]) for c in CASES])
def test_matches_spacy(case: dict[str, Any]) -> None:
    text = case["text"]
    assert spacy_en.tokenize(text) == case["words"]
    assert spacy_en.doc_tokens(text) == case["tokens"]
    assert spacy_en.count_sentences(text) == case["sentences"]
    assert spacy_en.sentencize(case["tokens"]) == case["sentences"]
    # again, now from the caches
    assert spacy_en.tokenize(text) == case["words"]
    assert spacy_en.count_sentences(text) == case["sentences"]
    # what the quality rules use for English (and unlabelled) text
    assert split_words(text) == case["words"]
    assert split_words(text, "en") == case["words"]
    assert count_sentences(text) == case["sentences"]


def test_spacy_and_the_old_regex_differ_where_spacy_keeps_abbreviations():
    # spaCy keeps "U.S." and "Dr." whole and "e-mail" in one piece; the regex for other
    # languages cuts them, so a language label picks the splitter.
    text = "The U.S. envoy, Dr. Smith, sent an e-mail."
    assert split_words(text) == [
        "The", "U.S.", "envoy", ",", "Dr.", "Smith", ",", "sent", "an", "e", "-", "mail", ".",
    ]  # fmt: skip
    assert split_words(text, "fr") == split_words_regex(text)
    assert split_words(text, "fr") != split_words(text)


# Pieces that spaCy's special cases, affixes and whitespace rules treat specially; random
# texts of them check the fast paths (per-chunk caches, the sentence classes) against the
# whole-text algorithm (doc_tokens, sentencize), which the cases above check against spaCy.
PIECES = [
    "U.S.", "Dr.", "vs.", "p.m.", "a.m.", "10a.m.", "e-mail", "http://x.com/a?b=1", ":)", ":-)",
    "<3", "):", "(:", ":(", "don't", "it's", "'s", "n't", "o'clock", "$", "€5", "10%", "...", "…",
    "well-known", "e.g.", "Mr", "Int", "right", "(a)", ".", "!", "?", '"', "'", "(", ")", "-",
    "—", "A", "word", "12", "3.5", " ", " ", " ", "  ", "\n", "\t", "\u00a0", "\u0301", "。",
]  # fmt: skip


def test_fast_paths_agree_with_the_whole_text_algorithm():
    rng = random.Random(11)
    for _ in range(4000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40)))
        tokens = spacy_en.doc_tokens(text)
        assert spacy_en.tokenize(text) == [t for t in tokens if not t.isspace()], text
        assert spacy_en.count_sentences(text) == spacy_en.sentencize(tokens), text


def test_every_non_space_character_is_in_one_token():
    rng = random.Random(5)
    alphabet = "ab1_'’-–—.…,!?n t\u0301हि ():\"x\n"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert "".join(spacy_en.tokenize(text)) == "".join(text.split()), text


def test_a_chunk_of_letters_is_one_token() -> None:
    """The cache's shortcut for letters-only chunks (spacy_en._tokens_of) against the full
    prefix/suffix/infix path: the shared corpora's words and random strings of letters of
    many scripts, none of them a special case, are one token each."""

    from tests.support.helpers import SHARED

    words: set[str] = set()
    for path in sorted(SHARED.glob("web_*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            # (web_python_docs.reference.jsonl holds reference reST, no "text")
            words.update(w for w in json.loads(line).get("text", "").split() if w.isalpha())
    rng = random.Random(0)
    letters = [
        chr(c)
        for c in (
            *range(0x41, 0x7B),
            *range(0xC0, 0x250),
            *range(0x370, 0x3FF),
            *range(0x400, 0x4FF),
            *range(0x5D0, 0x5EB),
            *range(0x620, 0x64B),
            *range(0x4E00, 0x4E80),
        )
        if chr(c).isalpha()
    ]
    words.update("".join(rng.choices(letters, k=rng.randint(1, 12))) for _ in range(20_000))
    checked = 0
    for w in words:
        if w in spacy_en.SPECIAL:
            continue
        assert spacy_en.chunk_tokens(w) == [w], w
        checked += 1
    # the random strings alone are ~19k distinct words (the shared corpora add ~44k when
    # present): the loop cannot pass by checking nothing
    assert checked > 15_000
    # ... and the tokenizer, which takes the shortcut, gives the same.
    sample = sorted(words)[:2000]
    spacy_en._CACHE.clear()
    assert spacy_en.tokenize(" ".join(sample)) == [
        t for w in sample for t in spacy_en.chunk_tokens(w)
    ]


def test_the_cache_across_generation_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tiny cache (a switch of generations every 50 chunks), tokenize still gives
    the whole-text algorithm's tokens (doc_tokens), chunks served from the old generation
    included."""
    monkeypatch.setattr(spacy_en, "CACHE_MAX", 50)
    rng = random.Random(1)
    vocab = [
        "the",
        "a",
        "Dr.",
        "U.S.",
        "don't",
        ":)",
        "x)",
        "5km",
        "e.g.",
        "(hi)",
        "word,",
        "word.",
        "it's",
        "Mr.",
        "a.m.",
        "C++",
        "well-known",
        "gonna",
        "$5",
        "...",
    ]
    for _ in range(2000):
        text = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 12)))
        assert spacy_en.tokenize(text) == spacy_en.doc_tokens(text), text
    assert len(spacy_en._OLD) > 0  # the old generation was in use
