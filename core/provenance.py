"""Provenance of a prepared dataset: which documents (and which of their tokens) each packed
row holds, and for each document its id, source, input location and what the quality rules
measured when they kept it. Prep writes it beside the rows (dataprep/stages/dataset.py); this
module is its contract and its reader, for `ballast blame` and the trainer's guard events.

Layout inside a dataset directory (every file is in manifest.json's `files`, with its
sha256, so `verify` covers it):

    provenance/<split>/spans-NNNNN-of-MMMMM.parquet   one row per packed row of the split's
        shard data-NNNNN-of-MMMMM.arrow: list columns doc / start / end, one entry per
        document piece in the row, in segment order (segment_ids 1, 2, ...): the global
        document index, and the piece's token offsets [start, end) within the document
    provenance/docs/NNNNN.parquet   the documents of one prep shard, aligned with the
        global document index: id, source, location, then one float64 column per quality
        statistic ("<rule>.<value>", null where that rule did not run on the document)

Memory: a lookup reads one Parquet row group (ROW_GROUP rows) per row asked for, and one
document file per document; nothing holds the whole table.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

FORMAT = "ballast-provenance/1"
ROW_GROUP = 1024  # span rows per Parquet row group: a row's group is row // ROW_GROUP
DOC_FIELDS = ("id", "source", "location")
DOCS_BASE_SCHEMA = pa.schema(
    [("id", pa.string()), ("source", pa.string()), ("location", pa.string())]
)
SPANS_SCHEMA = pa.schema(
    [("doc", pa.list_(pa.int64())), ("start", pa.list_(pa.int32())), ("end", pa.list_(pa.int32()))]
)
COLUMN_DOCS = {
    "spans": "per packed row: doc (global document index), start, end (token offsets of "
    "the piece in the document), one entry per segment in segment order",
    "docs": "per document: id, source, location (file:line or file#row=n), then "
    "<rule>.<value> float64 quality statistics (null where the rule did not run)",
}


def spans_file(split: str, shard_file: str) -> str:
    """The spans file beside a split's Arrow shard (train/data-00000-of-00004.arrow ->
    provenance/train/spans-00000-of-00004.parquet)."""
    stem = Path(shard_file).name.removeprefix("data-").removesuffix(".arrow")
    return f"provenance/{split}/spans-{stem}.parquet"


def docs_file(ordinal: int) -> str:
    return f"provenance/docs/{ordinal:05d}.parquet"


class ProvenanceError(ValueError):
    """The dataset has no provenance, or a lookup is out of range."""


@dataclass(frozen=True)
class Span:
    doc: int  # global document index
    start: int  # token offsets of the piece in the document
    end: int


@dataclass(frozen=True)
class Document:
    index: int
    id: str
    source: str
    location: str
    stats: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "doc": self.index,
            "id": self.id,
            "source": self.source,
            "location": self.location,
            "stats": self.stats,
        }


class Provenance:
    """Reads a local dataset directory's provenance (see the module docstring)."""

    def __init__(self, root: str | Path, manifest: dict[str, Any] | None = None):
        self.root = Path(root)
        if manifest is None:
            manifest = json.loads((self.root / "manifest.json").read_text())
        prov = manifest.get("provenance")
        if not prov or prov.get("format") != FORMAT:
            raise ProvenanceError(
                f"{self.root}: the dataset has no provenance (prepared by "
                "a ballast without it); prepare it again to use blame"
            )
        self.manifest = manifest
        self._splits: dict[str, list[dict[str, Any]]] = prov["splits"]
        self._docs: list[dict[str, Any]] = prov["docs"]
        self._firsts = [int(d["first_doc"]) for d in self._docs]
        self._row_starts = {s: _starts(files) for s, files in self._splits.items()}
        self._groups: dict[tuple[str, int, int], pa.Table] = {}
        self._doc_tables: dict[int, pa.Table] = {}

    @property
    def n_docs(self) -> int:
        return sum(int(d["docs"]) for d in self._docs)

    def rows(self, split: str) -> int:
        return sum(int(f["rows"]) for f in self._splits[split])

    def spans(self, split: str, row: int) -> list[Span]:
        """The document pieces of packed row `row` of `split`, in segment order."""
        starts = self._row_starts.get(split)
        if starts is None:
            raise ProvenanceError(f"no split {split!r} in the provenance")
        if not 0 <= row < starts[-1]:
            raise ProvenanceError(f"row {row} is out of range: {split} has {starts[-1]} rows")
        k = bisect.bisect_right(starts, row) - 1
        local = row - starts[k]
        g = local // ROW_GROUP
        key = (split, k, g)
        table = self._groups.get(key)
        if table is None:
            if len(self._groups) > 64:  # a bounded cache: batches are read group by group
                self._groups.clear()
            with pq.ParquetFile(self.root / self._splits[split][k]["file"]) as pf:
                table = pf.read_row_group(g)
            self._groups[key] = table
        i = local - g * ROW_GROUP
        docs, st, en = (table.column(c)[i].as_py() for c in ("doc", "start", "end"))
        return [Span(int(d), int(s), int(e)) for d, s, e in zip(docs, st, en, strict=True)]

    def document(self, index: int) -> Document:
        if not 0 <= index < self.n_docs:
            raise ProvenanceError(f"document {index} is out of range (0..{self.n_docs - 1})")
        k = bisect.bisect_right(self._firsts, index) - 1
        table = self._doc_tables.get(k)
        if table is None:
            if len(self._doc_tables) > 16:
                self._doc_tables.clear()
            table = pq.read_table(self.root / self._docs[k]["file"])
            self._doc_tables[k] = table
        row = table.slice(index - self._firsts[k], 1).to_pylist()[0]
        stats = {
            n: v
            for n, v in row.items()
            if n not in DOC_FIELDS
            and v is not None
            and not (isinstance(v, float) and math.isnan(v))
        }
        return Document(index, row["id"], row["source"], row["location"], stats)

    def find(self, doc_id: str) -> list[int]:
        """Every document index whose id is `doc_id` (a scan of the id columns, one file
        at a time)."""
        out = []
        for d in self._docs:
            ids = pq.read_table(self.root / d["file"], columns=["id"]).column("id")
            out += [int(d["first_doc"]) + i for i, v in enumerate(ids.to_pylist()) if v == doc_id]
        return out

    def rows_holding(self, split: str, docs: Iterable[int]) -> dict[int, list[Span]]:
        """Every row of `split` that holds a piece of one of `docs`: row -> those pieces.
        A scan of the spans files, a row group at a time."""
        want = set(docs)
        out: dict[int, list[Span]] = {}
        for k, f in enumerate(self._splits[split]):
            base = self._row_starts[split][k]
            with pq.ParquetFile(self.root / f["file"]) as pf:
                row = base
                for batch in pf.iter_batches(batch_size=ROW_GROUP):
                    for d, s, e in zip(
                        *(batch.column(c).to_pylist() for c in ("doc", "start", "end")), strict=True
                    ):
                        hit = [Span(a, b, c) for a, b, c in zip(d, s, e, strict=True) if a in want]
                        if hit:
                            out[row] = hit
                        row += 1
        return out


def _starts(files: list[dict[str, Any]]) -> list[int]:
    out = [0]
    for f in files:
        out.append(out[-1] + int(f["rows"]))
    return out
