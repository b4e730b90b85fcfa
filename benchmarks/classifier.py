"""Benchmark: how quality methods rank human-labelled web pages. Two subcommands:

    python -m benchmarks.classifier methods [--folds 5] [--skip-perplexity]
                                            [--out benchmarks/results/classifier.json]
    python -m benchmarks.classifier perplexity [--steps 600] [--workdir runs/bench-ppl]
                                               [--out benchmarks/results/perplexity.json]

The labelled pages: ../shared/data/web_dclm_quality_labels_train.jsonl (249 Common Crawl
pages from DCLM's annotations, 1 good, 0 bad). Target (issue 14): good kept >= 85%, bad
kept <= 15%.

`methods`: how well each quality method separates the good and bad pages, as
cross-validated keep rates on pages the method never saw. The same 5 folds
(`cross_validate`'s: seed 0, every 5th page of a shuffle) for every method; a method's
threshold is chosen on the training folds only, to keep 85% of the good training pages:
- heuristics: the default rule chain (DEFAULT_RULES), fixed published thresholds;
- classifier (text, text+stats): `train_model` on the training folds (its threshold from
  inner out-of-fold scores), applied to the held-out fold through the `classifier` rule;
- perplexity: the `perplexity` subcommand's small reference model and its cross_validate;
- heuristics -> classifier: both rules in one chain (what a config with both does);
- classifier + OpenWebText as good: the 1,000 shared OpenWebText pages added to every
  fold's training set as good pages (reference data as positives, as DCLM trains on
  OH-2.5 + ELI5); the threshold from the labelled training pages only;
- classifier + perplexity: the mean of the two scores' percentile ranks among the training
  pages (classifier scores out-of-fold), cut at 85% of the good training pages.

`perplexity`: the `perplexity` rule's "small reference model", made by Ballast end to end,
and how its score ranks the labelled pages.
1. Reference data: OpenWebText (../shared/data/web_openwebtext_1k.jsonl; the pages Reddit
   users linked to, the reference GPT-3's quality filter used), through `ballast prep`
   (exact + near dedup, byte tokens, packing to 256; no quality rules: the reference is what
   "good" means here).
2. A small byte-level model (the default tokenizer; d_model 192, 4 layers) trained on it
   by Ballast's trainer on CPU, then
   `ballast export hf`.
3. The labelled pages scored by the rule's function; reported: ROC AUC of -perplexity for
   good vs bad, and 5-fold cross-validated keep rates at a threshold chosen on the training
   folds only (the highest perplexity that keeps 85% of the good training pages), and
   scoring speed (docs/s, tokens/s) on this CPU.

Skips with a message when the shared data is absent. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from bisect import bisect_left, bisect_right
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import RESULTS, ROOT, SHARED, has_dataset, write_json
from dataprep.quality import DEFAULT_RULES, filter_documents, parse_rules
from dataprep.quality.train_classifier import (
    ClassifierTrainConfig,
    choose_threshold,
    fit,
    out_of_fold_scores,
    scores,
    train_model,
)

REFERENCE = SHARED / "web_openwebtext_1k.jsonl"
LABELLED = SHARED / "web_dclm_quality_labels_train.jsonl"
GOOD_KEEP = 0.85  # the target for the good pages
# 1,000 pages of OpenWebText (outbound Reddit links with 3+ karma: GPT-2's quality proxy).
OWT = LABELLED.parent / "web_openwebtext_1k.jsonl"


# ---- the reference model and the shared measures ---------------------------------------
def run(cmd: list[str]) -> None:
    subprocess.run(cmd, cwd=ROOT, check=True)


def build_model(work: Path, steps: int) -> Path:
    prep = work / "prep.yaml"
    prep.write_text(
        yaml.safe_dump(
            {
                "output": str(work / "ref"),
                "workers": 2,
                "seed": 0,
                "sources": [{"name": "owt", "paths": [str(REFERENCE)], "id_field": "id"}],
                "quality": [],
                "pack": {"seq_len": 256},
                "dataset": {"validation_fraction": 0.05},
            }
        )
    )
    train = work / "train.yaml"
    train.write_text(
        yaml.safe_dump(
            {
                "dataset": str(work / "ref" / "dataset"),
                "run_dir": str(work / "train"),
                "steps": steps,
                "micro_batch": 16,
                "eval_every": steps,
                "eval_batches": 4,
                "model": {"d_model": 192, "n_layer": 4, "n_head": 6},
                "optim": {"lr": 3e-3},
                "schedule": {"kind": "cosine", "warmup_steps": 30},
                "checkpoint": {"every": steps, "keep_last": 1},
            }
        )
    )
    ballast = str(Path(sys.executable).with_name("ballast"))
    if not has_dataset(work / "ref" / "dataset"):
        run([ballast, "prep", str(prep)])
    if not (work / "hf" / "config.json").exists():
        run([sys.executable, "-m", "training.train", "--config", str(train)])
        run([ballast, "export", "hf", str(work / "train"), str(work / "hf")])
    return work / "hf"


def auc(scores_good: list[float], scores_bad: list[float]) -> float:
    """P(a good page scores above a bad one), ties counted half (Mann-Whitney U)."""
    wins = sum((g > b) + 0.5 * (g == b) for g in scores_good for b in scores_bad)
    return wins / (len(scores_good) * len(scores_bad))


def cross_validate(
    ppl: list[float], labels: list[int], folds: int = 5, seed: int = 0
) -> dict[str, float]:
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


# ---- methods ---------------------------------------------------------------------------
def folds_of(n: int, folds: int, seed: int = 0) -> list[list[int]]:
    """cross_validate's folds."""
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    return [idx[f::folds] for f in range(folds)]


def rates(kept: list[bool], labels: list[int]) -> dict[str, float]:
    good = [k for k, y in zip(kept, labels, strict=True) if y == 1]
    bad = [k for k, y in zip(kept, labels, strict=True) if y == 0]
    return {"good_kept": round(sum(good) / len(good), 4), "bad_kept": round(sum(bad) / len(bad), 4)}


def heuristics(texts: list[str]) -> list[bool]:
    rules = parse_rules(list(DEFAULT_RULES))
    return [o.reason is None for o in filter_documents(rules, texts, [None] * len(texts))]


def percentile(ref: list[float], x: float) -> float:
    """Mid-rank of x among the sorted reference values, in [0, 1]."""
    return (bisect_left(ref, x) + bisect_right(ref, x)) / (2 * len(ref))


def classifier_cv(
    texts: list[str],
    labels: list[int],
    folds: list[list[int]],
    cfg: ClassifierTrainConfig,
    work: Path,
    chain_keep: list[bool],
    extra_good: list[str] | None = None,
) -> dict[str, Any]:
    """Held-out scores and keep decisions of the `classifier` rule, fold by fold, plus the
    out-of-fold training scores each fold's threshold came from (for the combination).
    `extra_good`: reference pages added to every fold's training set as good (DCLM trains
    on reference data as positives); the threshold still comes from the labelled training
    pages' out-of-fold scores only."""
    n = len(texts)
    kept = [False] * n
    chained = [False] * n
    held_scores = [0.0] * n
    train_oof: list[dict[int, float]] = []
    thresholds = []
    for fold in folds:
        held = set(fold)
        tr = [i for i in range(n) if i not in held]
        if extra_good:
            tt = [texts[i] for i in tr] + extra_good
            tl = [labels[i] for i in tr] + [1] * len(extra_good)
            oof = out_of_fold_scores(tt, tl, cfg)[: len(tr)]
            threshold = choose_threshold(oof, [labels[i] for i in tr], cfg.keep_good)
            model, spec = fit(tt, tl, cfg)
        else:
            model, spec, threshold, oof = train_model(
                [texts[i] for i in tr], [labels[i] for i in tr], cfg
            )
        thresholds.append(round(threshold, 4))
        train_oof.append(dict(zip(tr, oof, strict=True)))
        path = work / "fold.bin"
        model.save_model(str(path))
        (work / "fold.report.json").write_text(
            json.dumps({"threshold": threshold, "features": spec})
        )
        # Through the rule, as a pipeline applies it; the rule reads the fold's report.
        rule = parse_rules([{"classifier": {"model": str(path)}}])
        for i, o in zip(
            fold, filter_documents(rule, [texts[i] for i in fold], [None] * len(fold)), strict=True
        ):
            kept[i] = o.reason is None
            chained[i] = kept[i] and chain_keep[i]
        for i, s in zip(fold, scores(model, spec, [texts[i] for i in fold]), strict=True):
            held_scores[i] = s
    return {
        "kept": kept,
        "chained": chained,
        "scores": held_scores,
        "train_oof": train_oof,
        "thresholds": thresholds,
    }


def combined(
    labels: list[int], folds: list[list[int]], clf: dict[str, Any], ppl: list[float]
) -> list[bool]:
    kept = [False] * len(labels)
    for fold, oof in zip(folds, clf["train_oof"], strict=True):
        tr = sorted(oof)
        ref_c = sorted(oof[i] for i in tr)
        ref_p = sorted(-ppl[i] for i in tr)

        def score(
            i: int, c: float, ref_c: list[float] = ref_c, ref_p: list[float] = ref_p
        ) -> float:
            return (percentile(ref_c, c) + percentile(ref_p, -ppl[i])) / 2

        cut = choose_threshold([score(i, oof[i]) for i in tr], [labels[i] for i in tr], GOOD_KEEP)
        for i in fold:
            kept[i] = score(i, clf["scores"][i]) >= cut
    return kept


def methods_bench(args: argparse.Namespace) -> int:
    if not LABELLED.exists():
        print(f"skipped: {LABELLED} is absent")
        return 0
    rows = [json.loads(line) for line in LABELLED.read_text(encoding="utf-8").splitlines()]
    texts, labels = [r["text"] for r in rows], [int(r["label"]) for r in rows]
    folds = folds_of(len(texts), args.folds)
    methods: dict[str, Any] = {}
    t0 = time.perf_counter()
    chain = heuristics(texts)
    methods["heuristics"] = rates(chain, labels) | {
        "rules": list(DEFAULT_RULES),
        "note": "fixed published thresholds, no training",
        "seconds": round(time.perf_counter() - t0, 2),
    }
    clf: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ballast-clf-") as work:
        for features in ("text", "text+stats"):
            cfg = ClassifierTrainConfig(features=features)
            t0 = time.perf_counter()
            clf[features] = r = classifier_cv(texts, labels, folds, cfg, Path(work), chain)
            good = [s for s, y in zip(r["scores"], labels, strict=True) if y == 1]
            bad = [s for s, y in zip(r["scores"], labels, strict=True) if y == 0]
            methods[f"classifier[{features}]"] = rates(r["kept"], labels) | {
                "auc_good_above_bad": round(auc(good, bad), 4),
                "fold_thresholds": r["thresholds"],
                "config": {
                    k: getattr(cfg, k)
                    for k in ("features", "word_ngrams", "epoch", "lr", "dim", "folds", "keep_good")
                },
                "seconds": round(time.perf_counter() - t0, 1),
            }
            methods[f"heuristics -> classifier[{features}]"] = rates(r["chained"], labels)
        if OWT.is_file():  # reference pages as extra positives
            owt = [json.loads(line)["text"] for line in OWT.read_text().splitlines()]
            cfg = ClassifierTrainConfig(features="text+stats")
            t0 = time.perf_counter()
            r = classifier_cv(texts, labels, folds, cfg, Path(work), chain, extra_good=owt)
            good = [s for s, y in zip(r["scores"], labels, strict=True) if y == 1]
            bad = [s for s, y in zip(r["scores"], labels, strict=True) if y == 0]
            methods["classifier[text+stats] + OpenWebText as good"] = rates(r["kept"], labels) | {
                "auc_good_above_bad": round(auc(good, bad), 4),
                "extra_good_pages": len(owt),
                "fold_thresholds": r["thresholds"],
                "seconds": round(time.perf_counter() - t0, 1),
            }
    if not args.skip_perplexity:
        from dataprep.quality.perplexity import perplexities

        model_dir = build_model(Path(args.workdir), args.steps)
        ppl = [
            float("inf") if p is None else p
            for p in perplexities(texts, str(model_dir), device="cpu")
        ]
        good = [-s for s, y in zip(ppl, labels, strict=True) if y == 1]
        bad = [-s for s, y in zip(ppl, labels, strict=True) if y == 0]
        methods["perplexity"] = cross_validate(ppl, labels, args.folds) | {
            "auc_good_above_bad": round(auc(good, bad), 4),
            "model": str(model_dir),
        }
        for features in ("text", "text+stats"):
            methods[f"classifier[{features}] + perplexity"] = rates(
                combined(labels, folds, clf[features], ppl), labels
            )
    result = {
        "labelled": LABELLED.name,
        "pages": {"good": labels.count(1), "bad": labels.count(0)},
        "folds": args.folds,
        "target": {"good_kept_min": GOOD_KEEP, "bad_kept_max": 0.15},
        "methods": methods,
    }
    for name, m in methods.items():
        print(
            f"{name:42s} good kept {m['good_kept']:6.1%}   bad kept {m['bad_kept']:6.1%}"
            + (f"   AUC {m['auc_good_above_bad']:.3f}" if "auc_good_above_bad" in m else "")
        )
    out = write_json(args.out, result)
    print(f"wrote {out}")
    return 0


# ---- perplexity ------------------------------------------------------------------------
def perplexity_bench(args: argparse.Namespace) -> int:
    if not (REFERENCE.exists() and LABELLED.exists()):
        print(f"skipped: {SHARED} does not hold the reference and labelled files")
        return 0
    from dataprep.quality.perplexity import load, perplexities

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
    metrics = (
        json.loads(next(iter((work / "train").glob("metrics*.jsonl"))).read_text().splitlines()[-1])
        if list((work / "train").glob("metrics*.jsonl"))
        else {}
    )
    result = {
        "reference": REFERENCE.name,
        "labelled": LABELLED.name,
        "steps": args.steps,
        "model": {"d_model": 192, "n_layer": 4, "context": 256},
        "build_seconds": round(build_s, 1),
        "last_metrics_record": metrics,
        "pages": {"good": len(good), "bad": len(bad)},
        "median_perplexity": {
            "good": sorted(-g for g in good)[len(good) // 2],
            "bad": sorted(-b for b in bad)[len(bad) // 2],
        },
        "auc_good_above_bad": round(auc(good, bad), 4),
        "cv_keep_rates": cross_validate(scores, labels),
        "scoring": {
            "docs_per_s": round(len(texts) / score_s, 1),
            "tokens_per_s": round(n_tokens / score_s),
            "device": "cpu",
        },
    }
    print(json.dumps(result, indent=2))
    out = write_json(args.out, result)
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("methods", help="cross-validated keep rates of every quality method")
    m.add_argument("--folds", type=int, default=5)
    m.add_argument("--steps", type=int, default=600, help="perplexity model's training steps")
    m.add_argument("--workdir", default=str(ROOT / "runs" / "bench-ppl"))
    m.add_argument(
        "--skip-perplexity",
        action="store_true",
        help="leave out the methods that need the reference model (~6 min on CPU)",
    )
    m.add_argument("--out", default=str(RESULTS / "classifier.json"))
    p = sub.add_parser("perplexity", help="the perplexity rule's reference model, made here")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench-ppl"))
    p.add_argument("--out", default=str(RESULTS / "perplexity.json"))
    args = ap.parse_args()
    return (methods_bench if args.cmd == "methods" else perplexity_bench)(args)


if __name__ == "__main__":
    sys.exit(main())
