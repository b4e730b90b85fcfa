"""`stats_every` (and `max_attn_logit`): layer-wise statistics every N steps as a "stats"
record (the measurements: training/stats.py), and an attn_logit_warning event when a layer's
largest attention logit passes `max_attn_logit` (growing logits are an early sign of
divergence; Dehghani et al. 2023). A warning only: the step stands."""

from __future__ import annotations

import contextlib
from typing import Any

from training.components.base import Component
from training.config import TrainConfigError
from training.metrics import MetricsLog
from training.stats import LayerStats


class LayerStatistics(Component):
    name = "layer_stats"  # nothing to checkpoint: each statistics step stands alone

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        if t.fsdp:
            raise TrainConfigError("stats_every: not supported with parallel: fsdp2")
        self.every: int = t.cfg.stats_every
        self.limit: float | None = t.cfg.max_attn_logit
        self.stats: LayerStats | None = None

    def step_begin(self, step: int, accum: int) -> None:
        # The step logged as a multiple of `every`; hooks only during its first
        # micro-batch's forward.
        self.stats = LayerStats(self.t.model) if (step + 1) % self.every == 0 else None

    def forward_context(self, k: int) -> contextlib.AbstractContextManager[Any]:
        if self.stats is not None and k == 0:
            return self.stats.forward_hooks()
        return contextlib.nullcontext()

    def after_unscale(self) -> None:
        if self.stats is not None:
            self.stats.gradients()  # the raw gradients, before any clipping

    def step_end(self, applied: bool, host: list[float], grad_norm: float, accum: int) -> Any:
        return self.stats.result() if self.stats is not None else None

    def after_step(self, log: MetricsLog, out: Any) -> None:
        stats = out.extras.get(self.name)
        if stats is None:
            return
        step = self.t.state.step
        log.write({"kind": "stats", "step": step, **stats})
        logits = stats["attn_logit_max"]
        if self.limit is None or not any(v > self.limit for v in logits):
            return
        layer = max(range(len(logits)), key=lambda i: logits[i])
        self.t.record(
            log,
            {
                "event": "attn_logit_warning",
                "step": step,
                "layer": layer,
                "attn_logit_max": logits[layer],
                "limit": self.limit,
            },
        )
