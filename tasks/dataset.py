"""The output dataset (the contract between prep and training): a HF `datasets`
DatasetDict (train / validation) saved as Arrow shards with `save_to_disk`, the tokenizer
next to it, and manifest.json with the sha256 of every file; plus `verify`, which checks
a dataset against its manifest and says exactly what does not match."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from infra.storage import StorageError, StorageOptions, Store, open_store
from tasks.config import PrepConfig
from tasks.pack_stage import packed_key, row_schema
from tasks.stage import output_store
from tasks.tokenize_stage import TOKENIZER_KEY, run_tokenizer

DATASET_DIR = "dataset"
MANIFEST = "manifest.json"
FORMAT = "ballast-dataset/1"


def dataset_uri(cfg: PrepConfig) -> str:
    return f"{cfg.output.rstrip('/')}/{DATASET_DIR}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _arrow_stats(path: Path) -> tuple[int, int]:
    """Rows and real (non-pad) tokens of one saved Arrow shard, batch by batch."""
    rows = real = 0
    with pa.memory_map(str(path)) as src:
        for batch in pa.ipc.open_stream(src):
            rows += batch.num_rows
            if batch.num_rows:
                mask = batch.column("loss_mask").flatten()
                real += int(pc.sum(mask.cast(pa.int64())).as_py() or 0)
    return rows, real


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
            entry: dict[str, Any] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
            if rel.endswith(".arrow"):
                entry["rows"], entry["real_tokens"] = _arrow_stats(path)
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


def verify(uri: str, options: StorageOptions | None = None, deep: bool = True) -> list[str]:
    """Every way the dataset at `uri` differs from its manifest (empty = it verifies):
    missing or unexpected files, sizes, sha256, rows and tokens per shard, the tokenizer,
    and (deep, for local datasets) that `datasets.load_from_disk` sees the same rows."""
    store = open_store(uri, options)
    try:
        manifest = json.loads(store.get(MANIFEST))
    except StorageError:
        return [f"{uri}: no {MANIFEST} (not a ballast dataset, or an incomplete one)"]
    except json.JSONDecodeError as e:
        return [f"{uri}/{MANIFEST} is not valid JSON: {e}"]
    if manifest.get("format") != FORMAT:
        return [f"{uri}/{MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}"]
    problems = []
    listed: dict[str, Any] = manifest.get("files", {})
    present = set(store.list()) - {MANIFEST}
    for rel in sorted(set(listed) - present):
        problems.append(f"missing file {rel}")
    for rel in sorted(present - set(listed)):
        problems.append(f"unexpected file {rel} (not in the manifest)")
    with tempfile.TemporaryDirectory(prefix="ballast-verify-") as tmp:
        for rel in sorted(set(listed) & present):
            want = listed[rel]
            local = store.local_path(rel)
            if local is None:
                local = Path(tmp) / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                store.get_file(rel, local)
            size = local.stat().st_size
            if size != want["bytes"]:
                problems.append(f"{rel}: {size} bytes, manifest says {want['bytes']}")
            digest = _sha256(local)
            if digest != want["sha256"]:
                problems.append(f"{rel}: sha256 {digest[:16]}..., manifest says "
                                f"{want['sha256'][:16]}...")
                continue
            if rel.endswith(".arrow"):
                rows, real = _arrow_stats(local)
                if rows != want.get("rows") or real != want.get("real_tokens"):
                    problems.append(f"{rel}: {rows} rows / {real} real tokens, manifest says "
                                    f"{want.get('rows')} / {want.get('real_tokens')}")
        tok = manifest.get("tokenizer", {})
        if tok.get("file") and listed.get(tok["file"], {}).get("sha256") != tok.get("sha256"):
            problems.append("tokenizer sha256 differs from its file entry")
    if deep and not problems and store.local_path("") is not None:
        from datasets import load_from_disk

        dd = load_from_disk(str(store.local_path("")))
        for name, split in manifest.get("splits", {}).items():
            if name not in dd:
                problems.append(f"split {name} is in the manifest but load_from_disk "
                                f"does not find it")
            elif dd[name].num_rows != split["rows"]:
                problems.append(f"split {name}: load_from_disk gives {dd[name].num_rows} "
                                f"rows, manifest says {split['rows']}")
    return problems
