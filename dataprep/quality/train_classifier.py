"""Train the `classifier` rule's model on your own labels (`ballast quality train`): a
fastText supervised classifier, good pages `__label__hq` and bad `__label__cc` as in
DCLM, a threshold chosen without looking at the held-out pages, and a validation report.

Procedure (seeded, deterministic: one training thread):
1. A stratified held-out split (`holdout`, 20%) is set aside.
2. On the rest, `folds`-fold cross-validation gives every training page a score from a
   model that did not see it; the threshold is the highest score that keeps at least
   `keep_good` (85%) of those good pages. Keeping a stated share of the good data is what
   a data filter promises; maximising F1 would trade good pages for bad ones at a ratio
   the user never chose. Training-set scores are useless for this: fastText fits 200
   pages almost perfectly.
3. The model is trained on the whole training split and saved; its precision, recall and
   keep rates at that threshold on the held-out split go into MODEL.report.json, with the
   feature spec the rule needs (stat bucket edges), counts, seed and hyperparameters.

Hyperparameters: word bigrams (`word_ngrams` 2) as DCLM's published classifier
(openhermes_reddit_eli5_vs_rw_v2_bigram_200k_train.bin); `epoch` 25 and a higher `lr` than
DCLM's 5 / 0.1 (baselines/train_fasttext_classifier.py, tuned for 400k pages) because a
few hundred pages need more passes: fastText's supervised tutorial uses epoch 25 with
bigrams; 0.5 measured best here (benchmarks/classifier.py). `dim` 100 and `min_count` 1
are DCLM's defaults; `bucket` 200k instead of fastText's 2M keeps a small model small.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dataprep.quality.classifier import (
    BAD,
    GOOD,
    fasttext_line,
    probability,
    report_path,
    statistics,
)

_QUANTILES = tuple(i / 10 for i in range(1, 10))  # deciles: ten buckets per statistic


class TrainError(ValueError):
    """Bad training input (a file, a field, too few pages); one line naming it."""


@dataclass(frozen=True)
class ClassifierTrainConfig:
    features: Literal["text", "text+stats"] = "text+stats"
    word_ngrams: int = 2
    epoch: int = 25
    lr: float = 0.5
    dim: int = 100
    min_count: int = 1
    bucket: int = 200_000
    holdout: float = 0.2
    folds: int = 5
    keep_good: float = 0.85
    seed: int = 0
    threads: int = 1  # more is faster but not reproducible (fastText's Hogwild updates)


# ---------------------------------------------------------------- reading labelled pages


def _open(path: Path) -> Any:
    return (
        gzip.open(path, "rt", encoding="utf-8")
        if path.suffix == ".gz"
        else path.open(encoding="utf-8")
    )


def read_jsonl(path: str | Path, text_field: str = "text") -> list[dict[str, Any]]:
    """The records of a JSONL(.gz) file that hold a string `text_field`."""
    p = Path(path)
    if not p.is_file():
        raise TrainError(f"{p}: no such file")
    rows = []
    with _open(p) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise TrainError(f"{p}:{n}: not a JSON object") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise TrainError(f"{p}:{n}: no string field {text_field!r}")
            rows.append(row)
    return rows


def _label(value: Any, where: str, field: str) -> int:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return int(value)
    if value in ("0", "1"):
        return int(value)
    raise TrainError(f"{where}: field {field!r} must be 1 (good) or 0 (bad), got {value!r:.40}")


def load_examples(
    positive: Sequence[str] = (),
    negative: Sequence[str] = (),
    labelled: Sequence[str] = (),
    label_field: str = "label",
    text_field: str = "text",
) -> tuple[list[str], list[int]]:
    """Texts and labels (1 good, 0 bad) from good files, bad files and labelled files."""
    texts, labels, _ = load_calibrated(positive, negative, labelled, label_field, text_field)
    return texts, labels


def load_calibrated(
    positive: Sequence[str] = (),
    negative: Sequence[str] = (),
    labelled: Sequence[str] = (),
    label_field: str = "label",
    text_field: str = "text",
) -> tuple[list[str], list[int], list[bool] | None]:
    """load_examples, and which pages calibrate the threshold: with labelled files beside
    good or bad files, only the labelled pages (the extra pages, e.g. reference text as
    positives in DCLM's manner, are a different distribution: a threshold that keeps 85% of
    them kept 62.5% of unseen labelled good pages); otherwise None, every page."""
    texts: list[str] = []
    labels: list[int] = []
    for paths, y in ((positive, 1), (negative, 0)):
        for path in paths:
            for row in read_jsonl(path, text_field):
                texts.append(row[text_field])
                labels.append(y)
    n_labelled = 0
    for path in labelled:
        for n, row in enumerate(read_jsonl(path, text_field), 1):
            n_labelled += 1
            if label_field not in row:
                raise TrainError(f"{path}: record {n} has no field {label_field!r}")
            texts.append(row[text_field])
            labels.append(_label(row[label_field], f"{path}: record {n}", label_field))
    for y, name in ((1, "good"), (0, "bad")):
        if labels.count(y) < 2:
            raise TrainError(f"need at least 2 {name} pages (got {labels.count(y)})")
    extra = len(texts) - n_labelled
    calibrate = [False] * extra + [True] * n_labelled if extra and n_labelled else None
    return texts, labels, calibrate


# ---------------------------------------------------------------- training and scoring


def feature_spec(texts: Sequence[str], cfg: ClassifierTrainConfig) -> dict[str, Any]:
    """What fasttext_line needs to turn a text into the model's input: the normalisation,
    and for `text+stats` the decile edges of each statistic over the training pages."""
    spec: dict[str, Any] = {
        "kind": cfg.features,
        "normalise": "lowercase, words and punctuation split, one line",
    }
    if cfg.features == "text+stats":
        stats = [statistics(t) for t in texts]
        spec["stat_edges"] = {k: _quantiles(sorted(s[k] for s in stats)) for k in stats[0]}
    return spec


def _quantiles(xs: list[float]) -> list[float]:
    edges = []
    for q in _QUANTILES:
        e = round(xs[min(len(xs) - 1, int(q * len(xs)))], 6)
        if not edges or e > edges[-1]:  # equal edges would be empty buckets
            edges.append(e)
    return edges


def fit(
    texts: Sequence[str],
    labels: Sequence[int],
    cfg: ClassifierTrainConfig,
    spec: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """(fastText model, feature spec) trained on the pages given."""
    import fasttext

    spec = spec if spec is not None else feature_spec(texts, cfg)
    # Shuffled: fastText's SGD sees lines in file order, and all-good-then-all-bad would
    # end every epoch on one class.
    order = list(range(len(texts)))
    random.Random(cfg.seed).shuffle(order)
    fd, tmp = tempfile.mkstemp(suffix=".txt", prefix="ballast-ft-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for i in order:
                line = fasttext_line(texts[i], spec)
                f.write(f"__label__{GOOD if labels[i] else BAD} {line}\n")
        model = fasttext.train_supervised(
            input=tmp,
            wordNgrams=cfg.word_ngrams,
            epoch=cfg.epoch,
            lr=cfg.lr,
            dim=cfg.dim,
            minCount=cfg.min_count,
            bucket=cfg.bucket,
            thread=cfg.threads,
            seed=cfg.seed,
            verbose=0,
        )
    finally:
        os.unlink(tmp)
    return model, spec


def scores(model: Any, spec: dict[str, Any], texts: Sequence[str]) -> list[float]:
    return [probability(model, fasttext_line(t, spec)) for t in texts]


def stratified_folds(labels: Sequence[int], k: int, seed: int) -> list[list[int]]:
    """`k` disjoint index lists, each with about 1/k of the good and of the bad pages."""
    folds: list[list[int]] = [[] for _ in range(k)]
    for y in (1, 0):
        idx = [i for i, v in enumerate(labels) if v == y]
        random.Random(seed * 2 + y).shuffle(idx)
        for j, i in enumerate(idx):
            folds[j % k].append(i)
    return [sorted(f) for f in folds]


def _stratified_among(
    labels: Sequence[int], k: int, seed: int, calibrate: Sequence[bool] | None
) -> list[list[int]]:
    """stratified_folds over the calibration pages only (all pages when None), as indices
    of `labels`."""
    if calibrate is None:
        return stratified_folds(labels, k, seed)
    cal = [i for i, c in enumerate(calibrate) if c]
    return [[cal[j] for j in f] for f in stratified_folds([labels[i] for i in cal], k, seed)]


def out_of_fold_scores(
    texts: Sequence[str],
    labels: Sequence[int],
    cfg: ClassifierTrainConfig,
    calibrate: Sequence[bool] | None = None,
) -> list[float]:
    """Each calibration page's score from a model trained on every page outside its fold
    (extra pages are in every fold's training set; their scores stay 0.0)."""
    out = [0.0] * len(texts)
    for fold in _stratified_among(labels, cfg.folds, cfg.seed, calibrate):
        held = set(fold)
        train = [i for i in range(len(texts)) if i not in held]
        model, spec = fit([texts[i] for i in train], [labels[i] for i in train], cfg)
        for i, s in zip(fold, scores(model, spec, [texts[i] for i in fold]), strict=True):
            out[i] = s
    return out


def choose_threshold(scores_: Sequence[float], labels: Sequence[int], keep_good: float) -> float:
    """The highest threshold (keep score >= t) that keeps at least `keep_good` of the good
    pages."""
    good = sorted(s for s, y in zip(scores_, labels, strict=True) if y == 1)
    drop = math.floor((1 - keep_good) * len(good) + 1e-9)  # good pages we may lose
    return good[min(drop, len(good) - 1)]


def metrics(
    scores_: Sequence[float], labels: Sequence[int], threshold: float
) -> dict[str, float | int]:
    """Precision and recall of "good" at `threshold`, and the keep rates of each class."""
    tp = sum(1 for s, y in zip(scores_, labels, strict=True) if y == 1 and s >= threshold)
    fp = sum(1 for s, y in zip(scores_, labels, strict=True) if y == 0 and s >= threshold)
    n_good = sum(1 for y in labels if y == 1)
    n_bad = len(labels) - n_good
    return {
        "pages": len(labels),
        "good": n_good,
        "bad": n_bad,
        "precision": round(tp / (tp + fp), 4) if tp + fp else 0.0,
        "recall": round(tp / n_good, 4) if n_good else 0.0,
        "good_kept": round(tp / n_good, 4) if n_good else 0.0,
        "bad_kept": round(fp / n_bad, 4) if n_bad else 0.0,
    }


def train_model(
    texts: Sequence[str],
    labels: Sequence[int],
    cfg: ClassifierTrainConfig,
    calibrate: Sequence[bool] | None = None,
) -> tuple[Any, dict[str, Any], float, list[float]]:
    """(model, spec, threshold, out-of-fold scores) from all the pages given: the
    threshold from the calibration pages' out-of-fold scores (`calibrate`, None: all), the
    model from every page."""
    if cfg.folds < 2:
        raise TrainError(f"folds: need at least 2 (got {cfg.folds})")
    oof = out_of_fold_scores(texts, labels, cfg, calibrate)
    cal = [i for i in range(len(texts)) if calibrate is None or calibrate[i]]
    threshold = choose_threshold([oof[i] for i in cal], [labels[i] for i in cal], cfg.keep_good)
    model, spec = fit(texts, labels, cfg)
    return model, spec, threshold, oof


def train(
    texts: Sequence[str],
    labels: Sequence[int],
    out: str | Path,
    cfg: ClassifierTrainConfig | None = None,
    sources: dict[str, Any] | None = None,
    calibrate: Sequence[bool] | None = None,
) -> dict[str, Any]:
    """Train on all but a held-out split, write OUT (.bin) and OUT.report.json, and
    return the report. `calibrate` (see load_calibrated): the pages the held-out split and
    the threshold are drawn from; the others are trained on only."""
    return _train(texts, labels, out, cfg or ClassifierTrainConfig(), sources, calibrate)


def _train(
    texts: Sequence[str],
    labels: Sequence[int],
    out: str | Path,
    cfg: ClassifierTrainConfig,
    sources: dict[str, Any] | None,
    calibrate: Sequence[bool] | None,
) -> dict[str, Any]:
    if not 0 < cfg.holdout < 1:
        raise TrainError(f"holdout: must be between 0 and 1 (got {cfg.holdout})")
    if not 0 < cfg.keep_good <= 1:
        raise TrainError(f"keep_good: must be in (0, 1] (got {cfg.keep_good})")
    out = Path(out)
    if out.suffix != ".bin":
        raise TrainError(f"{out}: the model file must end in .bin")
    k = max(2, round(1 / cfg.holdout))
    held = set(_stratified_among(labels, k, cfg.seed + 1, calibrate)[0])
    tr = [i for i in range(len(texts)) if i not in held]
    ho = sorted(held)
    tr_labels = [labels[i] for i in tr]
    tr_cal = None if calibrate is None else [calibrate[i] for i in tr]
    cal = [j for j in range(len(tr)) if tr_cal is None or tr_cal[j]]
    cal_labels = [tr_labels[j] for j in cal]
    for y, name in ((1, "good"), (0, "bad")):
        if cal_labels.count(y) < cfg.folds:
            raise TrainError(
                f"need at least {cfg.folds} {name} training pages for "
                f"{cfg.folds}-fold threshold choice (got {cal_labels.count(y)})"
            )
    model, spec, threshold, oof = train_model([texts[i] for i in tr], tr_labels, cfg, tr_cal)
    held_scores = scores(model, spec, [texts[i] for i in ho])
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save_model(str(out))
    report = {
        "model": out.name,
        "labels": {"good": f"__label__{GOOD}", "bad": f"__label__{BAD}"},
        "threshold": round(threshold, 6),
        "threshold_rule": f"highest score keeping >= {cfg.keep_good:.0%} of the good "
        f"{'labelled ' if calibrate is not None else ''}training pages, "
        f"on {cfg.folds}-fold out-of-fold scores",
        "training": metrics([oof[j] for j in cal], cal_labels, threshold)
        | {"scores": "out-of-fold"},
        "held_out": metrics(held_scores, [labels[i] for i in ho], threshold),
        "config": asdict(cfg),
        "features": spec,
        "sources": sources or {},
        # Only with extra pages: which pages calibrated the threshold and the held-out
        # figures, so a default report is unchanged.
        **(
            {
                "calibration": {
                    "pages": "labelled",
                    "labelled": sum(calibrate),
                    "extra_trained_on": len(calibrate) - sum(calibrate),
                }
            }
            if calibrate is not None
            else {}
        ),
    }
    report_path(out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
