"""Benchmark: the whole `ballast prep` (ingest -> exact -> near -> quality -> tokenize ->
mixture -> pack -> dataset) on 2 cores: MB/s of raw text, time per stage and step, peak
RSS of the prep process tree.

    python benchmarks/prep.py [--docs 100000] [--out benchmarks/results/prep.json]

Two corpora: the shared web and code corpora as they are (the demo config), and a
larger one built from them by benchmarks/dedup.py's corpus builder (planted duplicates,
remixed documents), with web and code mixed 70/30.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dedup import CORPORA, SHARED, build_corpus, run_prep_process, write_corpus  # noqa: E402


def run(config: dict, workdir: Path) -> dict:
    r = run_prep_process(config, workdir)
    report, wall = r["report"], r["wall"]
    mb = report["stages"]["ingest"]["total"]["bytes_in"] / 1e6
    pk = report["packing"]["train"]
    return {
        "docs_in": report["stages"]["ingest"]["total"]["docs_in"], "mb_in": round(mb, 2),
        "wall_seconds": round(wall, 2), "mb_per_s": round(mb / wall, 2),
        "docs_per_s": round(report["stages"]["ingest"]["total"]["docs_in"] / wall),
        "peak_rss_mb": round(r["peak_rss"] / 2**20),
        "stage_seconds": report["stage_seconds"], "step_seconds": report["step_seconds"],
        "train_tokens": pk["real_tokens"], "packing_efficiency": round(pk["efficiency"], 5),
        "tokens_per_s": round(pk["real_tokens"] / wall),
        "kept_docs": {k: v["total"]["kept"] for k, v in report["stages"].items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prep.json"))
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-prep"))
    args = ap.parse_args()
    if not all((SHARED / c).is_file() for c in CORPORA):
        print(f"skip: shared corpora not found under {SHARED}")
        return
    work = Path(args.workdir)
    result: dict = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
                    "workers": 2, "runs": {}}

    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    demo["sources"] = [{**s, "paths": [str((ROOT / "configs" / p).resolve()) for p in s["paths"]]}
                       for s in demo["sources"]]
    demo["output"] = str(work / "demo-out")
    result["runs"]["shared_corpora"] = run(demo, work / "demo")
    print(json.dumps({"shared_corpora": result["runs"]["shared_corpora"]}, indent=2))

    docs, _ = build_corpus(args.docs, seed=1)
    corpus = write_corpus(docs, work / "big")
    del docs
    big = {
        "output": str(work / "big-out"), "workers": 2,
        "sources": [{"name": "mixed", "paths": [str(corpus)], "id_field": "id"}],
        "ingest": {"shard_docs": 10_000},
        # The remixed documents are prose and code spliced together: the character rule
        # and length only, so the later stages see most of the corpus.
        "quality": ["char_repetition", {"length": {"min_chars": 50}}],
        "pack": {"seq_len": 1024, "strategy": "bfd"},
    }
    result["runs"][f"scaled_{args.docs}"] = run(big, work / "big")
    print(json.dumps({f"scaled_{args.docs}": result["runs"][f"scaled_{args.docs}"]}, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
