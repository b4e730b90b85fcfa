"""Benchmark: the whole `ballast prep` at 100k, 1M and 10M documents on one machine, to
show that the cost per document stays flat and memory stays bounded as the corpus grows.

    python benchmarks/scale.py [--sizes 100000,1000000,10000000] [--workers 2]
                               [--out benchmarks/results/scale.json] [--keep]

Each corpus is one JSONL file (about 800 bytes a document: 8 GB at 10M), generated once
on disk under --workdir and reused: 75% distinct documents (the shared web corpora, then
runs of their lines remixed), 25% planted copies of an earlier
document anywhere in the file (a fifth exact, the rest with 1-3% or 5-10% of the words
changed), so near-dedup must link documents across the whole corpus. Every document is
a pure function of (seed, index): the corpus is written streaming and the benchmark can
regenerate any document to check near-dedup without holding the corpus.

The prep: the default web quality chain, exact + near dedup, byte-level BPE, bfd packing
and the dataset. Reported per size: wall time, MB/s, docs/s, time and peak RSS per step
and stage, peak RSS of the process tree, intermediate disk, and near-dedup precision and
recall on a sample against exact Jaccard of word 5-gram sets.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dedup import CORPORA, SHARED, edit, run_prep_process, string_shingles  # noqa: E402

QUALITY = ["char_repetition", "length", "gopher_quality", "gopher_repetition", "c4", "fineweb"]
THRESHOLD = 0.8


class Corpus:
    """Document i of the corpus, from (seed, i) alone. A copy points at an earlier index
    and copies whatever document is there (copies of copies make near-duplicate chains)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.base = []
        for name in CORPORA:
            if name.startswith("web_"):
                with open(SHARED / name, encoding="utf-8") as f:
                    self.base += [json.loads(line)["text"] for line in f]
        self.lines = [ls for ls in ([x for x in t.split("\n") if x.strip()] for t in self.base)
                      if ls]
        self.vocab = [w for t in self.base for w in t.split() if w.isalpha()]

    def _rng(self, i: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + i * 7919 + 17)

    def source_of(self, i: int) -> tuple[str, int]:
        """('orig', -1) or (kind of copy, index copied)."""
        if i < len(self.base):
            return "orig", -1
        rng = self._rng(i)
        if rng.random() >= 0.25:
            return "orig", -1
        r = rng.random()
        kind = "exact" if r < 0.2 else "edit_1_3" if r < 0.6 else "edit_5_10"
        return kind, rng.randrange(i)

    def text(self, i: int) -> str:
        if i < len(self.base):
            return self.base[i]
        kind, j = self.source_of(i)
        rng = self._rng(i)
        rng.random(), rng.random(), rng.random()  # the draws source_of made
        if kind == "orig":
            # Runs of consecutive lines of web pages (prose that the web rules keep) with
            # two fifths of the plain words swapped for words drawn from the same pages: two
            # originals that share a line share almost no 5-gram, so the duplicate
            # structure (and the cost per document) does not change with the corpus size.
            parts = []
            vocab, rand, n_vocab = self.vocab, rng.random, len(self.vocab)
            for _ in range(rng.randint(1, 3)):
                ls = self.lines[rng.randrange(len(self.lines))]
                k = rng.randrange(len(ls))
                for line in ls[k : k + rng.randint(1, 2)]:
                    parts.append(" ".join(
                        vocab[int(rand() * n_vocab)] if w.isalpha() and rand() < 0.4 else w
                        for w in line.split(" ")))
            return "\n".join(parts)
        src = self.text(j)
        if kind == "exact":
            return src
        lo, hi = (0.01, 0.03) if kind == "edit_1_3" else (0.05, 0.10)
        return edit(src, rng.uniform(lo, hi), rng)


def _write_part(args: tuple[int, int, int, str]) -> int:
    seed, lo, hi, path = args
    c = Corpus(seed)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lo, hi):
            line = json.dumps({"id": f"d{i}", "text": c.text(i)}) + "\n"
            n += len(line.encode("utf-8"))
            f.write(line)
    return n


def build(n_docs: int, seed: int, workdir: Path, procs: int) -> Path:
    """corpus-N.jsonl, generated in parallel parts and joined; reused when present."""
    path = workdir / f"corpus-{n_docs}.jsonl"
    done = path.with_suffix(".done")
    if done.exists():
        return path
    workdir.mkdir(parents=True, exist_ok=True)
    step = 200_000
    jobs = [(seed, lo, min(lo + step, n_docs), str(workdir / f".part-{lo:012d}"))
            for lo in range(0, n_docs, step)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(procs) as pool:
        pool.map(_write_part, jobs, chunksize=1)
    with open(path, "wb") as out:
        for *_, p in jobs:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
            os.unlink(p)
    done.write_text(json.dumps({"docs": n_docs, "seed": seed, "bytes": path.stat().st_size,
                                "seconds": round(time.perf_counter() - t0, 1)}))
    return path


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def near_check(out: Path, corpus: Corpus, n_docs: int, sample: int = 1500) -> dict:
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
    precision = (sum(jac(i, k) >= THRESHOLD for i, k in prec_sample) / len(prec_sample)
                 if prec_sample else 1.0)
    pairs, tried = [], 0
    while len(pairs) < sample and tried < 50 * sample:
        i = rng.randrange(n_docs)
        tried += 1
        kind, j = corpus.source_of(i)
        if kind.startswith("edit") and jac(i, j) >= THRESHOLD:
            pairs.append((i, j))
    recall = sum(root(i) == root(j) for i, j in pairs) / len(pairs) if pairs else 1.0
    return {"precision_sample": len(prec_sample), "precision_vs_kept": round(precision, 4),
            "recall_sample": len(pairs), "recall": round(recall, 4)}


def run_size(n_docs: int, args: argparse.Namespace) -> dict:
    work = Path(args.workdir)
    corpus_path = build(n_docs, args.seed, work / "corpora", max(1, os.cpu_count() or 1))
    out = work / f"out-{n_docs}"
    cfg = {
        "output": str(out), "workers": args.workers, "seed": 0,
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
        "docs": n_docs, "mb_in": round(mb, 1), "wall_seconds": round(wall, 1),
        "mb_per_s": round(mb / wall, 2), "docs_per_s": round(n_docs / wall),
        "peak_rss_mb": round(r["peak_rss"] / 2**20),
        "stage_seconds": report["stage_seconds"], "step_seconds": report["step_seconds"],
        "step_peak_rss_mb": step_rss,
        "intermediate_disk_mb": round(inter / 1e6), "dataset_disk_mb": round(
            du(out / "dataset") / 1e6),
        "kept_docs": {k: v["total"]["kept"] for k, v in report["stages"].items()},
        "train_tokens": report["packing"]["train"]["real_tokens"],
        "near": report.get("near"),
    }
    result["near_quality"] = near_check(out, Corpus(args.seed), n_docs)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,1000000,10000000")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-docs", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-scale"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scale.json"))
    ap.add_argument("--keep", action="store_true", help="keep each run's output")
    args = ap.parse_args()
    if not all((SHARED / c).is_file() for c in CORPORA):
        print(f"skip: shared corpora not found under {SHARED}")
        return
    result: dict = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
                    "workers": args.workers, "quality": QUALITY, "runs": {}}
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
    result["targets"] = {"flatness_mb_per_s_ratio": 0.8, "peak_rss_mb": 2048, "mb_per_s": 5.0}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
