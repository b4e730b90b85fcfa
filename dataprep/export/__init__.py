"""`ballast export dataset`: a prepared dataset in the formats other trainers read
(Megatron's indexed dataset, llm.c/nanoGPT token shards, MosaicML MDS), with the source
manifest's checksums and accounting alongside in `ballast_export.json`.

The split's shards are read one record batch at a time (dataprep/export/rows.py) and each
format's writer streams, so memory is bounded by a shard's batch, never by the dataset.
The export is written into a temporary directory: beside a local output, renamed into
place when complete, so a failed export leaves nothing half-written behind; for a remote
output (s3://...), uploaded file by file through the Store with the export record last,
so an output that has the record is complete."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.dataset import FORMAT, MANIFEST, resolve
from core.errors import NotFound
from core.files import sha256_file
from core.store import StorageOptions, Store, open_store
from dataprep.export import llmc, mds, megatron
from dataprep.export.rows import documents, sequences, split_rows, split_rows_with_spans

FORMATS = ("megatron", "llmc", "mds")
RECORD = "ballast_export.json"
RECORD_FORMAT = "ballast-export/1"
# The manifest's keys that say what the data is and how it was made.
_CARRIED = (
    "format",
    "config_fingerprint",
    "seed",
    "seq_len",
    "tokenizer",
    "splits",
    "packing",
    "mixture",
    "accounting",
    "version",
    "inputs",
    "files",
)


class DatasetExportError(ValueError):
    """The dataset cannot be exported as asked (one line, exit 1)."""


def check(
    dataset: str,
    fmt: str,
    out: str,
    splits: tuple[str, ...],
    options: StorageOptions | None = None,
    shard_tokens: int = llmc.SHARD_TOKENS,
) -> tuple[str, Store, bytes, dict[str, Any], Store]:
    """What export_dataset checks before it writes anything (DatasetExportError, one line): the
    format, the dataset and its splits, an empty output. Returns the dataset's newest
    version, its store, manifest bytes and manifest, and the output's store."""
    if fmt not in FORMATS:
        raise DatasetExportError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if not 0 < shard_tokens <= llmc.MAX_SHARD_TOKENS:
        raise DatasetExportError(
            f"--shard-tokens must be in 1..{llmc.MAX_SHARD_TOKENS} (llm.c's "
            f"header counts tokens in an int32), got {shard_tokens}"
        )
    uri = resolve(dataset, options)
    src = open_store(uri, options)
    try:
        raw = src.get(MANIFEST)
    except NotFound:
        raise DatasetExportError(f"{uri}: no {MANIFEST} (not a ballast dataset)") from None
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DatasetExportError(f"{uri}/{MANIFEST} is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise DatasetExportError(
            f"{uri}/{MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    unknown = [s for s in splits if s not in manifest["splits"]]
    if unknown:
        raise DatasetExportError(
            f"split {unknown[0]!r} is not in the dataset (it has {', '.join(manifest['splits'])})"
        )
    dst = open_store(out, options)
    _check_output(out, dst)
    return uri, src, raw, manifest, dst


def _check_output(out: str, dst: Store) -> None:
    """Refuse an output the export cannot become (DatasetExportError naming what is in the way),
    before anything is written: keys under it, in any store. A local export ends with a
    rename onto `out`, which also fails on what holds no key: a file at `out` or above it,
    a directory holding only directories or temporary files; those are refused here too,
    not after the whole dataset has been exported. An s3:// prefix has nothing else in
    the way (an object named like the prefix is not under it)."""
    present = dst.list()
    if present:
        raise DatasetExportError(
            f"{out} is not empty ({len(present)} files, e.g. {present[0]}): "
            "export into a new directory"
        )
    local = dst.local_path("")
    if local is None:
        return
    for p in (local, *local.parents):  # the nearest that exists must be a directory
        if p.is_dir():
            break
        if p.exists():
            what = "it is a file" if p == local else f"{p} is a file"
            raise DatasetExportError(f"{out}: {what}, not a directory: export into a new directory")
    if local.is_dir():
        with os.scandir(local) as entries:
            held = sorted(e.name + "/" * e.is_dir() for e in entries)
        if held:
            more = f" and {len(held) - 1} more" if len(held) > 1 else ""
            raise DatasetExportError(
                f"{out} is not empty (it holds {held[0]}{more}): export into a new directory"
            )


def _counted(
    batches: Iterator[Any], split: str, progress: Callable[[str, int], None] | None
) -> Iterator[Any]:
    """`batches` (Rows, or (Rows, Spans)), calling progress(split, rows) for each."""
    for b in batches:
        if progress is not None:
            progress(split, len(b[0] if isinstance(b, tuple) else b))
        yield b


def export_dataset(
    dataset: str,
    fmt: str,
    out: str,
    splits: tuple[str, ...] = ("train", "validation"),
    options: StorageOptions | None = None,
    shard_tokens: int = llmc.SHARD_TOKENS,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Write `dataset` (its newest version) as `fmt` into the empty directory or prefix
    `out`; returns the export record. `progress(split, rows)` is called per batch read."""
    uri, src, raw, manifest, dst = check(dataset, fmt, out, splits, options, shard_tokens)
    tok = manifest["tokenizer"]
    vocab, eos = int(tok["vocab_size"]), int(tok["eos_id"])
    # Whole documents from the provenance (any packing); without it, concat packing's
    # documents can still be joined from the rows alone (rows.py).
    provenance = "provenance" in manifest
    join = manifest.get("packing", {}).get("strategy") == "concat"
    local = dst.local_path("")
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
    root = Path(
        tempfile.mkdtemp(
            prefix=f".{local.name}.tmp-" if local else "ballast-export-",
            dir=local.parent if local else None,
        )
    )
    try:
        written: dict[str, Any] = {}
        for split in splits:
            if fmt == "mds":  # packed rows as they are
                rows_iter = split_rows(src, manifest, split)
                written[split] = mds.write_split(root, split, _counted(rows_iter, split, progress))
                continue
            if provenance:
                seqs = documents(
                    _counted(split_rows_with_spans(src, manifest, split), split, progress), eos
                )
            else:
                seqs = sequences(
                    _counted(split_rows(src, manifest, split), split, progress), eos, join
                )
            try:
                if fmt == "megatron":
                    written[split] = megatron.write_split(root, split, seqs, vocab)
                else:
                    written[split] = llmc.write_split(root, split, seqs, vocab, eos, shard_tokens)
            except ValueError as e:  # rows and provenance disagree: a damaged dataset
                raise DatasetExportError(
                    f"{uri}, split {split}: {e} (`ballast verify {uri}` "
                    "checks the files against the manifest)"
                ) from None
        tok_file = tok.get("file")
        if tok_file:  # the tokenizer, for the trainer that reads these ids
            src.get_file(tok_file, root / Path(tok_file).name)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        record = {
            "format": RECORD_FORMAT,
            "export": fmt,
            "dataset": uri,
            "dataset_manifest_sha256": hashlib.sha256(raw).hexdigest(),
            "documents_from": (
                "provenance"
                if provenance
                else "rows (concat packing)"
                if join
                else "rows (bfd pieces not joined)"
            ),
            "splits": written,
            "files": {
                rel: {"bytes": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}
                for rel in files
            },
            "source_manifest": {k: manifest[k] for k in _CARRIED if k in manifest},
        }
        body = json.dumps(record, indent=1, sort_keys=True).encode()
        if local is not None:
            (root / RECORD).write_bytes(body)
            root.chmod(0o755)  # mkdtemp's 0o700 would hide the export from other users
            # An empty directory is replaced; a file or a non-empty one makes this fail.
            root.replace(local)
        else:
            for rel in files:
                dst.put_file(rel, root / rel)
            dst.put(RECORD, body)
        return record
    finally:
        shutil.rmtree(root, ignore_errors=True)
