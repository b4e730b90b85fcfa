"""`classifier`: score each document with a fastText quality classifier, record the score
in the kept document's metadata (`quality_score`), and drop documents scoring under
`threshold`.

This is DCLM's model-based filter (mlfoundations/dclm, baselines/mappers/enrichers/
quality_prediction_enrichers_calc_fasttext.py + the `quality_filter` step of
baselines_configs/fasttext_filter.yaml): the score is the probability of the "high
quality" label (`__label__hq`, DCLM's label) and a document is kept when it is at least
the threshold. Models come from `ballast quality train` (dataprep/quality/train_classifier.py),
which writes MODEL.report.json next to the .bin with the threshold it chose on held-out
data and the features it was trained on; any other fastText binary (DCLM's published
openhermes_reddit_eli5_vs_rw_v2_bigram_200k_train.bin, for one) works too, read with
DCLM's preprocessing (the document's lines joined by spaces), and then needs `threshold`
(DCLM's example config uses 0.018112 for theirs: a threshold belongs to one model).

Features of a Ballast model: the text lowercased and split into words and punctuation
(one line, as fastText reads), optionally followed by one token per heuristic statistic
(`__stat_<name>_b<bucket>`, the bucket from quantile edges of the training pages): the
same quantities the Gopher / C4 / FineWeb rules threshold, so the classifier can weigh
them instead of applying fixed cuts.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from dataprep.quality.base import Drop, Fraction, Rule, RuleParams, Verdict
from dataprep.quality.gopher import STOP_WORDS
from dataprep.quality.text import Doc

_LABEL = "__label__"
GOOD, BAD = "hq", "cc"  # DCLM's labels: high quality vs Common Crawl
_TOKEN = re.compile(r"\w+|[^\w\s]")
_STOP = frozenset(STOP_WORDS)
_END_PUNCT = (".", "!", "?", '"', "”", "'", "’")


def report_path(model: str | Path) -> Path:
    """Where `ballast quality train` writes a model's validation report."""
    return Path(model).with_suffix(".report.json")


def statistics(text: str) -> dict[str, float]:
    """The heuristic rules' statistics of one document, all of them, with no early exit
    (a rule stops at its first failing check): Gopher quality (words, mean word length,
    alphabetic words, stop words, ellipses), Gopher repetition (duplicate lines), C4 /
    FineWeb line statistics (lines ending in punctuation, short lines), and the character
    mix (capitals, digits)."""
    doc = Doc(text)
    words = doc.words
    content = [w for w in words if w[-1].isalnum()]
    lines = [s for s in doc.lines if s.strip()]
    n_words, n_lines, n_chars = len(words) or 1, len(lines) or 1, len(text) or 1
    ended = [s for s in lines if s.rstrip().endswith(_END_PUNCT)]
    return {
        "chars": math.log1p(len(text)),
        "words": math.log1p(len(content)),
        "lines": math.log1p(len(lines)),
        "words_per_line": len(content) / n_lines,
        "mean_word_length": sum(map(len, content)) / (len(content) or 1),
        "alpha_words_ratio": sum(1 for w in words if any(c.isalpha() for c in w)) / n_words,
        "stop_words_ratio": sum(1 for w in words if w in _STOP) / n_words,
        "ellipsis_ratio": (text.count("...") + text.count("…")) / n_words,
        "dup_line_frac": 1 - len(set(lines)) / n_lines,
        "line_punct_ratio": len(ended) / n_lines,
        "punct_line_chars_ratio": sum(map(len, ended)) / n_chars,
        "short_line_ratio": sum(1 for s in lines if len(s.split()) < 5) / n_lines,
        "bar_line_ratio": sum(1 for s in lines if s.lstrip().startswith("|")) / n_lines,
        "capitalised_words_ratio": sum(1 for w in content if w[0].isupper()) / (len(content) or 1),
        "upper_chars_ratio": sum(1 for c in text if c.isupper()) / n_chars,
        "digit_chars_ratio": sum(1 for c in text if c.isdigit()) / n_chars,
        "sentences": math.log1p(len(re.findall(r"[.!?][\s\"”]", text))),
    }


def stat_tokens(stats: Mapping[str, float], edges: Mapping[str, Sequence[float]]) -> str:
    return " ".join(f"__stat_{k}_b{bisect_right(e, stats[k])}" for k, e in edges.items())


def fasttext_line(text: str, spec: Mapping[str, Any] | None = None) -> str:
    """The one line fastText reads for `text`. `spec` is a Ballast report's `features`
    entry; None is a model from elsewhere, read as DCLM reads its own."""
    if spec is None:
        return " ".join(text.strip().splitlines())
    line = " ".join(_TOKEN.findall(text.lower()))
    edges = spec.get("stat_edges")
    if edges:
        line = f"{line} {stat_tokens(statistics(text), edges)}"
    return line


def probability(model: Any, line: str, label: str = GOOD) -> float:
    """P(`label`) under `model` for one fastText line (0 when the model lacks the label)."""
    try:
        labels, probs = model.predict(line, k=-1)
    except (TypeError, UnicodeError):  # a lone surrogate cannot cross into C++ as UTF-8
        labels, probs = model.predict(line.encode("utf-8", "replace").decode(), k=-1)
    want = _LABEL + label
    for lab, p in zip(labels, probs, strict=True):
        if lab == want:
            return min(1.0, max(0.0, float(p)))  # fastText adds 1e-5 before the softmax cap
    return 0.0


@lru_cache(maxsize=4)
def load(path: str, stamp: float) -> Any:
    """The fastText model at `path`, once per process and file version (`stamp`: mtime)."""
    del stamp
    import fasttext  # imported here so config parsing stays light

    return fasttext.load_model(path)


def _report(path: str) -> dict[str, Any] | None:
    rp = report_path(path)
    if not rp.is_file():
        return None
    try:
        data = json.loads(rp.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{rp}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else None


# The first int32 of every fastText .bin (fastText's FASTTEXT_FILEFORMAT_MAGIC_INT32).
FASTTEXT_MAGIC = 793712314


class ClassifierParams(RuleParams):
    model: str = Field(
        min_length=1,
        description=(
            "A fastText .bin: `ballast quality train` output, or any supervised fastText "
            "model such as DCLM's published one (read with DCLM's preprocessing)."
        ),
    )
    threshold: Fraction | None = Field(
        default=None,
        description=(
            "Keep documents scoring at least this; None takes the threshold the training run "
            "chose (MODEL.report.json), required for a model without one. There is no "
            "universal default: a threshold belongs to a model."
        ),
    )
    label: str = Field(
        default=GOOD,
        min_length=1,
        description=('The "good" label whose probability is the score (DCLM\'s `hq`).'),
    )
    key: str = Field(
        default="quality_score",
        min_length=1,
        description=("The metadata field the score is written to."),
    )

    @field_validator("model")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not Path(v).is_file():
            raise ValueError(
                f"{v}: no such model file (train one with `ballast quality "
                "train`, or give a fastText .bin)"
            )
        # fastText's own header check, without loading a model that may be gigabytes.
        with open(v, "rb") as f:
            head = f.read(4)
        if len(head) < 4 or struct.unpack("<i", head)[0] != FASTTEXT_MAGIC:
            raise ValueError(
                f"{v}: not a fastText model (a .bin written by fastText, e.g. "
                "`ballast quality train`)"
            )
        return v

    @model_validator(mode="after")
    def _threshold_known(self) -> ClassifierParams:
        if self.threshold is None:
            report = _report(self.model)
            t = report.get("threshold") if report else None
            if not isinstance(t, int | float):
                raise ValueError(
                    f"threshold: required for {self.model} (no "
                    f"{report_path(self.model).name} with a chosen threshold)"
                )
        return self


class Classifier(Rule[ClassifierParams]):
    """Records `quality_score` (4 decimals; `key`) in `doc.annotations`; drops with
    `classifier:below_threshold` under the threshold."""

    name = "classifier"
    Params = ClassifierParams

    def setup(self) -> None:
        report = _report(self.params.model) or {}
        t = self.params.threshold
        # Params checked that a missing threshold is in the report.
        self.threshold: float = float(t if t is not None else report["threshold"])
        self._spec: dict[str, Any] | None = report.get("features")

    def score(self, text: str) -> float:
        path = self.params.model
        model = load(path, os.stat(path).st_mtime)
        return probability(model, fasttext_line(text, self._spec), self.params.label)

    def apply(self, doc: Doc) -> Verdict:
        s = self.score(doc.text)
        doc.annotations[self.params.key] = round(s, 4)
        doc.stats["classifier.score"] = s  # the dataset's provenance keeps it (blame)
        if s < self.threshold:
            # Six significant digits: a score just under the threshold must read as under.
            return Drop("below_threshold", f"score={s:.6g} < {self.threshold:.6g}")
        return None
