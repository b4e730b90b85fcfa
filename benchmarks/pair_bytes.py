"""Benchmark: the bytes a partitioned dedup's keepers task (dataprep/stages/dup_shuffle.py)
holds per duplicate pair it sends on, measured against what it sizes its batches by
(dup_shuffle.batch_pairs: PAIR_BYTES a pair plus ID_COPIES of the kept shard's mean id; a
flat 128 bytes, estimated, before this benchmark).

    python -m benchmarks.pair_bytes [--pairs 50000,100000,200000,400000]
                                    [--shard-docs 50000] [--shards 200]
                                    [--out benchmarks/results/pair_bytes.json]

One kept shard of --shard-docs documents, whose copies are kept for duplicates spread over
--shards shards, its pairs written as the select step writes them (dup_shuffle.write_pairs,
one piece per partition of 10,000 pairs); dup_shuffle.keepers on it, with max_task_memory
large enough that one batch holds every pair: the peak of holding and sending n pairs at
once. Each count in a fresh process, measured twice: tracemalloc's peak (Python's and
numpy's buffers) plus the rise of Arrow's memory pool to its peak (`max_memory`: Arrow's
buffers, which tracemalloc does not see), an upper bound on the two together. Per id form (the scale
corpus's `d<i>`, and 36-character UUIDs, since the pairs carry the kept copy's id): each
pair count's peak, and the slope of peak against pairs by least squares, the bytes per
pair (the fixed costs, the shard's id column above all, fall out of it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, machine, write_json

PIECE = 10_000  # pairs per partition's piece


def one(n_pairs: int, shard_docs: int, n_shards: int, ids: list[str]) -> dict[str, Any]:
    import pyarrow as pa

    from dataprep.config import parse_config
    from dataprep.layout import docs_key, output_store, version_store
    from dataprep.partition import shard_item
    from dataprep.records import table_to_parquet_bytes
    from dataprep.stages import dup_shuffle

    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_config(
            {
                "output": str(Path(tmp) / "out"),
                "sources": [{"name": "web", "paths": [str(Path(tmp) / "unused.jsonl")]}],
                "max_task_memory": "4GB",  # one batch: every pair held at once
            }
        )
        shards = [f"s{i:05d}" for i in range(n_shards)]
        offsets = np.arange(n_shards, dtype=np.int64) * shard_docs
        table = pa.table({"id": pa.array(ids[:shard_docs], pa.string())})
        output_store(cfg).put(docs_key("near", shards[0]), table_to_parquet_bytes(table))
        rng = np.random.default_rng(0)
        # Duplicates anywhere but the kept shard, each naming a kept copy in shard 0.
        dup = rng.choice(np.arange(shard_docs, n_shards * shard_docs), n_pairs, replace=False)
        kept = rng.integers(0, shard_docs, n_pairs)
        vstore = version_store(cfg)
        for k, a in enumerate(range(0, n_pairs, PIECE)):
            b = min(n_pairs, a + PIECE)
            dup_shuffle.write_pairs(
                vstore, "near", "t", f"p{k:05d}", shards, offsets, dup[a:b], kept[a:b]
            )
        del dup, kept
        pool = pa.default_memory_pool()
        arrow_before = pool.bytes_allocated()
        tracemalloc.start()
        try:
            sent = dup_shuffle.keepers(cfg, "near", "near", [], shards, shard_item("t", shards[0]))
            _, py_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        arrow_peak = max(0, pool.max_memory() - arrow_before)
        assert sent == n_pairs, (sent, n_pairs)
    peak = py_peak + arrow_peak
    return {
        "pairs": n_pairs,
        "peak_mb": round(peak / 2**20, 2),
        "python_numpy_mb": round(py_peak / 2**20, 2),
        "arrow_mb": round(arrow_peak / 2**20, 2),
        "peak": peak,
    }


def fresh(n_pairs: int, shard_docs: int, n_shards: int, form: str) -> dict[str, Any]:
    """`one` in a process of its own, so that Arrow's pool peak is this count's."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(one, (n_pairs, shard_docs, n_shards, ids_of(form, shard_docs)))


def ids_of(form: str, n: int) -> list[str]:
    if form == "uuid":
        return [str(uuid.UUID(int=i)) for i in range(n)]
    return [f"d{i}" for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="50000,100000,200000,400000")
    ap.add_argument("--shard-docs", type=int, default=50_000)
    ap.add_argument("--shards", type=int, default=200)
    ap.add_argument("--out", default=str(RESULTS / "pair_bytes.json"))
    args = ap.parse_args()
    import pyarrow as pa

    from dataprep.stages.dup_shuffle import ID_COPIES, PAIR_BYTES, batch_pairs

    counts = [int(x) for x in args.pairs.split(",")]
    result: dict[str, Any] = {
        "command": "python -m benchmarks.pair_bytes "
        f"--pairs {args.pairs} --shard-docs {args.shard_docs} --shards {args.shards}",
        "machine": machine(),
        "constants": {"PAIR_BYTES": PAIR_BYTES, "ID_COPIES": ID_COPIES},
        "id_forms": {},
    }
    for form in ("d<i>", "uuid"):
        rows = [fresh(n, args.shard_docs, args.shards, form) for n in counts]
        x = np.array([r["pairs"] for r in rows], float)
        y = np.array([r["peak"] for r in rows], float)
        slope, fixed = np.polyfit(x, y, 1)
        ids = pa.array(ids_of(form, args.shard_docs), pa.string())
        # What keepers sizes its batches by for this shard: bytes a pair at a 1 GB bound.
        planned = 2**30 / batch_pairs(2**30, ids)
        result["id_forms"][form] = {
            "id_bytes": len(ids[-1].as_py()),
            "planned_bytes_per_pair": round(planned, 1),
            "runs": [{k: v for k, v in r.items() if k != "peak"} for r in rows],
            "bytes_per_pair": round(float(slope), 1),
            "fixed_mb": round(float(fixed) / 2**20, 2),
            "within_planned": bool(slope <= planned),
        }
        print(form, json.dumps(result["id_forms"][form]), flush=True)
    print(write_json(args.out, result))


if __name__ == "__main__":
    main()
