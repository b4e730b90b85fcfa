"""The native MinHash kernel (native/minhash.cpp) against the Python reference
(dataprep/minhash.py's *_python functions): the same word hashes, shingle sets and
offsets, signatures (every instruction-set level this CPU has) and band keys, bit for
bit, on the shared corpora, on random text over many scripts and on the edge cases; and
the near stage's files byte for byte with BALLAST_NATIVE=0 and =1."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pytest

from dataprep import minhash, native
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.helpers import SHARED, read_jsonl, shared_file, write_jsonl

pytestmark = pytest.mark.skipif(not native.built(), reason="dataprep._native is not built")

NGRAMS = (1, 2, 5, 32)


def _mod() -> ModuleType:
    mod = native.module()
    if mod is None:
        pytest.skip("BALLAST_NATIVE=0")
    return mod


def _assert_same(texts: list[str], ngrams: tuple[int, ...] = NGRAMS) -> None:
    """Every kernel against its reference on `texts` (native.module() must be on)."""
    mod = _mod()
    h_py, o_py = minhash.word_hashes_python(texts)
    h_nat, o_nat = minhash.word_hashes(texts)
    assert h_nat.dtype == h_py.dtype and o_nat.dtype == o_py.dtype
    np.testing.assert_array_equal(o_nat, o_py)
    np.testing.assert_array_equal(h_nat, h_py)
    for ngram in ngrams:
        sh_py, off_py = minhash.shingle_hashes_python(texts, ngram)
        sh_nat, off_nat = minhash.shingle_hashes(texts, ngram)
        assert sh_nat.dtype == sh_py.dtype and off_nat.dtype == off_py.dtype
        np.testing.assert_array_equal(off_nat, off_py)
        np.testing.assert_array_equal(sh_nat, sh_py)
    sh, off = minhash.shingle_hashes_python(texts, 5)
    for num_perm in (8, 100, 128):
        a, b = minhash.permutations(num_perm, num_perm)
        sig_py = minhash.signatures_python(sh, off, a, b)
        for level in range(mod.minhash_simd_level() + 1):
            sig_nat = mod.minhash_signatures(sh, off, a, b, level)
            assert sig_nat.dtype == sig_py.dtype
            np.testing.assert_array_equal(sig_nat, sig_py, err_msg=f"level {level}")
        np.testing.assert_array_equal(minhash.signatures(sh, off, a, b), sig_py)
        bands, rows = minhash.choose_bands(0.8, num_perm, 0.999)
        keys_py = minhash.band_keys_python(sig_py, bands, rows)
        keys_nat = minhash.band_keys(sig_py, bands, rows)
        assert keys_nat.dtype == keys_py.dtype
        np.testing.assert_array_equal(keys_nat, keys_py)


def _assert_same_column(texts: list[str], max_chars: int | None, ngram: int = 5) -> None:
    """shingle_hashes_column (Arrow in place, truncation in characters) against the
    reference on the truncated Python strings."""
    cut = texts if max_chars is None else [t[:max_chars] for t in texts]
    sh_py, off_py = minhash.shingle_hashes_python(cut, ngram)
    for column in (pa.array(texts), pa.array(texts, type=pa.large_string())):
        sh_nat, off_nat = minhash.shingle_hashes_column(column, ngram, max_chars)
        np.testing.assert_array_equal(off_nat, off_py)
        np.testing.assert_array_equal(sh_nat, sh_py)


# ---- lower-casing ----------------------------------------------------------------------
def test_lower_table_is_str_lower_of_every_code_point():
    cps, low = minhash._lower_changes()
    want = {}
    for cp in range(0x80, 0x110000):
        if 0xD800 <= cp < 0xE000 or cp == 0x3A3:
            continue
        c = chr(cp)
        if c.lower() != c:
            want[cp] = c.lower()
    assert dict(zip(cps.tolist(), low, strict=True)) == want
    # The cases the kernel exists for: a longer lower case, and non-ASCII to ASCII.
    assert want[0x130] == "i\u0307" and want[0x212A] == "k"


# Scripts, case pairs with odd mappings, separators and punctuation for random text.
_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_",
    "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÑÒÓÔÕÖØÙÚÛÜÝŸßẞ",
    "İıIiŞşĞğÇçÖöÜü",  # Turkish: İ lower-cases to i + U+0307
    "\u212a\u212b\u2126Kk",  # KELVIN SIGN -> k, ANGSTROM SIGN -> å, OHM SIGN -> ω
    "ΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩαβγδεζηθικλμνξοπρσςτυφχψωΆΈΉΊΌΎΏ",  # Σ: Python's path
    "АБВГДЕЖЗИЙКЛМНОПРСТУФХЦЧШЩЪЫЬЭЮЯабвгдежзийклмнопрстуфхцчшщъыьэюяЁё",
    "中文字符漢字日本語のテキスト한국어텍스트",
    "😀🎉👍🏽🇫🇷\U0001f9d1\u200d\U0001f4bb𝔄𝔅𐐀𐐨",  # astral: emoji, math letters, Deseret
    "ǅǈǋǲᾈᾉᾼῌῼＡＢＣａｂｃ",  # title case, Greek with ypogegrammeni, fullwidth
    " \t\n\r\x0b\x0c\u00a0\u2003\u3000",
    ".,;:!?'\"()[]{}<>-–—…“”‘’«»/\\@#$%^&*+=|~`",
    "\x00\x01\x7f\u0300\u0301\u200b\ufeff",  # controls, combining marks, zero width
]


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pools = rng.sample(_POOLS, rng.randint(1, 4))
        # Most texts short (the edge cases: no words, fewer than ngram), some longer.
        length = rng.choice((0, 1, 2, 3, 5, 8, 13, 30, 60, 120, 400))
        words = []
        while sum(len(w) for w in words) < length:
            pool = rng.choice(pools)
            words.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 9))))
            words.append(rng.choice((" ", " ", "  ", "\n", ", ", ". ", "-", "")))
        out.append("".join(words)[:length])
    return out


def test_kernel_lower_case_is_str_lower():
    mod = _mod()
    texts = [t for t in _random_texts(20_000, 7) if "\u03a3" not in t]
    column = native.text_column(pa.array(texts))
    table = minhash._lower_table()
    for max_chars in (-1, 1, 7, 50):
        for i, t in enumerate(texts):
            want = (t if max_chars < 0 else t[:max_chars]).lower().encode()
            assert mod.minhash_lowered(column, i, max_chars, table) == want, repr(t)


def test_kernel_refuses_what_it_cannot_lower_exactly():
    """A capital sigma (lower() looks at its neighbours) or invalid UTF-8 without Python's
    replacement is an error, never a silently different hash."""
    mod = _mod()
    table = minhash._lower_table()
    none = np.zeros(0, dtype=np.int64)
    sigma = native.text_column(pa.array(["ok", "ΟΔΥΣΣΕΥΣ"]))
    assert mod.minhash_needs_python(sigma).tolist() == [1]
    with pytest.raises(ValueError, match="document 1"):
        mod.minhash_shingle_hashes(sigma, 5, -1, table, none, [])
    bad = pa.Array.from_buffers(
        pa.string(), 1, [None, pa.py_buffer(np.array([0, 2], np.int32)), pa.py_buffer(b"\xc3(")]
    )
    with pytest.raises(ValueError, match="document 0"):
        mod.minhash_shingle_hashes(native.text_column(bad), 5, -1, table, none, [])


# ---- differential tests against the Python reference -----------------------------------
def test_random_mixed_script_text_matches_reference():
    texts = _random_texts(100_000, 1)
    assert any("\u03a3" in t for t in texts)  # the replacement path runs too
    assert sum(not t.isascii() for t in texts) > len(texts) // 2
    _assert_same(texts, ngrams=(1, 5))
    _assert_same_column(texts[:20_000], 40)


def test_edge_cases_match_reference():
    long_word = "Ab" * 100  # past the kernel's table of powers (64 bytes)
    texts = [
        "",
        " ",
        "...",
        "\n\t ",
        "a",
        "a b",
        "a b c d",  # fewer words than ngram: one shingle of all of them
        "a b c d e",  # exactly ngram
        "x x x x x x x x x x",  # repeated shingles: one kept
        "Hello, World! foo_bar 42",
        long_word,
        f"{long_word} {long_word.lower()} {long_word}!",
        "é" * 40 + " " + "ü" * 70,
        "İSTANBUL İstanbul istanbul",
        "\u212aelvin kelvin KELVIN",
        "ΟΔΥΣΣΕΥΣ Σ σ ς ΑΣ.",  # capital sigma: lowered by Python
        "\x00word\x00 \x7f",
        "😀😀 🎉",
        " ".join(f"w{i % 997}" for i in range(5000)),  # the radix-sorted path
    ]
    _assert_same(texts)
    _assert_same(["only"])
    _assert_same([""])
    for max_chars in (None, 0, 1, 3, 4, 5, 30, 64, 1000):
        _assert_same_column(texts, max_chars)


def test_empty_batch():
    _mod()
    sh, off = minhash.shingle_hashes([], 5)
    assert len(sh) == 0 and off.tolist() == [0]
    sh, off = minhash.shingle_hashes_column(pa.array([], pa.string()), 5, 10)
    assert len(sh) == 0 and off.tolist() == [0]
    a, b = minhash.permutations(16, 0)
    assert minhash.signatures(sh, off, a, b).shape == (0, 16)


def test_column_slices_and_chunks_match_reference():
    texts = _random_texts(3000, 3)
    arr = pa.array(texts)
    sliced = arr.slice(1234, 1000)  # an array offset the kernel must honour
    sh_py, off_py = minhash.shingle_hashes_python([t[:100] for t in texts[1234:2234]], 5)
    sh, off = minhash.shingle_hashes_column(sliced, 5, 100)
    np.testing.assert_array_equal(off, off_py)
    np.testing.assert_array_equal(sh, sh_py)
    chunked = pa.chunked_array([arr.slice(0, 1000), arr.slice(1000)])
    sh_py, off_py = minhash.shingle_hashes_python(texts, 5)
    sh, off = minhash.shingle_hashes_column(chunked, 5)
    np.testing.assert_array_equal(off, off_py)
    np.testing.assert_array_equal(sh, sh_py)


def _shared_texts(path: Path) -> list[str]:
    """Every string field of every record (the text, and ids, urls, reference rst)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            out += [v for v in json.loads(line).values() if isinstance(v, str)]
    return out


@pytest.mark.parametrize(
    "name", sorted(p.name for p in SHARED.glob("*.jsonl")) if SHARED.is_dir() else ["absent"]
)
def test_shared_corpora_match_reference(name):
    texts = _shared_texts(shared_file(name))
    _assert_same(texts, ngrams=(5,))
    _assert_same_column(texts, 2000)


# ---- the near stage --------------------------------------------------------------------
def _near_files(out: Path) -> dict[str, bytes]:
    files = {}
    for sub in ("sig", "shingles"):
        for p in sorted(out.rglob(f"near/{sub}/*.npz")):
            files[str(p.relative_to(out))] = p.read_bytes()
    return files


def test_near_stage_files_are_identical_native_and_python(tmp_path, monkeypatch):
    _mod()
    web = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 150)
    rows = [{"id": r["id"], "text": r["text"]} for r in web]
    for i, t in enumerate(_random_texts(150, 5)):
        rows.append({"id": f"mixed-{i}", "text": t + " ΟΔΥΣΣΕΥΣ İstanbul \u212aelvin" * (i % 2)})
    data = write_jsonl(tmp_path / "web.jsonl", rows)
    # Which path shingled (one worker runs the steps in this process): both must have run.
    python_calls = []
    reference = minhash.shingle_hashes_python

    def counted(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
        python_calls.append(len(texts))
        return reference(texts, ngram)

    monkeypatch.setattr(minhash, "shingle_hashes_python", counted)
    got, calls = {}, {}
    for flag in ("0", "1"):
        monkeypatch.setenv("BALLAST_NATIVE", flag)
        python_calls.clear()
        out = tmp_path / f"out{flag}"
        cfg = parse_config(
            {
                "output": str(out),
                "workers": 1,
                "sources": [{"name": "web", "paths": [str(data)], "id_field": "id"}],
                "ingest": {"shard_docs": 100},
                "quality": [],
            }
        )
        run_prep(cfg, until="near", progress=False)
        got[flag] = _near_files(out)
        calls[flag] = sum(python_calls)
    assert calls["0"] > 0 and calls["1"] == 0
    assert len(got["1"]) >= 6  # three shards, two files each
    assert got["0"].keys() == got["1"].keys()
    for key, data_py in got["0"].items():
        assert got["1"][key] == data_py, key
