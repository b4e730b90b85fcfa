"""Benchmark: the web quality chain (char_repetition, length, gopher_quality,
gopher_repetition, c4, fineweb), Python rules against the native kernel
(native/quality.cpp + dataprep/quality/native_chain.py), one process, one core.

    python -m benchmarks.kernel_quality [--mb 32] [--out benchmarks/results/kernel_quality.json]

The documents: the scale corpus's (benchmarks/common.py ScaleCorpus: remixed lines of the
shared web corpora with planted near copies) and the OpenWebText sample repeated. For
each: MB/s of UTF-8 text for the native chain on its first pass (every distinct chunk
tokenised once by the Python reference: what one shard of a fresh worker pays), its
second pass (the chunk cache warm: what a worker pays after its first shards), and the
Python rules (their own chunk cache warm, as in a long prep); the share of documents the
kernel hands back to Python; and a check that every decision matched.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CORPORA,
    RESULTS,
    SHARED,
    ScaleCorpus,
    have_shared,
    machine,
    write_json,
)

WEB = ["char_repetition", "length", "gopher_quality", "gopher_repetition", "c4", "fineweb"]


def measure(name: str, docs: list[str]) -> dict[str, Any]:
    import pyarrow as pa

    from dataprep.quality import filter_document, native_chain, parse_rules

    rules = parse_rules(WEB)
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    column = pa.array(docs, pa.string())
    chain = native_chain.NativeChain(rules)
    t0 = time.perf_counter()
    first = chain.run(column)
    t1 = time.perf_counter()
    second = chain.run(column)
    t2 = time.perf_counter()
    reference = [filter_document(rules, d) for d in docs]
    t3 = time.perf_counter()
    decided = [i for i in range(len(docs)) if not second.fallback[i]]
    same = sum(second.reason[i] == reference[i].reason for i in decided)
    row = {
        "docs": len(docs),
        "mb": round(mb, 1),
        "python_mb_per_s": round(mb / (t3 - t2), 2),
        "native_first_pass_mb_per_s": round(mb / (t1 - t0), 2),
        "native_warm_mb_per_s": round(mb / (t2 - t1), 2),
        "speedup_warm": round((t3 - t2) / (t2 - t1), 1),
        "speedup_first_pass": round((t3 - t2) / (t1 - t0), 1),
        "chunks_tokenised_by_python": first.cache_misses,
        "lines_counted_in_context": second.doc_resolves - first.doc_resolves,
        "fallback_share": round(float(second.fallback.mean()), 4),
        "same_reason": f"{same}/{len(decided)}",
    }
    print(name, json.dumps(row))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=32.0, help="MB of text per corpus")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "kernel_quality.json")
    args = ap.parse_args()
    if not have_shared(*(c for c in CORPORA if c.startswith("web_"))):
        print("kernel_quality: skipped, the shared web corpora are not present")
        return
    from dataprep import native

    if native.module() is None:
        raise SystemExit(f"kernel_quality: no native module ({native.IMPORT_ERROR or 'off'})")

    corpus = ScaleCorpus(args.seed)
    scale: list[str] = []
    size = 0
    while size < args.mb * 1e6:
        scale.append(corpus.text(len(scale)))
        size += len(scale[-1].encode("utf-8"))
    owt = [json.loads(line)["text"] for line in (SHARED / "web_openwebtext_1k.jsonl").open()]
    owt_mb = sum(len(d.encode("utf-8")) for d in owt) / 1e6
    result = {
        "machine": machine(),
        "python": platform.python_version(),
        "rules": WEB,
        "timing": "one process, one core, one pass each",
        # Each corpus in a fresh chain, but the Python reference's own chunk cache
        # (spacy_en) is shared by the process: the scale corpus goes first.
        "corpora": {
            "scale": measure("scale", scale),
            "web_openwebtext_1k": measure(
                "web_openwebtext_1k", owt * max(1, round(args.mb / 4 / owt_mb))
            ),
        },
    }
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
