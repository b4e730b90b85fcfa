"""Benchmark: a nightly version on a large history (issue 35, "Incremental at scale"): the
exact-hash dedup index (dataprep/dedup_index.py) against re-reading every earlier
version's hashes, and against prepping the new data alone:

    python -m benchmarks.incremental [--docs 1000000] [--frac 0.01] [--workers 2]
                                     [--near] [--scale] [--versions append|whole]
                                     [--out benchmarks/results/incremental.json]

On the scale corpus (benchmarks/common.py ScaleCorpus: a quarter of the documents copies
of earlier ones, exact or edited), in turn:

    history   version 1: documents 0..N-1
    first     version 2: the next N*frac documents, with the index: it finds version 1
              without a run and indexes it from its hash files (once)
    nightly   version 3: the N*frac after those, plus planted exact copies of random
              history documents, with the index (the figure the target is about) and,
              on a hard-linked copy of the output after version 2, with the old path
              (BALLAST_DEDUP_INDEX=0): outputs compared byte for byte
    alone     the nightly's new file prepped by itself into a fresh output

Per run: wall seconds; peak RSS of the prep's processes summed and of the largest one
(benchmarks.common.TreeRSS, sampled every 50 ms); bytes read by the prep's process tree
(rchar: every read and pread, page cache or not, of the process and the workers it
reaped: /proc/self/io of this process, which reaps it); seconds per stage and step; the
index's counters (report `exact_index`). The ratio nightly / alone is set against the
target (3x); the stages planned over all of a version's documents with --versions whole
(mixture, pack, dataset) are reported apart, as what is left of the ratio without them.

--versions append (the default; dataset.versions) mixes and packs each version's new
documents only and appends their rows to the previous version's; --versions whole plans
every version over all of its documents, as before that setting (the stages it plans
anew are then reported apart, below).

Near dedup (--near: MinHash, its band keys looked up in the index's per-band runs) is off
by default, so the exact index's figures stand alone; with it, its counters are reported
too. --scale: the scale benchmark's config instead (its quality chain, near dedup, a BPE
tokenizer: at 10M documents the bytes tokenizer's intermediate files would not fit a 56 GB
disk, the BPE's take ~36 GB); the alone run then uses the history's tokenizer file.
Results are kept per configuration (documents, near, scale, versions) in one file. Timed
on a shared machine: say so with the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import (
    RESULTS,
    ROOT,
    ScaleCorpus,
    TreeRSS,
    build_scale_corpus,
    machine,
    prep_report,
    write_json,
)
from dataprep.stages.tokenize import TOKENIZER_KEY

# The stages that a version plans anew over all of its documents (not only the new ones).
WHOLE_VERSION = ("mixture", "pack", "dataset")
NEW_ONLY_UNTIL = "tokenize"  # the last stage over the new shards only
# Run records that differ between two runs of the same version by design.
VOLATILE = (
    "_index/",
    "_versions/",
    "_run.json",
    "report.json",
    "exact/index.json",
    "near/index/",
)


def rchar() -> int:
    """Bytes this process and the children it has reaped read (Linux /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def prep(cfg: dict[str, Any], work: Path, index: bool, until: str | None = None) -> dict[str, Any]:
    """`ballast prep` in a process of its own on an existing (or fresh) output."""
    out = Path(cfg["output"])
    path = work / f"config-{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "BALLAST_DEDUP_INDEX": "1" if index else "0"}
    cmd = [sys.executable, "-m", "cli.main", "prep", str(path), "--no-progress"]
    if until:
        cmd += ["--until", until]
    r0, t0 = rchar(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    with TreeRSS(proc.pid) as rss:
        code = proc.wait()
    wall, nread = time.perf_counter() - t0, rchar() - r0
    if code != 0:
        raise SystemExit(f"ballast prep failed with exit code {code}")
    # The prep's processes summed (the driver and its pool's workers), and the largest
    # one alone: what one worker must hold.
    memory = {
        "peak_rss_mb": round(rss.peak / 2**20),
        "peak_process_rss_mb": round(max(rss.per_pid.values(), default=0) / 2**20),
    }
    if until:  # the version is not finished: no `latest` yet; its report is written
        newest = sorted(out.glob("v[0-9][0-9][0-9][0-9]/report.json"))[-1]
        part = json.loads(newest.read_text())
        return {
            "wall_seconds": round(wall, 2),
            "bytes_read": nread,
            **memory,
            "step_seconds": {k: round(v, 3) for k, v in part.get("step_seconds", {}).items()},
            "exact_index": part.get("exact_index"),
            "near_index": part.get("near_index"),
        }
    report = prep_report(out)
    stages = report.get("stage_seconds", {})
    whole = sum(v for k, v in stages.items() if k in WHOLE_VERSION)
    return {
        "wall_seconds": round(wall, 2),
        "bytes_read": nread,
        "mb_read": round(nread / 1e6, 2),
        **memory,
        "stage_seconds": {k: round(v, 2) for k, v in stages.items()},
        "step_seconds": {k: round(v, 3) for k, v in report.get("step_seconds", {}).items()},
        "whole_version_seconds": round(whole, 2),
        "docs_in": report["stages"]["ingest"]["total"]["docs_in"],
        "removed_exact": report["stages"].get("exact", {}).get("total", {}).get("dropped"),
        "exact_index": report.get("exact_index"),
        "version": report["version"]["version"] if report.get("version") else 1,
    }


def two_parts(cfg: dict[str, Any], work: Path, index: bool) -> dict[str, Any]:
    """A version in two processes: up to tokenize (the stages over its new shards, exact
    select among them), then the rest (planned over all of the version's documents), so
    that the bytes read split the same way as the seconds."""
    a = prep(cfg, work, index, until=NEW_ONLY_UNTIL)
    b = prep(cfg, work, index)
    b["new_documents_part"] = a
    b["whole_version_part"] = {"wall_seconds": b["wall_seconds"], "bytes_read": b["bytes_read"]}
    for k in ("peak_rss_mb", "peak_process_rss_mb"):
        b[k] = max(a[k], b[k])
    b["wall_seconds"] = round(a["wall_seconds"] + b["wall_seconds"], 2)
    b["bytes_read"] = a["bytes_read"] + b["bytes_read"]
    b["mb_read"] = round(b["bytes_read"] / 1e6, 2)
    return b


def _near(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    if not rec:
        return None
    keys = ("bytes_read", "history_band_bytes", "blocks_read", "blocks_total", "runs")
    out = {k: rec.get(k) for k in keys}
    out["fraction_of_history_band_bytes"] = (
        round(rec["bytes_read"] / rec["history_band_bytes"], 3)
        if rec.get("history_band_bytes")
        else None
    )
    return out


def write_docs(path: Path, corpus: ScaleCorpus, lo: int, hi: int, planted: list[int]) -> int:
    """Documents lo..hi-1 of the corpus, then exact copies of the documents `planted`."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lo, hi):
            f.write(json.dumps({"id": f"d{i}", "text": corpus.text(i)}) + "\n")
            n += 1
        for k, j in enumerate(planted):
            f.write(json.dumps({"id": f"planted{lo}-{k}", "text": corpus.text(j)}) + "\n")
            n += 1
    return n


def digests(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and not any(s in p.relative_to(out).as_posix() for s in VOLATILE)
    }


def config(
    data: Path, out: Path, args: argparse.Namespace, tokenizer: Path | None = None
) -> dict[str, Any]:
    """The runs' config; --scale: the scale benchmark's (benchmarks/prep.py: its quality
    chain, near dedup, a BPE tokenizer, whose files take a quarter of the bytes
    tokenizer's: 10M documents fit this disk), `tokenizer` then the history's for the
    alone run (the same tokens, no training: a nightly version reuses version 1's)."""
    cfg: dict[str, Any] = {
        "output": str(out),
        "workers": args.workers,
        "seed": 0,
        "sources": [{"name": "web", "paths": [str(data)], "id_field": "id"}],
        "ingest": {"shard_docs": args.shard_docs},
        "dedup": {"exact": True, "near": {"threshold": 0.8} if args.near else None},
        "quality": ["length"],
        "tokenizer": {"kind": "bytes"},
        "pack": {"seq_len": 1024, "strategy": "bfd"},
        "dataset": {"versions": args.versions},
    }
    if args.scale:
        from benchmarks.prep import QUALITY, THRESHOLD

        cfg["quality"] = QUALITY
        cfg["dedup"]["near"] = {"threshold": THRESHOLD}
        cfg["tokenizer"] = (
            {"kind": "file", "path": str(tokenizer)}
            if tokenizer
            else {"kind": "bpe", "vocab_size": 8192, "train_docs": 50_000}
        )
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--frac", type=float, default=0.01)
    ap.add_argument("--planted", type=float, default=0.05, help="of the nightly's documents")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-docs", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--near", action="store_true")
    ap.add_argument(
        "--scale", action="store_true", help="the scale benchmark's config (implies --near)"
    )
    ap.add_argument(
        "--versions",
        choices=("whole", "append"),
        default="append",
        help="dataset.versions: mix and pack every version whole, or append its new rows",
    )
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-incremental"))
    ap.add_argument("--out", default=str(RESULTS / "incremental.json"))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    args.near = args.near or args.scale

    work = Path(args.workdir)
    n, inc = args.docs, max(1, int(args.docs * args.frac))
    hist = build_scale_corpus(n, args.seed, work / "corpora", max(1, os.cpu_count() or 1))
    corpus = ScaleCorpus(args.seed)
    data, alone_data = work / "data", work / "alone"
    for d in (data, alone_data, work / "out", work / "out-old", work / "out-alone"):
        shutil.rmtree(d, ignore_errors=True)
    data.mkdir(parents=True)
    alone_data.mkdir(parents=True)
    os.link(hist, data / "history.jsonl")
    out, old = work / "out", work / "out-old"
    runs: dict[str, Any] = {}

    print(f"history: {n} documents", flush=True)
    runs["history"] = prep(config(data, out, args), work, index=True)
    print(json.dumps(runs["history"]["stage_seconds"]), flush=True)

    write_docs(data / "first.jsonl", corpus, n, n + inc, [])
    runs["first"] = prep(config(data, out, args), work, index=True)
    print("first increment:", json.dumps(runs["first"]["exact_index"]), flush=True)

    # The nightly's old-path twin starts from the same output: hard links (a store
    # replaces a file by renaming a new one over it, never writes into one).
    subprocess.run(["cp", "-al", str(out), str(old)], check=True)
    rng = random.Random(args.seed + 1)
    planted = [rng.randrange(n) for _ in range(int(inc * args.planted))]
    nightly = data / "nightly.jsonl"
    docs = write_docs(nightly, corpus, n + inc, n + 2 * inc, planted)
    os.link(nightly, alone_data / "nightly.jsonl")
    runs["nightly"] = two_parts(config(data, out, args), work, index=True)
    print("nightly (index):", runs["nightly"]["wall_seconds"], "s", flush=True)
    runs["nightly_old_path"] = two_parts(config(data, old, args), work, index=False)
    print("nightly (old path):", runs["nightly_old_path"]["wall_seconds"], "s", flush=True)
    tok = out / TOKENIZER_KEY if args.scale else None
    alone_cfg = config(alone_data, work / "out-alone", args, tok)
    runs["alone"] = two_parts(alone_cfg, work, index=True)
    print("alone:", runs["alone"]["wall_seconds"], "s", flush=True)
    # The floor of every run: a prep that finds nothing new (the process, its imports,
    # the inventory): the bytes read above it are the data's.
    floor = prep(alone_cfg, work, index=True)
    runs["nothing_new"] = {k: floor[k] for k in ("wall_seconds", "bytes_read", "mb_read")}

    same = digests(out) == digests(old)
    night, alone, oldp = runs["nightly"], runs["alone"], runs["nightly_old_path"]
    idx = night["new_documents_part"]["exact_index"] or {}

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else float("inf")

    result = {
        "machine": machine(),
        "workers": args.workers,
        "history_docs": n,
        "increment_docs": inc,
        "nightly_docs": docs,
        "planted_copies": len(planted),
        "near": args.near,
        "scale_config": args.scale,
        "versions": args.versions,
        "runs": runs,
        "nightly_identical_to_old_path": same,
        "index": {
            "bytes_read": idx.get("bytes_read"),
            "kept_ids_bytes_read": idx.get("kept_ids_bytes_read"),
            "history_hash_bytes": idx.get("history_hash_bytes"),
            "index_bytes_total": idx.get("bytes_total"),
            "blocks_read": idx.get("blocks_read"),
            "blocks_total": idx.get("blocks_total"),
            "fraction_of_history_hashes": ratio(
                idx.get("bytes_read", 0), idx.get("history_hash_bytes", 0)
            ),
        },
        "near_index": _near(night["new_documents_part"].get("near_index")),
        "near_buckets_seconds": {
            "index": night["new_documents_part"]["step_seconds"].get("near: buckets"),
            "old_path": oldp["new_documents_part"]["step_seconds"].get("near: buckets"),
            "alone": alone["new_documents_part"]["step_seconds"].get("near: buckets"),
        },
        "exact_select_seconds": {
            "index": night["new_documents_part"]["step_seconds"].get("exact: select"),
            "old_path": oldp["new_documents_part"]["step_seconds"].get("exact: select"),
            "alone": alone["new_documents_part"]["step_seconds"].get("exact: select"),
        },
        # Memory: the history's prep against the nightly's, which should follow the new
        # data (summed over the prep's processes; the largest process alone).
        "peak_rss_mb": {
            k: {"all": v["peak_rss_mb"], "largest_process": v["peak_process_rss_mb"]}
            for k, v in runs.items()
            if "peak_rss_mb" in v
        },
        "target_ratio": 3.0,
        "ratio_vs_alone_above_the_floor": {
            "bytes_read": ratio(
                night["bytes_read"] - 2 * floor["bytes_read"],
                alone["bytes_read"] - 2 * floor["bytes_read"],
            ),
            "bytes_read_new_documents_part": ratio(
                night["new_documents_part"]["bytes_read"] - floor["bytes_read"],
                alone["new_documents_part"]["bytes_read"] - floor["bytes_read"],
            ),
            "bytes_read_new_documents_part_old_path": ratio(
                oldp["new_documents_part"]["bytes_read"] - floor["bytes_read"],
                alone["new_documents_part"]["bytes_read"] - floor["bytes_read"],
            ),
        },
        "ratio_vs_alone": {
            "wall": ratio(night["wall_seconds"], alone["wall_seconds"]),
            "bytes_read": ratio(night["bytes_read"], alone["bytes_read"]),
            "peak_rss": ratio(night["peak_rss_mb"], alone["peak_rss_mb"]),
            "wall_old_path": ratio(oldp["wall_seconds"], alone["wall_seconds"]),
            "bytes_read_old_path": ratio(oldp["bytes_read"], alone["bytes_read"]),
            # Without the stages planned over all of the version's documents: the
            # processes up to tokenize alone.
            "wall_new_documents_part": ratio(
                night["new_documents_part"]["wall_seconds"],
                alone["new_documents_part"]["wall_seconds"],
            ),
            "bytes_read_new_documents_part": ratio(
                night["new_documents_part"]["bytes_read"],
                alone["new_documents_part"]["bytes_read"],
            ),
            "bytes_read_new_documents_part_old_path": ratio(
                oldp["new_documents_part"]["bytes_read"],
                alone["new_documents_part"]["bytes_read"],
            ),
            "wall_whole_version_part": ratio(
                night["whole_version_part"]["wall_seconds"],
                alone["whole_version_part"]["wall_seconds"],
            ),
            "bytes_read_whole_version_part": ratio(
                night["whole_version_part"]["bytes_read"],
                alone["whole_version_part"]["bytes_read"],
            ),
        },
    }
    # One result per configuration (size, near on or off), kept side by side.
    out_path = Path(args.out)
    kept = json.loads(out_path.read_text()) if out_path.is_file() else {}
    configs = kept.get("configs", {})
    name = f"{n}{'-near' if args.near else ''}{'-scale' if args.scale else ''}"
    name += "-append" if args.versions == "append" else ""
    configs[name] = result
    path = write_json(out_path, {"configs": configs})
    keys = (
        "index",
        "exact_select_seconds",
        "peak_rss_mb",
        "ratio_vs_alone",
        "ratio_vs_alone_above_the_floor",
    )
    print(json.dumps({k: result[k] for k in keys}, indent=2))
    print(f"identical to the old path: {same}; written {path}")
    if not args.keep:
        for d in (out, old, work / "out-alone", data, alone_data):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
