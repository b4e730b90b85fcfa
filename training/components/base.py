"""The protocol of a trainer component: one recipe option (EMA, early stopping, the
gradient-noise controller, ...) with its own config, checkpoint state and hooks.

The trainer calls every component at fixed points, in the order of `training.components.
REGISTRY`; a component overrides only the hooks it needs (the defaults do nothing). This is
OLMo-core's callback design (`train/callbacks/`) and torchtitan's `Stateful` state: a new
option is one module plus one config field, not edits across the trainer.

Points, in the order a step meets them:
  accum -> step_begin -> [per micro-batch: forward_context, after_backward] -> after_unscale
  -> host_tensors (joins the step's one device-to-host transfer) -> after_update (only when
  the optimizer step was applied) -> step_end (its value lands in StepResult.extras[name])
  -> after_step (writes its records after the step's train record) -> divergence -> eval_fields /
  after_eval (evaluation steps) -> stopped (ends the loop).
Around checkpoints: state_dict / load_state_dict under `key`, trainer_state (fields of the
checkpoint's "trainer" entry), before_restore / after_restore. At a fresh start:
on_fresh_start; after weights were replaced from outside the optimizer: on_weights_loaded.
At the end: final_fields (final.json) and done_fields (the "done" event).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from training.metrics import MetricsLog
    from training.step import StepResult
    from training.trainer import Trainer


class Component:
    """A recipe option. `name`: how the trainer and StepResult.extras know it; `key`: its
    entry in a checkpoint (None: it keeps no state there). `t`: the trainer it belongs to
    (model, optimizer, config, state, world, device)."""

    name: str = ""
    key: str | None = None

    def __init__(self, t: Trainer) -> None:
        self.t = t

    # -- checkpoint state ------------------------------------------------------------
    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any | None) -> None:
        """`state` is None when the checkpoint predates the option being turned on."""

    def trainer_state(self) -> dict[str, Any]:
        """Fields added to the checkpoint's "trainer" entry."""
        return {}

    def before_restore(self, step: int) -> None:
        """Before checkpoint `step`'s model and optimizer state are loaded."""

    def after_restore(self, st: dict[str, Any]) -> None:
        """After the whole checkpoint `st` is loaded (every component's state included)."""

    # -- start -----------------------------------------------------------------------
    def on_fresh_start(self, log: MetricsLog) -> None:
        """A run with no checkpoint of its own, before its step-0 checkpoint."""

    def on_weights_loaded(self) -> None:
        """The model's weights were replaced outside training (a warm start)."""

    # -- one step --------------------------------------------------------------------
    def accum(self, step: int, accum: int) -> int:
        """The gradient accumulation of this step (the schedule's, or a component's)."""
        return accum

    def step_begin(self, step: int, accum: int) -> None:
        pass

    def forward_context(self, k: int) -> contextlib.AbstractContextManager[Any]:
        """Around micro-batch `k`'s forward pass."""
        return contextlib.nullcontext()

    def after_backward(self, k: int, accum: int) -> None:
        pass

    def after_unscale(self) -> None:
        """The raw gradients, before any clipping."""

    def host_tensors(self) -> list[Tensor]:
        """Device values (1-D float64) to bring back with the step's one host transfer;
        step_end receives them as floats."""
        return []

    def after_update(self) -> None:
        """The optimizer step was applied."""

    def step_end(self, applied: bool, host: list[float], grad_norm: float, accum: int) -> Any:
        """The component's result of this step (None: nothing), in StepResult.extras."""
        return None

    def after_step(self, log: MetricsLog, out: StepResult) -> None:
        """The step was counted; write this component's records."""

    def divergence(self) -> tuple[str, str, int] | None:
        """After after_step: a divergence this component found at this step (trigger,
        description, the first step of the bad window), handled as the guard's own (a
        rollback to a checkpoint before that step, or exit 3 with the budget spent)."""
        return None

    # -- evaluation and the end ------------------------------------------------------
    def eval_fields(self) -> dict[str, Any]:
        """Fields added to the "eval" record."""
        return {}

    def after_eval(self, val: float, log: MetricsLog) -> bool:
        """After the "eval" record; True when the run must stop now."""
        return False

    @property
    def stopped(self) -> bool:
        """True: the loop ends (the component decided the run is over)."""
        return False

    def final_fields(self) -> dict[str, Any]:
        return {}

    def done_fields(self) -> dict[str, Any]:
        return {}
