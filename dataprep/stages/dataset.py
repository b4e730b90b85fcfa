"""The output dataset (the contract between prep and training): a HF `datasets`
DatasetDict (train / validation) saved as Arrow shards in `save_to_disk`'s layout, the
tokenizer next to it, and manifest.json with the sha256 of every file. The check of a
dataset against its manifest lives with its reader, in core/dataset.py.

The shards are written streaming, one at a time, with `datasets`' own ArrowWriter: the
files are byte for byte what `DatasetDict.save_to_disk(num_shards=...)` writes from the
same rows, but no copy of a whole split is ever staged or memory-mapped."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core import provenance
from core.dataset import COLUMN_DOCS, FORMAT, MANIFEST, arrow_stats, row_schema
from core.files import remove_temp_files, sha256_bytes, sha256_file, temp_beside
from core.store import Store, open_store
from dataprep.config import PrepConfig
from dataprep.layout import output_store, provenance_key, under, version_dir, version_store
from dataprep.records import PARQUET_OPTIONS
from dataprep.stages.dataset_append import Base, shard_file
from dataprep.stages.mixture import appended_parent, read_doc_index
from dataprep.stages.pack import legacy_key, packed_done_key, packed_key, spans_key
from dataprep.stages.tokenize import TOKENIZER_KEY, load_run_tokenizer

if TYPE_CHECKING:
    from datasets import Features

DATASET_DIR = "dataset"
READ_BATCH_BYTES = 8 << 20
# The run's local working files, under a local output: <output>/_scratch/<step>/. Emptied
# at the start of the step (what a killed run left) and removed when the step is done.
SCRATCH_DIR = "_scratch"
# Where that goes for a remote (s3://) output: $BALLAST_SCRATCH, else this, then
# /<hash of the output URI>/<step>/.
DEFAULT_REMOTE_SCRATCH = Path("~/.cache/ballast/scratch")


def dataset_root(cfg: PrepConfig) -> str:
    """Where the output's datasets are: each version in vNNNN/, and `latest` naming the
    newest (core.dataset.resolve follows it)."""
    return f"{cfg.output.rstrip('/')}/{DATASET_DIR}"


def dataset_uri(cfg: PrepConfig) -> str:
    """The dataset of this run's version: <output>/dataset/vNNNN (layout.version_dir)."""
    return under(dataset_root(cfg), version_dir(cfg))


def scratch_dir(cfg: PrepConfig, step: str = DATASET_DIR) -> Path:
    """The local directory `step` of this run stages files in: inside the output itself
    when it is local (same filesystem and permissions as the output, and found again by
    the next run of the output), else a directory of its own per output URI."""
    local = output_store(cfg).local_path(SCRATCH_DIR)
    if local is not None:
        return local / step
    base = Path(os.environ.get("BALLAST_SCRATCH") or DEFAULT_REMOTE_SCRATCH).expanduser()
    return base / hashlib.sha256(cfg.output.encode()).hexdigest()[:16] / step


def _drop_scratch(scratch: Path) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
    with contextlib.suppress(OSError):  # only when no other step's scratch is in it
        scratch.parent.rmdir()


def shard_bounds(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each shard, as `Dataset.shard(num_shards, i, contiguous=True)`
    cuts them: the first rows % num_shards shards get one row more."""
    div, mod = divmod(rows, num_shards)
    bounds = []
    for i in range(num_shards):
        start = div * i + min(i, mod)
        bounds.append((start, start + div + (1 if i < mod else 0)))
    return bounds


def save_batch_size(rows: int, nbytes: int) -> int:
    """Rows per table that `Dataset.save_to_disk` hands its writer; each becomes one
    record batch of the shard file, so the bytes depend on it."""
    from datasets import config
    from datasets.arrow_writer import get_writer_batch_size_from_data_size

    size = config.DEFAULT_MAX_BATCH_SIZE
    if nbytes > 0:
        size = min(size, get_writer_batch_size_from_data_size(rows, nbytes))
    return size


def read_batch_rows(schema: pa.Schema) -> int:
    """Rows per batch read from a packed partition. Parquet's reader needs about four
    times a batch of these nested columns while decoding it (levels, growing buffers),
    so batches are kept at a few MB; the writer joins them again."""
    return max(1, READ_BATCH_BYTES // row_nbytes(schema))


def row_nbytes(schema: pa.Schema) -> int:
    """Bytes of one row in a memory-mapped Arrow table of `schema` (fixed-size lists of
    fixed-width values, no nulls): what `Dataset._estimate_nbytes` counts per row."""
    return sum(f.type.list_size * f.type.value_type.bit_width // 8 for f in schema)


def _json_bytes(obj: Any, sort_keys: bool) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=sort_keys).encode("utf-8")


def split_state(fingerprint: str, num_shards: int) -> bytes:
    """state.json as `Dataset.save_to_disk` writes it for an unformatted dataset."""
    state = {
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
        "_data_files": [
            {"filename": Path(shard_file("", i, num_shards)).name} for i in range(num_shards)
        ],
    }
    return _json_bytes(state, sort_keys=True)


def split_info(features: Features) -> bytes:
    """dataset_info.json as `Dataset.save_to_disk` writes it: only the top-level keys
    sorted, so that the order of nested feature fields is kept."""
    from datasets import DatasetInfo
    from datasets.utils.py_utils import asdict

    info = asdict(DatasetInfo(features=features))
    return _json_bytes({k: info[k] for k in sorted(info)}, sort_keys=False)


def packed_rows(store: Store, parts: list[str]) -> int:
    return sum(int(json.loads(store.get(packed_done_key(p)))["rows"]) for p in parts)


def packed_batches(
    store: Store,
    parts: list[str],
    batch_rows: int,
    scratch: Path,
    key_of: Callable[[str], str] = packed_key,
    skip: int = 0,
    part_rows: list[int] | None = None,
) -> Iterator[pa.RecordBatch]:
    """The packed rows of `parts` (or, with `key_of=spans_key`, their provenance), in
    order, a record batch at a time, from row `skip` on (`part_rows`: each partition's
    rows, so that whole partitions before it are never read). A partition in a remote
    store is downloaded to `scratch` first (one on disk at a time per reader) rather than
    held in memory."""
    for k, p in enumerate(parts):
        if part_rows is not None and skip >= part_rows[k]:
            skip -= part_rows[k]
            continue
        key = key_of(p)
        if not store.exists(key) and store.exists(legacy_key(key)):
            batches = _parquet_batches(store, legacy_key(key), batch_rows, scratch)
        else:
            batches = _ipc_batches(store, key, batch_rows, scratch)
        for batch in batches:
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            yield batch.slice(skip)
            skip = 0


def _local(store: Store, key: str, scratch: Path) -> tuple[Path, bool]:
    """`key` as a local file (downloaded into `scratch` when the store is remote, under
    a name of its own: readers of several shards run at once) and whether it was."""
    path = store.local_path(key)
    if path is not None:
        return path, False
    fd, tmp = tempfile.mkstemp(dir=scratch, suffix=Path(key).suffix)
    os.close(fd)
    store.get_file(key, tmp)
    return Path(tmp), True


def _ipc_batches(
    store: Store, key: str, batch_rows: int, scratch: Path
) -> Iterator[pa.RecordBatch]:
    path, fetched = _local(store, key, scratch)
    try:
        with pa.memory_map(str(path)) as source, pa.ipc.open_stream(source) as reader:
            for batch in reader:
                for at in range(0, batch.num_rows, batch_rows):
                    yield batch.slice(at, batch_rows)
    finally:
        if fetched:
            path.unlink(missing_ok=True)


def _parquet_batches(
    store: Store, key: str, batch_rows: int, scratch: Path
) -> Iterator[pa.RecordBatch]:
    """A partition that a ballast before the IPC format packed (pack.legacy_key)."""
    path, fetched = _local(store, key, scratch)
    try:
        with pq.ParquetFile(path) as pf:
            yield from pf.iter_batches(batch_size=batch_rows)
    finally:
        if fetched:
            path.unlink(missing_ok=True)


class _RowReader:
    """Takes consecutive runs of rows, of any length, from a stream of record batches."""

    def __init__(self, batches: Iterator[pa.RecordBatch], schema: pa.Schema):
        self._batches = batches
        self._schema = schema
        self._head: pa.RecordBatch | None = None

    def take(self, n: int) -> pa.Table:
        """The next `n` rows (n >= 1), cast to the row schema."""
        pieces: list[pa.RecordBatch] = []
        while n > 0:
            if self._head is None or self._head.num_rows == 0:
                self._head = next(self._batches, None)
                if self._head is None:
                    raise RuntimeError(
                        "the packed partitions hold fewer rows than their done markers say"
                    )
            piece = self._head.slice(0, n)
            pieces.append(piece)
            self._head = self._head.slice(piece.num_rows)
            n -= piece.num_rows
        return pa.Table.from_batches(pieces).cast(self._schema)

    def exhausted(self) -> bool:
        if self._head is not None and self._head.num_rows:
            return False
        return all(b.num_rows == 0 for b in self._batches)


@contextmanager
def _staged(target: Store, key: str, scratch: Path) -> Iterator[Path]:
    """A local file to write `key` into; when the block ends without error it becomes
    `key` in `target`. A local target gets it written next to the key under a hidden
    temporary name and renamed into place (LocalStore's own convention, so a crash never
    leaves a half-written key and no copy is made); any other target gets it uploaded
    from `scratch`."""
    dest = target.local_path(key)
    if dest is not None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, path = temp_beside(dest)
        os.close(fd)
    else:
        path = scratch / Path(key).name
    try:
        yield path
        if dest is not None:
            os.replace(path, dest)
        else:
            target.put_file(key, path)
    finally:
        path.unlink(missing_ok=True)


def _arrow_entry(path: Path, seq_len: int) -> dict[str, Any]:
    rows, real = arrow_stats(path)
    return {
        "sha256": sha256_file(path),
        "bytes": path.stat().st_size,
        "rows": rows,
        "real_tokens": real,
        "tokens": rows * seq_len,
    }


def _put(target: Store, key: str, data: bytes) -> dict[str, Any]:
    target.put(key, data)
    return {"sha256": sha256_bytes(data), "bytes": len(data)}


# Batches from row `start` on: the rows (or spans) of a split, read from there.
BatchesFrom = Callable[[int], Iterator[pa.RecordBatch]]
# Shards written at once. The step runs as one task after everything else; its reads,
# writes and hashing release the GIL, so two threads keep both cores of a 2-core worker
# busy (each shard's bytes are its own rows', whatever runs beside it).
SHARD_THREADS = 2


def _each_shard(
    bounds: list[tuple[int, int]], write: Callable[[int, int, int], dict[str, Any]]
) -> list[dict[str, Any]]:
    """write(i, start, end) for every shard, SHARD_THREADS at a time, results in order."""
    if len(bounds) == 1:
        return [write(0, *bounds[0])]
    with ThreadPoolExecutor(SHARD_THREADS, thread_name_prefix="ballast-dataset") as pool:
        futures = [pool.submit(write, i, a, b) for i, (a, b) in enumerate(bounds)]
        return [f.result() for f in futures]


def write_split(
    target: Store,
    name: str,
    batches_from: BatchesFrom,
    rows: int,
    num_shards: int,
    fingerprint: str,
    schema: pa.Schema,
    scratch: Path,
    first: int = 0,
    total: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Write `rows` rows (`batches_from(start)`: the rows from `start` on) as the split
    `name` (shards, state.json, dataset_info.json) in `Dataset.save_to_disk`'s layout
    and bytes; returns the manifest entries of its files. An appending version's new
    shards are numbered from `first` among `total` (the parent's come first)."""
    from datasets import Features
    from datasets.arrow_writer import ArrowWriter

    features = Features.from_arrow_schema(schema)
    seq_len = schema.field(0).type.list_size
    batch_rows = save_batch_size(rows, rows * row_nbytes(schema))
    bounds = shard_bounds(rows, num_shards)
    total = num_shards if total is None else total

    def write(i: int, start: int, end: int) -> dict[str, Any]:
        reader = _RowReader(batches_from(start), schema)
        rel = shard_file(name, first + i, total)
        with _staged(target, rel, scratch) as path:
            writer = ArrowWriter(features=features, path=str(path), embed_local_files=True)
            try:
                for off in range(start, end, batch_rows):
                    writer.write_table(reader.take(min(batch_rows, end - off)))
                writer.finalize()
            finally:
                writer.close()
            entry = _arrow_entry(path, seq_len)
        if i == len(bounds) - 1 and not reader.exhausted():
            raise RuntimeError(
                f"the packed partitions of {name} hold more rows than their done markers say"
            )
        return {rel: entry}

    files: dict[str, dict[str, Any]] = {}
    for entry in _each_shard(bounds, write):
        files.update(entry)
    files[f"{name}/state.json"] = _put(
        target, f"{name}/state.json", split_state(fingerprint, total)
    )
    files[f"{name}/dataset_info.json"] = _put(
        target, f"{name}/dataset_info.json", split_info(features)
    )
    return files


def write_spans(
    target: Store,
    name: str,
    batches_from: BatchesFrom,
    shards: list[tuple[str, int]],
    scratch: Path,
) -> dict[str, dict[str, Any]]:
    """The provenance of split `name`: one spans file per Arrow shard (`shards`: its file
    and rows), with the same rows, in row groups of provenance.ROW_GROUP rows (a reader
    finds a row's group by division). Returns the manifest entries of the files."""
    step = provenance.ROW_GROUP * 64  # rows per write: a multiple of the row group
    starts = np.cumsum([0, *(r for _, r in shards)]).tolist()
    bounds = [(starts[i], starts[i + 1]) for i in range(len(shards))]

    def write(i: int, start: int, end: int) -> dict[str, Any]:
        reader = _RowReader(batches_from(start), provenance.SPANS_SCHEMA)
        rows = end - start
        rel = provenance.spans_file(name, shards[i][0])
        with _staged(target, rel, scratch) as path:
            with pq.ParquetWriter(path, provenance.SPANS_SCHEMA, **PARQUET_OPTIONS) as w:
                for off in range(0, rows, step):
                    w.write_table(
                        reader.take(min(step, rows - off)), row_group_size=provenance.ROW_GROUP
                    )
            entry = {"sha256": sha256_file(path), "bytes": path.stat().st_size, "rows": rows}
        if i == len(bounds) - 1 and not reader.exhausted():
            raise RuntimeError(f"the provenance of {name} holds more rows than its packed rows")
        return {rel: entry}

    files: dict[str, dict[str, Any]] = {}
    for entry in _each_shard(bounds, write):
        files.update(entry)
    return files


def copy_doc_tables(
    cfg: PrepConfig, target: Store, skip: int = 0
) -> tuple[dict[str, Any], list[dict]]:
    """Every document table of the version (the quality stage's, one per shard) into the
    dataset, numbered by the global document index, less the first `skip` (an appending
    version's parent's, carried). Returns the files' manifest entries and the
    provenance's `docs` list."""
    store = output_store(cfg)
    files: dict[str, Any] = {}
    docs = []
    for k, (shard, first, n) in enumerate(read_doc_index(cfg)):
        if k < skip:
            continue
        data = store.get(provenance_key(shard))
        rows = pq.read_metadata(pa.BufferReader(data)).num_rows
        if rows != n:
            raise RuntimeError(
                f"{provenance_key(shard)} holds {rows} documents, its tokens "
                f"{n}: the output is inconsistent; prepare it again"
            )
        rel = provenance.docs_file(k)
        files[rel] = _put(target, rel, data)
        docs.append({"file": rel, "shard": shard, "first_doc": first, "docs": n})
    return files, docs


def append_base(cfg: PrepConfig) -> Base | None:
    parent = appended_parent(cfg)
    if parent is None:
        return None
    store = open_store(dataset_uri(parent), cfg.storage)
    return Base(parent.version, store, json.loads(store.get(MANIFEST)))


def write_dataset(
    cfg: PrepConfig,
    train_parts: list[str],
    extra: dict[str, Any],
    validation_parts: list[str] | None = None,
) -> dict:
    """Save the packed rows as a DatasetDict in dataset_uri(cfg) and write the
    manifest last (a dataset without a manifest is incomplete).

    What a killed run of this step left is removed first: temporary-named files in the
    dataset directory (half-written shards; `verify` refuses a dataset holding them) and
    its staging directory. So two runs must not write one dataset at the same time."""
    store = version_store(cfg)
    target = open_store(dataset_uri(cfg), cfg.storage)
    root = target.local_path("")
    if root is not None:
        remove_temp_files(root)
    scratch = scratch_dir(cfg, "-".join(filter(None, (DATASET_DIR, version_dir(cfg)))))
    _drop_scratch(scratch)
    if target.exists(MANIFEST):  # finished by an earlier run of the same config
        manifest = json.loads(target.get(MANIFEST))
        if manifest.get("config_fingerprint") == cfg.fingerprint():
            return manifest
    base = append_base(cfg)
    seq_len = cfg.pack.seq_len
    schema = row_schema(seq_len)
    tok = load_run_tokenizer(cfg)
    fp = cfg.fingerprint()
    parts = {"train": train_parts, "validation": validation_parts or ["validation"]}
    max_shards = {"train": cfg.dataset.train_shards, "validation": cfg.dataset.validation_shards}
    # Known before any shard is written: the shard boundaries depend on the totals.
    part_rows = {name: [packed_rows(store, [p]) for p in ps] for name, ps in parts.items()}
    rows = {name: sum(n) for name, n in part_rows.items()}
    files: dict[str, Any] = {}
    prov_splits: dict[str, list[dict[str, Any]]] = {}
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        files["dataset_dict.json"] = _put(
            target, "dataset_dict.json", json.dumps({"splits": list(parts)}).encode("utf-8")
        )
        for name, ps in parts.items():
            n = rows[name]
            per_part = part_rows[name]

            def rows_from(start: int, ps: list[str] = ps, per_part: list[int] = per_part):
                return packed_batches(
                    store, ps, read_batch_rows(schema), scratch, skip=start, part_rows=per_part
                )

            def spans_from(start: int, ps: list[str] = ps, per_part: list[int] = per_part):
                return packed_batches(
                    store,
                    ps,
                    provenance.ROW_GROUP * 16,
                    scratch,
                    spans_key,
                    skip=start,
                    part_rows=per_part,
                )

            carried: list[dict[str, Any]] = []
            if base is None:
                first, new = 0, max(1, min(max_shards[name], n))
            else:
                first, new = len(base.files(name)), base.new_shards(name, n, max_shards[name])
                carried_files, carried = base.carry_split(target, name, first + new)
                files.update(carried_files)
            # A fixed fingerprint: `datasets` would otherwise draw one from a path, and
            # state.json would differ per run.
            split_files = write_split(
                target,
                name,
                rows_from,
                n,
                new,
                f"{fp}-{name}",
                schema,
                scratch,
                first,
                first + new,
            )
            files.update(split_files)
            shards = [
                (rel, int(e["rows"]))
                for rel, e in sorted(split_files.items())
                if rel.endswith(".arrow")
            ]
            span_files = write_spans(target, name, spans_from, shards, scratch)
            files.update(span_files)
            prov_splits[name] = carried + [
                {"file": rel, "rows": e["rows"]} for rel, e in sorted(span_files.items())
            ]
        prov_docs: list[dict[str, Any]] = []
        if base is not None:
            doc_files, prov_docs = base.carry_docs(target)
            files.update(doc_files)
        doc_files, new_docs = copy_doc_tables(cfg, target, skip=len(prov_docs))
        files.update(doc_files)
        prov_docs += new_docs
    finally:
        _drop_scratch(scratch)
    # One tokenizer for every version of an output (token ids must mean the same).
    files["tokenizer.json"] = _put(target, "tokenizer.json", output_store(cfg).get(TOKENIZER_KEY))
    total_rows = {name: n + (base.rows(name) if base else 0) for name, n in rows.items()}
    if base is not None:
        extra = {
            **extra,
            "appended_to": {
                "version": base.version,
                "rows": {name: base.rows(name) for name in rows},
            },
        }
    manifest = {
        "format": FORMAT,
        "config_fingerprint": fp,
        "seed": cfg.seed,
        "seq_len": seq_len,
        "pack": cfg.pack.model_dump(),
        "columns": COLUMN_DOCS,
        "tokenizer": {
            "kind": cfg.tokenizer.kind,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "pad_id": tok.pad_id,
            "file": "tokenizer.json",
            "sha256": files["tokenizer.json"]["sha256"],
        },
        "splits": {
            name: {
                "rows": n,
                "tokens": n * seq_len,
                "real_tokens": sum(
                    f.get("real_tokens", 0) for r, f in files.items() if r.startswith(f"{name}/")
                ),
                "files": sorted(
                    r for r in files if r.startswith(f"{name}/") and r.endswith(".arrow")
                ),
            }
            for name, n in total_rows.items()
        },
        "files": files,
        "provenance": {
            "format": provenance.FORMAT,
            "columns": provenance.COLUMN_DOCS,
            "splits": prov_splits,
            "docs": prov_docs,
        },
        **extra,
    }
    target.put(MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    return manifest
