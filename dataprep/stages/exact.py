"""Exact deduplication: a 128-bit hash of the normalised text, global across sources.
The copy that stays is the first in input order (sources as configured, then files,
then lines), so the result does not depend on how the work was scheduled."""

from __future__ import annotations

import io
import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from core.store import Store
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


def hash_shard(cfg: PrepConfig, input_stage: str, shard: str) -> int:
    store = output_store(cfg)
    view = read_view(store, input_stage, shard)
    h = np.frombuffer(text_hashes(view_text(store, view, shard)), np.uint64)
    buf = io.BytesIO()
    np.save(buf, h.reshape(-1, 2))
    store.put(hashes_key(shard), buf.getvalue())
    return len(view.rows)


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
    themselves (a version, once made, never changes)."""
    store = output_store(cfg)
    shards = [*prior, *new]
    counts = np.array([_hash_rows(store, s) for s in shards], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    n_pass = max(1, -(-int(offsets[-1]) // PASS_DOCS))
    dups, keepers = [], []
    for p in range(n_pass):
        his, los, idx = [], [], []
        for si, s in enumerate(shards):
            h = _load_hashes(store, s)
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
        order = np.lexsort((gi, lo, hi))  # by hash, then input order: a run's first stays
        hi, lo, gi = hi[order], lo[order], gi[order]
        del order
        new = np.ones(len(gi), dtype=bool)
        new[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
        first = gi[new][np.cumsum(new) - 1]  # each document's run's first index
        dup = ~new
        dups.append(gi[dup])
        keepers.append(first[dup])
    dup_all = np.concatenate(dups) if dups else np.zeros(0, np.int64)
    kept_all = np.concatenate(keepers) if keepers else np.zeros(0, np.int64)
    fresh = dup_all >= offsets[len(prior)]  # earlier versions' documents stay as they are
    dup_all, kept_all = dup_all[fresh], kept_all[fresh]
    order = np.argsort(dup_all, kind="stable")
    write_dups(store, input_stage, shards, offsets, dup_all[order], kept_all[order], STAGE)
    version_store(cfg).put(DUPS_KEY, json.dumps({"removed": len(dup_all)}).encode())
    return len(dup_all)


def _hash_rows(store: Store, shard: str) -> int:
    """Rows of a shard's hash file, from its header alone when the store is local."""
    local = store.local_path(hashes_key(shard))
    if local is not None:
        return int(np.load(local, mmap_mode="r").shape[0])
    return int(_load_hashes(store, shard).shape[0])


def _load_hashes(store: Store, shard: str) -> np.ndarray:
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
) -> None:
    """Write, per shard, the rows it loses with the id of the copy that stays, so each
    shard's apply reads only its own list. `dup` (sorted) and `kept_of` are global
    indices (offsets[i] = first index of shards[i]). Ids are read one kept shard at a
    time and held as Arrow strings for the duplicates only."""
    kept_shard = np.searchsorted(offsets, kept_of, side="right") - 1
    by_kept = np.argsort(kept_shard, kind="stable")
    pieces: list[pa.Array] = []
    bounds = np.searchsorted(kept_shard[by_kept], np.arange(len(shards) + 1))
    for si in range(len(shards)):
        sel = by_kept[bounds[si] : bounds[si + 1]]
        if len(sel) == 0:
            continue
        data = store.get(docs_key(input_stage, shards[si]))
        ids = pq.read_table(pa.BufferReader(data), columns=["id"])["id"].combine_chunks()
        pieces.append(ids.take(pa.array(kept_of[sel] - offsets[si])))
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
