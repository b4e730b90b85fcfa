"""Benchmark: the whole dedup (exact + MinHash near: signatures, LSH buckets, clustering,
apply) on a corpus with planted duplicates built from ../shared/data.

    python -m benchmarks.dedup [--docs 20000] [--scale 200000] [--out benchmarks/results/dedup.json]

Reports docs/s and MB/s on `workers` processes, time per step, peak RSS of the process
tree, and precision/recall of what was removed against exact Jaccard >= threshold on
the same word 5-gram shingles. The ground truth comes from an independent path:
datasketch MinHash (SHA-1 based) with a very sensitive LSH (64 bands x 4 rows: a pair at
J=0.8 is a candidate with p > 1 - 1e-14), then exact Jaccard of Python string-shingle
sets for every candidate pair.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import (
    CORPORA,
    RESULTS,
    ROOT,
    SHARED,
    build_corpus,
    have_shared,
    machine,
    run_prep_process,
    string_shingles,
    write_corpus,
    write_json,
)


def ground_truth(docs: list[str], threshold: float, n: int) -> tuple[set, dict, float]:
    from datasketch import MinHash, MinHashLSH

    t0 = time.perf_counter()
    sets = [string_shingles(d, n) for d in docs]
    lsh = MinHashLSH(num_perm=256, params=(64, 4))
    mhs = []
    for i, s in enumerate(sets):
        m = MinHash(num_perm=256, seed=7)
        m.update_batch([x.encode() for x in s])
        mhs.append(m)
        if s:
            lsh.insert(i, m)
    ds_secs = time.perf_counter() - t0
    pairs = set()
    for i, m in enumerate(mhs):
        if not sets[i]:
            continue
        for j in lsh.query(m):
            if j > i:
                inter = len(sets[i] & sets[j])
                if inter / (len(sets[i]) + len(sets[j]) - inter) >= threshold:
                    pairs.add((i, j))
    return pairs, {"datasketch_signature_secs": ds_secs}, len(docs) / ds_secs


def signature_rates(docs: list[str], n: int = 5) -> dict[str, float]:
    """Single-core signature throughput (docs/s, 128 permutations, same shingles) of
    ballast's vectorised MinHash, datasketch, and rensa when it is installed."""
    from datasketch import MinHash

    from dataprep import minhash

    sample = docs[:5000]
    rates = {}
    t0 = time.perf_counter()
    a, b = minhash.permutations(128, 0)
    for i in range(0, len(sample), 1000):
        sh, off = minhash.shingle_hashes(sample[i : i + 1000], n)
        minhash.signatures(sh, off, a, b)
    rates["ballast_numpy"] = len(sample) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for d in sample:
        m = MinHash(num_perm=128, seed=0)
        m.update_batch([x.encode() for x in string_shingles(d, n)])
    rates["datasketch"] = len(sample) / (time.perf_counter() - t0)
    try:
        from rensa import RMinHash
    except ImportError:
        return {k: round(v) for k, v in rates.items()}
    t0 = time.perf_counter()
    for d in sample:
        r = RMinHash(num_perm=128, seed=0)
        r.update(list(string_shingles(d, n)))
        r.digest()
    rates["rensa"] = len(sample) / (time.perf_counter() - t0)
    return {k: round(v) for k, v in rates.items()}


def run_ballast(corpus: Path, workdir: Path, workers: int, threshold: float) -> dict:
    return run_prep_process(
        {
            "output": str(workdir / "out"),
            "workers": workers,
            "sources": [{"name": "bench", "paths": [str(corpus)], "id_field": "id"}],
            "ingest": {"shard_docs": 10_000},
            "dedup": {"exact": True, "near": {"threshold": threshold}},
            "quality": [],
        },
        workdir,
        until="near",
    )


def removed_map(out: Path) -> dict[int, int]:
    """Removed doc index -> index of the document kept in its place (exact then near)."""
    import pyarrow.parquet as pq

    kept: dict[int, int] = {}
    for stage in ("exact", "near"):
        for f in sorted((out / "dropped" / stage).glob("*.parquet")):
            t = pq.read_table(f, columns=["id", "detail"])
            for i, k in zip(t["id"].to_pylist(), t["detail"].to_pylist(), strict=True):
                kept[int(i[1:])] = int(k[1:])
    return kept


def quality_metrics(
    docs: list[str], gt: set, removed: dict[int, int], threshold: float, n: int
) -> dict:
    def root(i: int) -> int:
        while i in removed:
            i = removed[i]
        return i

    found = sum(1 for i, j in gt if root(i) == root(j))
    recall = found / len(gt) if gt else 1.0
    partners: dict[int, set[int]] = {}
    for i, j in gt:
        partners.setdefault(i, set()).add(j)
        partners.setdefault(j, set()).add(i)
    cluster: dict[int, int] = {d: root(d) for d in removed}
    ok_any = sum(1 for d in removed if any(root(p) == cluster[d] for p in partners.get(d, ())))
    cache: dict[int, set[str]] = {}

    def sh(i: int) -> set[str]:
        if i not in cache:
            cache[i] = string_shingles(docs[i], n)
        return cache[i]

    strict = 0
    for d in removed:
        a, b = sh(d), sh(root(d))
        inter = len(a & b)
        strict += inter / max(1, len(a) + len(b) - inter) >= threshold
    return {
        "ground_truth_pairs": len(gt),
        "pairs_found": found,
        "recall": recall,
        "removed": len(removed),
        "precision": ok_any / len(removed) if removed else 1.0,
        "precision_vs_kept_doc": strict / len(removed) if removed else 1.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--scale", type=int, default=200_000, help="0 to skip the scaled run")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--out", default=str(RESULTS / "dedup.json"))
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-dedup"))
    args = ap.parse_args()
    if not have_shared(*CORPORA):
        print(f"skip: shared corpora not found under {SHARED}")
        return
    result: dict = {
        "machine": machine(),
        "workers": args.workers,
        "threshold": args.threshold,
        "runs": [],
    }
    for n_docs in [args.docs] + ([args.scale] if args.scale else []):
        docs, planted = build_corpus(n_docs, seed=0)
        mb = sum(len(d.encode()) for d in docs) / 1e6
        workdir = Path(args.workdir) / str(n_docs)
        corpus = write_corpus(docs, workdir)
        # The benchmark's own copy of the corpus must not count in the pipeline's RSS.
        del docs
        r = run_ballast(corpus, workdir, args.workers, args.threshold)
        secs = r["report"]["stage_seconds"]
        dedup_secs = secs.get("exact", 0) + secs.get("near", 0)
        run = {
            "docs": n_docs,
            "mb": round(mb, 2),
            "planted": planted,
            "stage_seconds": secs,
            "step_seconds": r["report"]["step_seconds"],
            "dedup_seconds": round(dedup_secs, 2),
            "docs_per_s": round(n_docs / dedup_secs),
            "mb_per_s": round(mb / dedup_secs, 2),
            "peak_rss_mb": round(r["peak_rss"] / 2**20),
            "near": r["report"].get("near"),
            "removed_exact": sum(r["report"]["stages"]["exact"]["total"]["dropped"].values()),
            "removed_near": sum(r["report"]["stages"]["near"]["total"]["dropped"].values()),
        }
        if n_docs == args.docs:  # ground truth on the smaller corpus
            with open(corpus, encoding="utf-8") as f:
                docs = [json.loads(line)["text"] for line in f]
            gt, _, ds_rate = ground_truth(docs, args.threshold, 5)
            run["datasketch_signatures_docs_per_s_1core"] = round(ds_rate)
            run["signature_docs_per_s_1core"] = signature_rates(docs)
            run.update(quality_metrics(docs, gt, removed_map(r["out"]), args.threshold, 5))
        print(json.dumps(run, indent=2))
        result["runs"].append(run)
    result["targets"] = {
        "recall": 0.99,
        "precision": 0.99,
        "docs_per_s": 9000,
        "datatrove_4_stage_docs_per_s_reference": 920,
    }
    write_json(args.out, result, end="")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
