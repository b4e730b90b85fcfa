"""The dedup index's sorted runs (dataprep/dedup_index.py): a lookup finds what a plain
set lookup finds, reading only the blocks that can hold the keys; compaction keeps that."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from core.store import open_store
from dataprep import dedup_index as di
from dataprep.dedup_index import BLOCK_KEYS, Stats


def keys(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (
        rng.integers(0, 2**64, n, dtype=np.uint64),
        rng.integers(0, 2**64, n, dtype=np.uint64),
    )


def brute(
    runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], q0: np.ndarray, q1: np.ndarray
) -> np.ndarray:
    """Each query's smallest position over every run, by a dict."""
    best: dict[tuple[int, int], int] = {}
    for k0, k1, pos in runs:
        for a, b, p in zip(k0.tolist(), k1.tolist(), pos.tolist(), strict=True):
            if (a, b) not in best or p < best[(a, b)]:
                best[(a, b)] = p
    return np.array([best.get((a, b), -1) for a, b in zip(q0.tolist(), q1.tolist(), strict=True)])


def write(store, version: int, k0, k1, pos) -> di.Run:
    return di.write_run(store, "t", [version], [(f"s{version}", len(k0))], 0, k0, k1, pos, Stats())


def test_lookup_equals_a_set_lookup_at_block_edges_with_repeats(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    rng = np.random.default_rng(0)
    k0, k1 = keys(rng, 10 * BLOCK_KEYS + 3)
    # Runs of one k0 across a block boundary (other k1), and a key repeated at two
    # positions (the smaller stays).
    k0[5 * BLOCK_KEYS - 2 : 5 * BLOCK_KEYS + 3] = k0[5 * BLOCK_KEYS - 2]
    k0 = np.concatenate([k0, k0[:1]])
    k1 = np.concatenate([k1, k1[:1]])
    pos = rng.permutation(len(k0)).astype(np.int64)
    run = write(store, 1, k0, k1, pos)
    assert run.count == len(k0) - 1
    order = np.lexsort((k1, k0))
    edges = order[[0, BLOCK_KEYS - 1, BLOCK_KEYS, 2 * BLOCK_KEYS, len(order) - 1]]
    m0, m1 = keys(rng, 50)
    q0 = np.concatenate(
        [k0[edges], k0[5 * BLOCK_KEYS - 2 : 5 * BLOCK_KEYS + 3], m0, k0[:7], k0[:7]]
    )
    q1 = np.concatenate(
        [k1[edges], k1[5 * BLOCK_KEYS - 2 : 5 * BLOCK_KEYS + 3], m1, k1[:7], m1[:7]]
    )
    q0 = np.concatenate([q0, [np.uint64(0), np.uint64(2**64 - 1)]])  # below and above all
    q1 = np.concatenate([q1, [np.uint64(0), np.uint64(0)]])
    got = di.lookup(store, [run], q0, q1, Stats())
    assert got.tolist() == brute([(k0, k1, pos)], q0, q1).tolist()


def test_lookup_reads_only_the_blocks_of_the_keys(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    rng = np.random.default_rng(1)
    n = 1000 * BLOCK_KEYS
    k0, k1 = keys(rng, n)
    run = write(store, 1, k0, k1, np.arange(n))
    q0 = np.concatenate([k0[:10], keys(rng, 10)[0]])
    q1 = np.concatenate([k1[:10], keys(rng, 10)[1]])
    stats = Stats()
    got = di.lookup(store, [run], q0, q1, stats)
    assert got.tolist() == [*range(10), *[-1] * 10]
    # 20 keys: at most 20 k0 blocks, and k1 and pos blocks for the 10 found; the fence.
    assert stats.blocks_read <= 20 + 2 * 10
    assert stats.blocks_total == 3 * 1000
    block = BLOCK_KEYS * 8
    fence = 8 * 1000
    meta = 0  # list_runs was not called: no meta read
    assert stats.bytes_read <= fence + meta + 40 * block
    assert stats.bytes_read < run.nbytes / 10


def test_empty_runs_and_empty_queries(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    empty = np.zeros(0, np.uint64)
    run = write(store, 1, empty, empty, np.zeros(0, np.int64))
    assert run.count == 0
    q0, q1 = keys(np.random.default_rng(2), 5)
    assert di.lookup(store, [run], q0, q1, Stats()).tolist() == [-1] * 5
    assert di.lookup(store, [run], empty, empty, Stats()).tolist() == []
    assert [r.versions for r in di.list_runs(store, "t")] == [(1,)]


def test_compaction_merges_a_tier_and_lookups_stay_the_same(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(di, "MERGE_KEYS", 300)  # several merge steps
    store = open_store(tmp_path)
    rng = np.random.default_rng(3)
    data, runs = [], []
    for v in range(1, 7):
        k0, k1 = keys(rng, 200 + v)
        if v > 1:  # a key of an earlier run again, at a later position
            k0[0], k1[0] = data[0][0][3], data[0][1][3]
        pos = np.arange(len(k0)) + 1000 * v
        data.append((k0, k1, pos))
        runs.append(write(store, v, k0, k1, pos))
    q0 = np.concatenate([d[0][::7] for d in data] + [keys(rng, 30)[0]])
    q1 = np.concatenate([d[1][::7] for d in data] + [keys(rng, 30)[1]])
    want = brute(data, q0, q1)
    stats = Stats()
    live = di.compact(store, runs, stats)
    # Six runs of one tier (>= FANOUT): merged into one, the inputs deleted.
    assert stats.compactions == 1
    assert [r.versions for r in live] == [(1, 2, 3, 4, 5, 6)]
    assert [r.versions for r in di.list_runs(store, "t")] == [(1, 2, 3, 4, 5, 6)]
    assert di.lookup(store, live, q0, q1, Stats()).tolist() == want.tolist()
    (merged,) = live
    assert merged.count == sum(len(d[0]) for d in data) - 5  # the repeated key once
    assert merged.shards == tuple((f"s{v}", 200 + v) for v in range(1, 7))
    assert stats.compaction_bytes_read >= sum(r.nbytes for r in runs)


def test_a_cover_prefers_a_merged_run_over_leftovers(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    rng = np.random.default_rng(4)
    runs = [write(store, v, *keys(rng, 20), np.arange(20)) for v in (1, 2, 3)]
    merged = di.merge(store, runs[:2], Stats())
    leftover = write(store, 1, *keys(rng, 20), np.arange(20))  # as if the delete was cut
    found = di.list_runs(store, "t")
    chosen = di.cover(found, [1, 2, 3])
    assert [r.versions for r in chosen] == [(1, 2), (3,)]
    assert di.cover(found, [1]) == [leftover]  # another lineage's view: version 1 alone
    di.drop_replaced(store, found, chosen)
    assert sorted(r.versions for r in di.list_runs(store, "t")) == [(1, 2), (3,)]
    assert merged in chosen


@pytest.mark.parametrize("fanout_runs", [3, 4, 9])
def test_tiers_hold_fewer_than_fanout_runs(tmp_path: Path, fanout_runs: int) -> None:
    store = open_store(tmp_path)
    rng = np.random.default_rng(fanout_runs)
    live: list[di.Run] = []
    stats = Stats()
    for v in range(1, fanout_runs + 1):
        live = di.compact(store, [*live, write(store, v, *keys(rng, 50), np.arange(50))], stats)
    tiers = [r.tier for r in live]
    assert all(tiers.count(t) < di.FANOUT for t in tiers)
    assert sorted(v for r in live for v in r.versions) == list(range(1, fanout_runs + 1))


def write_all(store, version: int, k0, pos) -> di.Run:
    return di.write_run(
        store, "b", [version], [(f"s{version}", len(k0))], 0, k0, None, pos, Stats(), mode=di.ALL
    )


def brute_all(runs: list[tuple[np.ndarray, np.ndarray]], q: np.ndarray) -> list[tuple[int, int]]:
    """(query index, position) for every position holding a query's key, sorted."""
    return sorted(
        (i, int(p))
        for i, key in enumerate(q.tolist())
        for k0, pos in runs
        for p in pos[k0 == key].tolist()
    )


def test_an_all_run_returns_every_position_of_a_key_across_blocks(tmp_path: Path) -> None:
    """Band keys: many documents share one key (a run of it spans several blocks), and
    a merge keeps every position."""
    store = open_store(tmp_path)
    rng = np.random.default_rng(5)
    data = []
    for v in range(1, 5):
        k0 = rng.integers(0, 50, 8 * BLOCK_KEYS).astype(np.uint64)  # few keys: long runs
        k0[: 3 * BLOCK_KEYS] = 7  # one key over three blocks and more
        data.append((k0, np.arange(len(k0)) + 10_000 * v))
    runs = [write_all(store, v, k0, pos) for v, (k0, pos) in enumerate(data, start=1)]
    q = np.array([7, 0, 49, 50, 2**63], np.uint64)
    owner, pos = di.lookup_all(store, runs, q, Stats())
    want = brute_all(data, q)
    assert list(zip(owner.tolist(), pos.tolist(), strict=True)) == want
    stats = Stats()
    (merged,) = di.compact(store, runs, stats)
    assert merged.mode == di.ALL and merged.count == sum(len(k) for k, _ in data)
    owner, pos = di.lookup_all(store, [merged], q, Stats())
    assert list(zip(owner.tolist(), pos.tolist(), strict=True)) == want
