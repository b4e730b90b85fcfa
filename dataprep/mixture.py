"""Mixture planning and deterministic document selection: pure functions, no I/O.

Three steps, each usable on its own:

1. `plan_mixture` turns each source's available train tokens, the requested shares
   (weights, temperature `alpha`, or natural proportions) and per-source epoch caps into
   an integer token budget per source. With a total it caps sources that cannot give
   their share and hands the rest of the budget to the others (UniMax-style); without a
   total it picks the largest mix at the exact shares that no cap forbids.
2. `select_documents` realises one source's budget: how many times each document is
   used, chosen in the order of a stable per-document hash (`doc_keys`), so the result
   depends on the seed and the document ids only, never on shard layout or input order.
3. `order_keys` gives every (document, repeat) a uint64 training-order key: the
   curriculum group in the top 8 bits, a pseudo-random hash in the low 56 bits.

Warnings: `plan_mixture` returns only `list[SourcePlan]` (the mixture stage reads the
per-source `warning` fields), so plan-level problems are put on the sources: when every
source is at its cap and the mix falls short of `total_tokens`, each of those sources'
warnings ends with the same sentence giving the plan's total and shortfall.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

__all__ = [
    "GROUP_BITS",
    "HASH_BITS",
    "SourcePlan",
    "doc_keys",
    "expand_repeats",
    "order_keys",
    "plan_mixture",
    "select_documents",
]

# order_keys layout: top 8 bits = curriculum group, low 56 bits = hash.
GROUP_BITS = 8
HASH_BITS = 64 - GROUP_BITS
MAX_GROUP = (1 << GROUP_BITS) - 1


@dataclass(frozen=True)
class SourcePlan:
    source: str
    available_tokens: int  # the source's train-split tokens after filtering
    target_share: float  # requested share (normalised weight, or temperature share)
    planned_tokens: int  # what the plan allocates (after caps)
    planned_epochs: float  # planned_tokens / available_tokens (0.0 for an empty source)
    capped: bool  # the source has a positive share and is at its max_epochs cap
    shortfall_tokens: int  # requested-but-impossible tokens (0 if none)
    warning: str | None


# --------------------------------------------------------------------------- planning


def _share_str(share: float) -> str:
    # Two decimals read well ("0.30"); tiny shares would all print as "0.00".
    return f"{share:.2f}" if share >= 0.01 else f"{share:.2g}"


def _pct_str(part: int, whole: int) -> str:
    pct = 100.0 * part / whole if whole else 100.0
    if pct >= 1:
        return f"{pct:.0f}%"
    return f"{pct:.2f}%" if pct >= 0.01 else "<0.01%"


def _shares(
    names: list[str],
    available: Mapping[str, int],
    weights: Mapping[str, float] | None,
    alpha: float | None,
) -> dict[str, float]:
    """Normalised requested shares. `alpha` wins over `weights` (as in MixtureConfig:
    weights are only read when alpha is unset); neither = natural proportions."""
    if alpha is not None:
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be a positive number (got {alpha!r})")
        # 0 ** alpha == 0, so an empty source gets no share rather than an error.
        raw = {n: float(available[n]) ** alpha for n in names}
    elif weights is not None:
        missing = [n for n in names if n not in weights]
        extra = [n for n in weights if n not in available]
        if missing or extra:
            raise ValueError(
                "weights must name exactly the sources"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; unknown: {', '.join(extra)}" if extra else "")
            )
        raw = {n: float(weights[n]) for n in names}
        bad = [f"{n}={w!r}" for n, w in raw.items() if not (math.isfinite(w) and w >= 0)]
        if bad:
            raise ValueError(f"weights must be finite and >= 0: {', '.join(bad)}")
        if sum(raw.values()) <= 0:
            raise ValueError("weights sum to 0: give at least one source a positive weight")
    else:
        raw = {n: float(available[n]) for n in names}
    total = sum(raw.values())
    if total <= 0:  # every source is empty (natural / temperature shares)
        return dict.fromkeys(names, 0.0)
    return {n: raw[n] / total for n in names}


def _largest_remainder(
    exact: Mapping[str, float], total: int, caps: Mapping[str, int]
) -> dict[str, int]:
    """Integers close to `exact` that sum to `total`, none above its cap: floors first,
    then one more token to the largest fractional parts. The caps are checked here too
    because a float product can land a hair above an integer cap."""
    out = {n: min(math.floor(x), caps[n]) for n, x in exact.items()}
    remaining = max(0, total - sum(out.values()))
    # Ties broken by name so the plan never depends on dict order.
    by_frac = sorted(exact, key=lambda n: (-(exact[n] - math.floor(exact[n])), n))
    for n in by_frac:
        if remaining == 0:
            break
        if out[n] < caps[n]:
            out[n] += 1
            remaining -= 1
    # Only reachable through float noise at a cap: give what is left to any room.
    for n in by_frac:
        if remaining == 0:
            break
        give = min(remaining, caps[n] - out[n])
        out[n] += give
        remaining -= give
    return out


def plan_mixture(
    available: dict[str, int],
    weights: dict[str, float] | None,
    alpha: float | None,
    max_epochs: dict[str, float],
    total_tokens: int | None,
) -> list[SourcePlan]:
    """Token budget per source, in the order of `available`.

    available: train tokens per source after filtering. weights: raw weights for every
    source (normalised here); ignored when `alpha` is given. alpha: temperature sampling,
    share_i proportional to available_i ** alpha. max_epochs: cap per source (every
    source must be named). total_tokens: the mix's size; None = the largest mix at the
    exact shares that keeps every source within its cap (the binding source is used
    exactly up to its cap, the others are downsampled).

    A source's cap is floor(max_epochs * available) tokens. planned_tokens sum to the
    plan total: total_tokens when the caps allow it, else the sum of the caps.
    """
    names = list(available)
    bad_avail = [f"{n}={v!r}" for n, v in available.items() if int(v) != v or v < 0]
    if bad_avail:
        raise ValueError(f"available tokens must be integers >= 0: {', '.join(bad_avail)}")
    missing = [n for n in names if n not in max_epochs]
    if missing:
        raise ValueError(f"max_epochs is missing sources: {', '.join(missing)}")
    bad_cap = [
        f"{n}={max_epochs[n]!r}"
        for n in names
        if not (math.isfinite(max_epochs[n]) and max_epochs[n] > 0)
    ]
    if bad_cap:
        raise ValueError(f"max_epochs must be > 0: {', '.join(bad_cap)}")
    if total_tokens is not None and total_tokens < 0:
        raise ValueError(f"total_tokens must be >= 0 (got {total_tokens})")

    shares = _shares(names, available, weights, alpha)
    avail = {n: int(available[n]) for n in names}
    caps = {n: math.floor(max_epochs[n] * avail[n]) for n in names}
    active = [n for n in names if shares[n] > 0]

    if total_tokens is None:
        # Empty sources cannot bound the total (that would zero the whole mix); they are
        # warned about below and the others keep their relative shares.
        live = [n for n in active if avail[n] > 0]
        s_live = sum(shares[n] for n in live)
        if live:
            rel = {n: shares[n] / s_live for n in live}
            binding = min(live, key=lambda n: (caps[n] / rel[n], n))
            t_real = caps[binding] / rel[binding]
            exact = {n: rel[n] * t_real for n in live}
            exact[binding] = float(caps[binding])  # exactly at its cap, not a float hair off
            floors = sum(math.floor(x) for x in exact.values())
            total = floors + round(sum(x - math.floor(x) for x in exact.values()))
            planned = _largest_remainder(exact, total, caps)
        else:
            planned = {}
        plan_total = sum(planned.values())
        # What the mix would have been had the empty sources given their shares.
        requested_total = plan_total / s_live if s_live > 0 else 0.0
    else:
        # UniMax-style water-filling: cap every source whose share of the remaining
        # budget exceeds its cap, hand the rest to the uncapped ones by share, repeat.
        # Capping only ever raises the others' portions, so this ends in <= n rounds.
        capped_set: set[str] = set()
        free = list(active)
        budget = float(total_tokens)
        while free:
            budget = float(total_tokens - sum(caps[n] for n in capped_set))
            s_free = sum(shares[n] for n in free)
            over = [n for n in free if shares[n] / s_free * budget > caps[n]]
            if not over:
                break
            capped_set.update(over)
            free = [n for n in free if n not in capped_set]
        exact = {n: float(caps[n]) for n in capped_set}
        if free:
            s_free = sum(shares[n] for n in free)
            exact.update({n: shares[n] / s_free * budget for n in free})
        plan_total = min(total_tokens, sum(caps[n] for n in active))
        planned = _largest_remainder(exact, plan_total, caps) if active else {}
        requested_total = float(total_tokens)

    short_sentence = None
    if total_tokens is not None and active and plan_total < total_tokens:
        short_sentence = (
            f"every source is at its max_epochs cap, so the mix has {plan_total:,} tokens, "
            f"{total_tokens - plan_total:,} ({_pct_str(total_tokens - plan_total, total_tokens)})"
            f" short of total_tokens {total_tokens:,}"
        )

    explicit_weights = alpha is None and weights is not None
    plans = []
    for n in names:
        got = planned.get(n, 0)
        share = shares[n]
        is_capped = share > 0 and got >= caps[n]
        requested = round(share * requested_total)
        # Without a total every non-empty source sits at its exact share by construction,
        # so only an empty one can fall short (rounding must not invent a 1-token warning).
        can_fall_short = is_capped and (total_tokens is not None or avail[n] == 0)
        shortfall = max(0, requested - got) if can_fall_short else 0
        warning: str | None = None
        if share > 0 and avail[n] == 0:
            warning = (
                f"source '{n}' has no train tokens after filtering, but its share "
                f"{_share_str(share)} asks for {requested:,} (short by {shortfall:,} tokens, "
                f"100%)"
                if requested
                else f"source '{n}' has no train tokens after filtering, but its share is "
                f"{_share_str(share)}"
            )
        elif shortfall > 0:
            warning = (
                f"source '{n}' is too small for its share {_share_str(share)}: it can give "
                f"{caps[n]:,} tokens at max_epochs {max_epochs[n]:g} but the share asks for "
                f"{requested:,} (short by {shortfall:,} tokens, {_pct_str(shortfall, requested)})"
            )
        elif avail[n] == 0 and not explicit_weights:
            # Natural/temperature shares give an empty source nothing; still worth saying,
            # since filters removing a whole source is usually a mistake.
            warning = f"source '{n}' has no train tokens after filtering; it contributes nothing"
        if short_sentence is not None and is_capped:
            warning = (
                f"{warning}; {short_sentence}"
                if warning
                else f"source '{n}' is at its max_epochs cap ({caps[n]:,} tokens at max_epochs "
                f"{max_epochs[n]:g}); {short_sentence}"
            )
        plans.append(
            SourcePlan(
                source=n,
                available_tokens=avail[n],
                target_share=share,
                planned_tokens=got,
                planned_epochs=got / avail[n] if avail[n] else 0.0,
                capped=is_capped,
                shortfall_tokens=shortfall,
                warning=warning,
            )
        )
    return plans


# -------------------------------------------------------------------------- selection


def doc_keys(ids: Sequence[str], seed: int) -> np.ndarray:
    """A uint64 per document id: xxh3_64 of the UTF-8 bytes of f"{seed}:{id}". Stable
    across processes, platforms and shard layouts (xxh3 is specified, unlike hash())."""
    prefix = f"{seed}:"
    return np.fromiter(
        (xxhash.xxh3_64_intdigest((prefix + i).encode("utf-8")) for i in ids),
        dtype=np.uint64,
        count=len(ids),
    )


def select_documents(keys: np.ndarray, tokens: np.ndarray, target_tokens: int) -> np.ndarray:
    """How many times each document of ONE source is used (int32, aligned with `keys`).

    Every document is used floor(target / available) times (0 when downsampling); the
    remainder is a whole-document prefix in ascending key order, stopping before or after
    the document that crosses the remainder, whichever lands closer (before on a tie),
    so the realised total is within one document of the target. Keys are uniform hashes,
    so the prefix is a seeded uniform sample. Equal keys (duplicate ids) are ordered by
    token count; only documents equal in both can swap with input order, and they are
    indistinguishable to the token budget. An empty source yields zeros.
    """
    keys = np.asarray(keys)
    tok = np.asarray(tokens).astype(np.int64, copy=False)
    if keys.ndim != 1 or keys.shape != tok.shape:
        raise ValueError(
            f"keys and tokens must be 1-D of equal length (got {keys.shape} and {tok.shape})"
        )
    if target_tokens < 0:
        raise ValueError(f"target_tokens must be >= 0 (got {target_tokens})")
    if tok.size and int(tok.min()) < 0:
        raise ValueError("token counts must be >= 0")
    counts = np.zeros(len(keys), dtype=np.int32)
    available = int(tok.sum())
    if target_tokens == 0 or available == 0:
        return counts
    full, rem = divmod(int(target_tokens), available)
    if full + 1 > np.iinfo(np.int32).max:
        raise ValueError(
            f"target {target_tokens:,} needs more than int32 repeats of {available:,} tokens"
        )
    counts[:] = full
    if rem:
        order = np.lexsort((tok, keys))  # last key is primary: hash, then token count
        cum = np.cumsum(tok[order])
        i = int(np.searchsorted(cum, rem, side="left"))  # the crossing document
        before = int(cum[i - 1]) if i else 0
        take = i + 1 if int(cum[i]) - rem < rem - before else i
        counts[order[:take]] += 1
    return counts


# ----------------------------------------------------------------------- training order

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_REPEAT_SALT = np.uint64(0xD6E8FEB86659FD93)
_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised: a bijection on uint64 with full avalanche.
    Used instead of xxhash per row because orders cover every (document, repeat) and a
    Python-level loop over them would dominate the stage's run time."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def order_keys(keys: np.ndarray, repeat: np.ndarray, group: np.ndarray, seed: int) -> np.ndarray:
    """A uint64 training-order sort key per (document, repeat) row.

    All three arrays are per row (e.g. `keys[doc_index]`, `repeat_index`,
    `group[doc_index]` from `expand_repeats`; `group` may also be a scalar). Layout: top
    8 bits = curriculum group (0 first, at most 255), low 56 bits = the top 56 bits of a
    hash of (doc key, repeat index, seed). Sorting ascending therefore puts lower groups
    entirely before higher ones and shuffles inside a group; each repeat gets its own
    hash, so repeats of one document spread out instead of clustering.
    """
    k = np.asarray(keys, dtype=np.uint64)
    r = np.asarray(repeat)
    g = np.broadcast_to(np.asarray(group), k.shape)
    if r.shape != k.shape:
        raise ValueError(f"keys and repeat must have equal shapes (got {k.shape}, {r.shape})")
    if r.size and int(r.min()) < 0:
        raise ValueError("repeat indices must be >= 0")
    if g.size and (int(g.min()) < 0 or int(g.max()) > MAX_GROUP):
        raise ValueError(f"group must be in 0..{MAX_GROUP} (got {int(g.min())}..{int(g.max())})")
    with np.errstate(over="ignore"):  # uint64 arithmetic is meant to wrap
        s = _mix64(np.array([seed & _MASK64], dtype=np.uint64) + _GOLDEN)
        h = _mix64(k ^ s)
        h = _mix64(h ^ _mix64(r.astype(np.uint64) * _GOLDEN + _REPEAT_SALT))
    return (g.astype(np.uint64) << np.uint64(HASH_BITS)) | (h >> np.uint64(GROUP_BITS))


def expand_repeats(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(doc_index, repeat_index), one row per use: counts [2, 0, 1] gives
    doc_index [0, 0, 2] and repeat_index [0, 1, 0] (int64)."""
    c = np.asarray(counts).astype(np.int64, copy=False)
    if c.ndim != 1:
        raise ValueError(f"counts must be 1-D (got shape {c.shape})")
    if c.size and int(c.min()) < 0:
        raise ValueError("counts must be >= 0")
    doc = np.repeat(np.arange(len(c), dtype=np.int64), c)
    starts = np.cumsum(c) - c
    rep = np.arange(len(doc), dtype=np.int64) - np.repeat(starts, c)
    return doc, rep
