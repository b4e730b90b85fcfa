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
from dataprep.quality import FilterResult, batched, filter_document, filter_documents, parse_rules
from dataprep.records import DOC_SCHEMA, table_to_parquet_bytes

STAGE = "quality"


def filter_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    store = output_store(cfg)
    docs = read_docs(store, input_stage, shard)
    nbytes = pc.binary_length(docs["text"]).to_pylist()
    ids, texts, sources, metas = (docs[c].to_pylist() for c in ("id", "text", "source", "meta"))
    stats = ShardStats()
    dropped = DroppedRows()
    kept: dict[str, list[str]] = {"id": [], "text": [], "source": [], "meta": []}
    prov = ProvenanceRows()
    rules = {src: parse_rules(cfg.rules_for(src)) for src in set(sources)}
    scored = batch_outcomes(rules, texts, sources, metas)
    for row, text in enumerate(texts):
        src = sources[row]
        st = stats[src]
        st.add_in(nbytes[row])
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
        # Line-level rules (C4) may shorten the text; kept bytes count what stays.
        st.add_kept(nbytes[row] if out.text is text else len(out.text.encode("utf-8")))
        st.add_redacted(out.redacted)  # `pii`'s replacements, counted in the report
        kept["id"].append(ids[row])
        kept["text"].append(out.text)
        kept["source"].append(src)
        # Only rules that annotate (`language`) change meta: other runs keep its bytes.
        kept["meta"].append(
            with_annotations(metas[row], out.annotations) if out.annotations else metas[row]
        )
        prov.add(ids[row], src, doc_location(metas[row], shard, row), out)
    # The kept documents' provenance, aligned with their rows (written before the marker).
    store.put(provenance_key(shard), table_to_parquet_bytes(prov.table()))
    return write_shard(store, STAGE, shard, pa.table(kept, schema=DOC_SCHEMA), dropped, stats)


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
