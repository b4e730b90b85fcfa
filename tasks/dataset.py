"""The output dataset (the contract between prep and training): a HF `datasets`
DatasetDict (train / validation) saved as Arrow shards with `save_to_disk`, the tokenizer
next to it, and manifest.json with the sha256 of every file. The check of a dataset
against its manifest lives with its reader, in training/manifest.py."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from infra.storage import Store, open_store
from tasks.config import PrepConfig
from tasks.pack_stage import packed_key, row_schema
from tasks.stage import output_store
from tasks.tokenize_stage import TOKENIZER_KEY, run_tokenizer
from training.files import sha256_file
from training.manifest import FORMAT, MANIFEST, arrow_stats

DATASET_DIR = "dataset"


def dataset_uri(cfg: PrepConfig) -> str:
    return f"{cfg.output.rstrip('/')}/{DATASET_DIR}"


def _stream_split(store: Store, parts: list[str], seq_len: int, path: Path) -> int:
    """Append the packed rows of `parts`, in order, to one Arrow file; returns rows.
    Streaming keeps memory at one partition, however large the dataset."""
    schema = row_schema(seq_len)
    rows = 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for p in parts:
            table = pq.read_table(pa.BufferReader(store.get(packed_key(p))))
            for batch in table.cast(schema).to_batches(max_chunksize=1000):
                writer.write_batch(batch)
            rows += table.num_rows
    return rows


def write_dataset(cfg: PrepConfig, train_parts: list[str], extra: dict[str, Any]) -> dict:
    """Save the packed rows as a DatasetDict under <output>/dataset and write the
    manifest last (a dataset without a manifest is incomplete)."""
    from datasets import Dataset, DatasetDict, disable_progress_bars
    from datasets.table import MemoryMappedTable

    disable_progress_bars()  # the caller shows progress; datasets' bars would interleave

    store = output_store(cfg)
    target = open_store(dataset_uri(cfg), cfg.storage)
    if target.exists(MANIFEST):  # finished by an earlier run of the same config
        manifest = json.loads(target.get(MANIFEST))
        if manifest.get("config_fingerprint") == cfg.fingerprint():
            return manifest
    seq_len = cfg.pack.seq_len
    tok = run_tokenizer(cfg)
    fp = cfg.fingerprint()
    with tempfile.TemporaryDirectory(prefix="ballast-dataset-") as tmp:
        parts = {"train": train_parts, "validation": ["validation"]}
        rows = {name: _stream_split(store, ps, seq_len, Path(tmp) / f"{name}.arrow")
                for name, ps in parts.items()}
        # Memory-mapped, with a fixed fingerprint: `datasets` would otherwise draw one
        # from the temporary path into state.json, and the bytes would differ per run.
        dd = DatasetDict({
            name: Dataset(MemoryMappedTable.from_file(str(Path(tmp) / f"{name}.arrow")),
                          fingerprint=f"{fp}-{name}")
            for name in parts})
        shards = {"train": max(1, min(cfg.dataset.train_shards, rows["train"])),
                  "validation": max(1, min(cfg.dataset.validation_shards, rows["validation"]))}
        root = Path(tmp) / DATASET_DIR
        dd.save_to_disk(str(root), num_shards=shards)
        del dd
        (root / "tokenizer.json").write_bytes(store.get(TOKENIZER_KEY))
        files: dict[str, Any] = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            entry: dict[str, Any] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
            if rel.endswith(".arrow"):
                entry["rows"], entry["real_tokens"] = arrow_stats(path)
                entry["tokens"] = entry["rows"] * seq_len
            files[rel] = entry
        manifest = {
            "format": FORMAT,
            "config_fingerprint": fp,
            "seed": cfg.seed,
            "seq_len": seq_len,
            "pack": cfg.pack.model_dump(),
            "columns": {"input_ids": "int32[seq_len]", "position_ids": "int32[seq_len], "
                        "restart at 0 at every document", "segment_ids": "int32[seq_len], "
                        "1..k per document in the row, 0 on padding",
                        "loss_mask": "int8[seq_len], 0 on padding"},
            "tokenizer": {"kind": cfg.tokenizer.kind, "vocab_size": tok.vocab_size,
                          "eos_id": tok.eos_id, "pad_id": tok.pad_id, "file": "tokenizer.json",
                          "sha256": files["tokenizer.json"]["sha256"]},
            "splits": {
                name: {
                    "rows": n, "tokens": n * seq_len,
                    "real_tokens": sum(f.get("real_tokens", 0) for r, f in files.items()
                                       if r.startswith(f"{name}/")),
                    "files": sorted(r for r in files if r.startswith(f"{name}/")
                                    and r.endswith(".arrow")),
                } for name, n in rows.items()
            },
            "files": files,
            **extra,
        }
        for rel in files:
            target.put_file(rel, root / rel)
        target.put(MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    return manifest


