"""Benchmark: the `perplexity` rule's "small reference model", made by Ballast end to end,
and how its score ranks human-labelled web pages.

    python benchmarks/perplexity.py [--steps 600] [--workdir runs/bench-ppl]
                                    [--out benchmarks/results/perplexity.json]

1. Reference data: OpenWebText (../shared/data/web_openwebtext_1k.jsonl; the pages Reddit
   users linked to, the reference GPT-3's quality filter used), through `ballast prep`
   (exact + near dedup, byte tokens, packing to 256; no quality rules: the reference is what
   "good" means here).
2. A small byte-level model (the default tokenizer; d_model 192, 4 layers) trained on it
   by Ballast's trainer on CPU, then
   `ballast export hf`.
3. The 249 labelled pages (../shared/data/web_dclm_quality_labels_train.jsonl; 1 good,
   0 bad) scored by the rule's function; reported: ROC AUC of -perplexity for good vs bad,
   and 5-fold cross-validated keep rates at a threshold chosen on the training folds
   only (the highest perplexity that keeps 85% of the good training pages), and scoring
   speed (docs/s, tokens/s) on this CPU.

Skips with a message when the shared data is absent. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARED = ROOT.parent / "shared" / "data"
REFERENCE = SHARED / "web_openwebtext_1k.jsonl"
LABELLED = SHARED / "web_dclm_quality_labels_train.jsonl"
GOOD_KEEP = 0.85  # the target for the good pages


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, cwd=ROOT, check=True)


def build_model(work: Path, steps: int) -> Path:
    prep = work / "prep.yaml"
    prep.write_text(yaml.safe_dump({
        "output": str(work / "ref"), "workers": 2, "seed": 0,
        "sources": [{"name": "owt", "paths": [str(REFERENCE)], "id_field": "id"}],
        "quality": [], "pack": {"seq_len": 256},
        "dataset": {"validation_fraction": 0.05}}))
    train = work / "train.yaml"
    train.write_text(yaml.safe_dump({
        "dataset": str(work / "ref" / "dataset"), "run_dir": str(work / "train"),
        "steps": steps, "micro_batch": 16, "eval_every": steps, "eval_batches": 4,
        "model": {"d_model": 192, "n_layer": 4, "n_head": 6},
        "optim": {"lr": 3e-3}, "schedule": {"kind": "cosine", "warmup_steps": 30},
        "checkpoint": {"every": steps, "keep_last": 1}}))
    ballast = str(Path(sys.executable).with_name("ballast"))
    if not (work / "ref" / "dataset" / "manifest.json").exists():
        run([ballast, "prep", str(prep)])
    if not (work / "hf" / "config.json").exists():
        run([sys.executable, "-m", "training.train", "--config", str(train)])
        run([ballast, "export", "hf", str(work / "train"), str(work / "hf")])
    return work / "hf"


def auc(scores_good: list[float], scores_bad: list[float]) -> float:
    """P(a good page scores above a bad one), ties counted half (Mann-Whitney U)."""
    wins = sum((g > b) + 0.5 * (g == b) for g in scores_good for b in scores_bad)
    return wins / (len(scores_good) * len(scores_bad))


def cross_validate(ppl: list[float], labels: list[int], folds: int = 5,
                   seed: int = 0) -> dict[str, float]:
    """Keep rates on held-out folds, the cut chosen on the other folds only."""
    idx = list(range(len(ppl)))
    random.Random(seed).shuffle(idx)
    kept = {1: 0, 0: 0}
    total = {1: 0, 0: 0}
    for f in range(folds):
        test = set(idx[f::folds])
        good_train = sorted(ppl[i] for i in idx if i not in test and labels[i] == 1)
        cut = good_train[min(len(good_train) - 1, int(GOOD_KEEP * len(good_train)))]
        for i in test:
            total[labels[i]] += 1
            kept[labels[i]] += ppl[i] <= cut
    return {"good_kept": round(kept[1] / total[1], 4), "bad_kept": round(kept[0] / total[0], 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-ppl"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "perplexity.json"))
    args = ap.parse_args()
    if not (REFERENCE.exists() and LABELLED.exists()):
        print(f"skipped: {SHARED} does not hold the reference and labelled files")
        return 0
    from tasks.quality.perplexity import load, perplexities

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = build_model(work, args.steps)
    build_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in LABELLED.read_text(encoding="utf-8").splitlines()]
    texts, labels = [r["text"] for r in rows], [int(r["label"]) for r in rows]
    load(str(model_dir), "cpu", (model_dir / "config.json").stat().st_mtime)  # not timed
    t0 = time.perf_counter()
    ppl = perplexities(texts, str(model_dir), device="cpu")
    score_s = time.perf_counter() - t0
    _model, tok, _dev = load(str(model_dir), "cpu", (model_dir / "config.json").stat().st_mtime)
    n_tokens = sum(min(len(x), 256) for x in tok(texts, add_special_tokens=False)["input_ids"])
    scores = [float("inf") if p is None else p for p in ppl]
    good = [-s for s, y in zip(scores, labels, strict=True) if y == 1]
    bad = [-s for s, y in zip(scores, labels, strict=True) if y == 0]
    metrics = json.loads(next(iter((work / "train").glob("metrics*.jsonl"))).read_text()
                         .splitlines()[-1]) if list((work / "train").glob("metrics*.jsonl")) \
        else {}
    result = {
        "reference": REFERENCE.name, "labelled": LABELLED.name, "steps": args.steps,
        "model": {"d_model": 192, "n_layer": 4, "context": 256},
        "build_seconds": round(build_s, 1),
        "last_metrics_record": metrics,
        "pages": {"good": len(good), "bad": len(bad)},
        "median_perplexity": {"good": sorted(-g for g in good)[len(good) // 2],
                              "bad": sorted(-b for b in bad)[len(bad) // 2]},
        "auc_good_above_bad": round(auc(good, bad), 4),
        "cv_keep_rates": cross_validate(scores, labels),
        "scoring": {"docs_per_s": round(len(texts) / score_s, 1),
                    "tokens_per_s": round(n_tokens / score_s), "device": "cpu"},
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
