"""The data trained on between two evaluations: from sampler positions to rows (the
trainer's own Sampler) to the documents and sources of those rows (the dataset's
provenance, as `ballast blame` reads it). An eval_regression event names them: which
sources made up the window, by token share, and the documents with the most tokens in it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.provenance import Provenance, ProvenanceError
from training.blame import documents_of
from training.data import Sampler, TrainData

# Rows looked up at most (evenly spaced over the window): a window of thousands of steps
# would otherwise cost seconds of lookups at every regression.
MAX_ROWS = 4096
TOP_DOCS = 8


def window_data(
    data: TrainData, sampler: Sampler, start: int, end: int, limit: int = TOP_DOCS
) -> dict[str, Any]:
    """Sources by token share and the top documents of samples [start, end) of the
    training order; {"documents_error": ...} when the dataset has no provenance."""
    if data.root is None or end <= start:
        return {"rows": 0, "sources": [], "documents": []}
    try:
        prov = Provenance(data.root, data.manifest)
        rows = sampler.take(start, end - start)
        sampled = len(rows) > MAX_ROWS
        if sampled:
            rows = rows[np.linspace(0, len(rows) - 1, MAX_ROWS).astype(np.int64)]
        rows = [int(r) for r in rows]
        per_source: dict[str, int] = {}
        tokens: dict[int, int] = {}
        for r in rows:
            for sp in prov.spans("train", r):
                tokens[sp.doc] = tokens.get(sp.doc, 0) + sp.end - sp.start
        for d, n in tokens.items():
            src = prov.document(d).source
            per_source[src] = per_source.get(src, 0) + n
        total = sum(per_source.values()) or 1
        top = documents_of(prov, rows, limit, list(data.manifest.get("inputs", [])))
    except (ProvenanceError, OSError, ValueError, KeyError) as e:
        return {"documents_error": str(e)}
    sources = [
        {"source": s, "tokens": n, "share": round(n / total, 4)}
        for s, n in sorted(per_source.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    return {
        "rows": end - start,
        "rows_looked_up": len(rows),
        "sources": sources,
        **top,
    }
