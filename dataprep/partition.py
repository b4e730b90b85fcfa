"""Partitions of the run-once steps (`max_task_memory`): contiguous ranges of a 64-bit
hash's values, cut so that no range holds more items than one task's memory allows at the
step's measured bytes per item.

Why ranges cut from a histogram rather than `hash % P`: the number of partitions then
follows from counts, not from an average, so the bound holds for every partition and not
only on average (a modulo split of a few hundred items puts half again as many in the
fullest partition as in the mean one). Each shard's step writes the histogram of its items'
top HIST_BITS bits (a few KB compressed); the plan sums them and cuts greedily. An item's
partition depends only on its hash, so equal hashes always meet in one task: a partitioned
select finds exactly the duplicates a single one finds.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable

import numpy as np

HIST_BITS = 16  # 65,536 bins: at 10**10 items, ~150k items (12 MB at 80 B) a bin
BINS = 1 << HIST_BITS


def top_bins(words: np.ndarray) -> np.ndarray:
    """The histogram bin of each 64-bit hash word: its top HIST_BITS bits."""
    return (words >> np.uint64(64 - HIST_BITS)).astype(np.int64)


def histogram(words: np.ndarray) -> np.ndarray:
    """Items per bin (int64, BINS long)."""
    return np.bincount(top_bins(words), minlength=BINS).astype(np.int64)


def histogram_bytes(words: np.ndarray) -> bytes:
    """A histogram as stored: compressed (a small shard's bins are mostly zero)."""
    buf = io.BytesIO()
    np.savez_compressed(buf, counts=histogram(words).astype(np.uint32))
    return buf.getvalue()


def load_histogram(data: bytes) -> np.ndarray:
    with np.load(io.BytesIO(data)) as z:
        return z["counts"].astype(np.int64)


# A shard's items are also written sorted and split by their top bits into 2**bits files
# (split_bits), so a partition's task reads only the files its range overlaps: every
# shard's share of its range, not every shard's items, while there are no more
# partitions than files. Files of at least SPLIT_MIN_ITEMS items, at most 2**MAX_SPLIT_BITS.
SPLIT_MIN_ITEMS = 1024
MAX_SPLIT_BITS = 8


def split_bits(n: int) -> int:
    """How many top bits split a shard of `n` items into files."""
    bits = 0
    while bits < MAX_SPLIT_BITS and (n >> (bits + 1)) >= SPLIT_MIN_ITEMS:
        bits += 1
    return bits


def split_bounds(words: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The order that sorts `words` and, in that order, where each of the 2**bits files
    starts (2**bits + 1 bounds)."""
    order = np.argsort(words, kind="stable")
    tops = (words[order] >> np.uint64(64 - bits)) if bits else np.zeros(len(words), np.uint64)
    bounds = np.searchsorted(tops, np.arange((1 << bits) + 1, dtype=np.uint64))
    return order, bounds


def split_files_in(bits: int, lo: int, hi: int) -> range:
    """The files (of 2**bits) that bins [lo, hi) overlap."""
    shift = HIST_BITS - bits
    return range(lo >> shift, ((hi - 1) >> shift) + 1)


def item_cap(max_task_memory: int, bytes_per_item: int) -> int:
    """Items one task may hold: at least one, whatever the bound."""
    return max(1, max_task_memory // bytes_per_item)


def cut(counts: np.ndarray, cap: int) -> list[tuple[int, int]]:
    """Contiguous bin ranges [lo, hi) covering every bin, each holding at most `cap` items
    (a bin over the cap is a range of its own, with empty bins at most: the finest a range
    can be), the
    fewest a greedy left-to-right cut gives. Deterministic: the same counts and cap give
    the same ranges."""
    ranges: list[tuple[int, int]] = []
    lo, held = 0, 0
    for b, c in enumerate(counts.tolist()):
        if held and held + c > cap:
            ranges.append((lo, b))
            lo, held = b, 0
        held += c
    ranges.append((lo, len(counts)))
    return ranges


def in_range(words: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Which hash words fall in bins [lo, hi)."""
    if lo == 0 and hi == BINS:
        return np.ones(len(words), dtype=bool)
    b = top_bins(words)
    return (b >= lo) & (b < hi)


def plan_tag(ranges: Iterable[tuple[int, int]]) -> str:
    """A short name of a set of ranges, in the keys of its files: a run resumed with
    another bound writes beside, never over, the files of the first."""
    text = ",".join(f"{lo}-{hi}" for lo, hi in ranges)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def range_item(tag: str, lo: int, hi: int) -> str:
    """A partition as a step's item: "TAG.LLLLL-HHHHH" (hex bins)."""
    return f"{tag}.{lo:05x}-{hi:05x}"


def parse_range_item(item: str) -> tuple[str, int, int]:
    tag, _, bins = item.partition(".")
    lo, _, hi = bins.partition("-")
    return tag, int(lo, 16), int(hi, 16)


def shard_item(tag: str, shard: str) -> str:
    """A shard of a partitioned step's later passes: "TAG.SHARD"."""
    return f"{tag}.{shard}"


def parse_shard_item(item: str) -> tuple[str, str]:
    tag, _, shard = item.partition(".")
    return tag, shard
