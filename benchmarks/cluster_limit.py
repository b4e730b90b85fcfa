"""Benchmark (issue Scale III): prep on a local Dask cluster whose workers each have a
memory limit below what the single-task path's run-once steps need at 10M documents.
The partitioned path (`max_task_memory`) must complete; the single-task path must not,
and how it fails is recorded (the step, the exit code, its error line).

    python -m benchmarks.cluster_limit [--docs 10000000] [--memory-limit 900MiB]
                                       [--max-task-memory 64MB] [--workers 2]
                                       [--out benchmarks/results/cluster_limit.json]

The scale corpus and config of `benchmarks.prep scale` / `benchmarks.partitioned`. A
scheduler and `--workers` single-threaded `dask worker` processes with their nannies (as
deployed) are started here on loopback, fresh for each run, each worker with
`--memory-limit` (its nanny kills it at 95% of that; Dask's other thresholds are left at
their defaults). The single-task run at 10M grows one process by ~713 MB over exact select
(benchmarks/results/partitioned_10m.json) on an interpreter of ~250 MB, so 900 MiB
(terminate at 855 MiB) is below it. Reported per run: exit code, wall time, MB/s (a run
that completes), the peak RSS of each worker process (its nanny's children) and of the
whole cluster, and the last error line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.cluster import prep_config, start_cluster
from benchmarks.common import RESULTS, ROOT, build_scale_corpus, machine, prep_report, write_json
from benchmarks.partitioned import PidRSS, step_memory

BIN = Path(sys.executable).parent


def config(corpus: Path, out: Path, workers: int, max_task_memory: str | None) -> dict[str, Any]:
    """benchmarks.cluster's config (the scale config), with the bound when one is set."""
    cfg = prep_config(corpus, out, workers)
    if max_task_memory:
        cfg["max_task_memory"] = max_task_memory
    return cfg


def run(name: str, cfg: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = Path(cfg["output"])
    shutil.rmtree(out, ignore_errors=True)
    cfg_path = work / f"config-{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    cluster, address = start_cluster(work / f"cluster-{name}", args.workers, args.memory_limit)
    err = work / f"stderr-{name}.txt"
    try:
        t0 = time.perf_counter()
        with err.open("wb") as f:
            proc = subprocess.Popen(
                [str(BIN / "ballast"), "prep", str(cfg_path), "--no-progress", "--dask", address],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=f,
            )
            with PidRSS(cluster.pid, interval=0.1) as rss:
                try:
                    rc = proc.wait(timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                    rc = -1 if rc == 0 else rc
        wall = time.perf_counter() - t0
    finally:
        os.killpg(cluster.pid, 15)
        cluster.wait(timeout=60)
    log = (work / f"cluster-{name}" / "cluster.log").read_text(errors="replace")
    lines = err.read_text(errors="replace").splitlines()
    errors = [x for x in lines if x.startswith("error")]
    # Worker processes: the nannies' children, i.e. every process of the tree but the
    # shell, the scheduler and the nannies themselves, whose RSS stays small; reported as
    # the largest per-process peaks.
    peaks = sorted((v for v in rss.per_pid.values()), reverse=True)
    result: dict[str, Any] = {
        "exit_code": rc,
        "timed_out": rc == -1,
        "wall_seconds": round(wall, 1),
        "peak_rss_cluster_mb": round(rss.peak / 2**20),
        "peak_rss_largest_processes_mb": [round(v / 2**20) for v in peaks[:4]],
        "error": errors[-1] if errors else None,
        "traceback_printed": any(x.startswith("Traceback") for x in lines),
        "workers_killed_by_nanny": log.count("exceeded 95% memory budget"),
    }
    if rc == 0:
        report = prep_report(out)
        mb = report["stages"]["ingest"]["total"]["bytes_in"] / 1e6
        result.update(mb_in=round(mb, 1), mb_per_s=round(mb / wall, 2))
        result["step_seconds"] = report["step_seconds"]
        # The run-once steps' (or their partitioned steps') memory, per worker process.
        result["steps"] = step_memory(report, rss)
    print(f"{name}: {result}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=10_000_000)
    ap.add_argument("--memory-limit", default="900MiB")
    ap.add_argument("--max-task-memory", default="64MB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=5400)
    ap.add_argument("--only", choices=["single", "partitioned"], default=None)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-cluster-limit"))
    ap.add_argument("--corpora", default=str(ROOT / "runs" / "bench-scale" / "corpora"))
    ap.add_argument("--out", default=str(RESULTS / "cluster_limit.json"))
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = build_scale_corpus(args.docs, args.seed, Path(args.corpora), os.cpu_count() or 1)
    result: dict[str, Any] = {
        "machine": machine(),
        "docs": args.docs,
        "workers": args.workers,
        "memory_limit_per_worker": args.memory_limit,
        "max_task_memory": args.max_task_memory,
        "runs": {},
    }
    # The partitioned run first: it is the one that must complete.
    for name, mem in (("partitioned", args.max_task_memory), ("single", None)):
        if args.only and name != args.only:
            continue
        cfg = config(corpus, work / f"out-{name}", args.workers, mem)
        result["runs"][name] = run(name, cfg, args, work)
        write_json(Path(args.out), result)
    runs = result["runs"]
    if "partitioned" in runs and "single" in runs:
        result["partitioned_completes"] = runs["partitioned"]["exit_code"] == 0
        result["single_fails"] = runs["single"]["exit_code"] != 0
        result["met"] = result["partitioned_completes"] and result["single_fails"]
    write_json(Path(args.out), result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
