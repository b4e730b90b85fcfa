"""Packing: each partition of the training order (and the validation split) is sorted by
its order keys and packed into fixed-length rows, with what the trainer needs to keep
attention inside documents (position ids that restart per document, segment ids) and a
loss mask for padding."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.config import PrepConfig
from tasks.mixture_stage import part_key
from tasks.pack import Rows, pack_bfd, pack_concat
from tasks.records import table_to_parquet_bytes
from tasks.stage import output_store
from tasks.tokenize_stage import run_tokenizer

STAGE = "pack"
ROW_COLUMNS = ("input_ids", "position_ids", "segment_ids", "loss_mask")


def packed_key(part: str) -> str:
    return f"packed/{part}.parquet"


def packed_done_key(part: str) -> str:
    return f"_done/pack/{part.replace('/', '-')}.json"


def row_schema(seq_len: int) -> pa.Schema:
    return pa.schema([
        ("input_ids", pa.list_(pa.int32(), seq_len)),
        ("position_ids", pa.list_(pa.int32(), seq_len)),
        ("segment_ids", pa.list_(pa.int32(), seq_len)),
        ("loss_mask", pa.list_(pa.int8(), seq_len)),
    ])


def _docs(table: pa.Table) -> Iterator[np.ndarray]:
    tokens = table.column("tokens").combine_chunks()
    if len(tokens) == 0:
        return
    offsets = tokens.offsets.to_numpy()
    values = tokens.values.to_numpy()
    for i in range(len(tokens)):
        yield values[offsets[i] : offsets[i + 1]]


def _fixed(a: np.ndarray, dtype: pa.DataType, seq_len: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), dtype), seq_len)


def rows_table(batches: list[Rows], seq_len: int) -> pa.Table:
    cols = {}
    for name, dtype in zip(ROW_COLUMNS, (pa.int32(), pa.int32(), pa.int32(), pa.int8()),
                           strict=True):
        arrs = [getattr(b, name) for b in batches]
        a = np.concatenate(arrs) if arrs else np.zeros((0, seq_len), np.int32)
        cols[name] = _fixed(a.astype(np.int8 if name == "loss_mask" else np.int32), dtype,
                            seq_len)
    return pa.table(cols, schema=row_schema(seq_len))


def pack_partition(cfg: PrepConfig, shards: list[str], part: str) -> dict:
    """Gather a partition's documents from every token shard, order them by key, pack."""
    store = output_store(cfg)
    tables = [pq.read_table(pa.BufferReader(store.get(part_key(part, s)))) for s in shards]
    table = pa.concat_tables(tables) if tables else pa.table({"key": [], "tokens": []})
    table = table.take(pc.sort_indices(table, sort_keys=[("key", "ascending")]))
    tok = run_tokenizer(cfg)
    seq_len = cfg.pack.seq_len
    if cfg.pack.strategy == "bfd":
        batches = list(pack_bfd(_docs(table), seq_len, tok.pad_id, cfg.pack.window))
    else:
        batches = list(pack_concat(_docs(table), seq_len, tok.pad_id))
    out = rows_table(batches, seq_len)
    store.put(packed_key(part), table_to_parquet_bytes(out))
    stats = {
        "part": part, "rows": out.num_rows, "docs": table.num_rows,
        "real_tokens": sum(b.n_real for b in batches), "pad_tokens": sum(b.n_pad for b in batches),
        "split_docs": sum(b.n_split_docs for b in batches),
    }
    store.put(packed_done_key(part), json.dumps(stats, sort_keys=True).encode())
    return stats


def packing_summary(parts: list[dict]) -> dict:
    real = sum(p["real_tokens"] for p in parts)
    pad = sum(p["pad_tokens"] for p in parts)
    return {"rows": sum(p["rows"] for p in parts), "docs": sum(p["docs"] for p in parts),
            "real_tokens": real, "pad_tokens": pad,
            "split_docs": sum(p["split_docs"] for p in parts),
            "efficiency": real / (real + pad) if real + pad else 1.0}
