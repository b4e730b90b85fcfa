"""Exact deduplication: a 128-bit hash of the normalised text, global across sources.
The copy that stays is the first in input order (sources as configured, then files,
then lines), so the result does not depend on how the work was scheduled."""

from __future__ import annotations

import io
import itertools
import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from core.store import Store, open_file, open_ranged
from dataprep import dedup_index, partition
from dataprep.config import PrepConfig
from dataprep.layout import (
    DroppedRows,
    ShardStats,
    doc_location,
    docs_key,
    output_store,
    read_view,
    take_rows,
    text_source,
    version_store,
    view_text,
    write_view,
)
from dataprep.records import parquet_bytes_to_table, table_to_parquet_bytes

STAGE = "exact"
DUPS_KEY = "exact/dups.json"  # written last: select is done


def hashes_key(shard: str) -> str:
    return f"exact/hashes/{shard}.npy"


def hist_key(shard: str) -> str:
    """A shard's hashes counted by their top bits (dataprep/partition.py)."""
    return f"exact/hist/{shard}.npz"


def hash_shard(cfg: PrepConfig, input_stage: str, shard: str) -> int:
    store = output_store(cfg)
    view = read_view(store, input_stage, shard)
    h = np.frombuffer(text_hashes(view_text(store, view, shard)), np.uint64).reshape(-1, 2)
    # Before the hashes (their file is the done key): what a partitioned select's plan
    # reads instead of every hash (dataprep/partition.py).
    store.put(hist_key(shard), partition.histogram_bytes(h[:, 0]))
    if cfg.max_task_memory is not None:
        write_split(store, shard, h)
    buf = io.BytesIO()
    np.save(buf, h)
    store.put(hashes_key(shard), buf.getvalue())
    return len(view.rows)


def split_key(shard: str, bits: int, i: int) -> str:
    """Part i of 2**bits of a shard's hashes sorted by value (partition.split_bits)."""
    return f"exact/split/{shard}/{bits:02d}-{i:03x}.npy"


def write_split(store: Store, shard: str, h: np.ndarray) -> None:
    """The shard's hashes sorted and split by their top bits, as rows (hi, lo, row): a
    partitioned select's range task reads only the parts its range overlaps. Empty parts
    are not written; the directory's listing gives the split."""
    bits = partition.split_bits(len(h))
    order, bounds = partition.split_bounds(h[:, 0], bits)
    for i in range(1 << bits):
        a, b = int(bounds[i]), int(bounds[i + 1])
        if a == b:
            continue
        rows = order[a:b]
        part = np.empty((b - a, 3), np.uint64)
        part[:, :2] = h[rows]
        part[:, 2] = rows
        buf = io.BytesIO()
        np.save(buf, part)
        store.put(split_key(shard, bits, i), buf.getvalue())


def text_hashes(column: pa.ChunkedArray) -> bytes:
    """xxh3-128 digests of every text's UTF-8 bytes, concatenated, hashed straight from
    the Arrow buffers: no Python string is made or encoded again."""
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    for chunk in column.chunks:
        if len(chunk) == 0:
            continue
        _, offsets, data = chunk.buffers()
        width = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
        off = np.frombuffer(offsets, dtype=width)[chunk.offset : chunk.offset + len(chunk) + 1]
        mv = memoryview(data if data is not None else b"")
        bounds = off.tolist()
        out += [digest(mv[a:b]) for a, b in itertools.pairwise(bounds)]
    return b"".join(out)


# Documents whose hashes one pass of `select` sorts at once (40 bytes each with the sort's
# index arrays): more than this and the hashes are split into passes by hash value.
PASS_DOCS = 1 << 24


def select(cfg: PrepConfig, input_stage: str, prior: list[str], new: list[str]) -> int:
    """Find every duplicate among the `new` shards and the first copy it duplicates. Holds
    16 bytes per document (not text), and at most PASS_DOCS documents' hashes at once: a
    larger corpus is handled in passes, each over the hashes that fall in one range of
    values, so memory stays bounded and each pass's duplicates are complete (equal hashes
    share a pass).

    `prior`: the shards of earlier dataset versions, whose hashes are the index new
    documents are deduplicated against. They come first in input order, so a copy of an
    earlier version's document is dropped naming that document; they lose nothing
    themselves (a version, once made, never changes).

    With earlier versions, their hashes are looked up in the dedup index
    (dataprep/dedup_index.py; `select_with_index`) instead of read whole: the same files
    come out. This path (BALLAST_DEDUP_INDEX=0, or shards it cannot place) is its oracle."""
    store = output_store(cfg)
    if prior and dedup_index.enabled():
        removed = select_with_index(cfg, input_stage, prior, new)
        if removed is not None:
            return removed
    shards = [*prior, *new]
    counts = np.array([_hash_rows(store, s) for s in shards], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    n_pass = max(1, -(-int(offsets[-1]) // PASS_DOCS))
    dups, keepers = [], []
    for p in range(n_pass):
        his, los, idx = [], [], []
        for si, s in enumerate(shards):
            h = load_hashes(store, s)
            rows = (
                np.flatnonzero(h[:, 0] % np.uint64(n_pass) == p)
                if n_pass > 1
                else np.arange(len(h))
            )
            his.append(h[rows, 0])
            los.append(h[rows, 1])
            idx.append(rows + offsets[si])
        hi = np.concatenate(his) if his else np.zeros(0, np.uint64)
        lo = np.concatenate(los) if los else np.zeros(0, np.uint64)
        gi = np.concatenate(idx) if idx else np.zeros(0, np.int64)
        del his, los, idx
        dup, kept = first_copies(hi, lo, gi)
        dups.append(dup)
        keepers.append(kept)
    dup_all = np.concatenate(dups) if dups else np.zeros(0, np.int64)
    kept_all = np.concatenate(keepers) if keepers else np.zeros(0, np.int64)
    fresh = dup_all >= offsets[len(prior)]  # earlier versions' documents stay as they are
    dup_all, kept_all = dup_all[fresh], kept_all[fresh]
    order = np.argsort(dup_all, kind="stable")
    write_dups(store, input_stage, shards, offsets, dup_all[order], kept_all[order], STAGE)
    version_store(cfg).put(DUPS_KEY, json.dumps({"removed": len(dup_all)}).encode())
    return len(dup_all)


def first_copies(hi: np.ndarray, lo: np.ndarray, gi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of documents with 128-bit hashes (hi, lo) and global input indices gi: every
    duplicate and, for each, the first document in input order with its hash."""
    order = np.lexsort((gi, lo, hi))  # by hash, then input order: a run's first stays
    hi, lo, gi = hi[order], lo[order], gi[order]
    del order
    new = np.ones(len(gi), dtype=bool)
    new[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
    first = gi[new][np.cumsum(new) - 1]  # each document's run's first index
    dup = ~new
    return gi[dup], first[dup]


# The dedup index (dataprep/dedup_index.py) of exact hashes: k0, k1 = the hash's words.
INDEX_KIND = "exact"
INDEX_KEY = "exact/index.json"  # in the version's store: what its lookups read
_SHARD_VERSION = re.compile(r"^(?:v(\d{4,})-)?u\d{5}")


def shard_version(shard: str) -> int | None:
    """The version whose ingest made `shard` (unit names: "u00003-..." is version 1's,
    "v0002-u00003-..." version 2's); None for a name of another form."""
    m = _SHARD_VERSION.match(shard)
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) else 1


def versions_of(shards: list[str]) -> list[tuple[int, list[str]]] | None:
    """The shards grouped by version, in their order; None unless each version's shards
    are together and the versions ascend (a lineage, as versions.lineage lists it)."""
    groups: list[tuple[int, list[str]]] = []
    for s in shards:
        v = shard_version(s)
        if v is None or (groups and v < groups[-1][0]):
            return None
        if groups and groups[-1][0] == v:
            groups[-1][1].append(s)
        else:
            groups.append((v, [s]))
    return groups


# Builds the run of an earlier version that has none: (store, version, its shards, their
# document counts, its first position, the runs of the versions before it, stats) -> run.
Builder = Callable[
    [Store, int, list[str], dict[str, int], int, list[dedup_index.Run], dedup_index.Stats],
    dedup_index.Run,
]


def prepare_index(
    cfg: PrepConfig,
    prior: list[str],
    stats: dedup_index.Stats,
    build: Builder | None = None,
    merge_keys: int | None = None,
) -> tuple[list[dedup_index.Run], np.ndarray] | None:
    """The index's runs that cover the versions of `prior` (those a version lacks built
    first by `build`, by default from its whole hash files), compacted (`merge_keys` a
    merge step at most), and the prior shards' first positions (and their end). None
    when the shards cannot be placed in versions, or the index names other shards than
    they are."""
    groups = versions_of(prior)
    if groups is None or any(v >= cfg.version for v, _ in groups):
        return None
    store = output_store(cfg)
    runs = dedup_index.list_runs(store, INDEX_KIND, stats)
    chosen = dedup_index.cover(runs, [v for v, _ in groups])
    dedup_index.drop_replaced(store, runs, chosen)
    by_version = dict(groups)
    counts: dict[str, int] = {}
    for r in chosen:
        if sorted(s for s, _ in r.shards) != sorted(s for v in r.versions for s in by_version[v]):
            return None  # the index names other shards than the lineage: do not trust it
        counts.update(dict(r.shards))
    for s in prior:
        if s not in counts:
            counts[s] = _hash_rows(store, s)
    offsets = np.concatenate([[0], np.cumsum([counts[s] for s in prior])]).astype(np.int64)
    first_of = {s: int(offsets[i]) for i, s in enumerate(prior)}
    if any(r.start != first_of[r.shards[0][0]] for r in chosen if r.shards):
        return None
    held = {v for r in chosen for v in r.versions}
    for v, names in groups:  # earlier versions not yet indexed: from their hashes, once
        if v in held:
            continue
        earlier = [r for r in chosen if max(r.versions) < v]
        chosen.append(
            (build or _build_whole)(store, v, names, counts, first_of[names[0]], earlier, stats)
        )
        stats.built_lazily.append(v)
    return dedup_index.compact(store, chosen, stats, merge_keys), offsets


def _build_whole(
    store: Store,
    version: int,
    names: list[str],
    counts: dict[str, int],
    start: int,
    earlier: list[dedup_index.Run],
    stats: dedup_index.Stats,
) -> dedup_index.Run:
    """A version's run from all of its hashes at once (16 bytes a document held)."""
    h, gi = _hashes_at(store, names, start, stats)
    found = dedup_index.lookup(store, earlier, h[:, 0], h[:, 1], stats)
    fresh = found < 0
    return dedup_index.write_run(
        store,
        INDEX_KIND,
        [version],
        [(s, counts[s]) for s in names],
        start,
        h[fresh, 0],
        h[fresh, 1],
        gi[fresh],
        stats,
    )


def select_with_index(
    cfg: PrepConfig, input_stage: str, prior: list[str], new: list[str]
) -> int | None:
    """`select` for a version with earlier ones, its new hashes looked up in the index:

    1. the runs that cover the earlier versions (a version without one, as an output made
       before the index has, is indexed from its hash files first, once);
    2. compaction of those runs (dedup_index.compact);
    3. the new documents' duplicates among themselves (first_copies), then each distinct
       new hash looked up: one found is an earlier document's, the first copy the old path
       keeps (the index holds each hash at its first position), and every new document
       with that hash is a duplicate of it;
    4. the version's own run: its distinct hashes that no earlier version has.
    Returns None (the caller runs the old path) when the shards cannot be placed in
    versions, or the index disagrees with them."""
    store = output_store(cfg)
    stats = dedup_index.Stats()
    ready = prepare_index(cfg, prior, stats)
    if ready is None:
        return None
    chosen, offsets = ready

    base = int(offsets[-1])
    h, gi = _hashes_at(store, new, base, None)
    new_counts = [_hash_rows(store, s) for s in new]
    dup_w, kept_w = first_copies(h[:, 0], h[:, 1], gi)
    first = np.ones(len(gi), bool)
    first[dup_w - base] = False
    fpos = gi[first]
    found = dedup_index.lookup(store, chosen, h[first, 0], h[first, 1], stats)
    hit = found >= 0
    # A new document whose first new copy is an earlier document's copy keeps that one.
    earlier_copy = np.full(len(gi), -1, np.int64)
    earlier_copy[fpos[hit] - base] = found[hit]
    moved = earlier_copy[kept_w - base]
    kept_w = np.where(moved >= 0, moved, kept_w)
    dup_all = np.concatenate([fpos[hit], dup_w])
    kept_all = np.concatenate([found[hit], kept_w])
    order = np.argsort(dup_all, kind="stable")
    all_offsets = np.concatenate([offsets, base + np.cumsum(new_counts, dtype=np.int64)])
    ids_read = write_dups(
        store, input_stage, [*prior, *new], all_offsets, dup_all[order], kept_all[order], STAGE
    )
    mine = first.copy()
    mine[first] = ~hit
    dedup_index.write_run(
        store,
        INDEX_KIND,
        [cfg.version],
        list(zip(new, new_counts, strict=True)),
        base,
        h[mine, 0],
        h[mine, 1],
        gi[mine],
        stats,
    )
    record = {
        **stats.to_json(),
        "kept_ids_bytes_read": ids_read,
        "history_documents": base,
        "history_hash_bytes": base * 16,  # what the old path reads of the history
    }
    version_store(cfg).put(INDEX_KEY, json.dumps(record, indent=1).encode())
    version_store(cfg).put(DUPS_KEY, json.dumps({"removed": len(dup_all)}).encode())
    return len(dup_all)


def _hashes_at(
    store: Store, shards: list[str], start: int, stats: dedup_index.Stats | None
) -> tuple[np.ndarray, np.ndarray]:
    """The shards' hashes, concatenated, and their global positions from `start`."""
    parts = [load_hashes(store, s) for s in shards]
    h = np.concatenate(parts) if parts else np.zeros((0, 2), np.uint64)
    if stats is not None:  # an earlier version's hashes: history read
        stats.bytes_read += h.nbytes
    return h, start + np.arange(len(h), dtype=np.int64)


def index_record(cfg: PrepConfig) -> dict[str, Any] | None:
    """What the version's exact select read of the index (None: it did not use one)."""
    vstore = version_store(cfg)
    if vstore.exists(INDEX_KEY):
        return json.loads(vstore.get(INDEX_KEY))
    keys = vstore.list("exact/index/")  # a partitioned select's: its plan's, each range's
    if not keys:
        return None
    total: dict[str, Any] = {}
    for key in keys:
        for name, value in json.loads(vstore.get(key)).items():
            if isinstance(value, list):
                total[name] = sorted(set(total.get(name, [])) | set(value))
            elif name == "runs":
                total[name] = max(total.get(name, 0), value)
            else:
                total[name] = total.get(name, 0) + value
    return total


def _hash_rows(store: Store, shard: str) -> int:
    """Rows of a shard's hash file, from its header alone."""
    return npy_rows(store, hashes_key(shard))


def npy_rows(store: Store, key: str) -> int:
    """Rows of a stored .npy array, from its header alone: a local file's first bytes, or
    a ranged read of the object's (the count plans passes before any array is loaded)."""
    with open_file(store, key) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _fortran, _dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _fortran, _dtype = np.lib.format.read_array_header_2_0(f)
    return int(shape[0])


def load_hashes(store: Store, shard: str) -> np.ndarray:
    return np.load(io.BytesIO(store.get(hashes_key(shard))))


def dups_key(prefix: str, shard: str) -> str:
    return f"{prefix}/dups/{shard}.parquet"


def write_dups(
    store: Store,
    input_stage: str,
    shards: list[str],
    offsets: np.ndarray,
    dup: np.ndarray,
    kept_of: np.ndarray,
    prefix: str,
) -> int:
    """Write, per shard, the rows it loses with the id of the copy that stays, so each
    shard's apply reads only its own list. `dup` (sorted) and `kept_of` are global
    indices (offsets[i] = first index of shards[i]). Ids are read one kept shard at a
    time and held as Arrow strings for the duplicates only. Returns the bytes of the kept
    shards' files it read."""
    kept_shard = np.searchsorted(offsets, kept_of, side="right") - 1
    by_kept = np.argsort(kept_shard, kind="stable")
    pieces: list[pa.Array] = []
    bounds = np.searchsorted(kept_shard[by_kept], np.arange(len(shards) + 1))
    nread = 0
    for si in range(len(shards)):
        sel = by_kept[bounds[si] : bounds[si + 1]]
        if len(sel) == 0:
            continue
        ids, n = ids_at(store, docs_key(input_stage, shards[si]), kept_of[sel] - offsets[si])
        pieces.append(ids)
        nread += n
    kept_ids = (
        pa.concat_arrays(pieces).take(pa.array(np.argsort(by_kept, kind="stable")))
        if pieces
        else pa.array([], pa.string())
    )
    dup_shard = np.searchsorted(offsets, dup, side="right") - 1
    cuts = np.searchsorted(dup_shard, np.arange(len(shards) + 1))
    for si in range(len(shards)):
        a, b = int(cuts[si]), int(cuts[si + 1])
        if a == b:
            continue
        table = pa.table(
            {
                "row": pa.array(dup[a:b] - offsets[si], pa.int64()),
                "kept_id": kept_ids.slice(a, b - a),
            }
        )
        store.put(dups_key(prefix, shards[si]), table_to_parquet_bytes(table))
    return nread


def ids_at(store: Store, key: str, rows: np.ndarray) -> tuple[pa.Array, int]:
    """The ids at `rows` of a documents file, and the bytes read for them: only the
    footer and the id column of the row groups that hold those rows (a later version's
    copies of earlier documents name a few rows of many earlier shards), from a local file
    or by ranged reads of the object."""
    path = store.local_path(key)
    ranged = open_ranged(store, key) if path is None else None
    try:
        # A file object passed in stays open (pyarrow closes only what it opened).
        with pq.ParquetFile(path if ranged is None else ranged[0]) as pf:
            md = pf.metadata
            sizes = np.array([md.row_group(i).num_rows for i in range(md.num_row_groups)], np.int64)
            starts = np.concatenate([[0], np.cumsum(sizes)])
            group = np.searchsorted(starts, rows, side="right") - 1
            wanted = np.unique(group)
            table = pf.read_row_groups(wanted.tolist(), columns=["id"])
            col = pf.schema_arrow.get_field_index("id")
            nread = md.serialized_size + sum(
                md.row_group(int(g)).column(col).total_compressed_size for g in wanted
            )
    finally:
        if ranged is not None:
            ranged[0].close()
    if ranged is not None:
        nread = ranged[1].fetched  # what the requests returned: footer read-ahead included
    # Row r of group g is at (rows of the wanted groups before g) + (r - starts[g]).
    before = np.concatenate([[0], np.cumsum(sizes[wanted])])
    at = before[np.searchsorted(wanted, group)] + rows - starts[group]
    ids = table["id"].combine_chunks()
    return ids.take(pa.array(at, pa.int64())), int(nread)


def load_dups(store: Store, prefix: str, shard: str) -> dict[int, str]:
    """Rows of `shard` that a dedup step removes, and the id of the document kept."""
    rows, kept_ids = _load_dup_rows(store, prefix, shard)
    return dict(zip(rows.tolist(), kept_ids, strict=True))


def _load_dup_rows(store: Store, prefix: str, shard: str) -> tuple[np.ndarray, list[str]]:
    key = dups_key(prefix, shard)
    if not store.exists(key):
        return np.zeros(0, np.int64), []
    t = parquet_bytes_to_table(store.get(key))
    return t["row"].to_numpy(), t["kept_id"].to_pylist()


def apply_dups(
    cfg: PrepConfig, input_stage: str, stage: str, shard: str, prefix: str, reason: str
) -> dict:
    """Split a shard into kept documents and duplicates dropped with `reason`. The kept
    ones are written as a view (layout.write_view): their text is not copied; only the
    duplicates' text is read out, for the dropped table."""
    store = output_store(cfg)
    view = read_view(store, input_stage, shard)
    text = text_source(store, view, shard)
    nbytes = pc.binary_length(text).to_numpy()[view.rows] if len(view.rows) else view.rows
    dup_rows, kept_ids = _load_dup_rows(store, prefix, shard)
    keep = np.ones(len(view.rows), dtype=bool)
    keep[dup_rows] = False
    stats = ShardStats()
    stats.add_rows(view.table["source"], nbytes, ~keep, reason)
    dropped = DroppedRows()
    if len(dup_rows):
        order = np.argsort(dup_rows, kind="stable")  # dropped rows in input order
        rows = dup_rows[order]
        idx = pa.array(rows, pa.int64())
        ids, sources, metas = (
            view.table[c].take(idx).to_pylist() for c in ("id", "source", "meta")
        )
        texts = take_rows(text, view.rows[rows]).to_pylist()
        for k, row in enumerate(rows.tolist()):
            dropped.add(
                ids[k],
                sources[k],
                reason,
                kept_ids[order[k]],
                doc_location(metas[k], shard, row),
                texts[k],
            )
    return write_view(store, stage, shard, view, keep, dropped, stats)


def apply_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    return apply_dups(cfg, input_stage, STAGE, shard, STAGE, "exact_dup")
