"""Benchmark: the partitioned run-once steps (`max_task_memory`, issue Scale III) on the
scale corpus (benchmarks/prep.py's `scale` config and corpus), against the single-task
path on the same corpus:

    python -m benchmarks.partitioned [--sizes 100000,1000000] [--max-task-memory 4MB]
                                     [--workers 2] [--out benchmarks/results/partitioned.json]

Per size, two whole preps in turn (single task, then partitioned): wall time and MB/s of
each, and for each step of exact select and the mixture plan (single, or the partitioned
steps that replace it) its time, the peak RSS of the process that ran it and that
process's growth over the step (per process, sampled every 50 ms: a single run-once step
runs in the driver process, the partitioned ones in the pool's workers), the plan (ranges,
documents per range at most, the cap) and whether every output file (dataset shards,
manifest, documents of every stage, dropped/, exact/dups, the mixture's plan and repeats)
is byte-identical. Timed on a shared machine: say so with the
figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import (
    CORPORA,
    RESULTS,
    ROOT,
    SHARED,
    TreeRSS,
    build_scale_corpus,
    have_shared,
    machine,
    prep_report,
    write_json,
)
from benchmarks.prep import QUALITY, THRESHOLD
from dataprep.config_dedup import parse_size

# Run records that differ between two runs by design, and the files only one of the two
# select forms writes.
VOLATILE = ("_run.json", "_versions/v0001.json", "v0001/report.json")
ONE_FORM_ONLY = (
    "v0001/exact/ranges/",
    "exact/split/",
    "v0001/near/cc/",
    "v0001/near/ranges/",
    "v0001/exact/dups.json",
    *(f"v0001/mixture/{k}" for k in ("keys/", "hist/", "boundary/", "cut.json", "taken.npy")),
    "v0001/mixture/resolved.json",
)
# The single-task steps and the partitioned steps that replace them.
STEPS = (
    "exact: select",
    "exact: select ranges",
    "exact: keepers",
    "exact: dups",
    "near: cluster",
    "near: edges",
    "near: components",
    "near: labels",
    "near: route groups",
    "near: route sets",
    "near: replay",
    "near: keepers",
    "near: dups",
    "near: summary",
    "mixture: plan",
    "mixture: keys",
    "mixture: cut",
    "mixture: boundary",
    "mixture: resolve",
    "mixture: repeats",
    "mixture: record",
)


class PidRSS(TreeRSS):
    """TreeRSS that also keeps every process's samples, so a step's peak can be read per
    process (the task's worker), not only summed over the tree."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(pid, interval)
        self.by_pid: list[tuple[float, dict[int, int]]] = []

    def sample(self) -> int:
        before = dict(self.per_pid)
        self.per_pid.clear()
        total = super().sample()
        self.by_pid.append((time.time(), dict(self.per_pid)))
        for p, v in before.items():
            self.per_pid[p] = max(v, self.per_pid.get(p, 0))
        return total


def step_memory(report: dict[str, Any], rss: PidRSS) -> dict[str, Any]:
    """Per run-once step (single, or the partitioned steps in its place): its seconds, the
    largest RSS of one process in its window, and the largest growth of one process over
    it."""
    steps = {}
    for step in STEPS:
        if step not in report["step_epoch_seconds"]:
            continue
        a, b = report["step_epoch_seconds"][step]
        inside = [s for t, s in rss.by_pid if a <= t <= b]
        peak = max((max(s.values(), default=0) for s in inside), default=0)
        # What the step added to a process: its peak in the step less its RSS as the
        # step began (the interpreter and libraries, ~150-230 MB, are not the step's).
        start = inside[0] if inside else {}
        grew = max(
            (v - start.get(p, v) for s in inside for p, v in s.items() if p in start), default=0
        )
        steps[step] = {
            "seconds": report["step_seconds"][step],
            "peak_rss_per_process_mb": round(peak / 2**20),
            "growth_per_process_mb": round(grew / 2**20, 1),
        }
    return steps


def run_prep(cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    out = Path(cfg["output"])
    shutil.rmtree(out, ignore_errors=True)
    cfg_path = work / f"config-{out.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "cli.main", "prep", str(cfg_path), "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    with PidRSS(proc.pid) as rss:
        if proc.wait() != 0:
            raise SystemExit(f"ballast prep failed with exit code {proc.returncode}")
    wall = time.perf_counter() - t0
    report = prep_report(out)
    mb = report["stages"]["ingest"]["total"]["bytes_in"] / 1e6
    steps = step_memory(report, rss)
    return {
        "wall_seconds": round(wall, 1),
        "mb_in": round(mb, 1),
        "mb_per_s": round(mb / wall, 2),
        "peak_rss_tree_mb": round(rss.peak / 2**20),
        "steps": steps,
        "plan": report.get("exact_ranges"),
        "near_plan": {k: report.get(k) for k in ("near_parts", "near_replay")},
        "near": report.get("near"),
        "removed_exact": report["stages"]["exact"]["total"]["dropped"],
    }


def digests(out: Path) -> dict[str, str]:
    found = {}
    for p in sorted(out.rglob("*")):
        key = p.relative_to(out).as_posix()
        if not p.is_file() or key in VOLATILE or key.startswith(ONE_FORM_ONLY):
            continue
        h = hashlib.sha256()
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        found[key] = h.hexdigest()
    return found


def held_per_range(out: Path, plan: dict[str, Any]) -> list[int]:
    """Documents each select task held, as its marker records."""
    base = out / "v0001" / "exact" / "ranges" / plan["tag"] / "done" / "select"
    return [json.loads(p.read_text())["documents"] for p in sorted(base.glob("*.json"))]


def run_size(n_docs: int, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = build_scale_corpus(n_docs, args.seed, work / "corpora", max(1, os.cpu_count() or 1))
    runs: dict[str, Any] = {}
    outs = {}
    sums: dict[str, dict[str, str]] = {}
    for name, mem in (("single", None), ("partitioned", args.max_task_memory)):
        out = work / f"out-{name}-{n_docs}"
        cfg: dict[str, Any] = {
            "output": str(out),
            "workers": args.workers,
            "seed": 0,
            "sources": [{"name": "web", "paths": [str(corpus)], "id_field": "id"}],
            "ingest": {"shard_docs": args.shard_docs},
            "dedup": {"exact": True, "near": {"threshold": THRESHOLD}},
            "quality": QUALITY,
            "tokenizer": {"kind": "bpe", "vocab_size": 8192, "train_docs": 50_000},
            "pack": {"seq_len": 1024, "strategy": "bfd"},
        }
        if mem is not None:
            cfg["max_task_memory"] = mem
        runs[name] = run_prep(cfg, work)
        outs[name] = out
        sums[name] = digests(out)
        if name == "single" and not args.keep:
            # At 10M the corpus and two outputs outgrow the disk (session 34's run
            # stopped there): the single output is compared by its digests.
            shutil.rmtree(out, ignore_errors=True)
        print(json.dumps({f"{n_docs} {name}": runs[name]}), flush=True)
    plan = runs["partitioned"]["plan"]
    held = held_per_range(outs["partitioned"], plan)
    a, b = sums["single"], sums["partitioned"]
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    result = {
        "docs": n_docs,
        "max_task_memory_bytes": parse_size(args.max_task_memory),
        "runs": runs,
        "ranges": len(held),
        "documents_per_range_max": max(held),
        "documents_per_range_mean": round(sum(held) / len(held)),
        "cap_documents": plan["cap_documents"],
        "files_compared": len(a),
        "byte_identical": not differ,
        "differing_files": len(differ),
        "differing_first": differ[:20],
    }
    if not args.keep:
        for out in outs.values():
            shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--max-task-memory", default="4MB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-docs", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-scale"))
    ap.add_argument("--out", default=str(RESULTS / "partitioned.json"))
    ap.add_argument("--keep", action="store_true", help="keep both outputs")
    args = ap.parse_args()
    if not have_shared(*CORPORA):
        print(f"skip: shared corpora not found under {SHARED}")
        return
    result: dict[str, Any] = {"machine": machine(), "workers": args.workers, "sizes": {}}
    for n in [int(x) for x in args.sizes.split(",")]:
        result["sizes"][str(n)] = run_size(n, args)
        print(json.dumps({str(n): result["sizes"][str(n)]}, indent=2), flush=True)
        write_json(Path(args.out), result)  # after each size: a long run's partial
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
