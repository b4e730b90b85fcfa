"""Trainer components: each recipe option is one module here (see base.py for the hooks).

REGISTRY lists them in the order the trainer builds and calls them; `on(cfg)` says whether
a run's config turns one on. A new option: a module with a Component subclass, a config
field in training/config.py, and one line below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from training.components.base import Component
from training.components.early_stopping import EarlyStopping
from training.components.ema import Ema
from training.components.evals import Evals
from training.components.layer_stats import LayerStatistics
from training.components.noise_scale import NoiseScaleController
from training.components.progress import Progress
from training.components.resume_overrides import ApplyResumeOverrides
from training.components.schedule_change import ScheduleChange
from training.components.warm_start import WarmStart
from training.config import TrainConfig

REGISTRY: list[tuple[type[Component], Callable[[TrainConfig], bool]]] = [
    (WarmStart, lambda cfg: bool(cfg.init_from)),
    (LayerStatistics, lambda cfg: cfg.stats_every is not None),
    # Checkpoint entries are written in this order: ema, early_stopping, noise_scale.
    (Ema, lambda cfg: cfg.ema is not None),
    (EarlyStopping, lambda cfg: cfg.early_stopping is not None),
    (NoiseScaleController, lambda cfg: cfg.noise_scale is not None),
    # After ema (it evaluates with the EMA weights) and before progress.
    (Evals, lambda cfg: cfg.evals is not None),
    (ApplyResumeOverrides, lambda cfg: cfg.resume_overrides is not None),
    (ScheduleChange, lambda cfg: True),
    (Progress, lambda cfg: True),
]


def build(
    t: Any, registry: list[tuple[type[Component], Callable[[TrainConfig], bool]]] | None = None
) -> list[Component]:
    """The components `t.cfg` turns on, built in registry order."""
    return [cls(t) for cls, on in (REGISTRY if registry is None else registry) if on(t.cfg)]


__all__ = ["REGISTRY", "Component", "build"]
