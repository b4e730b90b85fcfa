"""Exact deduplication: a 128-bit hash of the normalised text, global across sources.
The copy that stays is the first in input order (sources as configured, then files,
then lines), so the result does not depend on how the work was scheduled."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from infra.storage import Store
from tasks.config import PrepConfig
from tasks.records import parquet_bytes_to_table, table_to_parquet_bytes
from tasks.stage import (
    DroppedRows,
    ShardStats,
    doc_location,
    docs_key,
    output_store,
    read_docs,
    write_shard,
)

STAGE = "exact"
DUPS_KEY = "exact/dups.parquet"


def hashes_key(shard: str) -> str:
    return f"exact/hashes/{shard}.npy"


def hash_shard(cfg: PrepConfig, input_stage: str, shard: str) -> int:
    store = output_store(cfg)
    texts = read_docs(store, input_stage, shard).column("text").to_pylist()
    h = np.frombuffer(b"".join(xxhash.xxh3_128_digest(t.encode("utf-8")) for t in texts),
                      dtype=np.uint64).reshape(-1, 2)
    buf = io.BytesIO()
    np.save(buf, h)
    store.put(hashes_key(shard), buf.getvalue())
    return len(texts)


def select(cfg: PrepConfig, input_stage: str, shards: list[str]) -> int:
    """Find every duplicate and the first copy it duplicates. Holds 16 bytes per
    document (not text); a corpus too big for that would partition by hash prefix."""
    store = output_store(cfg)
    parts = [np.load(io.BytesIO(store.get(hashes_key(s)))) for s in shards]
    counts = np.array([len(p) for p in parts], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    allh = np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.uint64)
    keys = np.ascontiguousarray(allh).view(np.dtype((np.void, 16))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    keeper = first[inverse]  # np.unique's return_index is the first occurrence
    dup = np.flatnonzero(keeper != np.arange(len(keys)))
    write_dups(store, input_stage, shards, offsets, dup, keeper[dup], DUPS_KEY)
    return len(dup)


def write_dups(store: Store, input_stage: str, shards: list[str], offsets: np.ndarray,
               dup: np.ndarray, kept_of: np.ndarray, key: str) -> None:
    """Write (shard, row) of every removed document with the id of the copy that stays.
    `dup` and `kept_of` are global indices (offsets[i] = first index of shards[i]); ids
    are read only from the shards that hold a kept copy."""
    need = np.unique(np.searchsorted(offsets, kept_of, side="right") - 1)
    ids: dict[int, list[str]] = {}
    for si in need:
        data = store.get(docs_key(input_stage, shards[si]))
        ids[int(si)] = pq.read_table(pa.BufferReader(data), columns=["id"])["id"].to_pylist()
    dup_shard = np.searchsorted(offsets, dup, side="right") - 1
    kept_shard = np.searchsorted(offsets, kept_of, side="right") - 1
    table = pa.table({
        "shard": pa.array([shards[i] for i in dup_shard], pa.string()),
        "row": pa.array(dup - offsets[dup_shard], pa.int64()),
        "kept_id": pa.array([ids[int(s)][int(k - offsets[s])]
                             for s, k in zip(kept_shard, kept_of, strict=True)], pa.string()),
    })
    store.put(key, table_to_parquet_bytes(table))


def load_dups(store: Store, key: str, shard: str) -> dict[int, str]:
    """Rows of `shard` that a dedup step removes, and the id of the document kept."""
    t = parquet_bytes_to_table(store.get(key))
    t = t.filter(pc.equal(t["shard"], shard))
    return dict(zip(t["row"].to_pylist(), t["kept_id"].to_pylist(), strict=True))


def apply_dups(cfg: PrepConfig, input_stage: str, stage: str, shard: str, dups_key: str,
               reason: str) -> dict:
    """Split a shard into kept documents and duplicates dropped with `reason`."""
    store = output_store(cfg)
    docs = read_docs(store, input_stage, shard)
    dups = load_dups(store, dups_key, shard)
    nbytes = pc.binary_length(docs["text"]).to_pylist()
    ids, sources, texts = (docs[c].to_pylist() for c in ("id", "source", "text"))
    metas = docs["meta"].to_pylist()
    stats = ShardStats()
    dropped = DroppedRows()
    keep = np.ones(len(ids), dtype=bool)
    for row in range(len(ids)):
        st = stats[sources[row]]
        st.add_in(nbytes[row])
        kept_id = dups.get(row)
        if kept_id is None:
            st.add_kept(nbytes[row])
            continue
        keep[row] = False
        st.add_dropped(reason, nbytes[row])
        dropped.add(ids[row], sources[row], reason, kept_id, doc_location(metas[row], shard, row),
                    texts[row])
    return write_shard(store, stage, shard, docs.filter(pa.array(keep)), dropped, stats)


def apply_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    return apply_dups(cfg, input_stage, STAGE, shard, DUPS_KEY, "exact_dup")
