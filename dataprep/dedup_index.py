"""The compacted dedup index (issue 35): what a later dataset version looks its new
documents' keys up in, instead of re-reading every earlier version's hashes.

Under the output, per kind of key (`exact`: the 128-bit text hash):

    _index/<kind>/<run>/k0.u64    the run's keys' high words, sorted (by k0, then k1)
                        k1.u64    their low words (0 where a kind has one word)
                        pos.i64   each key's global document position (input order over
                                  the versions' shards, as exact.select numbers them)
                        fence.u64 k0 of the first key of each block of BLOCK_KEYS keys
                        meta.json written last: the run is complete; its versions, their
                                  shards with document counts, its key count

A run holds each key once, with its smallest position. A version's run holds only the
keys its documents bring that no earlier version of its lineage has: a key is then in
exactly one run of a lineage, the run of the version that first had it, at its first
position, which is the copy the old path keeps.

Why fixed-width columns of raw uint64 and not parquet row groups: a lookup of K random
hashes among N sorted ones touches ~K blocks whatever their size (hashes are uniform), so
the bytes read are about K * block bytes + the zone map (8 bytes per block): smallest
near BLOCK_KEYS = sqrt(N / K) keys, ~10 at a 1% increment. Parquet row groups and pages
that small carry more header and statistics than data; a fixed-width column puts block i
at byte i * BLOCK_KEYS * 8, one ranged read with no footer to parse, and the fence (the
first key of each block, which for sorted contiguous blocks is the zone map's min and
the previous block's max bound) is an array searched with numpy. k1 and pos are read
only for the blocks where k0 matched, so a miss (most new documents) costs 128 bytes.

Compaction is tiered (LSM): runs of a lineage whose key counts fall in the same tier
(floor(log_FANOUT(count))) are merged into one when FANOUT of them exist, so a lineage
of V versions has O(FANOUT * log V) runs and each key is rewritten O(log V) times. A
merged run is written (meta last) before its inputs are deleted: a reader meanwhile
finds both, and covers its versions with the largest runs first.

The store's local files are read by ranges (pread), a store without local files (S3) by
ranged GETs (Store.get_range): one request per run of consecutive blocks. A version is
never changed; the index is not part of any version: it can be deleted, and is built
again from the hash files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.store import Store

INDEX = "_index"
BLOCK_KEYS = 16  # keys per block: 128 bytes of k0 per block read (see the module doc)
FANOUT = 4  # runs of one tier merged when this many exist
MERGE_KEYS = 1 << 22  # keys one merge step holds at once (~100 MB with the sort's arrays)
ENV = "BALLAST_DEDUP_INDEX"  # "0": the old path (every earlier hash re-read), the oracle
# On an object store, blocks closer than this are fetched by one ranged GET, the gap with
# them: a request's time to first byte (tens of ms on S3) buys about a megabyte of transfer,
# so fetching a small gap is cheaper than a second request (pyarrow's
# CacheOptions.from_network_metrics sizes its hole limit the same way). Measured on moto
# without it: 5x the requests and 1.6x the wall time of whole-file reads at 12k documents.
# Local files are read block by block (pread of a gap costs its bytes).
HOLE_ENV = "BALLAST_RANGE_HOLE_BYTES"
HOLE_BYTES = 1 << 20
# A run's mode: FIRST (exact hashes: two-word keys, each once at its first position) or
# ALL (MinHash band keys: one word, every document's position, since a bucket's members
# are all the documents that share the key).
FIRST, ALL = "first", "all"
COLUMNS = {
    FIRST: (("k0", np.uint64), ("k1", np.uint64), ("pos", np.int64)),
    ALL: (("k0", np.uint64), ("pos", np.int64)),
}


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass
class Stats:
    """What one version's lookups read from the history, and what compaction did."""

    bytes_read: int = 0
    blocks_read: int = 0
    blocks_total: int = 0
    bytes_total: int = 0  # every run's bytes: what reading the whole index would cost
    runs: int = 0
    compactions: int = 0
    compaction_bytes_read: int = 0
    compaction_bytes_written: int = 0
    bytes_written: int = 0
    built_lazily: list[int] = field(default_factory=list)  # versions indexed from hashes
    lookups: int = 0  # keys looked up in at least one run
    found: int = 0
    requests: int = 0  # reads (ranged GETs on an object store, preads on disk)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Run:
    kind: str
    name: str
    versions: tuple[int, ...]
    shards: tuple[tuple[str, int], ...]  # the versions' shards in input order, docs each
    start: int  # position of the first document of the run's first version
    count: int  # keys
    k0_max: int
    mode: str = FIRST

    @property
    def columns(self) -> tuple[tuple[str, type], ...]:
        return COLUMNS[self.mode]

    @property
    def prefix(self) -> str:
        return f"{INDEX}/{self.kind}/{self.name}/"

    @property
    def blocks(self) -> int:
        return -(-self.count // BLOCK_KEYS)

    @property
    def nbytes(self) -> int:
        return self.count * 8 * len(self.columns) + self.blocks * 8

    @property
    def tier(self) -> int:
        return int(math.log(max(self.count, 1), FANOUT))

    def to_json(self) -> dict[str, Any]:
        return {
            "versions": list(self.versions),
            "shards": [list(s) for s in self.shards],
            "start": self.start,
            "count": self.count,
            "k0_max": self.k0_max,
            "mode": self.mode,
            "block_keys": BLOCK_KEYS,
        }


def run_name(versions: Sequence[int]) -> str:
    tag = hashlib.sha1(",".join(map(str, versions)).encode()).hexdigest()[:8]
    return f"v{min(versions):04d}-v{max(versions):04d}-{tag}"


def list_runs(store: Store, kind: str, stats: Stats | None = None) -> list[Run]:
    """Every complete run of `kind` (those with their meta.json)."""
    out = []
    for key in store.list(f"{INDEX}/{kind}/"):
        if not key.endswith("/meta.json"):
            continue
        data = store.get(key)
        if stats is not None:
            stats.bytes_read += len(data)
        m = json.loads(data)
        if m.get("block_keys") != BLOCK_KEYS:
            continue  # written with another block size: ignored, built again
        out.append(
            Run(
                kind,
                key.split("/")[-2],
                tuple(m["versions"]),
                tuple((s, int(n)) for s, n in m["shards"]),
                int(m["start"]),
                int(m["count"]),
                int(m["k0_max"]),
                m.get("mode", FIRST),
            )
        )
    return out


def cover(runs: Sequence[Run], versions: Sequence[int]) -> list[Run]:
    """Runs that together hold each of `versions` once (and nothing else): the largest
    first, so a merged run wins over the runs it replaced if both are still there.
    Versions no run covers are the caller's to build."""
    want = set(versions)
    chosen: list[Run] = []
    have: set[int] = set()
    for r in sorted(runs, key=lambda r: (-len(r.versions), r.versions)):
        vs = set(r.versions)
        if vs <= want and not vs & have:
            chosen.append(r)
            have |= vs
    return sorted(chosen, key=lambda r: r.versions)


def hole_bytes() -> int:
    """The largest gap between wanted bytes that a remote read fetches rather than skips."""
    return int(os.environ.get(HOLE_ENV, HOLE_BYTES))


class _Reader:
    """Ranged reads of one file of the store, counted (bytes and requests)."""

    def __init__(self, store: Store, key: str, stats: Stats, counter: str = "bytes_read"):
        self.store, self.key, self.stats, self.counter = store, key, stats, counter
        self.path: Path | None = store.local_path(key)
        self.fd: int | None = None
        self.hole = 0 if self.path is not None else hole_bytes()

    def read(self, start: int, length: int) -> bytes:
        self.stats.requests += 1
        if self.path is None:
            data = self.store.get_range(self.key, start, length)
            self._count(len(data))
            return data
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDONLY)
        data = os.pread(self.fd, length, start)
        self._count(len(data))
        return data

    def _count(self, n: int) -> None:
        setattr(self.stats, self.counter, getattr(self.stats, self.counter) + n)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _read_all(store: Store, key: str, dtype: type, stats: Stats, counter: str) -> np.ndarray:
    path = store.local_path(key)
    data = path.read_bytes() if path is not None else store.get(key)
    setattr(stats, counter, getattr(stats, counter) + len(data))
    return np.frombuffer(data, dtype)


def _read_blocks(reader: _Reader, blocks: np.ndarray, count: int, dtype: type) -> np.ndarray:
    """Blocks `blocks` (sorted, unique) of a column of `count` values, concatenated; runs
    of blocks with gaps of at most the reader's hole (none on local disk) are one read
    each, the gaps' values dropped."""
    if len(blocks) == 0:
        return np.zeros(0, dtype)
    gap_blocks = reader.hole // (BLOCK_KEYS * 8)
    breaks = np.flatnonzero(np.diff(blocks) > gap_blocks + 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(blocks)]])
    parts = []
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        first = int(blocks[a]) * BLOCK_KEYS
        last = min(int(blocks[b - 1] + 1) * BLOCK_KEYS, count)
        span = np.frombuffer(reader.read(first * 8, (last - first) * 8), dtype)
        if b - a == int(blocks[b - 1]) - int(blocks[a]) + 1:  # no gap: all of it wanted
            parts.append(span)
        else:
            parts.append(span[_block_rows(blocks[a:b] - blocks[a], last - first)])
    return np.concatenate(parts)


def _block_rows(blocks: np.ndarray, count: int) -> np.ndarray:
    """The row numbers of the given blocks' values, as _read_blocks concatenates them."""
    rows = (blocks[:, None] * BLOCK_KEYS + np.arange(BLOCK_KEYS)[None, :]).ravel()
    return rows[rows < count]


def lookup_run(store: Store, run: Run, q0: np.ndarray, q1: np.ndarray, stats: Stats) -> np.ndarray:
    """Each query key's position in `run`, -1 where it is not there. Reads the fence,
    then only the k0 blocks whose key range can hold a query, then k1 and pos of the
    blocks where k0 matched."""
    found = np.full(len(q0), -1, np.int64)
    owner, rows, readers = _candidates(store, run, q0, stats)
    try:
        if len(rows) == 0:
            return found
        mblocks = np.unique(rows // BLOCK_KEYS)
        g1 = _read_blocks(readers["k1"], mblocks, run.count, np.uint64)
        gp = _read_blocks(readers["pos"], mblocks, run.count, np.int64)
        stats.blocks_read += 2 * len(mblocks)
        at = np.searchsorted(_block_rows(mblocks, run.count), rows)
        same = g1[at] == q1[owner]
        # Equal keys are one row of a run; several candidates per query only when k0 alone
        # repeats, and then at most one has the query's k1.
        found[owner[same]] = gp[at[same]]
    finally:
        for r in readers.values():
            r.close()
    return found


def lookup_all_run(
    store: Store, run: Run, q0: np.ndarray, stats: Stats
) -> tuple[np.ndarray, np.ndarray]:
    """Every row of an ALL run whose key is a query's: (query index, position) pairs, by
    query, then position."""
    owner, rows, readers = _candidates(store, run, q0, stats)
    try:
        if len(rows) == 0:
            return owner, np.zeros(0, np.int64)
        mblocks = np.unique(rows // BLOCK_KEYS)
        gp = _read_blocks(readers["pos"], mblocks, run.count, np.int64)
        stats.blocks_read += len(mblocks)
        return owner, gp[np.searchsorted(_block_rows(mblocks, run.count), rows)]
    finally:
        for r in readers.values():
            r.close()


def _candidates(
    store: Store, run: Run, q0: np.ndarray, stats: Stats
) -> tuple[np.ndarray, np.ndarray, dict[str, _Reader]]:
    """The rows of `run` whose k0 is a query's, as (query index, row) pairs by query then
    row, and the run's column readers (the caller closes them). Reads the fence, then only
    the k0 blocks whose key range can hold a query."""
    stats.blocks_total += run.blocks * len(run.columns)
    stats.bytes_total += run.nbytes
    readers = {c: _Reader(store, run.prefix + f"{c}.{_ext(t)}", stats) for c, t in run.columns}
    none = np.zeros(0, np.int64)
    if run.count == 0 or len(q0) == 0:
        return none, none, readers
    fence = _read_all(store, run.prefix + "fence.u64", np.uint64, stats, "bytes_read")
    # A key equal to a fence may also end the block before it (equal k0, other k1): a
    # query's blocks run from the last fence below it to the last fence not above it.
    first_b = np.maximum(np.searchsorted(fence, q0, "left") - 1, 0)
    last_b = np.searchsorted(fence, q0, "right") - 1
    live = (last_b >= 0) & (q0 <= np.uint64(run.k0_max))
    if not live.any():
        return none, none, readers
    spans = last_b[live] - first_b[live]
    blocks = np.concatenate([first_b[live], last_b[live]])
    for a, n in zip(first_b[live][spans > 1].tolist(), spans[spans > 1].tolist(), strict=True):
        blocks = np.concatenate([blocks, np.arange(a, a + n + 1)])  # long runs of one k0
    blocks = np.unique(blocks)
    g0 = _read_blocks(readers["k0"], blocks, run.count, np.uint64)
    stats.blocks_read += len(blocks)
    rows0 = _block_rows(blocks, run.count)
    left = np.searchsorted(g0, q0, "left")
    right = np.searchsorted(g0, q0, "right")
    hit = np.flatnonzero(right > left)
    n = (right - left)[hit]
    owner = np.repeat(hit, n)
    # Each hit's candidates left..right-1, without a Python loop over the hits.
    cand = np.repeat(left[hit], n) + np.arange(len(owner)) - np.repeat(np.cumsum(n) - n, n)
    return owner, rows0[cand], readers


def lookup(
    store: Store, runs: Sequence[Run], q0: np.ndarray, q1: np.ndarray, stats: Stats
) -> np.ndarray:
    """Each query key's smallest position over `runs`, -1 where none holds it."""
    q0 = np.ascontiguousarray(q0, np.uint64)
    q1 = np.ascontiguousarray(q1, np.uint64)
    best = np.full(len(q0), -1, np.int64)
    stats.runs = len(runs)
    if not runs:
        return best
    stats.lookups += len(q0)
    for run in runs:
        pos = lookup_run(store, run, q0, q1, stats)
        better = (pos >= 0) & ((best < 0) | (pos < best))
        best[better] = pos[better]
    stats.found += int((best >= 0).sum())
    return best


def lookup_all(
    store: Store, runs: Sequence[Run], q0: np.ndarray, stats: Stats
) -> tuple[np.ndarray, np.ndarray]:
    """Every position over `runs` (ALL mode) with a query's key: (query index, position)
    pairs sorted by query, then position."""
    q0 = np.ascontiguousarray(q0, np.uint64)
    stats.runs = len(runs)
    owners, found = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    if runs:
        stats.lookups += len(q0)
    for run in runs:
        o, p = lookup_all_run(store, run, q0, stats)
        owners.append(o)
        found.append(p)
    owner, pos = np.concatenate(owners), np.concatenate(found)
    order = np.lexsort((pos, owner))
    stats.found += len(np.unique(owner))
    return owner[order], pos[order]


def _ext(dtype: type) -> str:
    return "i64" if dtype is np.int64 else "u64"


def write_run(
    store: Store,
    kind: str,
    versions: Sequence[int],
    shards: Sequence[tuple[str, int]],
    start: int,
    k0: np.ndarray,
    k1: np.ndarray | None,
    pos: np.ndarray,
    stats: Stats,
    mode: str = FIRST,
) -> Run:
    """A run of the given keys (any order; FIRST: repeats allowed, the smallest position
    stays; ALL: every (key, position), k1 unused), its meta written last."""
    if mode == ALL:
        order = np.lexsort((pos, k0))
        cols = {"k0": k0[order], "pos": pos[order].astype(np.int64)}
    else:
        assert k1 is not None
        order = np.lexsort((pos, k1, k0))
        k0, k1, pos = k0[order], k1[order], pos[order]
        first = np.ones(len(k0), bool)
        first[1:] = (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1])
        cols = {"k0": k0[first], "k1": k1[first], "pos": pos[first].astype(np.int64)}
    return write_sorted_run(store, kind, versions, shards, start, [cols], stats, mode)


def write_sorted_run(
    store: Store,
    kind: str,
    versions: Sequence[int],
    shards: Sequence[tuple[str, int]],
    start: int,
    pieces: Iterable[dict[str, np.ndarray]],
    stats: Stats,
    mode: str = FIRST,
    counter: str = "bytes_written",
) -> Run:
    """A run from pieces already in key order (FIRST: deduplicated; each piece's keys after
    the previous piece's), drawn one at a time: a run of any size, holding one piece.
    `counter`: the Stats field its bytes count in (a merge's are compaction, not new
    index)."""
    name = run_name(versions)
    prefix = f"{INDEX}/{kind}/{name}/"
    cols = COLUMNS[mode]
    fence_parts = [np.zeros(0, np.uint64)]
    count = k0_max = 0
    with tempfile.TemporaryDirectory(prefix="ballast-index-") as tmp:
        files = {c: open(Path(tmp) / c, "wb") for c, _ in cols}  # noqa: SIM115
        try:
            for p in pieces:
                n = len(p["k0"])
                if n:  # the first key of each block, across pieces
                    fence_parts.append(p["k0"][np.arange((-count) % BLOCK_KEYS, n, BLOCK_KEYS)])
                    k0_max = int(p["k0"][-1])
                for c, t in cols:
                    files[c].write(np.ascontiguousarray(p[c], t).tobytes())
                count += n
        finally:
            for f in files.values():
                f.close()
        for c, t in cols:
            store.put_file(prefix + f"{c}.{_ext(t)}", Path(tmp) / c)
    fence = np.concatenate(fence_parts).astype(np.uint64)
    store.put(prefix + "fence.u64", fence.tobytes())
    run = Run(kind, name, tuple(versions), tuple(shards), start, count, k0_max, mode)
    store.put(prefix + "meta.json", json.dumps(run.to_json()).encode())
    setattr(stats, counter, getattr(stats, counter) + run.nbytes)
    return run


def _lower_bound(store: Store, run: Run, value: int, fence: np.ndarray, stats: Stats) -> int:
    """The first row of `run` whose k0 is >= value (one block read)."""
    b = int(np.searchsorted(fence, np.uint64(value), "left")) - 1
    if b < 0:
        return 0
    reader = _Reader(store, run.prefix + "k0.u64", stats, "compaction_bytes_read")
    try:
        block = _read_blocks(reader, np.array([b]), run.count, np.uint64)
    finally:
        reader.close()
    return b * BLOCK_KEYS + int(np.searchsorted(block, np.uint64(value), "left"))


def merge(store: Store, runs: Sequence[Run], stats: Stats, merge_keys: int | None = None) -> Run:
    """One run holding every key of `runs` (FIRST: at its smallest position; ALL: every
    position). In steps over ranges of k0 (hashes are uniform: equal slices of the key
    space hold about equal counts), so a merge holds `merge_keys` (default MERGE_KEYS)
    keys at a time, not the runs' sum."""
    runs = sorted(runs, key=lambda r: r.versions)
    mode = runs[0].mode
    cols = COLUMNS[mode]
    total = sum(r.count for r in runs)
    steps = max(1, -(-total // (merge_keys or MERGE_KEYS)))
    cuts = [0, *[(i << 64) // steps for i in range(1, steps)], 1 << 64]
    fences = [
        _read_all(store, r.prefix + "fence.u64", np.uint64, stats, "compaction_bytes_read")
        for r in runs
    ]
    bounds = [
        [0, *[_lower_bound(store, r, c, f, stats) for c in cuts[1:-1]], r.count]
        for r, f in zip(runs, fences, strict=True)
    ]

    def pieces() -> Iterator[dict[str, np.ndarray]]:
        for s in range(steps):
            yield _merged_piece(store, runs, bounds, s, cols, mode, stats)

    versions = sorted(v for r in runs for v in r.versions)
    shards = [s for r in runs for s in r.shards]
    merged = write_sorted_run(
        store,
        runs[0].kind,
        versions,
        shards,
        min(r.start for r in runs),
        pieces(),
        stats,
        mode,
        counter="compaction_bytes_written",
    )
    for r in runs:
        delete_run(store, r)
    stats.compactions += 1
    return merged


def _merged_piece(
    store: Store,
    runs: Sequence[Run],
    bounds: Sequence[Sequence[int]],
    s: int,
    cols: tuple[tuple[str, type], ...],
    mode: str,
    stats: Stats,
) -> dict[str, np.ndarray]:
    """Step s of a merge: every run's rows in its k0 range, sorted (FIRST: deduplicated)."""
    parts: dict[str, list[np.ndarray]] = {c: [] for c, _ in cols}
    for r, b in zip(runs, bounds, strict=True):
        lo, hi = b[s], b[s + 1]
        for c, t in cols:
            reader = _Reader(store, r.prefix + f"{c}.{_ext(t)}", stats, "compaction_bytes_read")
            try:
                parts[c].append(np.frombuffer(reader.read(lo * 8, (hi - lo) * 8), t))
            finally:
                reader.close()
    got = {c: np.concatenate(parts[c]) for c, _ in cols}
    if mode == ALL:
        order = np.lexsort((got["pos"], got["k0"]))
        return {c: v[order] for c, v in got.items()}
    k0, k1, pos = got["k0"], got["k1"], got["pos"]
    order = np.lexsort((pos, k1, k0))
    k0, k1, pos = k0[order], k1[order], pos[order]
    first = np.ones(len(k0), bool)
    first[1:] = (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1])
    return {"k0": k0[first], "k1": k1[first], "pos": pos[first]}


def delete_run(store: Store, run: Run) -> None:
    """The meta first: a half-deleted run is no longer a run."""
    store.delete(run.prefix + "meta.json")
    for key in store.list(run.prefix):
        store.delete(key)


def compact(
    store: Store, runs: Sequence[Run], stats: Stats, merge_keys: int | None = None
) -> list[Run]:
    """Merge runs tier by tier while some tier holds FANOUT of them (module doc)."""
    live = sorted(runs, key=lambda r: r.versions)
    while True:
        tiers: dict[int, list[Run]] = {}
        for r in live:
            tiers.setdefault(r.tier, []).append(r)
        full = [t for t, rs in sorted(tiers.items()) if len(rs) >= FANOUT]
        if not full:
            return live
        group = tiers[full[0]]
        merged = merge(store, group, stats, merge_keys)
        live = sorted([r for r in live if r not in group] + [merged], key=lambda r: r.versions)


def drop_replaced(store: Store, runs: Sequence[Run], chosen: Sequence[Run]) -> None:
    """Delete runs whose versions a chosen (merged) run holds: left by a merge that was
    stopped between writing its run and deleting its inputs."""
    for r in runs:
        if r in chosen:
            continue
        if any(set(r.versions) < set(c.versions) for c in chosen):
            delete_run(store, r)
