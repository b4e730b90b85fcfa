"""The native byte-level BPE (native/bpe.cpp via Tokenizer.encode_column) against HF
`tokenizers`, the reference: the same ids on every shared corpus and on 100,000+ random
strings, the same pre-token splits, the same character classes as HF's regex engine, the
vocabulary check's verdicts, and byte-identical tokenize-stage shards with BALLAST_NATIVE=0
and =1."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import random
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from dataprep import native
from dataprep.tokenizer import (
    EOS_TOKEN,
    Tokenizer,
    _bytes_to_unicode,
    byte_tokenizer,
    load_tokenizer,
    train_bpe,
)
from tests.support.helpers import SHARED, read_jsonl

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.skipif(
    native.module() is None, reason="dataprep._native not built or BALLAST_NATIVE=0"
)

CORPORA = [
    "web_openwebtext_1k.jsonl",
    "web_c4_olmo_fixtures.jsonl",
    "web_dolma_cc_fixtures.jsonl",
    "web_dclm_quality_labels_train.jsonl",
    "web_python_docs.reference.jsonl",
    "code_python_cosqa_dev.jsonl",
    "code_humanevalx.jsonl",
    "code_java_methods_codexglue_flat.jsonl",
]


# ---------------------------------------------------------------------------------------
# random text

_WS = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "\x0b", "\x0c", "\x85"]
_WS += ["\u00a0", "\u1680", "\u2000", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f"]
_WS += ["\u205f", "\u3000"]
# isspace() in Python but not \s in HF's regex, or zero-width: must not count as whitespace.
_NOT_WS = ["\x1c", "\x1d", "\x1e", "\x1f", "\u200b", "\u200d", "\ufeff", "\u180e", "\u2060"]
_ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~'''",
    "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿßœŒĀāĞğİıŁłŠšŽž",
    "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΩάέήίόύώ",
    "абвгдежзийклмнопрстуфхцчшщъыьэюяАБВГДЁЖЗ",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629\u064b\u064e\u0651\u0660\u0669\u06f0",
    "\u05d0\u05d1\u05d2\u05e9\u05dc\u05d5\u05dd\u05b0\u05bc",
    "\u0915\u094d\u0937\u093f\u0928\u094d\u0926\u0940\u0966\u0967\u0903",
    "\u0e01\u0e32\u0e23\u0e17\u0e14\u0e2a\u0e2d\u0e1a\u0e31\u0e48",
    "日本語中文文本漢字的一是不了人我在有他这为之大来以个中上们",
    "ひらがなカタカナーゝゞヽヾ",
    "한국어텍스트가나다라마바사",
    "٠١٢٣٤٥٦٧٨٩０１２３４５²³¹⁴½¼¾ⅠⅡⅢⅫⅰ①②③〇𝟎𝟏𝟐",  # Nd, No, Nl
    "𝕳𝖊𝖑𝖑𝖔𝐀𝐁𝑎𝑏ℌℍℕ∑∫∂√≈≠≤≥∞",
    "😀😃👍🏽👩\u200d👩\u200d👧\u200d👦🇩🇪🇫🇷❤️\u20e3🤗🔥✨",
    "e\u0301a\u0308n\u0303\u0300\u0301\u0302\u0327",
    "\ufffd\x00\x01\x07\x1b\x7f\ue000\uf8ff\U000f0000\U0010fffd",
    "“”‘’«»—–…•·§¶†‡‰′″",
]
_WORDS = ["the", " the", "The", "don't", "it's", "we're", "I'M", "you'll", "he'd", "'s"]
_WORDS += ["'t", "'re", "'ve", "'m", "'ll", "'d", "'", "''", "'x", " 's", "'S", "'LL"]
_WORDS += [EOS_TOKEN, "<|pad|>", "<|endoftext", "|>", " <|endoftext|>", "x<|endoftext|>y"]
_WORDS += ["naïve", "straße", " 123", " 1.5", "3.14159", "https://example.com/a?b=c"]


def random_text(rng: random.Random) -> str:
    parts: list[str] = []
    for _ in range(rng.randrange(0, 24)):
        r = rng.random()
        if r < 0.3:
            parts.append(rng.choice(_WS))
        elif r < 0.35:
            parts.append(rng.choice(_NOT_WS))
        elif r < 0.5:
            parts.append(rng.choice(_WORDS))
        else:
            alphabet = rng.choice(_ALPHABETS)
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 8))))
    if rng.random() < 0.2:
        parts.append(rng.choice(_WS) * rng.randrange(1, 4))  # trailing whitespace
    return "".join(parts)


def random_code_points(rng: random.Random) -> str:
    """Anything from U+0000 to U+10FFFF but surrogates: mostly unassigned, declined."""
    out = []
    for _ in range(rng.randrange(0, 12)):
        cp = rng.randrange(0x110000) if rng.random() < 0.5 else rng.randrange(0x3000)
        out.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else " ")
    return "".join(out)


def random_bytes(rng: random.Random) -> str:
    return rng.randbytes(rng.randrange(0, 48)).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def random_texts() -> list[str]:
    rng = random.Random(7)
    return [random_text(rng) for _ in range(100_000)]


@pytest.fixture(scope="module")
def random_tok(random_texts: list[str]) -> Tokenizer:
    """Trained on random text, so its merges span every script and whitespace kind."""
    return train_bpe(random_texts[:20_000], 3000)


# ---------------------------------------------------------------------------------------
# the shared corpora


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    if not all((SHARED / name).is_file() for name in [*CORPORA, "tinyshakespeare.txt"]):
        pytest.skip(f"the shared corpora are not all under {SHARED}")
    # web_python_docs.reference.jsonl holds its text as reference_rst.
    texts = [
        r.get("text", r.get("reference_rst", "")) for n in CORPORA for r in read_jsonl(SHARED / n)
    ]
    shakespeare = (SHARED / "tinyshakespeare.txt").read_text(encoding="utf-8")
    return texts + shakespeare.split("\n\n")


@pytest.fixture(scope="module", params=[512, 8192])
def corpus_tok(request: pytest.FixtureRequest, corpus: list[str]) -> Tokenizer:
    # Every 5th document: part of every corpus, and the rest is unseen text.
    return train_bpe(corpus[::5], request.param)


def assert_same_ids(tok: Tokenizer, texts: list[str], chunk: int = 20_000) -> None:
    """encode_column (native) gives HF's ids for every text, EOS appended and not."""
    assert tok.native_status() == "native"
    for start in range(0, len(texts), chunk):
        batch = texts[start : start + chunk]
        want = tok.encode_batch(batch)
        values, offsets = tok.encode_column(pa.array(batch, pa.large_string()))
        assert offsets.dtype == np.int64 and values.dtype == np.int32
        assert len(offsets) == len(batch) + 1
        for i, w in enumerate(want):
            got = values[offsets[i] : offsets[i + 1]]
            if not np.array_equal(got, w):
                pytest.fail(f"text {batch[i]!r}: native {got.tolist()} != HF {w.tolist()}")
        with_eos, eos_offsets = tok.encode_column(pa.array(batch), append_id=tok.eos_id)
        assert np.array_equal(np.diff(eos_offsets), np.diff(offsets) + 1)
        assert (with_eos[eos_offsets[1:] - 1] == tok.eos_id).all()


def test_shared_corpora(corpus_tok: Tokenizer, corpus: list[str]) -> None:
    assert_same_ids(corpus_tok, corpus)


def test_random_text(random_tok: Tokenizer, random_texts: list[str]) -> None:
    assert_same_ids(random_tok, random_texts)


def test_random_code_points_and_bytes(random_tok: Tokenizer) -> None:
    rng = random.Random(11)
    texts = [random_code_points(rng) for _ in range(10_000)]
    texts += [random_bytes(rng) for _ in range(10_000)]
    assert_same_ids(random_tok, texts)


def test_long_pretokens_take_the_heap_path(random_tok: Tokenizer) -> None:
    rng = random.Random(5)
    texts = [" " * 1000 + "x", "a" * 5000, "ab" * 3000 + "\n" * 300, "1" * 999]
    texts += ["".join(rng.choice("abcdefgh") for _ in range(rng.randrange(100, 2000)))]
    texts += ["".join(rng.choice("日本語中文") for _ in range(300)), "-=" * 700, "\t " * 400]
    assert_same_ids(random_tok, texts)


def test_sliced_chunked_and_empty_columns(random_tok: Tokenizer, random_texts: list[str]) -> None:
    """Arrow slices (an offset into the buffers), several chunks, empty columns."""
    texts = [*random_texts[:300], "x \U000116d0"]
    want = [e.tolist() for e in random_tok.encode_batch(texts)]
    whole = pa.array(texts)
    chunked = pa.chunked_array([whole.slice(0, 7), whole.slice(7, 0), whole.slice(7)])
    for column, expect in [
        (whole.slice(5, 100), want[5:105]),
        (chunked, want),
        (pa.chunked_array([], pa.string()), []),
        (pa.array([], pa.large_string()), []),
    ]:
        values, offsets = random_tok.encode_column(column)
        assert len(offsets) == len(expect) + 1
        assert [values[a:b].tolist() for a, b in itertools.pairwise(offsets)] == expect


def test_unsure_code_points_are_declined_and_spliced(random_tok: Tokenizer) -> None:
    # U+1C89 and U+116D0 are assigned in Unicode 16 (HF's regex: a letter, a digit) and
    # unassigned in Python 3.11's Unicode 14: the native encoder hands them to HF.
    texts = ["before", "x\u1c89y \U000116d0 z", "middle", "\U0010fffe", "after"]
    m = native.module()
    assert m is not None and not isinstance(random_tok._native, str)
    enc = random_tok._native.encoder(m, random_tok._hf)  # type: ignore[union-attr]
    _, offsets, declined = enc.encode(native.text_column(pa.array(texts)), -1)
    assert declined.tolist() == [1, 3]
    assert offsets[2] == offsets[1] and offsets[4] == offsets[3]
    assert_same_ids(random_tok, texts)


def test_splits_match_hf(random_tok: Tokenizer, random_texts: list[str]) -> None:
    """The pre-token pieces themselves, so a wrong split cannot hide behind a merge the
    vocabulary happens to lack."""
    from tokenizers import pre_tokenizers

    hf_split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    m = native.module()
    assert m is not None
    enc = random_tok._native.encoder(m, random_tok._hf)  # type: ignore[union-attr]
    extra = ["a  b", "a \n b", "x \t\n", "  ", " !", "  !!", "'sam", " 's", "1 2  3   "]
    for text in extra + random_texts[:30_000]:
        data = text.encode()
        pieces, unsure = enc.split(data)
        want = [bytes(to_byte[c] for c in piece) for piece, _ in hf_split(text)]
        assert [data[a:b] for a, b in pieces] == want, text
        assert not unsure


def test_char_classes_match_hf() -> None:
    """native/bpe_unicode.h against HF's regex engine: every BMP code point and a sample
    above; and every code point unassigned in this Python's Unicode is marked unsure."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    m = native.module()
    assert m is not None
    table = m.bpe_char_classes()
    probes = {1: "a", 2: "1", 0: "!", 3: "\t"}  # letter, number, other, whitespace
    points = [*range(0x10000), *range(0x10000, 0x110000, 97), 0x1C89, 0x116D0, 0x2EBF0]
    for cp in points:
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        cls = table[cp] & 3
        assert len(split(probes[cls] + c)) == 1, f"U+{cp:04X} is not class {cls} in HF"
        if unicodedata.category(c) == "Cn":
            assert table[cp] & 4, f"U+{cp:04X} is unassigned here but not unsure"


# ---------------------------------------------------------------------------------------
# the vocabulary check


def _edited(tok: Tokenizer, edit: Any) -> Tokenizer:
    body = json.loads(tok.to_json())
    edit(body)
    return load_tokenizer(json.dumps(body))


def _swap_dependent_merges(body: dict[str, Any]) -> None:
    merges = body["model"]["merges"]
    made = {a + b: i for i, (a, b) in enumerate(merges)}
    for j, (a, b) in enumerate(merges):
        i = made.get(a, made.get(b))
        if i is not None:  # merge j uses what merge i made: put j first
            merges[i], merges[j] = merges[j], merges[i]
            return
    raise AssertionError("no merge builds on another")


def _drop_byte(body: dict[str, Any]) -> None:
    vocab = body["model"]["vocab"]
    used = {p for m in body["model"]["merges"] for p in m}
    unused = next(c for c in _bytes_to_unicode().values() if c not in used)
    del vocab[unused]


REFUSALS = {
    "normalizer": lambda b: b.update(normalizer={"type": "NFC"}),
    "pre-tokenizer options": lambda b: b["pre_tokenizer"].update(add_prefix_space=True),
    "pre-tokenizer is not ByteLevel": lambda b: b.update(pre_tokenizer={"type": "Whitespace"}),
    "dropout": lambda b: b["model"].update(dropout=0.1),
    "ignore_merges": lambda b: b["model"].update(ignore_merges=True),
    "end_of_word_suffix": lambda b: b["model"].update(end_of_word_suffix="</w>"),
    "truncation": lambda b: b.update(
        truncation={"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    ),
    "non-special added token": lambda b: b["added_tokens"].append(
        {
            "id": max(b["model"]["vocab"].values()) + 1,
            "content": "hello",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
    ),
    "no earlier merge": _swap_dependent_merges,
    "lacks some of the 256 byte": _drop_byte,
}


def test_check_accepts_trained_and_reloaded(random_tok: Tokenizer) -> None:
    assert random_tok.native_status() == "native"
    assert load_tokenizer(random_tok.to_json()).native_status() == "native"
    assert pickle.loads(pickle.dumps(random_tok)).native_status() == "native"
    assert byte_tokenizer().native_status() == "not a BPE tokenizer"


def test_check_accepts_gpt2_style_options(random_tok: Tokenizer) -> None:
    """GPT-2's own tokenizer.json: empty subword prefix and suffix, a ByteLevel
    post-processor. Same algorithm, so native."""

    def gpt2(body: dict[str, Any]) -> None:
        body["model"].update(continuing_subword_prefix="", end_of_word_suffix="")
        body["post_processor"] = {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        }

    tok = _edited(random_tok, gpt2)
    assert tok.native_status() == "native"
    rng = random.Random(2)
    assert_same_ids(tok, [random_text(rng) for _ in range(2000)])


@pytest.mark.parametrize("reason", sorted(REFUSALS))
def test_check_refuses_what_it_cannot_encode(random_tok: Tokenizer, reason: str) -> None:
    tok = _edited(random_tok, REFUSALS[reason])
    assert reason in tok.native_status()
    # ... and encode_column still gives HF's ids.
    texts = ["Hello world, it's 12 o'clock  ", "\u1c89 日本語 \t\n", "", EOS_TOKEN]
    values, offsets = tok.encode_column(pa.array(texts), append_id=tok.eos_id)
    assert len(offsets) == len(texts) + 1 and (values[offsets[1:] - 1] == tok.eos_id).all()
    if reason != "dropout":  # HF's dropout is random: no two encodings need agree
        want = [[*e.tolist(), tok.eos_id] for e in tok.encode_batch(texts)]
        assert [values[a:b].tolist() for a, b in itertools.pairwise(offsets)] == want


def test_check_refuses_a_non_byte_level_tokenizer_built_by_hf() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="[UNK]"))
    hf.normalizer = normalizers.NFKC()
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS_TOKEN, "[UNK]"])
    hf.train_from_iterator(["hello world, the quick brown fox"] * 50, trainer=trainer)
    tok = load_tokenizer(hf.to_str())
    assert "normalizer" in tok.native_status()
    values, _ = tok.encode_column(pa.array(["hello fox", "ﬁne"]))
    assert values.tolist() == [i for e in tok.encode_batch(["hello fox", "ﬁne"]) for i in e]


def test_switched_off_and_bytes_kind(
    random_tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BALLAST_NATIVE", "0")
    assert "BALLAST_NATIVE=0" in random_tok.native_status()
    texts = ["it's a test ", "", "日本"]
    values, offsets = random_tok.encode_column(pa.chunked_array([pa.array(texts[:1]), texts[1:]]))
    assert values.tolist() == [i for e in random_tok.encode_batch(texts) for i in e]
    assert offsets.tolist()[-1] == len(values)
    monkeypatch.setenv("BALLAST_NATIVE", "1")
    bt = byte_tokenizer()
    values, offsets = bt.encode_column(pa.array(texts), append_id=bt.eos_id)
    assert values.tolist() == [*b"it's a test ", 256, 256, *"日本".encode(), 256]


# ---------------------------------------------------------------------------------------
# the tokenize stage


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.rglob("tokens/*.parquet"))}


def test_tokenize_stage_is_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataprep.config import parse_config
    from dataprep.pipeline import run_prep

    rng = random.Random(3)
    texts = [random_text(rng) for _ in range(600)] + ["x \U000116d0 y", f"a {EOS_TOKEN} b"]
    if (SHARED / CORPORA[0]).is_file():
        texts += [r["text"] for r in read_jsonl(SHARED / CORPORA[0], 150)]
    rows = [{"id": f"d{i}", "text": t} for i, t in enumerate(texts) if t.strip()]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("BALLAST_NATIVE", flag)
        out = tmp_path / f"out{flag}"
        cfg = {
            "output": str(out),
            "workers": 1,
            "sources": [{"name": "s", "paths": [str(tmp_path / "docs.jsonl")], "quality": []}],
            "ingest": {"shard_docs": 200},
            "dedup": {"exact": False, "near": False},
            "quality": [],
            "tokenizer": {"kind": "bpe", "vocab_size": 600},
        }
        run_prep(parse_config(cfg), until="tokenize", progress=False)
        outputs.append(_shards(out))
    assert os.environ["BALLAST_NATIVE"] == "1"
    assert len(outputs[0]) >= 2
    assert outputs[0] == outputs[1]
