"""The document and quarantine schemas every prep stage reads and writes, and the
Parquet helpers that keep their bytes deterministic."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

# One row per document. `meta` is a JSON object as a string: sources disagree on
# metadata fields, and a string column keeps every shard's schema identical.
DOC_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("meta", pa.string()),
    ]
)

# One row per document a stage dropped: why, and where it was. `text` keeps the
# document (or, for records that never parsed, the raw record) so nothing is lost.
DROPPED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("location", pa.string()),
        ("text", pa.string()),
    ]
)


# Fixed writer settings: same rows in, same bytes out (resume and reruns rely on it).
PARQUET_OPTIONS: dict = {"compression": "zstd", "compression_level": 3,
                         "write_statistics": False, "use_dictionary": ["source", "reason"]}


def table_to_parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=10_000, **PARQUET_OPTIONS)
    return buf.getvalue()


def parquet_bytes_to_table(data: bytes) -> pa.Table:
    return pq.read_table(pa.BufferReader(data))


def empty(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()
