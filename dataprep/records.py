"""The document and quarantine schemas every prep stage reads and writes, and the
Parquet helpers that keep their bytes deterministic."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

# One row per document. `meta` is a JSON object as a string: sources disagree on
# metadata fields, and a string column keeps every shard's schema identical. It holds the
# record's own fields (all but the text) as they were, plus where the record was read
# from under LOCATION_KEY (a record with a field of that name is quarantined as
# `reserved_field`, so ingest never overwrites a user's field). Always standard JSON: no
# NaN or Infinity.
DOC_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("meta", pa.string()),
    ]
)

LOCATION_KEY = "_ballast_location"


def meta_location(meta: dict) -> str | None:
    """Where ingest read a document from, from its parsed meta. Shards written before
    LOCATION_KEY existed kept it under "location" (when LOCATION_KEY is present,
    "location" is the record's own field)."""
    loc = meta[LOCATION_KEY] if LOCATION_KEY in meta else meta.get("location")
    return loc if isinstance(loc, str) else None


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
PARQUET_OPTIONS: dict = {
    "compression": "zstd",
    "compression_level": 3,
    "write_statistics": False,
    "use_dictionary": ["source", "reason"],
}


def table_to_parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=10_000, **PARQUET_OPTIONS)
    return buf.getvalue()


def parquet_bytes_to_table(data: bytes) -> pa.Table:
    return pq.read_table(pa.BufferReader(data))
