"""The second half of a partitioned dedup select (dataprep/stages/exact_ranges.py): from
the (duplicate, copy kept) pairs each partition found to the per-shard lists that the
stage's apply reads (`<prefix>/dups/<shard>.parquet`, the same bytes a single-task select
writes with exact.write_dups). A duplicate's list needs the id of the copy kept, which is
in another shard, so the pairs take two hops, each task holding one shard's share:

    keepers (per shard that may hold kept copies)  the pairs whose kept copy is in it,
             partitions' pairs batched up to max_task_memory; its ids column once; -> per
             (duplicate's shard, this shard, batch) the rows and the kept ids
    dups    (per shard of this run)  its pieces from every kept shard, in row order

Files (in the version's store, under `<prefix>/ranges/<tag>/`, tag naming the partition
plan, so a run resumed with another bound never mixes two plans' files):

    kept/<kept shard>/<range>.npy    int64 rows (duplicate's shard index, its row, kept row)
    dup/<dup shard>/<kept shard>-s<k>.parquet   (row, kept_id): the k-th batch of the
                                                 kept shard's pairs (max_task_memory's worth)
    done/keepers/<shard>.json, done/dups/<shard>.json   the steps' markers
"""

from __future__ import annotations

import io
import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.store import Store
from dataprep.config import PrepConfig
from dataprep.layout import docs_key, output_store, version_store
from dataprep.partition import parse_shard_item
from dataprep.records import parquet_bytes_to_table, table_to_parquet_bytes
from dataprep.stages.exact import dups_key

# What keepers holds per pair it sends on, measured (benchmarks/pair_bytes.py, tracemalloc
# plus Arrow's pool, a pair count's slope): ~74 bytes of numpy (3 int64s, the sort and the
# pieces' columns) plus the kept copy's id twice in Arrow (its bytes and a 4-byte offset:
# the taken ids and their concatenation), 92 bytes a pair with 6-byte ids and 153 with
# 36-byte UUIDs. The partitions' pairs it reads come within the cap of the select and
# replay tasks that wrote them.
PAIR_BYTES = 80
ID_COPIES = 2


def base(prefix: str, tag: str) -> str:
    return f"{prefix}/ranges/{tag}"


def kept_key(prefix: str, tag: str, kept_shard: str, part: str) -> str:
    return f"{base(prefix, tag)}/kept/{kept_shard}/{part}.npy"


def keepers_done_key(prefix: str, item: str) -> str:
    tag, shard = parse_shard_item(item)
    return f"{base(prefix, tag)}/done/keepers/{shard}.json"


def dups_done_key(prefix: str, item: str) -> str:
    tag, shard = parse_shard_item(item)
    return f"{base(prefix, tag)}/done/dups/{shard}.json"


def runs(values: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) of each run of equal values in a sorted array."""
    cuts = (np.flatnonzero(np.diff(values)) + 1).tolist()
    return list(itertools.pairwise([0, *cuts, len(values)])) if len(values) else []


def write_pairs(
    store: Store,
    prefix: str,
    tag: str,
    part: str,
    shards: list[str],
    offsets: np.ndarray,
    dup: np.ndarray,
    kept_of: np.ndarray,
) -> None:
    """A partition's pairs (global indices; offsets[i] = first index of shards[i]), split
    by the shard of the copy kept: one file each, for that shard's keepers task."""
    if not len(dup):
        return
    # In the order of the copies kept (one index array at a time, freed as it goes: this is
    # the select task's peak when most of its range is duplicates).
    order = np.argsort(kept_of, kind="stable")
    kept_of = kept_of[order]
    dup = dup[order]
    del order
    kept_shard = np.searchsorted(offsets, kept_of, side="right") - 1
    for a, b in runs(kept_shard):
        ks = int(kept_shard[a])
        rows = np.empty((b - a, 3), np.int64)  # filled column by column: no temporaries
        rows[:, 0] = np.searchsorted(offsets, dup[a:b], side="right") - 1
        rows[:, 1] = dup[a:b] - offsets[rows[:, 0]]
        rows[:, 2] = kept_of[a:b] - offsets[ks]
        buf = io.BytesIO()
        np.save(buf, rows)
        store.put(kept_key(prefix, tag, shards[ks], part), buf.getvalue())


def keepers(
    cfg: PrepConfig, prefix: str, input_stage: str, prior: list[str], new: list[str], item: str
) -> int:
    """One shard's kept copies: the ids of those that some duplicate names, sent on to the
    duplicates' shards. Partitions' pairs are read one at a time and sent on together, up
    to max_task_memory's worth (batch_pairs), so a shard that keeps the first copy of very
    many duplicates is no exception to the bound, while a duplicate's shard gets one piece
    per kept shard, not one per kept shard and partition (at 10M documents and 54 near
    partitions, ~3,000 pieces of one or two rows each per shard, most of the step's time).
    Returns the pairs handled."""
    tag, shard = parse_shard_item(item)
    vstore = version_store(cfg)
    shards = [*prior, *new]
    keys = vstore.list(f"{base(prefix, tag)}/kept/{shard}/")
    cap = 1
    n = 0
    ids: pa.Array | None = None
    held: list[tuple[np.ndarray, pa.Array]] = []  # (rows, their kept copies' ids)
    sent = 0
    for i, key in enumerate(keys):
        rows = np.load(io.BytesIO(vstore.get(key)))
        n += len(rows)
        if ids is None:  # read once, and only for a shard that keeps something
            data = output_store(cfg).get(docs_key(input_stage, shard))
            ids = pq.read_table(pa.BufferReader(data), columns=["id"])["id"].combine_chunks()
            cap = batch_pairs(cfg.max_task_memory or 0, ids)
        held.append((rows, ids.take(pa.array(rows[:, 2]))))
        if sum(len(r) for r, _ in held) >= cap or i == len(keys) - 1:
            _send(vstore, prefix, tag, shard, shards, held, sent)
            held, sent = [], sent + 1
    vstore.put(keepers_done_key(prefix, item), json.dumps({"pairs": n}).encode())
    return n


def batch_pairs(max_task_memory: int, ids: pa.Array) -> int:
    """Pairs a keepers batch may hold: PAIR_BYTES a pair plus ID_COPIES of an id of the
    kept shard's mean size (its string bytes and offset)."""
    id_bytes = (ids.nbytes / len(ids)) if len(ids) else 0.0
    return max(1, int(max_task_memory // (PAIR_BYTES + ID_COPIES * id_bytes)))


def _send(
    vstore: Store,
    prefix: str,
    tag: str,
    shard: str,
    shards: list[str],
    held: list[tuple[np.ndarray, pa.Array]],
    k: int,
) -> None:
    """Pairs held by `shard`'s keepers task to their duplicates' shards: piece k of each."""
    rows = np.concatenate([r for r, _ in held])
    kept_ids = pa.concat_arrays([a for _, a in held])
    order = np.argsort(rows[:, 0], kind="stable")
    ds = rows[order, 0]
    for a, b in runs(ds):
        sel = order[a:b]
        table = pa.table(
            {"row": pa.array(rows[sel, 1], pa.int64()), "kept_id": kept_ids.take(pa.array(sel))}
        )
        piece = f"{base(prefix, tag)}/dup/{shards[int(ds[a])]}/{shard}-s{k:05d}.parquet"
        vstore.put(piece, table_to_parquet_bytes(table))


def gather(cfg: PrepConfig, prefix: str, item: str) -> int:
    """One shard's duplicates from every kept shard's pieces, written as the single-task
    select writes them: rows ascending, with the kept copy's id. Returns their number."""
    tag, shard = parse_shard_item(item)
    vstore = version_store(cfg)
    keys = vstore.list(f"{base(prefix, tag)}/dup/{shard}/")
    n = 0
    if keys:
        t = pa.concat_tables([parquet_bytes_to_table(vstore.get(k)) for k in keys])
        order = np.argsort(t["row"].to_numpy(), kind="stable")
        t = t.take(pa.array(order))
        table = pa.table(
            {"row": t["row"].combine_chunks(), "kept_id": t["kept_id"].combine_chunks()}
        )
        n = table.num_rows
        output_store(cfg).put(dups_key(prefix, shard), table_to_parquet_bytes(table))
    vstore.put(dups_done_key(prefix, item), json.dumps({"duplicates": n}).encode())
    return n
