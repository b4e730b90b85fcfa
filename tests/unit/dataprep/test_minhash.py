"""The MinHash core: shingling, signatures against exact Jaccard, band choice; and the
union-find the clustering tests check prep against (tests/support/union_find.py)."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from datasketch import MinHash

from dataprep import minhash
from tests.support.helpers import edit_words, read_jsonl, shared_file
from tests.support.union_find import UnionFind


def test_word_split_matches_regex_reference():
    texts = ["Hello, World! foo_bar 42", "naïve café — ünïcode", "", "...", "a"]
    _, off = minhash.word_hashes(texts)
    ref = [len(re.findall(r"[A-Za-z0-9_\x80-\U0010ffff]+", t.lower())) for t in texts]
    assert np.diff(off).tolist() == ref


def test_word_hash_ignores_case_and_position():
    h, _ = minhash.word_hashes(["Apple pie", "the apple"])
    assert h[0] == h[3]  # "Apple" in text 0, "apple" in text 1
    assert h[0] != h[1]


def test_shingles_are_sorted_unique_and_short_docs_get_one():
    sh, off = minhash.shingle_hashes(["a b c d e f", "a b", "", "x x x x x x x x"], 5)
    counts = np.diff(off).tolist()
    assert counts == [2, 1, 0, 1]  # two 5-grams; one shingle for a short text; none; repeats
    for i in range(4):
        part = sh[off[i] : off[i + 1]]
        assert np.all(np.diff(part.astype(np.int64)) > 0)


def _exact(a: str, b: str, n: int = 5) -> float:
    def sh(t: str) -> set:
        w = re.findall(r"[A-Za-z0-9_\x80-\U0010ffff]+", t.lower())
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    x, y = sh(a), sh(b)
    return len(x & y) / len(x | y)


def test_signature_estimates_match_exact_jaccard_like_datasketch():
    """Our estimator's error at 256 permutations is within a few standard deviations, and
    of the same size as datasketch's on the same shingles."""
    docs = [r["text"] for r in read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 40)]
    rng = random.Random(0)
    pairs = [(d, edit_words(d, rng.choice([0.01, 0.03, 0.08, 0.2]), rng)) for d in docs]
    a, b = minhash.permutations(256, 1)
    ours, theirs, exact = [], [], []
    for x, y in pairs:
        sh, off = minhash.shingle_hashes([x, y], 5)
        sig = minhash.signatures(sh, off, a, b)
        ours.append(float((sig[0] == sig[1]).mean()))
        ex = _exact(x, y)
        exact.append(ex)
        m1, m2 = MinHash(num_perm=256, seed=1), MinHash(num_perm=256, seed=1)
        for m, t in ((m1, x), (m2, y)):
            w = re.findall(r"[A-Za-z0-9_\x80-\U0010ffff]+", t.lower())
            m.update_batch([" ".join(w[i : i + 5]).encode() for i in range(len(w) - 4)])
        theirs.append(m1.jaccard(m2))
    err_ours = np.abs(np.array(ours) - exact)
    err_theirs = np.abs(np.array(theirs) - exact)
    assert err_ours.mean() < 0.04
    assert err_ours.max() < 0.12
    assert err_ours.mean() < 2 * err_theirs.mean() + 0.01


def test_exact_jaccard_of_hashed_shingles_matches_string_shingles():
    docs = [r["text"] for r in read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 20)]
    rng = random.Random(1)
    for d in docs:
        e = edit_words(d, 0.05, rng)
        sh, off = minhash.shingle_hashes([d, e], 5)
        j = minhash.jaccard(sh[off[0] : off[1]], sh[off[1] : off[2]])
        assert j == pytest.approx(_exact(d, e), abs=0.01)


def test_choose_bands_catches_pairs_at_threshold():
    bands, rows = minhash.choose_bands(0.8, 128, 0.999)
    assert bands * rows <= 128
    assert minhash.candidate_probability(0.8, bands, rows) >= 0.999
    # one more row per band would fall short of the target
    b2 = 128 // (rows + 1)
    assert minhash.candidate_probability(0.8, b2, rows + 1) < 0.999
    # datasketch's automatic choice for the same setting misses most pairs at 0.8
    from datasketch.lsh import _optimal_param

    db, dr = _optimal_param(0.8, 128, 0.5, 0.5)
    assert minhash.candidate_probability(0.8, db, dr) < 0.6


def test_union_find_root_is_smallest():
    uf = UnionFind.of(6)
    uf.union(4, 2)
    uf.union(5, 4)
    uf.union(3, 1)
    assert uf.roots().tolist() == [0, 1, 2, 1, 2, 2]
