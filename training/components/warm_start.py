"""`init_from`: a fresh run (no checkpoint of its own yet) starts from another checkpoint's
weights (shapes checked), with a new optimizer, at step 0 (the reading and checks:
training/warm_start.py). Ignored once the run has a checkpoint of its own."""

from __future__ import annotations

from typing import Any

from training.components.base import Component
from training.config import TrainConfigError
from training.metrics import MetricsLog
from training.warm_start import check_shapes, checkpoint_weights


class WarmStart(Component):
    name = "warm_start"

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        if t.fsdp:
            raise TrainConfigError("init_from: not supported with parallel: fsdp2")
        self.source: str = t.cfg.init_from

    def on_fresh_start(self, log: MetricsLog) -> None:
        t = self.t
        where, weights = checkpoint_weights(self.source)
        check_shapes(weights, t.model.state_dict(), where)
        t.model.load_state_dict(weights)
        for c in t.components:
            c.on_weights_loaded()
        t.record(log, {"event": "init_from", "step": 0, "checkpoint": where})
