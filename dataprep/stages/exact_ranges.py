"""Exact select partitioned by hash range (`max_task_memory` set), in place of the one
task of exact.select:

    plan      (once, small)  the shards' histograms of hash values summed and cut into
              ranges, the fewest such that none holds more documents than max_task_memory
              allows at SELECT_DOC_BYTES each (dataprep/partition.py)
    select    (per range)    every shard's hashes in the range, sorted: each duplicate and
              the first copy in input order -> pairs by the kept copy's shard
    keepers   (per shard of the version)  the kept copies' ids (dataprep/stages/dup_shuffle.py)
    dups      (per shard of this run)  exact/dups/<shard>.parquet, as exact.select writes it

Equal hashes fall in one range, and the first copy is chosen by global input index within
it, so the duplicates, the copies kept and every file after them are those of the
single-task select, for any number of ranges.

A later version (earlier versions' shards in `prior`) looks the earlier hashes up in the
dedup index (dataprep/dedup_index.py) instead: the plan readies its runs (an earlier
version without one is indexed range by range, each range within the cap) and cuts the
new shards' hashes alone into ranges; each range task looks its distinct new hashes up.
The version's own run is built the same way by the next version's plan.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np

from core.store import Store
from dataprep import dedup_index, partition
from dataprep.config import PrepConfig
from dataprep.layout import output_store, version_store
from dataprep.partition import parse_range_item, parse_shard_item, range_item, shard_item
from dataprep.stages import dup_shuffle
from dataprep.stages.exact import (
    INDEX_KIND,
    STAGE,
    first_copies,
    hist_key,
    load_hashes,
    prepare_index,
    shard_version,
    split_key,
    versions_of,
)

# Bytes a select task holds per document of its range, at its peak: the hash (16) and
# global index (8) gathered, lexsort's order (8) and the sorted copies (24), the run starts
# and first-copy indices (~17); when most of the range is duplicates, their pairs and the
# files written from them take over (~110). Measured with tracemalloc over one task of
# 200k documents (tests/e2e/test_partitioned.py holds it to this): 70 bytes at
# 30% duplicates, 73 at 0.05%, 113 at 99.5%.
SELECT_DOC_BYTES = 120
PLAN_KEY = "exact_ranges"  # the plan's entry in the run's extra (and the report)


def enabled(cfg: PrepConfig) -> bool:
    return cfg.dedup.exact and cfg.max_task_memory is not None


def single(cfg: PrepConfig) -> bool:
    return cfg.dedup.exact and cfg.max_task_memory is None


def plan(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    """The ranges of the version's hashes (earlier versions' shards included): summed
    histograms (a shard hashed by an older ballast, without one, is counted from its
    hashes) cut at the cap."""
    assert cfg.max_task_memory is not None
    store = output_store(cfg)
    cap = partition.item_cap(cfg.max_task_memory, SELECT_DOC_BYTES)
    n_new = _new_count(cfg, shards)
    prior = shards[: len(shards) - n_new]
    if prior and dedup_index.enabled():
        stats = dedup_index.Stats()
        # Within the cap: building a missing version's run, and each merge step.
        ready = prepare_index(cfg, prior, stats, partial(_build_by_ranges, cap), cap)
        if ready is not None:
            return _plan_with_index(cfg, shards, prior, ready[1], cap, stats)
    counts = np.zeros(partition.BINS, np.int64)
    offsets = np.zeros(len(shards) + 1, np.int64)
    for si, s in enumerate(shards):
        h = _histogram(store, s)
        counts += h
        offsets[si + 1] = offsets[si] + int(h.sum())
    ranges = partition.cut(counts, cap)
    tag = partition.plan_tag(ranges)
    # Each shard's first global index, for the range tasks (which then read only their
    # share of each shard, never a whole hash file): written by the plan, the same bytes
    # however often it is read again.
    buf = io.BytesIO()
    np.save(buf, offsets)
    version_store(cfg).put(offsets_key(tag), buf.getvalue())
    return _plan_record(counts, cap, ranges, tag)


def _new_count(cfg: PrepConfig, shards: list[str]) -> int:
    """How many of `shards` (the version's, earlier versions' first) are this version's:
    those its ingest named for it, at the end."""
    n = 0
    for s in reversed(shards):
        if shard_version(s) != cfg.version:
            break
        n += 1
    return n


def index_marker_key(tag: str) -> str:
    """Written by a plan that uses the dedup index: its range tasks look hashes up."""
    return f"{dup_shuffle.base(STAGE, tag)}/index.json"


def range_index_key(lo: int) -> str:
    """What one range task read of the index (summed by exact.index_record)."""
    return f"exact/index/{lo:05x}.json"


def _plan_with_index(
    cfg: PrepConfig,
    shards: list[str],
    prior: list[str],
    prior_offsets: np.ndarray,
    cap: int,
    stats: dedup_index.Stats,
) -> dict[str, Any]:
    """The ranges of the new shards' hashes alone (earlier ones are looked up, not held),
    with every shard's first position for the range tasks, as `plan` writes them."""
    store = output_store(cfg)
    new = shards[len(prior) :]
    counts = np.zeros(partition.BINS, np.int64)
    offsets = np.zeros(len(shards) + 1, np.int64)
    offsets[: len(prior) + 1] = prior_offsets
    for si, s in enumerate(new, start=len(prior)):
        h = _histogram(store, s)
        counts += h
        offsets[si + 1] = offsets[si] + int(h.sum())
    ranges_ = partition.cut(counts, cap)
    tag = partition.plan_tag(ranges_)
    vstore = version_store(cfg)
    buf = io.BytesIO()
    np.save(buf, offsets)
    vstore.put(offsets_key(tag), buf.getvalue())
    # Kept from the plan's first reading (a resumed run's plan finds the index ready and
    # would record that it built nothing).
    vstore.put_if_absent("exact/index/plan.json", json.dumps(stats.to_json()).encode())
    vstore.put_if_absent(
        index_marker_key(tag), json.dumps({"prior_documents": int(offsets[len(prior)])}).encode()
    )
    return {**_plan_record(counts, cap, ranges_, tag), "index": True}


def _histogram(store: Store, shard: str) -> np.ndarray:
    """A shard's hash histogram: the one its hash step wrote, else from its hashes."""
    key = hist_key(shard)
    if store.exists(key):
        return partition.load_histogram(store.get(key))
    return partition.histogram(load_hashes(store, shard)[:, 0])


def _plan_record(
    counts: np.ndarray, cap: int, ranges: list[tuple[int, int]], tag: str
) -> dict[str, Any]:
    """The plan's record: documents, ranges and the most one range task holds."""
    held = [int(counts[lo:hi].sum()) for lo, hi in ranges]
    return {
        "documents": int(counts.sum()),
        "bytes_per_document": SELECT_DOC_BYTES,
        "cap_documents": cap,
        "partitions": len(ranges),
        "max_documents": max(held, default=0),
        "tag": tag,
        "ranges": [[lo, hi] for lo, hi in ranges],
    }


def _build_by_ranges(
    cap: int,
    store: Store,
    version: int,
    names: list[str],
    counts: dict[str, int],
    start: int,
    earlier: list[dedup_index.Run],
    stats: dedup_index.Stats,
) -> dedup_index.Run:
    """An earlier version's run, range by range of hash values (each within the cap, as a
    select task): a version of any size is indexed holding one range of it."""
    hist = np.zeros(partition.BINS, np.int64)
    for s in names:
        key = hist_key(s)
        hist += (
            partition.load_histogram(store.get(key))
            if store.exists(key)
            else partition.histogram(load_hashes(store, s)[:, 0])
        )
    first: dict[str, int] = {}
    at = start
    for s_ in names:
        first[s_] = at
        at += counts[s_]

    def pieces() -> Iterator[dict[str, np.ndarray]]:
        for lo, hi in partition.cut(hist, cap):
            his, los, idx = [], [], []
            for s in names:
                h, rows = _in_range(store, s, lo, hi)
                stats.bytes_read += h.nbytes
                his.append(h[:, 0])
                los.append(h[:, 1])
                idx.append(rows + first[s])
            k0 = np.concatenate(his) if his else np.zeros(0, np.uint64)
            k1 = np.concatenate(los) if los else np.zeros(0, np.uint64)
            pos = np.concatenate(idx) if idx else np.zeros(0, np.int64)
            order = np.lexsort((pos, k1, k0))
            k0, k1, pos = k0[order], k1[order], pos[order]
            one = np.ones(len(k0), bool)
            one[1:] = (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1])
            k0, k1, pos = k0[one], k1[one], pos[one]
            fresh = dedup_index.lookup(store, earlier, k0, k1, stats) < 0
            yield {"k0": k0[fresh], "k1": k1[fresh], "pos": pos[fresh]}

    return dedup_index.write_sorted_run(
        store, INDEX_KIND, [version], [(s, counts[s]) for s in names], start, pieces(), stats
    )


def ranges(planned: dict[str, Any]) -> list[str]:
    """The select step's items."""
    return [range_item(planned["tag"], lo, hi) for lo, hi in planned["ranges"]]


def shard_items(planned: dict[str, Any], shards: list[str]) -> list[str]:
    """The keepers' and dups' items."""
    return [shard_item(planned["tag"], s) for s in shards]


def select_done_key(item: str) -> str:
    tag, lo, _hi = parse_range_item(item)
    return f"{dup_shuffle.base(STAGE, tag)}/done/select/{lo:05x}.json"


def select_range(cfg: PrepConfig, prior: list[str], new: list[str], item: str) -> int:
    """One range of hash values over every shard of the version: its duplicates among the
    `new` shards' documents (earlier versions lose nothing) and the copies they keep.
    Holds the range's documents, not the corpus's. Returns how many it held; its marker
    records that too, for the bound's test and the benchmark."""
    tag, lo, hi = parse_range_item(item)
    store, vstore = output_store(cfg), version_store(cfg)
    shards = [*prior, *new]
    offsets = np.load(io.BytesIO(vstore.get(offsets_key(tag))))
    if prior and vstore.exists(index_marker_key(tag)):
        return _select_range_with_index(store, vstore, prior, new, item, offsets)
    hi_w, lo_w, gi = _range_hashes(store, shards, 0, offsets, lo, hi)
    held = len(gi)
    dup, kept = first_copies(hi_w, lo_w, gi)
    del hi_w, lo_w, gi
    fresh = dup >= offsets[len(prior)]  # earlier versions' documents stay as they are
    dup, kept = dup[fresh], kept[fresh]
    dup_shuffle.write_pairs(vstore, STAGE, tag, f"{lo:05x}", shards, offsets, dup, kept)
    vstore.put(
        select_done_key(item), json.dumps({"documents": held, "duplicates": len(dup)}).encode()
    )
    return held


def _select_range_with_index(
    store: Store,
    vstore: Store,
    prior: list[str],
    new: list[str],
    item: str,
    offsets: np.ndarray,
) -> int:
    """select_range for a later version: the new shards' hashes in the range, their
    duplicates among themselves, then their distinct hashes looked up in the index runs
    the plan readied (exact.select_with_index, one range of it)."""
    tag, lo, hi = parse_range_item(item)
    shards = [*prior, *new]
    stats = dedup_index.Stats()
    groups = versions_of(prior)
    assert groups is not None  # the plan placed them
    versions = [v for v, _ in groups]
    chosen = dedup_index.cover(dedup_index.list_runs(store, INDEX_KIND, stats), versions)
    if sorted(v for r in chosen for v in r.versions) != versions:
        raise RuntimeError(f"the dedup index no longer covers versions {versions}: re-run")
    hi_w, lo_w, gi = _range_hashes(store, new, len(prior), offsets, lo, hi)
    held = len(gi)
    dup_w, kept_w = first_copies(hi_w, lo_w, gi)
    first = ~np.isin(gi, dup_w)
    found = dedup_index.lookup(store, chosen, hi_w[first], lo_w[first], stats)
    hit = found >= 0
    # A new document whose first new copy is an earlier document's copy keeps that one.
    firsts, earlier = gi[first][hit], found[hit]
    if len(firsts):
        by = np.argsort(firsts)
        firsts_s, earlier_s = firsts[by], earlier[by]
        at = np.minimum(np.searchsorted(firsts_s, kept_w), len(firsts_s) - 1)
        kept_w = np.where(firsts_s[at] == kept_w, earlier_s[at], kept_w)
    dup = np.concatenate([firsts, dup_w])
    kept = np.concatenate([earlier, kept_w])
    dup_shuffle.write_pairs(vstore, STAGE, tag, f"{lo:05x}", shards, offsets, dup, kept)
    vstore.put(range_index_key(lo), json.dumps(stats.to_json()).encode())
    vstore.put(
        select_done_key(item), json.dumps({"documents": held, "duplicates": len(dup)}).encode()
    )
    return held


def _range_hashes(
    store: Store, shards: list[str], first: int, offsets: np.ndarray, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shards' hashes in bins [lo, hi) as their high and low words, and each one's
    global input index; `first`: the first shard's place among the version's shards (the
    row of `offsets` it starts at)."""
    his, los, idx = [], [], []
    for si, s in enumerate(shards, start=first):
        h, rows = _in_range(store, s, lo, hi)
        his.append(h[:, 0])
        los.append(h[:, 1])
        idx.append(rows + offsets[si])
    return (
        np.concatenate(his) if his else np.zeros(0, np.uint64),
        np.concatenate(los) if los else np.zeros(0, np.uint64),
        np.concatenate(idx) if idx else np.zeros(0, np.int64),
    )


def offsets_key(tag: str) -> str:
    return f"{dup_shuffle.base(STAGE, tag)}/offsets.npy"


def _in_range(store: Store, shard: str, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """A shard's hashes in bins [lo, hi) and their rows: from the parts of its sorted
    split that the range overlaps, or, for a shard hashed without one (a single-task run
    resumed with max_task_memory, an earlier version's), from its whole hash file."""
    keys = store.list(f"exact/split/{shard}/")
    if keys:
        bits = int(keys[0].rsplit("/", 1)[1][:2])
        want = {split_key(shard, bits, i) for i in partition.split_files_in(bits, lo, hi)}
        parts = [np.load(io.BytesIO(store.get(k))) for k in keys if k in want]
        found = np.concatenate(parts) if parts else np.zeros((0, 3), np.uint64)
        found = found[partition.in_range(found[:, 0], lo, hi)]
        return found[:, :2], found[:, 2].astype(np.int64)
    h = load_hashes(store, shard)
    rows = np.flatnonzero(partition.in_range(h[:, 0], lo, hi))
    return h[rows], rows


def read_select_marker(cfg: PrepConfig, item: str) -> dict[str, int]:
    """What one range's select held and found."""
    return json.loads(version_store(cfg).get(select_done_key(item)))


def keepers(cfg: PrepConfig, input_stage: str, prior: list[str], new: list[str], item: str) -> int:
    return dup_shuffle.keepers(cfg, STAGE, input_stage, prior, new, item)


def keepers_done_key(item: str) -> str:
    return dup_shuffle.keepers_done_key(STAGE, item)


def dups(cfg: PrepConfig, item: str) -> int:
    return dup_shuffle.gather(cfg, STAGE, item)


def dups_done_key(item: str) -> str:
    return dup_shuffle.dups_done_key(STAGE, item)


def item_shard(item: str) -> str:
    return parse_shard_item(item)[1]
