"""The quality stage: run each source's quality rules over a shard; dropped documents go
to dropped/quality/ with the rule and check that dropped them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dataprep.config import PrepConfig
from dataprep.layout import (
    DroppedRows,
    ShardStats,
    doc_location,
    output_store,
    provenance_key,
    read_docs,
    write_shard,
)
from dataprep.quality import (
    FilterResult,
    batched,
    filter_document,
    filter_documents,
    native_chain,
    parse_rules,
)
from dataprep.records import DOC_SCHEMA, table_to_parquet_bytes

STAGE = "quality"


def filter_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    store = output_store(cfg)
    docs = read_docs(store, input_stage, shard)
    n = docs.num_rows
    nbytes = pc.binary_length(docs["text"]).to_pylist()
    ids, sources, metas = (docs[c].to_pylist() for c in ("id", "source", "meta"))
    rules = {src: parse_rules(cfg.rules_for(src)) for src in set(sources)}
    # The native kernel first, for each source whose whole chain it runs; the documents
    # it leaves (and the other sources') go through the Python rules, which need them as
    # Python strings. Either way each document gets the same outcome.
    native, python_rows = native_outcomes(rules, docs["text"], sources)
    texts: list[str | None] = [None] * n
    dropped_native = [r for r, (o, k) in native.items() if o.reason[k] is not None]
    for rows in (python_rows, dropped_native):
        for r, t in zip(rows, docs["text"].take(pa.array(rows, pa.int64())).to_pylist(), strict=True):
            texts[r] = t
    stats = ShardStats()
    dropped = DroppedRows()
    kept_rows: list[int] = []
    new_text: list[str | None] = []  # per kept row: C4's (or a redacting rule's) new text
    new_meta: list[str | None] = []  # per kept row: meta with the rules' annotations
    prov = ProvenanceRows()
    scored = batch_outcomes(rules, texts, sources, metas)  # type: ignore[arg-type]
    for row in range(n):
        src = sources[row]
        st = stats[src]
        st.add_in(nbytes[row])
        at = native.get(row)
        if at is not None:
            o, k = at
            out = FilterResult(
                None if o.reason[k] is not None else o.edited.get(k, ""),
                o.reason[k],
                o.detail[k],
                stats=o.stats_of(k) if o.reason[k] is None else {},
            )
            changed = out.text if k in o.edited else None
        else:
            text = texts[row]
            assert text is not None
            out = scored.get(row) or filter_document(rules[src], text, metas[row])  # `url`: meta
            changed = out.text if out.text is not text else None
        if out.text is None:
            st.add_dropped(out.reason or "quality", nbytes[row])
            dropped.add(
                ids[row],
                src,
                out.reason or "quality",
                out.detail,
                doc_location(metas[row], shard, row),
                texts[row] or "",
            )
            continue
        # Line-level rules (C4) may shorten the text; kept bytes count what stays.
        st.add_kept(nbytes[row] if changed is None else len(changed.encode("utf-8")))
        st.add_redacted(out.redacted)  # `pii`'s replacements, counted in the report
        kept_rows.append(row)
        new_text.append(changed)
        # Only rules that annotate (`language`) change meta: other runs keep its bytes.
        new_meta.append(with_annotations(metas[row], out.annotations) if out.annotations else None)
        prov.add(ids[row], src, doc_location(metas[row], shard, row), out)
    # The kept documents' provenance, aligned with their rows (written before the marker).
    store.put(provenance_key(shard), table_to_parquet_bytes(prov.table()))
    kept = docs.select(DOC_SCHEMA.names).take(pa.array(kept_rows, pa.int64()))
    kept = _replaced(_replaced(kept, "text", new_text), "meta", new_meta)
    return write_shard(store, STAGE, shard, kept.combine_chunks(), dropped, stats)


def _replaced(table: pa.Table, column: str, values: list[str | None]) -> pa.Table:
    """`table` with the non-None `values` in place of its column's cells."""
    if all(v is None for v in values):
        return table
    col = pc.coalesce(pa.array(values, pa.string()), table[column])
    return table.set_column(table.schema.get_field_index(column), column, col)


def native_outcomes(
    rules: Mapping[str, list], column: pa.ChunkedArray, sources: list[str]
) -> tuple[dict[int, tuple[native_chain.Outcomes, int]], list[int]]:
    """The native kernel's outcomes by row (each as (outcomes, index in them)) for the
    sources whose chain it runs, and the rows left to the Python rules, ascending."""
    out: dict[int, tuple[native_chain.Outcomes, int]] = {}
    by_source: dict[str, list[int]] = {}
    for r, s in enumerate(sources):
        by_source.setdefault(s, []).append(r)
    for src, rows in by_source.items():
        chain = native_chain.chain_for(rules[src])
        if chain is None:
            continue
        o = chain.run(column.take(pa.array(rows, pa.int64())) if len(rows) != len(sources) else column)
        for k, r in enumerate(rows):
            if not o.fallback[k]:
                out[r] = (o, k)
    return out, [r for r in range(len(sources)) if r not in out]


# Documents a model-scoring rule sees at once: bounds the memory of the documents held
# between rules (their cached words and lines), not the model's batch (its batch_size).
BATCH_DOCS = 1024


def batch_outcomes(
    rules: Mapping[str, list], texts: list[str], sources: list[str], metas: list[str | None]
) -> dict[int, FilterResult]:
    """The outcomes of the documents whose source's chain scores in batches (a model
    rule), by row, BATCH_DOCS at a time; other sources' documents go one by one."""
    out: dict[int, FilterResult] = {}
    for src, chain in rules.items():
        if not batched(chain):
            continue
        rows = [r for r, s in enumerate(sources) if s == src]
        for k in range(0, len(rows), BATCH_DOCS):
            part = rows[k : k + BATCH_DOCS]
            results = filter_documents(chain, [texts[r] for r in part], [metas[r] for r in part])
            out.update(zip(part, results, strict=True))
    return out


def with_annotations(meta: str | None, annotations: Mapping[str, Any]) -> str:
    """The meta JSON with the rules' annotations added (replacing fields of the same
    name), written as ingest writes meta: sorted keys, UTF-8, no NaN."""
    fields = json.loads(meta) if meta else {}
    fields.update(annotations)
    return json.dumps(fields, sort_keys=True, ensure_ascii=False, default=str, allow_nan=False)


class ProvenanceRows:
    """The kept documents' provenance table (core/provenance.py's document columns): id,
    source, location and one float64 column per statistic the rules measured, in sorted
    name order, null where a document's chain did not measure it. Numeric annotations
    (`language_score`, `perplexity`) count as statistics too."""

    def __init__(self) -> None:
        self.base: dict[str, list[str]] = {"id": [], "source": [], "location": []}
        self.stats: dict[str, list[float | None]] = {}

    def add(self, id: str, source: str, location: str, out: FilterResult) -> None:
        n = len(self.base["id"])
        self.base["id"].append(id)
        self.base["source"].append(source)
        self.base["location"].append(location)
        values = dict(out.stats)
        for k, v in out.annotations.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                values[k] = v
        for k, v in values.items():
            col = self.stats.get(k)
            if col is None:
                col = self.stats[k] = [None] * n
            col.append(float(v))
        for col in self.stats.values():
            if len(col) == n:
                col.append(None)

    def table(self) -> pa.Table:
        cols: dict[str, Any] = dict(self.base)
        fields = [
            pa.field("id", pa.string()),
            pa.field("source", pa.string()),
            pa.field("location", pa.string()),
        ]
        for k in sorted(self.stats):
            cols[k] = self.stats[k]
            fields.append(pa.field(k, pa.float64()))
        return pa.table(cols, schema=pa.schema(fields))
