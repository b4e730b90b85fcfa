"""Benchmark: the bytes a partitioned near-clustering task holds per item it is planned
by, measured (issue Scale III asked for measured figures where near_parts.EDGE_BYTES and
CANDIDATE_BYTES were estimates).

    python -m benchmarks.near_item_bytes [--sizes 100000,1000000] [--max-task-memory 16MB]
                                         [--out benchmarks/results/near_item_bytes.json]

One partitioned prep of the scale corpus (benchmarks/prep.py's scale config, near dedup on)
up to the near stage, in this process, its items run one after another: every item of
"near: components" and "near: replay" under tracemalloc (numpy's buffers included), its
peak set against what the plan counts for it: a components round's input edges (the plan
sizes the partitions by EDGE_BYTES per edge) and a replay task's candidates (its held
documents; the cap is max_task_memory / CANDIDATE_BYTES). Reported per step: items,
the largest items' peak, peak per planned item (max and the item-weighted figure) against
the constant, and the largest peak against max_task_memory (what the bound promises). A
task's fixed costs are not per item: a small task's bytes per item are mostly those, so
the per-item figure is read off the largest items. The corpora are generated under
--workdir (reused when present), never committed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CORPORA,
    RESULTS,
    ROOT,
    build_scale_corpus,
    have_shared,
    machine,
    write_json,
)
from benchmarks.prep import QUALITY, THRESHOLD
from dataprep.config_dedup import parse_size

MEASURED = ("near: components", "near: replay")


def measuring_runner() -> Any:
    from dataprep.pipeline import LocalRunner

    class Measuring(LocalRunner):
        """One worker, so every item runs in this process, one at a time; the items of
        MEASURED under tracemalloc, their peak and their return value kept."""

        def __init__(self) -> None:
            super().__init__(1, progress=False)
            self.rows: dict[str, list[dict[str, Any]]] = {}

        def _map(self, fn: Callable[[Any], Any], items: list[Any], desc: str, done: int) -> None:
            if desc not in MEASURED:
                super()._map(fn, items, desc, done)
                return
            for item in items:
                tracemalloc.start()
                try:
                    out = fn(item)
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                self.rows.setdefault(desc, []).append({"item": item, "peak": peak, **out})

    return Measuring()


def summarise(rows: list[dict[str, Any]], count: str, constant: int, bound: int) -> dict[str, Any]:
    rows = [r for r in rows if r[count] > 0]
    biggest = sorted(rows, key=lambda r: r[count])[-5:]
    return {
        "items": len(rows),
        "planned_by": count,
        "constant_bytes_per_item": constant,
        "largest": [
            {
                count: r[count],
                "peak_mb": round(r["peak"] / 2**20, 2),
                "bytes_per_item": round(r["peak"] / r[count], 1),
            }
            for r in biggest
        ],
        "max_bytes_per_item_of_largest": round(max(r["peak"] / r[count] for r in biggest), 1),
        "weighted_bytes_per_item": round(
            sum(r["peak"] for r in rows) / sum(r[count] for r in rows), 1
        ),
        # What the bound promises: no task's peak above it (a small task's bytes per item
        # are mostly its fixed costs, so the per-item figure is read off the largest).
        "peak_mb_max": round(max(r["peak"] for r in rows) / 2**20, 2),
        "bound_mb": round(bound / 2**20, 2),
        "peak_within_bound": max(r["peak"] for r in rows) <= bound,
    }


def measure(n_docs: int, args: argparse.Namespace) -> dict[str, Any]:
    """One size: the partitioned prep up to near, its near tasks measured."""
    from dataprep.config import parse_config
    from dataprep.pipeline import run_stages
    from dataprep.stages import near_parts

    work = Path(args.workdir).resolve()
    cpus = max(1, os.cpu_count() or 1)
    corpus = build_scale_corpus(n_docs, args.seed, work / "corpora", cpus)
    out = work / f"out-{n_docs}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = parse_config(
        {
            "output": str(out),
            "workers": 1,
            "seed": 0,
            "sources": [{"name": "web", "paths": [str(corpus)], "id_field": "id"}],
            "dedup": {"exact": True, "near": {"threshold": THRESHOLD}},
            "quality": QUALITY,
            "max_task_memory": args.max_task_memory,
        }
    )
    runner = measuring_runner()
    bound = parse_size(args.max_task_memory)
    t0 = time.perf_counter()
    report = run_stages(cfg, runner, "near", False).report
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    rows = runner.rows
    return {
        "docs": n_docs,
        "plan": {k: report.get(k) for k in (near_parts.PLAN_KEY, near_parts.REPLAY_KEY)},
        "components": summarise(
            rows.get("near: components", []), "edges", near_parts.EDGE_BYTES, bound
        ),
        "replay": summarise(
            rows.get("near: replay", []), "held", near_parts.CANDIDATE_BYTES, bound
        ),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--max-task-memory", default="16MB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-near-item-bytes"))
    ap.add_argument("--out", default=str(RESULTS / "near_item_bytes.json"))
    args = ap.parse_args()
    if not have_shared(*CORPORA):
        print("skip: the shared corpora are absent")
        return
    sizes = []
    for n in (int(x) for x in args.sizes.split(",")):
        r = measure(n, args)
        for k in ("components", "replay"):
            print(n, k, json.dumps(r[k]), flush=True)
        sizes.append(r)
    result = {
        "command": "python -m benchmarks.near_item_bytes "
        f"--sizes {args.sizes} --max-task-memory {args.max_task_memory}",
        "machine": machine(),
        "max_task_memory": args.max_task_memory,
        "sizes": sizes,
    }
    print(write_json(args.out, result))


if __name__ == "__main__":
    main()
