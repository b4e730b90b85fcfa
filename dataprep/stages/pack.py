"""Packing: each partition of the training order (and the validation split) is sorted by
its order keys and packed into fixed-length rows, with what the trainer needs to keep
attention inside documents (position ids that restart per document, segment ids) and a
loss mask for padding. Beside the rows, each partition's provenance: the document pieces
every row holds (core/provenance.py's spans, by global document index)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.dataset import COLUMNS, row_schema
from core.provenance import SPANS_SCHEMA
from dataprep.config import PrepConfig
from dataprep.layout import version_store
from dataprep.pack import Rows, pack_bfd, pack_concat
from dataprep.stages.mixture import (
    read_mix_part,
    train_partitions,
    validation_partitions,
)
from dataprep.stages.tokenize import load_run_tokenizer

STAGE = "pack"


# A packed partition's rows and their provenance are Arrow IPC streams (zstd): read back
# once, by the dataset step, where decoding Parquet's fixed-size lists took 2.8 of its
# 7.9 s at 1M documents (IPC reads at memory speed) and the write cost pack 0.35 s a
# partition (IPC: 0.15).
def packed_key(part: str) -> str:
    return f"packed/{part}.arrows"


def spans_key(part: str) -> str:
    return f"packed-spans/{part}.arrows"


def legacy_key(key: str) -> str:
    """Where a ballast before the IPC format stored `key` (Parquet): a run it packed and
    this one finishes reads from there."""
    return key.removesuffix(".arrows") + ".parquet"


IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")
# A stream's record batch is read whole: at most this many bytes each, so the dataset
# step's memory stays a few batches whatever seq_len and the packer's batch are.
IPC_BATCH_BYTES = 4 << 20


def write_batches(writer: pa.ipc.RecordBatchStreamWriter, data: pa.RecordBatch | pa.Table) -> None:
    """`data` into `writer` in record batches of at most IPC_BATCH_BYTES."""
    for batch in data.to_batches() if isinstance(data, pa.Table) else [data]:
        if batch.num_rows == 0:
            continue
        rows = max(1, IPC_BATCH_BYTES * batch.num_rows // max(1, batch.nbytes))
        for at in range(0, batch.num_rows, rows):
            writer.write_batch(batch.slice(at, rows))


def table_bytes(table: pa.Table) -> bytes:
    """`table` as packed_key and spans_key store it (tests build partitions with this)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=IPC_OPTIONS) as w:
        write_batches(w, table)
    return sink.getvalue().to_pybytes()


def packed_done_key(part: str) -> str:
    return f"_done/pack/{part.replace('/', '-')}.json"


def _docs(table: pa.Table, order: np.ndarray) -> Iterator[np.ndarray]:
    """The documents' tokens in `order` (rows of `table`), as views of one buffer: the
    order is applied to the offsets, never to the tokens (a take of the token lists
    copied the whole partition, a fifth of packing's time)."""
    tokens = table.column("tokens").combine_chunks()
    if len(tokens) == 0:
        return
    offsets = tokens.offsets.to_numpy()
    values = tokens.values.to_numpy()
    for i in order.tolist():
        yield values[offsets[i] : offsets[i + 1]]


def _fixed(a: np.ndarray, dtype: pa.DataType, seq_len: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), dtype), seq_len)


def rows_batch(rows: Rows, seq_len: int) -> pa.RecordBatch:
    cols = [
        _fixed(
            getattr(rows, name).astype(np.int8 if name == "loss_mask" else np.int32), dtype, seq_len
        )
        for name, dtype in zip(
            COLUMNS, (pa.int32(), pa.int32(), pa.int32(), pa.int8()), strict=True
        )
    ]
    return pa.RecordBatch.from_arrays(cols, schema=row_schema(seq_len))


def spans_batch(rows: Rows, doc_index: np.ndarray) -> pa.RecordBatch:
    """The provenance of a batch of rows: per row, the global index of each piece's
    document (`doc_index`: by position in the packer's input) and its token offsets."""
    sp = rows.spans
    assert sp is not None
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(np.bincount(sp.row, minlength=len(rows)), out=offsets[1:])
    off = pa.array(offsets)
    cols = [
        pa.ListArray.from_arrays(off, pa.array(doc_index[sp.doc], pa.int64())),
        pa.ListArray.from_arrays(off, pa.array(sp.start.astype(np.int32))),
        pa.ListArray.from_arrays(off, pa.array(sp.end.astype(np.int32))),
    ]
    return pa.RecordBatch.from_arrays(cols, schema=SPANS_SCHEMA)


def pack_partition(cfg: PrepConfig, shards: list[str], part: str) -> dict:
    """Gather a partition's documents from every token shard, order them by key, pack.
    Rows are written as they are packed: memory holds the partition's documents (bounded
    by the mixture's PARTITION_TOKENS) and one batch of rows, never all its rows."""
    store = version_store(cfg)
    tables = [read_mix_part(store, part, s) for s in shards]
    table = (
        pa.concat_tables(tables)
        if tables
        else pa.table(
            {
                "key": pa.array([], pa.uint64()),
                "doc": pa.array([], pa.int64()),
                "tokens": pa.array([], pa.list_(pa.int32())),
            }
        )
    )
    del tables
    # Stable: keys that tie keep the shards' order, as a sort of the whole table did.
    order = pc.sort_indices(table.column("key")).to_numpy()
    doc_index = table.column("doc").to_numpy()[order]
    tok = load_run_tokenizer(cfg)
    seq_len = cfg.pack.seq_len
    if cfg.pack.strategy == "bfd":
        batches = pack_bfd(_docs(table, order), seq_len, tok.pad_id, cfg.pack.window)
    else:
        batches = pack_concat(_docs(table, order), seq_len, tok.pad_id)
    stats = {
        "part": part,
        "rows": 0,
        "docs": table.num_rows,
        "real_tokens": 0,
        "pad_tokens": 0,
        "split_docs": 0,
    }
    with tempfile.TemporaryDirectory(prefix="ballast-pack-") as tmp:
        path = os.path.join(tmp, "rows.arrows")
        spath = os.path.join(tmp, "spans.arrows")
        with (
            pa.OSFile(path, "wb") as sink,
            pa.OSFile(spath, "wb") as ssink,
            pa.ipc.new_stream(sink, row_schema(seq_len), options=IPC_OPTIONS) as writer,
            pa.ipc.new_stream(ssink, SPANS_SCHEMA, options=IPC_OPTIONS) as swriter,
        ):
            for b in batches:
                write_batches(writer, rows_batch(b, seq_len))
                write_batches(swriter, spans_batch(b, doc_index))
                stats["rows"] += len(b)
                stats["real_tokens"] += b.n_real
                stats["pad_tokens"] += b.n_pad
                stats["split_docs"] += b.n_split_docs
        store.put_file(packed_key(part), path)
        store.put_file(spans_key(part), spath)
    store.put(packed_done_key(part), json.dumps(stats, sort_keys=True).encode())
    return stats


def packing_summary(parts: list[dict]) -> dict:
    real = sum(p["real_tokens"] for p in parts)
    pad = sum(p["pad_tokens"] for p in parts)
    return {
        "rows": sum(p["rows"] for p in parts),
        "docs": sum(p["docs"] for p in parts),
        "real_tokens": real,
        "pad_tokens": pad,
        "split_docs": sum(p["split_docs"] for p in parts),
        "efficiency": real / (real + pad) if real + pad else 1.0,
    }


def partitions(cfg: PrepConfig, plan: dict) -> list[str]:
    """Every partition to pack: the training order's, then the validation split's."""
    return [*train_partitions(cfg, plan), *validation_partitions(plan)]


def summary(cfg: PrepConfig, plan: dict) -> dict:
    """The packing of the whole run (every partition packed), for the report."""
    store = version_store(cfg)

    def stats(parts: list[str]) -> list[dict]:
        return [json.loads(store.get(packed_done_key(p))) for p in parts]

    return {
        "strategy": cfg.pack.strategy,
        "seq_len": cfg.pack.seq_len,
        "train": packing_summary(stats(train_partitions(cfg, plan))),
        "validation": packing_summary(stats(validation_partitions(plan))),
    }
