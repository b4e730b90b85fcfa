"""The quality stage: run each source's quality rules over a shard; dropped documents go
to dropped/quality/ with the rule and check that dropped them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
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
from dataprep.stages import substring

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
        taken = docs["text"].take(pa.array(rows, pa.int64())).to_pylist()
        for r, t in zip(rows, taken, strict=True):
            texts[r] = t
    stats = ShardStats()
    dropped = DroppedRows()
    kept_rows: list[int] = []
    new_text: list[str | None] = []  # per kept row: C4's (or a redacting rule's) new text
    new_meta: list[str | None] = []  # per kept row: meta with the rules' annotations
    python_kept: dict[int, FilterResult] = {}  # the Python rules' kept outcomes, by row
    scored = batch_outcomes(rules, texts, sources, metas)  # type: ignore[arg-type]
    for row in range(n):
        src = sources[row]
        st = stats[src]
        st.add_in(nbytes[row])
        at = native.get(row)
        if at is not None:
            o, k = at
            reason = o.reason[k]
            if reason is not None:
                st.add_dropped(reason, nbytes[row])
                dropped.add(
                    ids[row],
                    src,
                    reason,
                    o.detail[k],
                    doc_location(metas[row], shard, row),
                    texts[row] or "",
                )
                continue
            changed = o.edited.get(k)
            st.add_kept(nbytes[row] if changed is None else len(changed.encode("utf-8")))
            kept_rows.append(row)
            new_text.append(changed)
            new_meta.append(None)
            continue
        text = texts[row]
        assert text is not None
        out = scored.get(row) or filter_document(rules[src], text, metas[row])  # `url`: meta
        if out.text is None:
            st.add_dropped(out.reason or "quality", nbytes[row])
            dropped.add(
                ids[row],
                src,
                out.reason or "quality",
                out.detail,
                doc_location(metas[row], shard, row),
                text,
            )
            continue
        changed = out.text if out.text is not text else None
        # Line-level rules (C4) may shorten the text; kept bytes count what stays.
        st.add_kept(nbytes[row] if changed is None else len(changed.encode("utf-8")))
        st.add_redacted(out.redacted)  # `pii`'s replacements, counted in the report
        kept_rows.append(row)
        new_text.append(changed)
        # Only rules that annotate (`language`) change meta: other runs keep its bytes.
        new_meta.append(with_annotations(metas[row], out.annotations) if out.annotations else None)
        python_kept[row] = out
    # The kept documents' provenance, aligned with their rows (written before the marker).
    locations = [doc_location(metas[r], shard, r) for r in kept_rows]
    prov = provenance_table(kept_rows, native, python_kept, ids, sources, locations)
    if input_stage == substring.STAGE:  # what substring dedup cut from each document
        removed = substring.removed_bytes(store, shard)[np.asarray(kept_rows, dtype=np.int64)]
        prov = with_stat(prov, substring.PROVENANCE_STAT, removed.astype(np.float64))
    store.put(provenance_key(shard), table_to_parquet_bytes(prov))
    kept = docs.select(DOC_SCHEMA.names).take(pa.array(kept_rows, pa.int64()))
    kept = _replaced(_replaced(kept, "text", new_text), "meta", new_meta)
    return write_shard(store, STAGE, shard, kept.combine_chunks(), dropped, stats)


def with_stat(prov: pa.Table, name: str, values: np.ndarray) -> pa.Table:
    """A provenance table with one more statistic column, the statistics kept in sorted
    name order after id, source and location (as provenance_table writes them)."""
    table = prov.append_column(pa.field(name, pa.float64()), pa.array(values, pa.float64()))
    stats = sorted(n for n in table.column_names if n not in ("id", "source", "location"))
    return table.select(["id", "source", "location", *stats])


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
        part = column if len(rows) == len(sources) else column.take(pa.array(rows, pa.int64()))
        o = chain.run(part)
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


def provenance_table(
    kept_rows: list[int],
    native: Mapping[int, tuple[native_chain.Outcomes, int]],
    python_kept: Mapping[int, FilterResult],
    ids: list[str],
    sources: list[str],
    locations: list[str],
) -> pa.Table:
    """The kept documents' provenance table (core/provenance.py's document columns): id,
    source, location and one float64 column per statistic the rules measured, in sorted
    name order, null where a document's chain did not measure it. Numeric annotations
    (`language_score`, `perplexity`) count as statistics too. Statistics of natively
    decided documents come as the kernel's columns, the Python rules' per document."""
    m = len(kept_rows)
    values: dict[str, np.ndarray] = {}

    def column(key: str) -> np.ndarray:
        col = values.get(key)
        if col is None:
            col = values[key] = np.full(m, np.nan)
        return col

    groups: dict[int, tuple[native_chain.Outcomes, list[int], list[int]]] = {}
    for pos, row in enumerate(kept_rows):
        at = native.get(row)
        if at is not None:
            o, k = at
            _, positions, ks = groups.setdefault(id(o), (o, [], []))
            positions.append(pos)
            ks.append(k)
            continue
        out = python_kept[row]
        for key, v in out.stats.items():
            column(key)[pos] = float(v)
        for key, v in out.annotations.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                column(key)[pos] = float(v)
    for o, positions, ks in groups.values():
        for key, arr in o.stats.items():
            picked = arr[np.asarray(ks, dtype=np.int64)]
            if not np.isnan(picked).all():
                column(key)[np.asarray(positions, dtype=np.int64)] = picked
    cols: dict[str, Any] = {
        "id": [ids[r] for r in kept_rows],
        "source": [sources[r] for r in kept_rows],
        "location": locations,
    }
    fields = [pa.field(k, pa.string()) for k in cols]
    for key in sorted(values):
        col = values[key]
        missing = np.isnan(col)
        if missing.all():
            continue
        cols[key] = pa.array(col, pa.float64(), mask=missing)
        fields.append(pa.field(key, pa.float64()))
    return pa.table(cols, schema=pa.schema(fields))
