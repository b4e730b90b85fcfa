"""Mixture planning (shares, temperature, caps) and deterministic selection/order."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from dataprep.mixture import (
    SourcePlan,
    doc_keys,
    expand_repeats,
    order_keys,
    plan_mixture,
    select_documents,
)
from tests.support.helpers import ROOT


def by_name(plans: list[SourcePlan]) -> dict[str, SourcePlan]:
    return {p.source: p for p in plans}


def lognormal_tokens(n: int, seed: int) -> np.ndarray:
    # Document lengths of web text are roughly lognormal (median ~ 400 tokens, long tail).
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(mean=6.0, sigma=1.2, size=n)).astype(np.int64)


def ids(n: int, prefix: str = "doc") -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


# ---------------------------------------------------------------------------- shares


def test_weights_give_exact_shares_when_data_allows() -> None:
    available = {"web": 10_000_000, "code": 5_000_000, "books": 3_000_000}
    weights = {"web": 5.0, "code": 3.0, "books": 2.0}  # normalised inside
    plans = plan_mixture(available, weights, None, dict.fromkeys(available, 1.0), 1_000_000)
    p = by_name(plans)
    assert [x.source for x in plans] == ["web", "code", "books"]
    assert (p["web"].planned_tokens, p["code"].planned_tokens, p["books"].planned_tokens) == (
        500_000,
        300_000,
        200_000,
    )
    assert p["code"].target_share == pytest.approx(0.3)
    assert all(x.warning is None and not x.capped and x.shortfall_tokens == 0 for x in plans)
    assert p["web"].planned_epochs == pytest.approx(0.05)


def test_largest_remainder_sums_to_total() -> None:
    available = {"a": 10**6, "b": 10**6, "c": 10**6}
    plans = plan_mixture(available, {"a": 1, "b": 1, "c": 1}, None, dict.fromkeys("abc", 1.0), 1000)
    got = sorted(x.planned_tokens for x in plans)
    assert got == [333, 333, 334]
    assert all(isinstance(x.planned_tokens, int) for x in plans)


def test_natural_proportions_by_default_and_alpha_one() -> None:
    available = {"a": 600, "b": 300, "c": 100}
    caps = dict.fromkeys(available, 10.0)
    natural = by_name(plan_mixture(available, None, None, caps, 10_000))
    alpha1 = by_name(plan_mixture(available, None, 1.0, caps, 10_000))
    for n, share in {"a": 0.6, "b": 0.3, "c": 0.1}.items():
        assert natural[n].target_share == pytest.approx(share)
        assert alpha1[n].target_share == pytest.approx(share)
        assert natural[n].planned_tokens == alpha1[n].planned_tokens == round(share * 10_000)


def test_temperature_two_source_example_by_hand() -> None:
    # n = 900 and 100; alpha 0.5 -> sqrt: 30 and 10 -> shares 0.75 and 0.25.
    plans = by_name(
        plan_mixture({"big": 900, "small": 100}, None, 0.5, {"big": 10.0, "small": 10.0}, 4000)
    )
    assert plans["big"].target_share == pytest.approx(0.75)
    assert plans["small"].target_share == pytest.approx(0.25)
    assert (plans["big"].planned_tokens, plans["small"].planned_tokens) == (3000, 1000)


def test_alpha_wins_over_weights() -> None:
    # MixtureConfig reads weights only when alpha is unset.
    plans = by_name(
        plan_mixture(
            {"big": 900, "small": 100},
            {"big": 0.0, "small": 1.0},
            0.5,
            {"big": 10.0, "small": 10.0},
            4000,
        )
    )
    assert plans["big"].target_share == pytest.approx(0.75)


def test_small_alpha_flattens_monotonically() -> None:
    available = {"a": 1_000_000, "b": 100_000, "c": 10_000}
    caps = dict.fromkeys(available, 1e9)
    rows = []
    for alpha in (1.0, 0.7, 0.5, 0.3, 0.1, 0.01):
        p = by_name(plan_mixture(available, None, alpha, caps, 10**6))
        shares = [p[n].target_share for n in "abc"]
        assert shares[0] > shares[1] > shares[2]  # the order of sizes is kept
        assert sum(shares) == pytest.approx(1.0)
        rows.append(shares)
    big = [r[0] for r in rows]
    small = [r[2] for r in rows]
    assert all(x > y for x, y in itertools.pairwise(big))
    assert all(x < y for x, y in itertools.pairwise(small))
    assert rows[-1][0] == pytest.approx(1 / 3, abs=0.03)  # alpha -> 0: uniform


# ------------------------------------------------------------------------------ caps


def test_too_small_source_is_capped_with_numbers_and_budget_redistributed() -> None:
    available = {"web": 10_000_000, "code": 600_000, "books": 2_000_000}
    weights = {"web": 0.5, "code": 0.3, "books": 0.2}
    caps = {"web": 1.0, "code": 2.0, "books": 4.0}
    plans = plan_mixture(available, weights, None, caps, 10_000_000)
    p = by_name(plans)
    code = p["code"]
    assert code.capped and code.planned_tokens == 1_200_000
    assert code.shortfall_tokens == 1_800_000
    assert code.warning == (
        "source 'code' is too small for its share 0.30: it can give 1,200,000 tokens at "
        "max_epochs 2 but the share asks for 3,000,000 (short by 1,800,000 tokens, 60%)"
    )
    assert sum(x.planned_tokens for x in plans) == 10_000_000
    # The 1.8M go to web and books in proportion to their shares (0.5 : 0.2).
    extra_web = p["web"].planned_tokens - 5_000_000
    extra_books = p["books"].planned_tokens - 2_000_000
    assert extra_web + extra_books == 1_800_000
    assert extra_web / extra_books == pytest.approx(0.5 / 0.2, rel=1e-5)
    for x in plans:
        assert x.planned_epochs <= caps[x.source] + 1e-12
    assert p["web"].warning is None and p["books"].warning is None


def test_redistribution_cascades_until_stable() -> None:
    # a is capped first; its budget then pushes b over its cap too; c takes the rest.
    available = {"a": 100, "b": 1_000, "c": 100_000}
    weights = {"a": 0.4, "b": 0.4, "c": 0.2}
    caps = dict.fromkeys(available, 1.0)
    plans = plan_mixture(available, weights, None, caps, 3_000)
    p = by_name(plans)
    assert p["a"].capped and p["a"].planned_tokens == 100
    assert p["b"].capped and p["b"].planned_tokens == 1_000
    assert not p["c"].capped and p["c"].planned_tokens == 1_900
    assert sum(x.planned_tokens for x in plans) == 3_000
    assert p["a"].shortfall_tokens == 1_100 and p["b"].shortfall_tokens == 200
    assert "short by 200 tokens, 17%" in (p["b"].warning or "")


def test_source_capped_only_by_redistribution_has_no_shortfall() -> None:
    # b can give its own share (400 <= 500) but not its share of a's leftover as well.
    available = {"a": 100, "b": 500, "c": 100_000}
    weights = {"a": 0.4, "b": 0.4, "c": 0.2}
    p = by_name(plan_mixture(available, weights, None, dict.fromkeys(available, 1.0), 1_000))
    assert p["b"].capped and p["b"].planned_tokens == 500
    assert p["b"].shortfall_tokens == 0 and p["b"].warning is None
    assert p["c"].planned_tokens == 400


def test_every_source_capped_total_falls_short_and_says_so() -> None:
    available = {"a": 1_000, "b": 600}
    plans = plan_mixture(available, {"a": 1, "b": 1}, None, {"a": 1.0, "b": 2.0}, 10_000)
    p = by_name(plans)
    assert p["a"].planned_tokens == 1_000 and p["b"].planned_tokens == 1_200
    assert all(x.capped for x in plans)
    for x in plans:
        assert x.warning is not None
        assert (
            "every source is at its max_epochs cap, so the mix has 2,200 tokens, "
            "7,800 (78%) short of total_tokens 10,000"
        ) in x.warning


def test_empty_source_with_positive_share_never_divides_by_zero() -> None:
    available = {"web": 1_000_000, "empty": 0}
    weights = {"web": 0.7, "empty": 0.3}
    caps = {"web": 1.0, "empty": 3.0}
    p = by_name(plan_mixture(available, weights, None, caps, 100_000))
    assert p["empty"].capped and p["empty"].planned_tokens == 0
    assert p["empty"].planned_epochs == 0.0
    assert p["empty"].shortfall_tokens == 30_000
    assert "source 'empty' has no train tokens" in (p["empty"].warning or "")
    assert p["web"].planned_tokens == 100_000  # takes the whole budget
    # Without a total the empty source cannot zero the mix.
    q = by_name(plan_mixture(available, weights, None, caps, None))
    assert q["web"].planned_tokens == 1_000_000 and q["web"].capped
    assert q["empty"].warning is not None and q["web"].warning is None


def test_empty_source_with_natural_shares_is_flagged() -> None:
    p = by_name(plan_mixture({"a": 100, "b": 0}, None, None, {"a": 1.0, "b": 1.0}, None))
    assert p["b"].target_share == 0 and p["b"].planned_tokens == 0 and not p["b"].capped
    assert p["b"].warning == (
        "source 'b' has no train tokens after filtering; it contributes nothing"
    )
    assert p["a"].planned_tokens == 100


def test_zero_weight_source_gets_nothing_quietly() -> None:
    p = by_name(
        plan_mixture({"a": 100, "b": 100}, {"a": 1, "b": 0}, None, {"a": 1.0, "b": 1.0}, 50)
    )
    assert (p["a"].planned_tokens, p["b"].planned_tokens) == (50, 0)
    assert p["b"].warning is None and not p["b"].capped


# ----------------------------------------------------------------- total_tokens None


def test_no_total_uses_most_constrained_source_exactly_at_cap() -> None:
    available = {"web": 10_000_000, "code": 600_000, "books": 2_000_000}
    weights = {"web": 0.5, "code": 0.3, "books": 0.2}
    caps = dict.fromkeys(available, 1.0)
    plans = plan_mixture(available, weights, None, caps, None)
    p = by_name(plans)
    # code binds: 600k / 0.3 = 2M total; the others are downsampled to their shares.
    assert p["code"].planned_tokens == 600_000 and p["code"].planned_epochs == 1.0
    assert p["code"].capped
    assert p["web"].planned_tokens == 1_000_000 and p["books"].planned_tokens == 400_000
    assert all(x.warning is None and x.shortfall_tokens == 0 for x in plans)
    assert not p["web"].capped and not p["books"].capped


def test_no_total_with_awkward_numbers_and_fractional_caps() -> None:
    available = {"a": 123_457, "b": 98_765, "c": 5_003}
    weights = {"a": 0.45, "b": 0.35, "c": 0.2}
    caps = {"a": 1.0, "b": 1.5, "c": 2.5}
    plans = plan_mixture(available, weights, None, caps, None)
    total = sum(x.planned_tokens for x in plans)
    binding = min(plans, key=lambda x: int(caps[x.source] * x.available_tokens) / x.target_share)
    assert binding.source == "c"
    assert binding.planned_tokens == int(2.5 * 5_003)  # exactly at its cap
    for x in plans:
        assert x.planned_tokens <= caps[x.source] * x.available_tokens
        assert abs(x.planned_tokens - x.target_share * total) <= 1
        assert x.warning is None


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_epochs is missing"):
        plan_mixture({"a": 1, "b": 1}, None, None, {"a": 1.0}, None)
    with pytest.raises(ValueError, match="sum to 0"):
        plan_mixture({"a": 1}, {"a": 0.0}, None, {"a": 1.0}, None)
    with pytest.raises(ValueError, match="missing: b"):
        plan_mixture({"a": 1, "b": 1}, {"a": 1.0}, None, {"a": 1.0, "b": 1.0}, None)
    with pytest.raises(ValueError, match="total_tokens"):
        plan_mixture({"a": 1}, None, None, {"a": 1.0}, -5)


# ------------------------------------------------------------------------- selection


@pytest.mark.parametrize("fraction", [0.01, 0.25, 0.5, 0.9, 0.999])
def test_downsampling_realises_the_target(fraction: float) -> None:
    tokens = lognormal_tokens(10_000, seed=1)
    keys = doc_keys(ids(10_000), seed=3)
    target = int(fraction * tokens.sum())
    counts = select_documents(keys, tokens, target)
    assert counts.dtype == np.int32 and set(np.unique(counts)) <= {0, 1}
    realised = int((counts * tokens).sum())
    assert abs(realised - target) <= 0.01 * target
    assert abs(realised - target) <= tokens.max()  # within one document
    # A whole-document prefix in key order: every chosen key is below every other key.
    if 0 < counts.sum() < len(counts):
        assert keys[counts == 1].max() < keys[counts == 0].min()


@pytest.mark.parametrize("factor", [1.0, 1.37, 2.0, 3.9])
def test_upsampling_realises_the_target(factor: float) -> None:
    tokens = lognormal_tokens(10_000, seed=2)
    keys = doc_keys(ids(10_000), seed=3)
    target = int(factor * tokens.sum())
    counts = select_documents(keys, tokens, target)
    full = int(factor)
    assert counts.min() >= full and counts.max() <= full + 1
    realised = int((counts.astype(np.int64) * tokens).sum())
    assert abs(realised - target) <= 0.01 * target
    assert abs(realised - target) <= tokens.max()


def test_plan_and_selection_together_within_one_percent() -> None:
    names = {"web": 10_000, "code": 3_000, "books": 1_000}
    toks = {n: lognormal_tokens(k, seed=i) for i, (n, k) in enumerate(names.items())}
    available = {n: int(t.sum()) for n, t in toks.items()}
    weights = {"web": 0.4, "code": 0.35, "books": 0.25}
    caps = {"web": 1.0, "code": 4.0, "books": 3.0}
    total = available["web"]  # web is downsampled, the others upsampled
    plans = plan_mixture(available, weights, None, caps, total)
    for p in plans:
        counts = select_documents(
            doc_keys(ids(names[p.source], p.source), 11), toks[p.source], p.planned_tokens
        )
        realised = int((counts.astype(np.int64) * toks[p.source]).sum())
        assert abs(realised - p.planned_tokens) <= 0.01 * p.planned_tokens
        assert counts.max() <= math.ceil(p.planned_epochs) <= math.ceil(caps[p.source])
        assert realised <= caps[p.source] * p.available_tokens + toks[p.source].max()
    epochs = by_name(plans)
    assert epochs["web"].planned_epochs < 1 < epochs["code"].planned_epochs


def test_selection_is_independent_of_input_order() -> None:
    tokens = lognormal_tokens(5_000, seed=4)
    keys = doc_keys(ids(5_000), seed=9)
    rng = np.random.default_rng(0)
    for target in (int(0.3 * tokens.sum()), int(2.6 * tokens.sum())):
        counts = select_documents(keys, tokens, target)
        perm = rng.permutation(len(keys))
        assert np.array_equal(select_documents(keys[perm], tokens[perm], target), counts[perm])


def test_selection_is_deterministic_and_seed_dependent() -> None:
    tokens = lognormal_tokens(5_000, seed=5)
    target = int(0.4 * tokens.sum())
    a = select_documents(doc_keys(ids(5_000), 1), tokens, target)
    b = select_documents(doc_keys(ids(5_000), 1), tokens, target)
    c = select_documents(doc_keys(ids(5_000), 2), tokens, target)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    # Different seeds choose nearly independent subsets (~40% overlap of a 40% sample).
    overlap = ((a == 1) & (c == 1)).sum() / max(1, (a == 1).sum())
    assert 0.3 < overlap < 0.5


def test_selection_edge_cases() -> None:
    keys = doc_keys(ids(3), 0)
    assert select_documents(keys, np.array([5, 0, 7]), 0).tolist() == [0, 0, 0]
    assert select_documents(keys, np.array([0, 0, 0]), 10).tolist() == [0, 0, 0]
    empty = select_documents(np.zeros(0, np.uint64), np.zeros(0, np.int64), 100)
    assert empty.shape == (0,) and empty.dtype == np.int32
    assert select_documents(keys, np.array([5, 1, 7]), 26).tolist() == [2, 2, 2]
    with pytest.raises(ValueError):
        select_documents(keys, np.array([1, 2]), 1)


def test_doc_keys_match_xxhash_and_are_stable_across_processes() -> None:
    sample = ["doc-1", "ünïcode/ö", ""]
    expected = [xxhash.xxh3_64_intdigest(f"42:{i}".encode()) for i in sample]
    keys = doc_keys(sample, 42)
    assert keys.dtype == np.uint64 and keys.tolist() == expected
    code = (
        "import sys; from dataprep.mixture import doc_keys; "
        "print(','.join(map(str, doc_keys(['doc-1', 'ünïcode/ö', ''], 42).tolist())))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PYTHONIOENCODING": "utf-8"},
    )
    assert [int(x) for x in out.stdout.strip().split(",")] == expected


def test_doc_keys_do_not_depend_on_shard_layout() -> None:
    all_ids = ids(1_000)
    whole = doc_keys(all_ids, 7)
    parts = np.concatenate([doc_keys(all_ids[:300], 7), doc_keys(all_ids[300:], 7)])
    assert np.array_equal(whole, parts)
    assert not np.array_equal(whole, doc_keys(all_ids, 8))


# ---------------------------------------------------------------------- training order


def test_expand_repeats() -> None:
    doc, rep = expand_repeats(np.array([2, 0, 1, 3], dtype=np.int32))
    assert doc.tolist() == [0, 0, 2, 3, 3, 3]
    assert rep.tolist() == [0, 1, 0, 0, 1, 2]
    d0, r0 = expand_repeats(np.zeros(0, np.int32))
    assert d0.size == 0 and r0.size == 0


def test_order_keys_put_groups_strictly_in_order_and_shuffle_inside() -> None:
    n = 3_000
    keys = doc_keys(ids(n), 0)
    group = np.arange(n) % 3  # 0, 1, 2 interleaved in input order
    counts = np.full(n, 2)
    doc, rep = expand_repeats(counts)
    ok = order_keys(keys[doc], rep, group[doc], seed=0)
    assert ok.dtype == np.uint64
    assert np.array_equal(ok >> np.uint64(56), group[doc].astype(np.uint64))
    order = np.argsort(ok, kind="stable")
    g_sorted = group[doc][order]
    assert np.all(np.diff(g_sorted) >= 0)  # all of group 0, then 1, then 2
    for g in (0, 1):
        assert ok[group[doc] == g].max() < ok[group[doc] == g + 1].min()
    # Inside a group the order is unrelated to input order.
    inside = doc[order][g_sorted == 0]
    rank_corr = np.corrcoef(inside, np.arange(len(inside)))[0, 1]
    assert abs(rank_corr) < 0.1


def test_order_keys_spread_repeats() -> None:
    n, k = 1_000, 3
    keys = doc_keys(ids(n), 5)
    doc, rep = expand_repeats(np.full(n, k))
    ok = order_keys(keys[doc], rep, np.zeros(len(doc), np.int64), seed=5)
    ordered_docs = doc[np.argsort(ok)]
    adjacent_same = int((ordered_docs[1:] == ordered_docs[:-1]).sum())
    assert adjacent_same <= 10  # ~2 expected by chance; clustering would give ~2000
    # Positions of a document's repeats are spread across the whole run.
    pos = np.empty(len(doc), np.int64)
    pos[np.argsort(ok)] = np.arange(len(doc))
    spans = pos.reshape(n, k).max(axis=1) - pos.reshape(n, k).min(axis=1)
    assert spans.mean() > 0.3 * len(doc)


def test_order_keys_deterministic_and_seeded() -> None:
    keys = doc_keys(ids(500), 1)
    rep = np.zeros(500, np.int64)
    a = order_keys(keys, rep, 0, seed=1)
    assert np.array_equal(a, order_keys(keys, rep, 0, seed=1))
    assert not np.array_equal(np.argsort(a), np.argsort(order_keys(keys, rep, 0, seed=2)))
    assert not np.array_equal(a, order_keys(keys, rep + 1, 0, seed=1))
    with pytest.raises(ValueError, match="group"):
        order_keys(keys, rep, 256, seed=1)
