"""Benchmark: the whole `ballast prep` (ingest -> exact -> near -> quality -> tokenize ->
mixture -> pack -> dataset): throughput, time per stage and step, peak RSS of the prep
process tree. Two subcommands:

    python -m benchmarks.prep stages [--docs 100000] [--out benchmarks/results/prep.json]
    python -m benchmarks.prep scale [--sizes 100000,1000000,10000000] [--workers 2]
                                    [--out benchmarks/results/scale.json] [--keep]

`stages`: on 2 cores, MB/s of raw text, time per stage and step, peak RSS, on two corpora:
the shared web and code corpora as they are (the demo config), and a larger one built
from them by the dedup benchmark's corpus builder (benchmarks/common.py: planted
duplicates, remixed documents), with web and code mixed 70/30.

`scale`: at 100k, 1M and 10M documents on one machine, to show that the cost per document
stays flat and memory stays bounded as the corpus grows. Each corpus is one JSONL file
(about 800 bytes a document: 8 GB at 10M), generated once on disk under --workdir and
reused: 75% distinct documents (the shared web corpora, then runs of their lines
remixed), 25% planted copies of an earlier document anywhere in the file (a fifth exact,
the rest with 1-3% or 5-10% of the words changed), so near-dedup must link documents
across the whole corpus. Every document is a pure function of (seed, index)
(benchmarks/common.py's ScaleCorpus): the corpus is written streaming and the benchmark
can regenerate any document to check near-dedup without holding the corpus. The prep:
the default web quality chain, exact + near dedup, byte-level BPE, bfd packing and the
dataset. Reported per size: wall time, MB/s, docs/s, time and peak RSS per step and
stage, peak RSS of the process tree, intermediate disk, and near-dedup precision and
recall on a sample against exact Jaccard of word 5-gram sets.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from pathlib import Path

import yaml

from benchmarks.common import (
    CORPORA,
    RESULTS,
    ROOT,
    SHARED,
    ScaleCorpus,
    build_corpus,
    build_scale_corpus,
    du,
    have_shared,
    machine,
    run_prep_process,
    string_shingles,
    write_corpus,
    write_json,
)

# The scale runs' quality chain and near-dedup threshold (also the cluster benchmark's).
QUALITY = ["char_repetition", "length", "gopher_quality", "gopher_repetition", "c4", "fineweb"]
THRESHOLD = 0.8


# ---- stages ----------------------------------------------------------------------------
def run(config: dict, workdir: Path) -> dict:
    r = run_prep_process(config, workdir)
    report, wall = r["report"], r["wall"]
    mb = report["stages"]["ingest"]["total"]["bytes_in"] / 1e6
    pk = report["packing"]["train"]
    return {
        "docs_in": report["stages"]["ingest"]["total"]["docs_in"],
        "mb_in": round(mb, 2),
        "wall_seconds": round(wall, 2),
        "mb_per_s": round(mb / wall, 2),
        "docs_per_s": round(report["stages"]["ingest"]["total"]["docs_in"] / wall),
        "peak_rss_mb": round(r["peak_rss"] / 2**20),
        "stage_seconds": report["stage_seconds"],
        "step_seconds": report["step_seconds"],
        "train_tokens": pk["real_tokens"],
        "packing_efficiency": round(pk["efficiency"], 5),
        "tokens_per_s": round(pk["real_tokens"] / wall),
        "kept_docs": {k: v["total"]["kept"] for k, v in report["stages"].items()},
    }


def stages(args: argparse.Namespace) -> None:
    if not have_shared(*CORPORA):
        print(f"skip: shared corpora not found under {SHARED}")
        return
    work = Path(args.workdir)
    result: dict = {"machine": machine(), "workers": 2, "runs": {}}

    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    demo["sources"] = [
        {**s, "paths": [str((ROOT / "configs" / p).resolve()) for p in s["paths"]]}
        for s in demo["sources"]
    ]
    demo["output"] = str(work / "demo-out")
    result["runs"]["shared_corpora"] = run(demo, work / "demo")
    print(json.dumps({"shared_corpora": result["runs"]["shared_corpora"]}, indent=2))

    docs, _ = build_corpus(args.docs, seed=1)
    corpus = write_corpus(docs, work / "big")
    del docs
    big = {
        "output": str(work / "big-out"),
        "workers": 2,
        "sources": [{"name": "mixed", "paths": [str(corpus)], "id_field": "id"}],
        "ingest": {"shard_docs": 10_000},
        # The remixed documents are prose and code spliced together: the character rule
        # and length only, so the later stages see most of the corpus.
        "quality": ["char_repetition", {"length": {"min_chars": 50}}],
        "pack": {"seq_len": 1024, "strategy": "bfd"},
    }
    result["runs"][f"scaled_{args.docs}"] = run(big, work / "big")
    print(json.dumps({f"scaled_{args.docs}": result["runs"][f"scaled_{args.docs}"]}, indent=2))
    write_json(args.out, result, end="")
    print(f"wrote {args.out}")


# ---- scale -----------------------------------------------------------------------------
def near_check(out: Path, corpus: ScaleCorpus, n_docs: int, sample: int = 1500) -> dict:
    """Precision: a sample of near-dup removals, exact Jaccard against the document kept
    in their place. Recall: a sample of planted edited copies whose exact Jaccard with
    their source reaches the threshold: both must end in the same cluster."""
    import numpy as np
    import pyarrow.parquet as pq

    kept_of = np.arange(n_docs, dtype=np.int64)
    near_removed: list[tuple[int, int]] = []
    for stage in ("exact", "near"):
        for f in sorted((out / "dropped" / stage).glob("*.parquet")):
            t = pq.read_table(f, columns=["id", "detail"])
            ids = np.array([int(x[1:]) for x in t["id"].to_pylist()], dtype=np.int64)
            kept = np.array([int(x[1:]) for x in t["detail"].to_pylist()], dtype=np.int64)
            kept_of[ids] = kept
            if stage == "near":
                near_removed += list(zip(ids.tolist(), kept.tolist(), strict=True))

    def root(i: int) -> int:
        while kept_of[i] != i:
            i = int(kept_of[i])
        return i

    def jac(i: int, j: int) -> float:
        a, b = string_shingles(corpus.text(i), 5), string_shingles(corpus.text(j), 5)
        inter = len(a & b)
        return inter / max(1, len(a) + len(b) - inter)

    rng = random.Random(0)
    prec_sample = rng.sample(near_removed, min(sample, len(near_removed)))
    precision = (
        sum(jac(i, k) >= THRESHOLD for i, k in prec_sample) / len(prec_sample)
        if prec_sample
        else 1.0
    )
    pairs, tried = [], 0
    while len(pairs) < sample and tried < 50 * sample:
        i = rng.randrange(n_docs)
        tried += 1
        kind, j = corpus.source_of(i)
        if kind.startswith("edit") and jac(i, j) >= THRESHOLD:
            pairs.append((i, j))
    recall = sum(root(i) == root(j) for i, j in pairs) / len(pairs) if pairs else 1.0
    return {
        "precision_sample": len(prec_sample),
        "precision_vs_kept": round(precision, 4),
        "recall_sample": len(pairs),
        "recall": round(recall, 4),
    }


def run_size(n_docs: int, args: argparse.Namespace) -> dict:
    work = Path(args.workdir)
    corpus_path = build_scale_corpus(
        n_docs, args.seed, work / "corpora", max(1, os.cpu_count() or 1)
    )
    out = work / f"out-{n_docs}"
    cfg = {
        "output": str(out),
        "workers": args.workers,
        "seed": 0,
        "sources": [{"name": "web", "paths": [str(corpus_path)], "id_field": "id"}],
        "ingest": {"shard_docs": args.shard_docs},
        "dedup": {"exact": True, "near": {"threshold": THRESHOLD}},
        "quality": QUALITY,
        "tokenizer": {"kind": "bpe", "vocab_size": 8192, "train_docs": 50_000},
        "pack": {"seq_len": 1024, "strategy": "bfd"},
    }
    r = run_prep_process(cfg, work)
    report, wall = r["report"], r["wall"]
    mb = report["stages"]["ingest"]["total"]["bytes_in"] / 1e6
    step_rss = {}
    for step, (a, b) in report.get("step_epoch_seconds", {}).items():
        inside = [rss for t, rss in r["samples"] if a <= t <= b]
        step_rss[step] = round(max(inside) / 2**20) if inside else None
    inter = du(out) - du(out / "dataset")
    result = {
        "docs": n_docs,
        "mb_in": round(mb, 1),
        "wall_seconds": round(wall, 1),
        "mb_per_s": round(mb / wall, 2),
        "docs_per_s": round(n_docs / wall),
        "peak_rss_mb": round(r["peak_rss"] / 2**20),
        "stage_seconds": report["stage_seconds"],
        "step_seconds": report["step_seconds"],
        "step_peak_rss_mb": step_rss,
        "intermediate_disk_mb": round(inter / 1e6),
        "dataset_disk_mb": round(du(out / "dataset") / 1e6),
        "kept_docs": {k: v["total"]["kept"] for k, v in report["stages"].items()},
        "train_tokens": report["packing"]["train"]["real_tokens"],
        "near": report.get("near"),
    }
    result["near_quality"] = near_check(out, ScaleCorpus(args.seed), n_docs)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


def scale(args: argparse.Namespace) -> None:
    if not have_shared(*CORPORA):
        print(f"skip: shared corpora not found under {SHARED}")
        return
    result: dict = {"machine": machine(), "workers": args.workers, "quality": QUALITY, "runs": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in [int(x) for x in args.sizes.split(",")]:
        r = run_size(n, args)
        result["runs"][str(n)] = r
        print(json.dumps({str(n): r}, indent=2), flush=True)
        out.write_text(json.dumps(result, indent=2))  # after each size: a long run's partial
    runs = list(result["runs"].values())
    if len(runs) > 1:
        result["flatness_mb_per_s_ratio"] = round(runs[-1]["mb_per_s"] / runs[0]["mb_per_s"], 3)
    # mb_per_s: "Native speed" (issue 30) asks 10 MB/s on 2 cores at 1M and 10M documents.
    result["targets"] = {"flatness_mb_per_s_ratio": 0.8, "peak_rss_mb": 2048, "mb_per_s": 10.0}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stages", help="the shared corpora and one scaled corpus: per stage")
    st.add_argument("--docs", type=int, default=100_000)
    st.add_argument("--out", default=str(RESULTS / "prep.json"))
    st.add_argument("--workdir", default=str(ROOT / "runs" / "bench-prep"))
    sc = sub.add_parser("scale", help="100k, 1M and 10M documents: flat cost, bounded memory")
    sc.add_argument("--sizes", default="100000,1000000,10000000")
    sc.add_argument("--workers", type=int, default=2)
    sc.add_argument("--shard-docs", type=int, default=50_000)
    sc.add_argument("--seed", type=int, default=1)
    sc.add_argument("--workdir", default=str(ROOT / "runs" / "bench-scale"))
    sc.add_argument("--out", default=str(RESULTS / "scale.json"))
    sc.add_argument("--keep", action="store_true", help="keep each run's output")
    args = ap.parse_args()
    (stages if args.cmd == "stages" else scale)(args)


if __name__ == "__main__":
    main()
