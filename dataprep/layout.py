"""What every prep stage shares: where its files live, per-shard accounting, completion
markers, and writing kept/dropped shards.

Layout under the run's output URI:
    docs/<stage>/<shard>.parquet      documents that survive <stage>; for the stages that
                                      only drop (exact, near) a view: their id, source,
                                      meta and row in the file that has the text (see
                                      TEXT_FROM; read_docs reads either kind)
    dropped/<stage>/<shard>.parquet   documents <stage> dropped, with reason and detail
    _done/<stage>/<shard>.json        accounting for that shard; written last, so its
                                      presence means the shard is complete
    provenance/<shard>.parquet        the quality stage's kept documents: id, source,
                                      location, the rules' statistics (core/provenance.py)
    vNNNN/                            what version N computes over all of its documents
                                      (version_store): mixture plan and order, packed rows,
                                      report.json (the accounting of the whole run)
    dataset/vNNNN/, dataset/latest    version N's dataset; the newest (dataprep/versions.py)
    _run.json                         the output's claim: config, run id, LAYOUT

Per-shard files of every version share the output itself: shard names never repeat
across versions.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.store import NotFound, Store, open_store
from dataprep.config import PrepConfig
from dataprep.records import (
    DOC_SCHEMA,
    DROPPED_SCHEMA,
    LOCATION_KEY,
    meta_location,
    parquet_bytes_to_table,
    table_to_parquet_bytes,
)


@lru_cache(maxsize=8)
def _store(uri: str, options_json: str) -> Store:
    from core.store import StorageOptions

    return open_store(uri, StorageOptions.model_validate_json(options_json))


def output_store(cfg: PrepConfig) -> Store:
    """The run's output store, one per process (stores are re-opened in workers rather
    than pickled: an S3 client does not survive pickling)."""
    return _store(cfg.output, cfg.storage.model_dump_json())


RUN_KEY = "_run.json"
# The layout of the output's files. Bumped when a step's files change shape (2: per-shard
# duplicate lists, band-per-member signatures, byte-range ingest units; 3: the provenance:
# quality's document tables, the mixture's document index, packed spans; 4: version 1 in
# v0001/ and dataset/v0001/ like every later version), so an output half-made by an older
# ballast is refused instead of resumed wrongly: except layout 3, which differs from 4 in
# where version 1 is only, and is read as it is (version_dir).
LAYOUT = 4
V1_AT_ROOTS = 3
READABLE_LAYOUTS = (V1_AT_ROOTS, LAYOUT)


def version_name(version: int) -> str:
    return f"v{version:04d}"


def version_dir(cfg: PrepConfig) -> str:
    """The directory of cfg.version's files, under the output and under dataset/: vNNNN
    for every version. An output made with layout 3 holds its version 1 at those roots
    themselves (""), and keeps it there: it is read as it is, not migrated. A version that
    training has read is never changed, and moving one (on S3: copy, then delete) would
    change it under its readers and break every path given out to it, `load_from_disk`
    users' included; only a re-run of that version 1 needs to know where it is (the
    output's later versions are in vNNNN/ as in any other), and this is the one place
    that knows."""
    if cfg.version == 1 and _v1_at_roots(cfg.output, cfg.storage.model_dump_json()):
        return ""
    return version_name(cfg.version)


def under(uri: str, name: str) -> str:
    """`name` under `uri` ("": `uri` itself)."""
    return f"{uri.rstrip('/')}/{name}" if name else uri


_layouts: dict[tuple[str, str], bool] = {}


def _v1_at_roots(uri: str, options_json: str) -> bool:
    """Whether the output at `uri` was claimed with layout 3: read once per process (an
    output keeps its layout; one not claimed yet is made with LAYOUT)."""
    key = (uri, options_json)
    if key not in _layouts:
        try:
            run = json.loads(_store(uri, options_json).get(RUN_KEY))
        except NotFound:
            return False
        _layouts[key] = run.get("layout") == V1_AT_ROOTS
    return _layouts[key]


def version_uri(cfg: PrepConfig) -> str:
    """Where what cfg.version computes over all of its documents goes (mixture plan and
    order, packed rows, report): `<output>/vNNNN`."""
    return under(cfg.output, version_dir(cfg))


def version_store(cfg: PrepConfig) -> Store:
    """The store at version_uri."""
    return _store(version_uri(cfg), cfg.storage.model_dump_json())


def docs_key(stage: str, shard: str) -> str:
    return f"docs/{stage}/{shard}.parquet"


def dropped_key(stage: str, shard: str) -> str:
    return f"dropped/{stage}/{shard}.parquet"


def provenance_key(shard: str) -> str:
    return f"provenance/{shard}.parquet"


def done_key(stage: str, shard: str) -> str:
    return f"_done/{stage}/{shard}.json"


@dataclass
class SourceStats:
    docs_in: int = 0
    bytes_in: int = 0
    kept: int = 0
    bytes_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    bytes_dropped: int = 0
    # Replacements in kept documents by kind ({"email": 3, "ip": 1}; the `pii` rule);
    # in the report only when something was replaced.
    redacted: dict[str, int] = field(default_factory=dict)

    def add_in(self, nbytes: int) -> None:
        self.docs_in += 1
        self.bytes_in += nbytes

    def add_kept(self, nbytes: int) -> None:
        self.kept += 1
        self.bytes_kept += nbytes

    def add_dropped(self, reason: str, nbytes: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.bytes_dropped += nbytes

    def merge(self, other: SourceStats) -> None:
        self.docs_in += other.docs_in
        self.bytes_in += other.bytes_in
        self.kept += other.kept
        self.bytes_kept += other.bytes_kept
        self.bytes_dropped += other.bytes_dropped
        for r, n in other.dropped.items():
            self.dropped[r] = self.dropped.get(r, 0) + n
        self.add_redacted(other.redacted)

    def add_redacted(self, counts: Mapping[str, int]) -> None:
        for kind, n in counts.items():
            self.redacted[kind] = self.redacted.get(kind, 0) + n

    def add_rows(self, nbytes: np.ndarray, dropped: np.ndarray, reason: str) -> None:
        """Account many documents at once: `nbytes` each, `dropped` (bool) with `reason`
        (the same as add_in, then add_kept or add_dropped, per document)."""
        n, nd = len(nbytes), int(np.count_nonzero(dropped))
        bytes_dropped = int(nbytes[dropped].sum())
        self.docs_in += n
        self.bytes_in += int(nbytes.sum())
        self.kept += n - nd
        self.bytes_kept += int(nbytes.sum()) - bytes_dropped
        if nd:
            self.dropped[reason] = self.dropped.get(reason, 0) + nd
            self.bytes_dropped += bytes_dropped

    @property
    def n_dropped(self) -> int:
        return sum(self.dropped.values())

    def to_json(self) -> dict[str, Any]:
        out = {
            "docs_in": self.docs_in,
            "bytes_in": self.bytes_in,
            "kept": self.kept,
            "bytes_kept": self.bytes_kept,
            "dropped": dict(sorted(self.dropped.items())),
            "bytes_dropped": self.bytes_dropped,
        }
        if self.redacted:  # absent rather than {}: a run without `pii` reports as before
            out["redacted"] = dict(sorted(self.redacted.items()))
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SourceStats:
        return cls(
            d["docs_in"],
            d["bytes_in"],
            d["kept"],
            d["bytes_kept"],
            dict(d["dropped"]),
            d["bytes_dropped"],
            dict(d.get("redacted", {})),
        )


class ShardStats(defaultdict[str, SourceStats]):
    def __init__(self) -> None:
        super().__init__(SourceStats)

    def to_json(self) -> dict[str, Any]:
        return {src: s.to_json() for src, s in sorted(self.items())}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardStats:
        out = cls()
        for src, s in d.items():
            out[src] = SourceStats.from_json(s)
        return out

    def add_rows(
        self,
        sources: pa.ChunkedArray | pa.Array,
        nbytes: np.ndarray,
        dropped: np.ndarray,
        reason: str,
    ) -> None:
        """Account a shard's documents by source, vectorised: the same totals as add_in and
        add_kept / add_dropped row by row (every source present gets its entry)."""
        if isinstance(sources, pa.ChunkedArray):
            sources = sources.combine_chunks()
        enc = pc.dictionary_encode(sources)
        inv = enc.indices.to_numpy(zero_copy_only=False)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        names = enc.dictionary.to_pylist()
        for k, name in enumerate(names):
            rows = inv == k if len(names) > 1 else slice(None)
            self[name].add_rows(nbytes[rows], dropped[rows], reason)


class DroppedRows:
    """Accumulates the rows of a dropped-documents table."""

    def __init__(self) -> None:
        self.cols: dict[str, list[str]] = {f.name: [] for f in DROPPED_SCHEMA}

    def add(self, id: str, source: str, reason: str, detail: str, location: str, text: str) -> None:
        c = self.cols
        c["id"].append(id)
        c["source"].append(source)
        c["reason"].append(reason)
        c["detail"].append(detail)
        c["location"].append(location)
        c["text"].append(text)

    def __len__(self) -> int:
        return len(self.cols["id"])

    def table(self) -> pa.Table:
        return pa.table(self.cols, schema=DROPPED_SCHEMA)


def is_done(store: Store, stage: str, shard: str) -> bool:
    return store.exists(done_key(stage, shard))


def read_done(store: Store, stage: str, shard: str) -> dict[str, Any]:
    return json.loads(store.get(done_key(stage, shard)))


def write_shard(
    store: Store,
    stage: str,
    shard: str,
    kept: pa.Table | None,
    dropped: DroppedRows,
    stats: ShardStats,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a stage's outputs for one shard, then its marker (last: the marker is the
    promise that everything before it is complete)."""
    if kept is not None:
        store.put(docs_key(stage, shard), table_to_parquet_bytes(kept.cast(DOC_SCHEMA)))
    if len(dropped):
        store.put(dropped_key(stage, shard), table_to_parquet_bytes(dropped.table()))
    marker = {"shard": shard, "stats": stats.to_json(), **(extra or {})}
    store.put(done_key(stage, shard), json.dumps(marker, sort_keys=True).encode())
    return marker


# A stage that only drops documents (exact and near dedup) does not copy their text: its
# docs/<stage>/<shard>.parquet is a view, the kept documents' id, source and meta and, in
# `row`, each one's row in the same shard of the stage that holds the text, named in the
# file's schema metadata under TEXT_FROM. That stage's file always has the text itself (a
# view of a view points at the text directly), so a view is one read away from it.
# read_docs turns a view into the very table the stage would otherwise have written.
TEXT_FROM = b"ballast.text_from"
VIEW_SCHEMA = pa.schema(
    [("id", pa.string()), ("source", pa.string()), ("meta", pa.string()), ("row", pa.int64())]
)
# Rows per chunk of a view's materialised text: as a read of a written table gives them
# (table_to_parquet_bytes' row groups).
VIEW_CHUNK = 10_000


@dataclass
class DocView:
    """A stage's kept documents as stored: `table` has id, source and meta (and text
    when `text_stage` is the stage itself); document i's text is row rows[i] of
    `text_stage`'s shard."""

    table: pa.Table
    text_stage: str
    rows: np.ndarray

    @property
    def is_view(self) -> bool:
        return "text" not in self.table.column_names


def read_view(store: Store, stage: str, shard: str) -> DocView:
    table = parquet_bytes_to_table(store.get(docs_key(stage, shard)))
    meta = table.schema.metadata or {}
    if TEXT_FROM in meta:
        rows = table.column("row").to_numpy()
        return DocView(table.drop_columns(["row"]), meta[TEXT_FROM].decode(), rows)
    return DocView(table, stage, np.arange(table.num_rows, dtype=np.int64))


def text_source(store: Store, view: DocView, shard: str) -> pa.ChunkedArray:
    """The whole text column of the shard `view`'s texts are rows of."""
    if not view.is_view:
        return view.table.column("text")
    data = store.get(docs_key(view.text_stage, shard))
    return pq.read_table(pa.BufferReader(data), columns=["text"]).column("text")


def take_rows(col: pa.ChunkedArray, rows: np.ndarray) -> pa.ChunkedArray:
    """col[rows], in chunks of at most VIEW_CHUNK rows, each taken from one chunk of
    `col` (never one array for the whole column: a string array holds at most 2 GiB)."""
    if len(rows) > 1 and not bool(np.all(rows[1:] >= rows[:-1])):
        return col.take(pa.array(rows, pa.int64()))  # not in order: never from a view
    bounds = np.cumsum([0, *(len(c) for c in col.chunks)])
    out: list[pa.Array] = []
    for a in range(0, len(rows), VIEW_CHUNK):
        r = rows[a : a + VIEW_CHUNK]
        ci = np.searchsorted(bounds, r, side="right") - 1
        cut = np.flatnonzero(np.diff(ci)) + 1
        out += [
            col.chunk(int(c[0])).take(pa.array(rr - bounds[c[0]], pa.int64()))
            for rr, c in zip(np.split(r, cut), np.split(ci, cut), strict=True)
        ]
    return pa.chunked_array(out, type=col.type)


def view_text(store: Store, view: DocView, shard: str) -> pa.ChunkedArray:
    """The text of `view`'s documents, in their order."""
    if not view.is_view:
        return view.table.column("text")
    return take_rows(text_source(store, view, shard), view.rows)


def read_docs(store: Store, stage: str, shard: str) -> pa.Table:
    """A stage's kept documents (id, text, source, meta), whether stored whole or as a
    view."""
    view = read_view(store, stage, shard)
    if not view.is_view:
        return view.table
    t = view.table
    text = view_text(store, view, shard)
    return pa.table([t["id"], text, t["source"], t["meta"]], schema=DOC_SCHEMA)


def write_view(
    store: Store,
    stage: str,
    shard: str,
    view: DocView,
    keep: np.ndarray,
    dropped: DroppedRows,
    stats: ShardStats,
) -> dict[str, Any]:
    """write_shard for a stage that only drops: the rows of `view` where `keep`, stored as
    a view onto the text `view` already points at (no text is copied)."""
    t = view.table
    mask = pa.array(keep)
    kept = pa.table(
        [*(t[c].filter(mask) for c in ("id", "source", "meta")), pa.array(view.rows[keep])],
        schema=VIEW_SCHEMA.with_metadata({TEXT_FROM: view.text_stage.encode()}),
    )
    store.put(docs_key(stage, shard), table_to_parquet_bytes(kept))
    return write_shard(store, stage, shard, None, dropped, stats)


# How ingest's meta JSON spells the location's key and the start of its value.
_LOCATION_AT = json.dumps({LOCATION_KEY: ""})[1:-2]
_LOCATION_KEY_AT = _LOCATION_AT[:-1]


def doc_location(meta: str, shard: str, row: int) -> str:
    """Where a document came from (ingest records it in meta), for dropped rows."""
    if not meta:
        return f"{shard}#row={row}"
    # Without parsing the meta (a json.loads per document was 7% of the quality stage):
    # quotes inside JSON strings are escaped, so an unescaped `"key": "` is a key; when
    # the key occurs once and its value has no escape, that value is the location as
    # json.loads reads it. Anything else (a nested key of the same name, escapes, an old
    # shard's "location") takes the parse.
    at = meta.find(_LOCATION_AT)
    if at >= 0 and meta.find(_LOCATION_KEY_AT, at + 1) < 0 and meta.find(_LOCATION_KEY_AT) == at:
        start = at + len(_LOCATION_AT)
        end = meta.find('"', start)
        if end >= 0 and "\\" not in meta[start:end]:
            return meta[start:end]
    loc = meta_location(json.loads(meta))
    return loc if loc is not None else f"{shard}#row={row}"
