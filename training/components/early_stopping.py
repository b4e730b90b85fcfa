"""`early_stopping`: stop when the validation loss has not improved by `min_delta` for
`patience` evaluations. The stopping step is checkpointed (final.json names it) and a
relaunch of the stopped run resumes there and ends at once, unless it brings more patience."""

from __future__ import annotations

import math
from typing import Any

from training.components.base import Component
from training.metrics import MetricsLog


class EarlyStopping(Component):
    name = key = "early_stopping"

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        assert t.cfg.early_stopping is not None
        self.cfg = t.cfg.early_stopping
        # The best loss so far, the step it was seen at, evaluations since without an
        # improvement, and whether the run has stopped.
        self.early: dict[str, Any] = {"best": None, "best_step": None, "bad": 0, "stopped": False}

    def state_dict(self) -> Any:
        return dict(self.early)

    def load_state_dict(self, state: Any | None) -> None:
        if state is None:  # rewound on a rollback too
            return
        self.early = dict(state)
        # Judged by this config's patience: relaunched with more, a stopped run goes on.
        self.early["stopped"] = self.early["bad"] >= self.cfg.patience

    def after_eval(self, val: float, log: MetricsLog) -> bool:
        """Count this evaluation; True when the run must stop now."""
        e = self.early
        if not math.isfinite(val):
            return False
        if e["best"] is None or val < e["best"] - self.cfg.min_delta:
            e.update(best=val, best_step=self.t.state.step, bad=0)
            return False
        e["bad"] += 1
        e["stopped"] = e["bad"] >= self.cfg.patience
        if e["stopped"]:
            self.t.record(
                log,
                {
                    "event": "early_stop",
                    "step": self.t.state.step,
                    "val_loss": val,
                    **self.summary(),
                },
            )
        return e["stopped"]

    @property
    def stopped(self) -> bool:
        return bool(self.early["stopped"])

    def summary(self) -> dict[str, Any]:
        return {
            "reason": "early_stopping",
            "best_val_loss": self.early["best"],
            "best_step": self.early["best_step"],
            "patience": self.cfg.patience,
            "min_delta": self.cfg.min_delta,
        }

    def final_fields(self) -> dict[str, Any]:
        return {"early_stopping": self.summary()} if self.stopped else {}

    def done_fields(self) -> dict[str, Any]:
        return {"reason": "early_stopping"} if self.stopped else {}
