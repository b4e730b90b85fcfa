"""Benchmark: the overhead of running prep on a Dask cluster (Scale II) against the local
process pool, on one machine: the same config and corpus as `benchmarks.prep scale` (1M
documents by default), once with `ballast prep` (a pool of 2 worker processes) and once
with `ballast prep --dask` on a local cluster of a `dask scheduler` and 2 single-threaded
`dask worker` processes (with their nannies, as deployed) started here on loopback.
Both write to local disk, so the difference is the cluster path alone (scheduling, task
transport, a step item per task), not the storage. Target: the cluster at most 15% slower.
The two run in turn (A B B A for two rounds) and the medians are compared, since one
pair's ratio moves with whatever else the machine does.

    python -m benchmarks.cluster [--docs 1000000] [--workers 2] [--out FILE.json]

Reported per run: wall time, MB/s, seconds per step, peak RSS of the process tree (for the
cluster: the client plus the scheduler and workers), and whether the two outputs are
byte-identical (every file but the run's own records and timings).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, TreeRSS, build_scale_corpus, prep_report
from benchmarks.prep import QUALITY, THRESHOLD

BIN = Path(sys.executable).parent
VOLATILE = {"_run.json", "report.json", "v0001.json"}


def prep_config(corpus: Path, out: Path, workers: int) -> dict:
    return {
        "output": str(out),
        "workers": workers,
        "seed": 0,
        "sources": [{"name": "web", "paths": [str(corpus)], "id_field": "id"}],
        "ingest": {"shard_docs": 50_000},
        "dedup": {"exact": True, "near": {"threshold": THRESHOLD}},
        "quality": QUALITY,
        "tokenizer": {"kind": "bpe", "vocab_size": 8192, "train_docs": 50_000},
        "pack": {"seq_len": 1024, "strategy": "bfd"},
    }


def start_cluster(
    work: Path, workers: int, memory_limit: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """One shell whose children are the scheduler and the workers, so that one TreeRSS
    sees them all; returns it and the scheduler's address. `memory_limit`: each worker's
    (`dask worker --memory-limit`; its nanny kills it at 95% of that)."""
    sched = work / "scheduler.json"
    sched.unlink(missing_ok=True)
    dask = BIN / "dask"
    lines = [
        f"{dask} scheduler --host 127.0.0.1 --port 0 --no-dashboard --scheduler-file {sched} &"
    ]
    lines += ["while [ ! -s " + str(sched) + " ]; do sleep 0.1; done"]
    for i in range(workers):
        scratch = work / f"worker{i}"
        scratch.mkdir(parents=True, exist_ok=True)
        lines.append(
            f"TMPDIR={scratch} {dask} worker --scheduler-file {sched} "
            f"--host 127.0.0.1 --nthreads 1 --no-dashboard --name w{i} "
            f"--local-directory {scratch}"
            + (f" --memory-limit {memory_limit}" if memory_limit else "")
            + " &"
        )
    lines.append("wait")
    log = (work / "cluster.log").open("wb")
    proc = subprocess.Popen(
        ["bash", "-c", "\n".join(lines)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    from distributed import Client

    deadline = time.monotonic() + 120
    while True:
        try:
            address = json.loads(sched.read_text())["address"]
            break
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the Dask scheduler did not start") from None
            time.sleep(0.2)
    with Client(address, timeout="30s", set_as_default=False) as c:
        c.wait_for_workers(workers, timeout=120)
    return proc, address


def run(
    cfg: dict,
    work: Path,
    name: str,
    extra: list[str],
    cluster: subprocess.Popen[bytes] | None = None,
) -> dict:
    import yaml

    out = Path(cfg["output"])
    shutil.rmtree(out, ignore_errors=True)
    cfg_path = work / f"config-{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    cmd = [str(BIN / "ballast"), "prep", str(cfg_path), "--no-progress", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    with TreeRSS(proc.pid) as client_rss:
        if cluster is not None:
            with TreeRSS(cluster.pid) as cluster_rss:
                rc = proc.wait()
        else:
            rc = proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{name}: ballast prep failed with exit code {rc}")
    report = prep_report(out)
    mb = report["stages"]["ingest"]["total"]["bytes_in"] / 1e6
    # The peak of the sum over time of both trees, sampled at about the same instants.
    peak = client_rss.peak
    if cluster is not None:
        both = [
            a + b for (_, a), (_, b) in zip(client_rss.samples, cluster_rss.samples, strict=False)
        ]
        peak = max(both or [client_rss.peak + cluster_rss.peak])
    return {
        "wall_seconds": round(wall, 1),
        "mb_in": round(mb, 1),
        "mb_per_s": round(mb / wall, 2),
        "peak_rss_mb": round(peak / 2**20),
        "step_seconds": report["step_seconds"],
    }


def same_output(a: Path, b: Path) -> tuple[bool, list[str]]:
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    other = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    if files != other:
        return False, sorted(set(files) ^ set(other))[:10]
    differ = [
        f
        for f in files
        if Path(f).name not in VOLATILE and not filecmp.cmp(a / f, b / f, shallow=False)
    ]
    return not differ, differ[:10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="pool/dask pairs, run A B B A ...")
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-cluster"))
    ap.add_argument("--corpora", default=str(ROOT / "runs" / "bench-scale" / "corpora"))
    ap.add_argument("--out", default=str(RESULTS / "cluster.json"))
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = build_scale_corpus(
        args.docs, args.seed, Path(args.corpora), max(1, os.cpu_count() or 1)
    )

    # The two in turn, A B B A ... (drift in the machine's speed cancels out). The cluster
    # runs only during the dask runs: idle, it would still take CPU from the pool's.
    order = [("pool", "dask") if r % 2 == 0 else ("dask", "pool") for r in range(args.rounds)]
    runs: dict[str, list[dict]] = {"pool": [], "dask": []}
    identical, differ = False, []
    for r, pair in enumerate(order):
        for mode in pair:
            cfg = prep_config(corpus, work / f"out-{mode}", args.workers)
            if mode == "pool":
                res = run(cfg, work, mode, ["--dask", "local"])
            else:
                cluster, address = start_cluster(work, args.workers)
                try:
                    res = run(cfg, work, mode, ["--dask", address], cluster)
                finally:
                    os.killpg(cluster.pid, 15)
                    cluster.wait(timeout=30)
            runs[mode].append(res)
            print(
                f"round {r + 1} {mode}: {res['wall_seconds']} s, {res['mb_per_s']} MB/s, "
                f"peak {res['peak_rss_mb']} MiB",
                flush=True,
            )
        if r == 0:
            identical, differ = same_output(work / "out-pool", work / "out-dask")
    pool_s = statistics.median(x["wall_seconds"] for x in runs["pool"])
    dask_s = statistics.median(x["wall_seconds"] for x in runs["dask"])
    ratios = [
        round(d["wall_seconds"] / p["wall_seconds"], 4)
        for p, d in zip(runs["pool"], runs["dask"], strict=True)
    ]
    overhead = dask_s / pool_s - 1
    result = {
        "docs": args.docs,
        "workers": args.workers,
        "machine": f"{os.cpu_count()} cores",
        "rounds": args.rounds,
        "pool_median_seconds": pool_s,
        "dask_median_seconds": dask_s,
        "ratio_per_round": ratios,
        "pool": runs["pool"],
        "dask": runs["dask"],
        "overhead": round(overhead, 4),
        "target_overhead": 0.15,
        "met": overhead <= 0.15,
        "byte_identical": identical,
        "differing_files": differ,
    }
    print(
        f"overhead of the cluster path (medians): {100 * overhead:+.1f}% (target <= +15%): "
        f"{'met' if result['met'] else 'MISSED'}; per round {ratios}; outputs "
        f"byte-identical: {identical}"
    )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for d in ("out-pool", "out-dask"):
        shutil.rmtree(work / d, ignore_errors=True)


if __name__ == "__main__":
    main()
