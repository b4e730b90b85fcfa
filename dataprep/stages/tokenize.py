"""Tokenization: build (or train, or load) the tokenizer once, then encode every shard in
parallel with EOS after each document. Each document also gets its split here
(validation by a stable hash of its id), so every later step sees the same split."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from core.store import Store
from dataprep.config import PrepConfig
from dataprep.layout import DroppedRows, ShardStats, docs_key, output_store, write_shard
from dataprep.records import table_to_parquet_bytes
from dataprep.tokenizer import Tokenizer, build_tokenizer, load_tokenizer

STAGE = "tokenize"
TOKENIZER_KEY = "tokenizer/tokenizer.json"

TOKENS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("n_tokens", pa.int32()),
        ("n_bytes", pa.int64()),
        ("tokens", pa.list_(pa.int32())),
        # meta.language for the documents of a source mixed per language (sources[].languages),
        # null otherwise; shards written before the column existed read as all null.
        ("language", pa.string()),
    ]
)


def tokens_key(shard: str) -> str:
    return f"tokens/{shard}.parquet"


def is_validation(ids: list[str], fraction: float) -> np.ndarray:
    """Stable split: a document is in validation when the hash of its id falls below the
    fraction. Independent of the seed, so runs with different seeds share a split."""
    if fraction <= 0:
        return np.zeros(len(ids), dtype=bool)
    h = np.fromiter(
        (xxhash.xxh3_64_intdigest(f"split:{i}".encode()) for i in ids),
        dtype=np.uint64,
        count=len(ids),
    )
    return h < np.uint64(int(fraction * 2**64))


def _training_texts(store: Store, input_stage: str, shards: list[str], limit: int) -> Iterator[str]:
    """Up to `limit` documents spread evenly over the shards (the head of each), so a
    BPE trained on them sees every source and the choice is deterministic."""
    per_shard = max(1, -(-limit // max(1, len(shards))))
    for s in shards:
        # Only the row groups that hold the head, and only the head as Python strings: at
        # 1M documents the whole shards' text came to ~340 MB of strings, sliced away.
        f = pq.ParquetFile(pa.BufferReader(store.get(docs_key(input_stage, s))))
        groups, rows = [], 0
        for g in range(f.metadata.num_row_groups):
            if rows >= per_shard:
                break
            groups.append(g)
            rows += f.metadata.row_group(g).num_rows
        t = f.read_row_groups(groups, columns=["text"])
        yield from t.column("text").slice(0, per_shard).to_pylist()


def prepare_tokenizer(cfg: PrepConfig, input_stage: str, shards: list[str]) -> str:
    """Build the run's tokenizer and store it as tokenizer/tokenizer.json; returns it."""
    store = output_store(cfg)
    if store.exists(TOKENIZER_KEY):
        return store.get(TOKENIZER_KEY).decode()
    tok = build_tokenizer(
        cfg.tokenizer,
        lambda: _training_texts(store, input_stage, shards, cfg.tokenizer.train_docs),
    )
    text = tok.to_json()
    store.put(TOKENIZER_KEY, text.encode())
    return text


@lru_cache(maxsize=4)
def _tokenizer(text: str) -> Tokenizer:
    return load_tokenizer(text)


def load_run_tokenizer(cfg: PrepConfig) -> Tokenizer:
    """The run's tokenizer, as the tokenizer step stored it (parsed once per process)."""
    return _tokenizer(output_store(cfg).get(TOKENIZER_KEY).decode())


def _encode_column(tok: Tokenizer, texts: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of every text with EOS after each, flat, and the document offsets: native
    BPE when the tokenizer allows it (Tokenizer.encode_column), HF otherwise, the same
    ids either way."""
    return tok.encode_column(texts, append_id=tok.eos_id)


def tokenize_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    store = output_store(cfg)
    tok = load_run_tokenizer(cfg)
    by_language = {s.name for s in cfg.sources if s.languages is not None}
    docs = pq.read_table(
        pa.BufferReader(store.get(docs_key(input_stage, shard))),
        columns=["id", "text", "source", *(["meta"] if by_language else [])],
    )
    ids, sources = (docs[c].to_pylist() for c in ("id", "source"))
    languages = (
        [
            _language(m) if src in by_language else None
            for src, m in zip(sources, docs["meta"].to_pylist(), strict=True)
        ]
        if by_language
        else [None] * len(ids)
    )
    values, offsets = _encode_column(tok, docs["text"])
    lengths = np.diff(offsets).astype(np.int32)
    val = is_validation(ids, cfg.dataset.validation_fraction)
    fixed = {s.name: s.split for s in cfg.sources if s.split != "auto"}
    if fixed:
        val = np.array(
            [
                fixed.get(src, "auto") == "validation" or (fixed.get(src, "auto") == "auto" and v)
                for src, v in zip(sources, val, strict=True)
            ],
            dtype=bool,
        )
    split = np.where(val, "validation", "train").tolist()
    nbytes = pc.binary_length(docs["text"])
    table = pa.table(
        {
            "id": ids,
            "source": sources,
            "split": split,
            "n_tokens": pa.array(lengths),
            "n_bytes": nbytes.cast(pa.int64()),
            "tokens": pa.ListArray.from_arrays(
                pa.array(offsets.astype(np.int32)), pa.array(values)
            ),
            "language": pa.array(languages, pa.string()),
        },
        schema=TOKENS_SCHEMA,
    )
    store.put(tokens_key(shard), table_to_parquet_bytes(table))
    stats = ShardStats()
    tokens: dict[str, dict[str, int]] = {}
    for i, (src, nb) in enumerate(zip(sources, nbytes.to_pylist(), strict=True)):
        stats[src].add_in(nb)
        stats[src].add_kept(nb)
        t = tokens.setdefault(src, {"train": 0, "validation": 0})
        t[split[i]] += int(lengths[i])
    return write_shard(store, STAGE, shard, None, DroppedRows(), stats, {"tokens": tokens})


def _language(meta: str | None) -> str | None:
    """meta.language of a document (the `language` rule's label), None without one."""
    if not meta:
        return None
    lang = json.loads(meta).get("language")
    return lang if isinstance(lang, str) and lang else None


def read_tokens(store: Store, shard: str, columns: list[str] | None = None) -> pa.Table:
    buf = pa.BufferReader(store.get(tokens_key(shard)))
    if columns is None or "language" not in columns:
        return pq.read_table(buf, columns=columns)
    pf = pq.ParquetFile(buf)
    if "language" in pf.schema_arrow.names:
        return pf.read(columns=columns)
    # A shard tokenized before the column existed (an earlier version's): no labels.
    t = pf.read(columns=[c for c in columns if c != "language"])
    return t.append_column("language", pa.nulls(t.num_rows, pa.string()))
