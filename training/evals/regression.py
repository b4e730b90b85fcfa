"""Regression detection on in-loop evaluations: each metric's best value so far, and the
test of a new evaluation against it.

The same items are scored at every evaluation, so the comparison is paired: for each item
the difference between its value at the best step and now (acc: 1/0 per item; bpb: per
document), and the drop is a regression when its mean exceeds k standard errors of those
differences. A paired test sees a real drop far sooner than comparing two means with their
own standard errors (which carry the items' spread twice). Each regression is reported once:
the metric must recover to its best (or set a new one) before it can regress again.

The state (every best value with its per-item values) goes into the checkpoint, so a
resumed run compares against the same best as the uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from training.evals.score import stderr

# Metrics where a lower value is better; the rest are accuracies.
LOWER_IS_BETTER = frozenset({"bpb"})


@dataclass
class Best:
    step: int
    samples_seen: int
    value: float
    per_item: np.ndarray


@dataclass(frozen=True)
class Regression:
    key: str  # "<task>/<metric>"
    best: Best
    value: float
    drop: float  # how much worse (positive), in the metric's units
    stderr: float  # of the paired difference


class RegressionTracker:
    def __init__(self, k: float) -> None:
        self.k = k
        self.best: dict[str, Best] = {}
        self.regressed: set[str] = set()

    def update(
        self, key: str, metric: str, value: float, per_item: np.ndarray, step: int, samples: int
    ) -> Regression | None:
        """Judge `value` (per item: `per_item`) of evaluation `step` against the best so far;
        a new best replaces it. Returns the regression when one starts here."""
        lower = metric in LOWER_IS_BETTER
        best = self.best.get(key)
        if not math.isfinite(value):
            return None
        if best is None or len(best.per_item) != len(per_item):
            self.best[key] = Best(step, samples, value, per_item.copy())
            self.regressed.discard(key)
            return None
        better = value < best.value if lower else value > best.value
        if better:
            self.best[key] = Best(step, samples, value, per_item.copy())
            self.regressed.discard(key)
            return None
        diff = (per_item - best.per_item) if lower else (best.per_item - per_item)
        drop = float(diff.mean())
        se = stderr(diff)
        if not (math.isfinite(se) and se > 0 and drop > self.k * se):
            if drop <= 0:  # back at its best: it may regress again later
                self.regressed.discard(key)
            return None
        if key in self.regressed:
            return None
        self.regressed.add(key)
        return Regression(key, best, value, drop, se)

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": {
                k: {
                    "step": b.step,
                    "samples_seen": b.samples_seen,
                    "value": b.value,
                    "per_item": b.per_item.tolist(),
                }
                for k, b in self.best.items()
            },
            "regressed": sorted(self.regressed),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.best, self.regressed = {}, set()
        if not state:
            return
        for k, b in state["best"].items():
            self.best[k] = Best(
                int(b["step"]),
                int(b["samples_seen"]),
                float(b["value"]),
                np.asarray(b["per_item"], np.float64),
            )
        self.regressed = set(state["regressed"])
