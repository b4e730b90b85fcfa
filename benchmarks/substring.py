"""Benchmark: exact substring dedup (the `substring` stage) on the scale corpus's distinct
documents with repeated paragraphs planted at known positions.

    python -m benchmarks.substring [--sizes 10000,100000] [--workers 2]
        [--max-memory 1GiB,512MiB] [--reference-docs 10000]
        [--out benchmarks/results/substring.json]

The corpus: the scale corpus's original documents (benchmarks/common.py ScaleCorpus; its
planted copies are left out, so what repeats is what this benchmark plants), and 400
paragraphs of 60-150 random words, each planted into 2 to ~2% of the documents (a few
very common, most rare: boilerplate's shape) at the start, at a line break in the middle,
or at the end. The prep runs `--until substring` with exact and near dedup off (they are
measured elsewhere): `unit: tokens, min_tokens: 50, keep: first`.

Reported per size: the stage's MB/s (of its input text) and seconds per step; the peak
RSS of each worker process (a task runs in one) and of the whole tree; partitions, hash
passes, the hash files' disk; the share of bytes removed; precision and recall of the
removed bytes against the planted truth (every occurrence of a planted paragraph but its
first); and, up to --reference-docs documents, against an exact reference (every window
of 50 tokens, keyed by its 128-bit xxh3 digest, in a dict) that also finds the
corpus's natural repeats. The stage's removed ranges are recomputed from the run's own
select output (dataprep/stages/substring.removed_ranges), so they are exactly what the
stage cut.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    ROOT,
    ScaleCorpus,
    TreeRSS,
    have_shared,
    machine,
    write_json,
)

MIN_TOKENS = 50
N_PARAGRAPHS = 400


def make_corpus(n_docs: int, seed: int, path: Path) -> tuple[dict[str, list[int]], list[str]]:
    """Write the corpus (one JSONL file, ids d0..); returns the paragraphs planted in each
    document (by index) and the paragraphs."""
    rng = random.Random(seed)
    scale = ScaleCorpus(seed)
    vocab = sorted(set(scale.vocab))
    paragraphs = [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(60, 150)))
        for _ in range(N_PARAGRAPHS)
    ]
    # How many documents get paragraph p: Zipf-like, from ~2% of the corpus down to 2.
    copies = [max(2, int(0.02 * n_docs / (p + 1) ** 0.8)) for p in range(N_PARAGRAPHS)]
    plants: dict[str, list[int]] = {}
    for p, c in enumerate(copies):
        for d in rng.sample(range(n_docs), c):
            plants.setdefault(f"d{d}", []).append(p)
    i = 0  # the scale corpus's index: its copies are skipped
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in range(n_docs):
            while scale.source_of(i)[0] != "orig":
                i += 1
            text = scale.text(i)
            i += 1
            for p in plants.get(f"d{d}", []):
                text = _plant(text, paragraphs[p], rng)
            f.write(json.dumps({"id": f"d{d}", "text": text}) + "\n")
    return plants, paragraphs


def _plant(text: str, para: str, rng: random.Random) -> str:
    """`text` with `para` as a line of its own: at the start, at a line break in the
    middle, or at the end."""
    lines = text.split("\n")
    where = rng.choice(["start", "middle", "end"] if len(lines) > 1 else ["start", "end"])
    if where == "start":
        lines.insert(0, para)
    elif where == "end":
        lines.append(para)
    else:
        lines.insert(rng.randrange(1, len(lines)), para)
    return "\n".join(lines)


def _locate(text: str, para: str) -> tuple[int, int]:
    b, p = text.encode("utf-8"), para.encode("utf-8")
    at = b.find(b"\n" + p + b"\n")
    if at >= 0:
        return at + 1, at + 1 + len(p)
    if b.startswith(p + b"\n") or b == p:
        return 0, len(p)
    assert b.endswith(b"\n" + p)
    return len(b) - len(p), len(b)


def reference_hashed(texts: list[str], k: int) -> list[list[tuple[int, int]]]:
    """keep: first over 50-token windows, each keyed by the 128-bit digest of its tokens
    (joined by one space: tokens hold no whitespace), in input order."""
    import re

    import xxhash

    token = re.compile(rb"[^ \t\n\r\x0b\x0c]+")
    windows: list[list[tuple[bytes, int, int]]] = []
    count: Counter[bytes] = Counter()
    for text in texts:
        toks = [(m.start(), m.end(), m.group()) for m in token.finditer(text.encode("utf-8"))]
        mine = []
        for i in range(len(toks) - k + 1):
            key = xxhash.xxh3_128_digest(b" ".join(t[2] for t in toks[i : i + k]))
            mine.append((key, toks[i][0], toks[i + k - 1][1]))
            count[key] += 1
        windows.append(mine)
    seen: set[bytes] = set()
    out = []
    for mine in windows:
        marks = []
        for key, s, e in mine:
            if count[key] < 2:
                continue
            if key not in seen:
                seen.add(key)
                continue
            marks.append((s, e))
        merged: list[list[int]] = []
        for s, e in sorted(marks):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        out.append([(s, e) for s, e in merged])
    return out


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Bytes in both sets of disjoint sorted ranges."""
    i = j = n = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        n += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return n


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _size(r: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in r)


def _scores(got: dict[str, list], want: dict[str, list]) -> dict[str, Any]:
    tp = sum(_overlap(got.get(i, []), want.get(i, [])) for i in set(got) | set(want))
    n_got = sum(_size(r) for r in got.values())
    n_want = sum(_size(r) for r in want.values())
    return {
        "removed_bytes": n_got,
        "truth_bytes": n_want,
        "precision": round(tp / n_got, 6) if n_got else 1.0,
        "recall": round(tp / n_want, 6) if n_want else 1.0,
        "docs_differing": sum(got.get(i, []) != want.get(i, []) for i in set(got) | set(want)),
    }


def run_one(n_docs: int, args: argparse.Namespace) -> dict[str, Any]:
    import pyarrow.parquet as pq
    import yaml

    from dataprep.config import parse_config
    from dataprep.layout import output_store
    from dataprep.stages import substring as stage

    work = Path(args.workdir) / f"substring-{n_docs}-{args.max_memory}"
    corpus = work / "corpus.jsonl"
    t0 = time.perf_counter()
    planted, paragraphs = make_corpus(n_docs, args.seed, corpus)
    gen_s = time.perf_counter() - t0
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    cfg = {
        "output": str(out),
        "workers": args.workers,
        "sources": [{"name": "web", "paths": [str(corpus)], "id_field": "id"}],
        "ingest": {"shard_docs": args.shard_docs},
        "dedup": {
            "exact": False,
            "near": False,
            "substring": {
                "min_tokens": MIN_TOKENS,
                "unit": "tokens",
                "keep": "first",
                "max_memory": args.max_memory,
            },
        },
    }
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "cli.main", "prep", str(cfg_path), "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.Popen([*cmd, "--until", "substring"], cwd=ROOT, stdout=subprocess.DEVNULL)
    with TreeRSS(proc.pid) as rss:
        if proc.wait() != 0:
            raise SystemExit(f"ballast prep failed with exit code {proc.returncode}")
    wall = time.perf_counter() - t0
    report = json.loads((out / "v0001" / "report.json").read_text())
    parsed = parse_config(cfg)
    store = output_store(parsed)
    # What the stage cut, per document, from its own select output; and the inputs in order.
    got: dict[str, list[tuple[int, int]]] = {}
    ids: list[str] = []
    texts: list[str] = []
    for shard in report["shards"]:
        t = pq.read_table(out / "docs" / "ingest" / f"{shard}.parquet", columns=["id", "text"])
        ranges = stage.removed_ranges(parsed, t["text"], stage.shard_dups(store, shard))
        shard_ids = t["id"].to_pylist()
        for row, r in ranges.items():
            got[shard_ids[row]] = r
        ids += shard_ids
        texts += t["text"].to_pylist()
    # The planted truth: every occurrence of a paragraph but its first, in input order.
    seen: set[int] = set()
    truth: dict[str, list[tuple[int, int]]] = {}
    for i, text in zip(ids, texts, strict=True):
        spans = [_locate(text, paragraphs[p]) for p in planted.get(i, []) if p in seen]
        seen.update(planted.get(i, []))
        if spans:
            truth[i] = _merged(spans)
    st = report["stages"]["substring"]["total"]
    summary = report["substring"]
    bytes_in = st["bytes_in"]
    secs = report["stage_seconds"]["substring"]
    result: dict[str, Any] = {
        "docs": n_docs,
        "input_mb": round(bytes_in / 1e6, 2),
        "corpus_seconds": round(gen_s, 1),
        "prep_wall_s": round(wall, 1),
        "stage_seconds": round(secs, 2),
        "stage_mb_per_s": round(bytes_in / 1e6 / secs, 2),
        "step_seconds": {
            k: round(v, 2) for k, v in report["step_seconds"].items() if k.startswith("substring")
        },
        "workers": args.workers,
        "max_memory": args.max_memory,
        "peak_rss_tree_mb": round(rss.peak / 2**20, 1),
        "peak_rss_tree_mb_per_step": {
            k: round(max((r for t, r in rss.samples if a <= t <= b), default=0) / 2**20, 1)
            for k, (a, b) in report["step_epoch_seconds"].items()
            if k.startswith("substring")
        },
        "peak_rss_per_process_mb": sorted(
            (round(v / 2**20, 1) for v in rss.per_pid.values()), reverse=True
        ),
        "partitions": summary["partitions"],
        "max_partition_entries": summary["max_partition_entries"],
        "windows": summary["windows"],
        "hash_passes": max(
            json.loads((out / "substring" / "windows" / f"{s}.json").read_text())["passes"]
            for s in report["shards"]
        ),
        "hash_disk_mb": round(summary["hash_disk_bytes"] / 1e6, 2),
        "hash_disk_bytes_per_input_byte": round(summary["hash_disk_bytes"] / bytes_in, 2),
        "docs_edited": sum(e["edited"] for e in summary["sources"].values()),
        "docs_dropped": st["dropped"].get("substring_dup", 0),
        "removed_share": round((bytes_in - st["bytes_kept"]) / bytes_in, 5),
        "vs_planted": _scores(got, truth),
    }
    if n_docs <= args.reference_docs:
        t0 = time.perf_counter()
        ref = {i: r for i, r in zip(ids, reference_hashed(texts, MIN_TOKENS), strict=True) if r}
        result["reference_seconds"] = round(time.perf_counter() - t0, 1)
        result["reference_mb_per_s"] = round(bytes_in / 1e6 / (time.perf_counter() - t0), 3)
        result["vs_reference"] = _scores(got, ref)
        result["reference_vs_planted"] = _scores(ref, truth)
    print(json.dumps({k: v for k, v in result.items()}, indent=None))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-docs", type=int, default=50_000)
    ap.add_argument("--max-memory", default="1GiB,512MiB", help="bounds, each run at every size")
    ap.add_argument("--reference-docs", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-substring"))
    ap.add_argument("--keep", action="store_true", help="keep the corpora and outputs")
    ap.add_argument("--out", default=str(RESULTS / "substring.json"))
    args = ap.parse_args()
    if not have_shared("web_openwebtext_1k.jsonl"):
        print("skipped: ../shared/data is not present")
        return
    runs = []
    for bound in args.max_memory.split(","):
        for n in args.sizes.split(","):
            runs.append(run_one(int(n), argparse.Namespace(**{**vars(args), "max_memory": bound})))
    write_json(args.out, {"machine": machine(), "min_tokens": MIN_TOKENS, "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
