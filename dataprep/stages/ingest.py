"""Ingest: read every source into normalised {id, text, source, meta} shards; records that
cannot become documents go to dropped/ingest/ with the reason and their location.

`meta` is the record's own fields (all but the text), untouched, plus its location under
`records.LOCATION_KEY`; it is always standard JSON (the readers quarantine NaN/Infinity)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from core.errors import NotFound
from core.store import Store
from dataprep.config import PrepConfig, SourceConfig
from dataprep.formats import BadRecord, InputFile
from dataprep.inputs import hash_input, part_entry
from dataprep.layout import (
    DroppedRows,
    ShardStats,
    docs_key,
    output_store,
    version_name,
    write_shard,
)
from dataprep.readers import local_input, read_local, resolve_inputs, split_input
from dataprep.records import DOC_SCHEMA, LOCATION_KEY, table_to_parquet_bytes

STAGE = "ingest"
# Small files are grouped into one unit of work up to this many bytes, so a source of
# many tiny files does not become thousands of tasks; a bigger file is split into parts
# of about this size where it can be (see plan_units). Not a config field: a new field
# would change the fingerprint of every existing config.
UNIT_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Unit:
    index: int
    source: str
    files: tuple[InputFile, ...]
    # The dataset version that reads it. Units of version 1 are named as they always were;
    # a later version's carry its name, so that shard names never repeat across versions.
    version: int = 1

    @property
    def name(self) -> str:
        base = f"u{self.index:05d}"
        return base if self.version == 1 else f"{version_name(self.version)}-{base}"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "source": self.source,
            "version": self.version,
            "files": [dataclasses.asdict(f) for f in self.files],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Unit:
        files = tuple(input_file(f) for f in d["files"])
        return cls(int(d["index"]), d["source"], files, int(d["version"]))


def input_file(d: dict[str, Any]) -> InputFile:
    """An InputFile from its dataclasses.asdict form."""
    return InputFile(
        **{**d, "row_groups": None if d["row_groups"] is None else tuple(d["row_groups"])}
    )


# The parts big input files were split into, kept in the output for the next run.
SPLITS_KEY = "_splits.json"


class Splits:
    """split_input, remembered: a big jsonl file is split by a newline-counting pass over
    all of it, so without this every run of an output re-read every input it ever had
    (a nightly version on a 1M-document history: 822 MB of it, for 10 MB of new data).
    A file is known by its uri, format, size and version tag (local: size and mtime;
    S3: ETag), the same test that tells an unchanged input without reading it
    (dataprep/inputs.py); a file without a tag is split afresh."""

    def __init__(self, known: dict[str, list[dict[str, Any]]] | None = None) -> None:
        self.known = known or {}
        self.used: dict[str, list[dict[str, Any]]] = {}

    @classmethod
    def load(cls, store: Store) -> Splits:
        try:
            return cls(json.loads(store.get(SPLITS_KEY)))
        except NotFound:
            return cls()

    def split(self, f: InputFile, unit_bytes: int) -> list[InputFile]:
        if not f.version or f.size <= unit_bytes:
            return split_input(f, unit_bytes)
        key = json.dumps([f.source, f.uri, f.rel, f.format, f.size, f.version, unit_bytes])
        if key in self.known:
            parts = [input_file(d) for d in self.known[key]]
        else:
            parts = split_input(f, unit_bytes)
        self.used[key] = [dataclasses.asdict(p) for p in parts]
        return parts

    def save(self, store: Store) -> None:
        """Keep the splits of this plan's files (those no longer listed are dropped)."""
        data = json.dumps(self.used, sort_keys=True)
        if data != json.dumps(self.known, sort_keys=True):  # row_groups: tuple vs list
            store.put(SPLITS_KEY, data.encode())


def plan_units(
    cfg: PrepConfig, unit_bytes: int | None = None, splits: Splits | None = None
) -> list[Unit]:
    """Resolve every input of every source (raising IngestError before any work starts)
    and group them into units in a deterministic order: sources as configured, files
    sorted within each source. The plan depends on the inputs and `unit_bytes` (default
    UNIT_BYTES) only, never on the worker count.

    Files up to `unit_bytes` are grouped into units of up to `unit_bytes`. A bigger local
    file is split so that several workers read it (`split_input`): uncompressed jsonl into
    byte ranges aligned to line starts (a newline-counting pass over the file numbers their
    first lines), parquet into runs of row groups; each part is a unit of its own. A
    compressed file (.gz, .zst: no random access), a txt file, an hf dataset, an s3 object
    and a parquet file of one row group stay one unit, read by one worker. `splits`: the
    splits an earlier run of the output made (Splits), reused for files unchanged since."""
    limit = UNIT_BYTES if unit_bytes is None else unit_bytes
    if limit < 1:
        raise ValueError(f"unit_bytes must be at least 1, got {limit}")
    units: list[Unit] = []
    for src in cfg.sources:
        files = resolve_inputs(src, cfg.storage)
        group: list[InputFile] = []
        size = 0
        for f in files:
            parts = (splits or Splits()).split(f, limit)
            if len(parts) > 1:
                if group:
                    units.append(Unit(len(units), src.name, tuple(group)))
                    group, size = [], 0
                for p in parts:
                    units.append(Unit(len(units), src.name, (p,)))
                continue
            if group and (size + f.size > limit or f.format == "hf"):
                units.append(Unit(len(units), src.name, tuple(group)))
                group, size = [], 0
            group.append(f)
            size += f.size
        if group:
            units.append(Unit(len(units), src.name, tuple(group)))
    return units


# allow_nan=False: never write NaN/Infinity (not JSON); the readers refuse them, so
# this raising would be a reader bug, not bad input. One encoder for every document:
# json.dumps with these arguments builds the same one per call.
_meta_json = json.JSONEncoder(
    sort_keys=True, ensure_ascii=False, default=str, allow_nan=False
).encode


def _utf8(s: str) -> str:
    """`s`, with any unpaired surrogate (from a JSON \\ud800 escape) spelled out, so that
    a quarantine row (id, detail) can always be written."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")
    return s


def ingest_unit(cfg: PrepConfig, unit: Unit) -> dict:
    """Read one unit's files into shards of at most `ingest.shard_docs` documents."""
    store = output_store(cfg)
    src: SourceConfig = next(s for s in cfg.sources if s.name == unit.source)
    stats = ShardStats()
    st = stats[src.name]
    dropped = DroppedRows()
    shards: list[str] = []
    cols: dict[str, list[str]] = {"id": [], "text": [], "source": [], "meta": []}

    def flush() -> None:
        name = f"{unit.name}-p{len(shards):04d}"
        table = pa.table(cols, schema=DOC_SCHEMA)
        store.put(docs_key(STAGE, name), table_to_parquet_bytes(table))
        shards.append(name)
        for v in cols.values():
            v.clear()

    inputs: list[dict] = []
    for f in unit.files:
        with local_input(src, f, cfg.storage) as path:
            # What was read, for the run's inventory (dataprep/inputs.py): hashed in one
            # sequential read just before the reader's, which the page cache then serves.
            inputs.append(part_entry(f, hash_input(f, path)))
            for rec in read_local(src, f, path, cfg.ingest.max_doc_bytes, cfg.ingest.extract):
                if isinstance(rec, BadRecord):
                    # The whole record's size: rec.raw is cut for display.
                    st.add_in(rec.size)
                    st.add_dropped(rec.reason, rec.size)
                    dropped.add(
                        _utf8(rec.id or f"{src.name}/{rec.location}"),
                        src.name,
                        rec.reason,
                        _utf8(rec.detail),
                        rec.location,
                        rec.raw,
                    )
                    continue
                text, nbytes = rec.text, rec.nbytes
                if nbytes < 0:
                    nbytes = len(text.encode("utf-8"))
                st.add_in(nbytes)
                st.add_kept(nbytes)
                cols["id"].append(rec.id)
                cols["text"].append(text)
                cols["source"].append(src.name)
                # The readers refuse a record with a LOCATION_KEY field: nothing is
                # overwritten.
                cols["meta"].append(_meta_json({**rec.meta, LOCATION_KEY: rec.location}))
                if len(cols["id"]) >= cfg.ingest.shard_docs:
                    flush()
    if cols["id"] or not shards:
        flush()  # an empty unit still gets one (empty) shard, so every stage sees it
    return write_shard(
        store, STAGE, unit.name, None, dropped, stats, {"shards": shards, "inputs": inputs}
    )
