"""The stability recipe's options in the training config: the guards, early stopping, the
EMA of the weights, the gradient-noise-scale controller and resume overrides. Each option
but the guards is a trainer component (training/components/)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    field_validator,
)

from core.config import Strict
from training.config.optim import OptimConfig


class GuardConfig(Strict):
    enabled: bool = Field(
        default=True,
        description=(
            "The stability guards (docs/training.md); false keeps only the skips of "
            "non-finite steps (that check is never off)."
        ),
    )
    loss_z: float = Field(
        default=6.0,
        gt=0,
        description=(
            "A loss spike: the loss's z-score against an EMA of its mean and variance above "
            "this skips the batch."
        ),
    )
    grad_z: float = Field(
        default=6.0, gt=0, description=("A grad-norm spike: the same, judged in log space.")
    )
    ema_beta: float = Field(
        default=0.98, gt=0, lt=1, description=("The EMA's decay for the running statistics.")
    )
    warmup_steps: int = Field(
        default=50, ge=0, description=("No spike calls before the statistics settle.")
    )
    spikes_to_rollback: int = Field(
        default=3,
        ge=1,
        description=(
            "Divergence: this many spikes within `window` steps roll back to the last "
            "checkpoint before the trouble."
        ),
    )
    window: int = Field(default=50, ge=1, description="See spikes_to_rollback.")
    divergence_factor: float = Field(
        default=3.0,
        gt=1,
        description=(
            "Divergence: the loss above this factor x its running mean for "
            "`divergence_steps` steps in a row."
        ),
    )
    divergence_steps: int = Field(default=10, ge=1, description=("See divergence_factor."))
    max_rollbacks: int = Field(
        default=3,
        ge=0,
        description=(
            "Past this many rollbacks the trainer exits with code 3, naming the steps and the "
            "data involved."
        ),
    )
    max_nonfinite_steps: int = Field(
        default=5,
        ge=1,
        description=(
            "This many non-finite steps (loss or grad norm) in a row are a divergence, not a "
            "run of skips: the weights are most likely NaN already, so roll back (or give "
            "up)."
        ),
    )
    rollback_lr_scale: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description=("The learning rate is multiplied by this at each rollback."),
    )


class EarlyStoppingConfig(Strict):
    patience: int = Field(
        ge=1,
        description=(
            "Stop after this many evaluations in a row without a validation loss below the "
            "best so far minus `min_delta` (exit 0, an early_stop event, and final.json's "
            "early_stopping)."
        ),
    )
    min_delta: float = Field(default=0.0, ge=0, description="See patience.")


class EmaConfig(Strict):
    decay: float = Field(
        default=0.999,
        gt=0,
        lt=1,
        description=(
            "ema <- decay * ema + (1 - decay) * weights after every applied optimizer step."
        ),
    )


class NoiseScaleConfig(Strict):
    every: int = Field(
        default=10,
        ge=1,
        description=(
            'The gradient noise scale B_noise (McCandlish et al. 2018, the "simple" '
            "estimator from the first micro-batch's and the whole step's gradient norms) every "
            'this many steps, as a "noise_scale" record; needs accum_steps >= 2.'
        ),
    )
    ema_beta: float = Field(
        default=0.9, ge=0, lt=1, description=("Decay of the EMAs of the estimator's |G|^2 and S.")
    )
    max_accum: int | None = Field(
        default=None,
        ge=2,
        description=(
            "The controller: raise grad accumulation towards target * B_noise / micro_batch "
            '(never lower it), at most to this; a "batch_size" event at each change '
            "(checkpointed). None: estimate only."
        ),
    )
    target: float = Field(
        default=1.0,
        gt=0,
        description=("1: the batch B_noise, McCandlish et al.'s critical-batch estimate."),
    )


class ResumeOverrides(Strict):
    # Applied whenever the trainer loads one of the run's checkpoints (a resume, or a
    # rollback), keeping the step count, the data position and the guards' state; a fresh
    # run uses `optim` as it is. Each change is an event in the metrics log.
    lr: float | None = Field(
        default=None,
        gt=0,
        description=("The new peak lr of the `optim.lr` groups (an lr_override event)."),
    )
    muon_lr: float | None = Field(default=None, gt=0, description=("The same for Muon's matrices."))
    optimizer: str | None = Field(
        default=None,
        description=(
            "Switch to this optimizer (a key of training.optim.OPTIMIZERS, e.g. adamw -> "
            "muon: Muon for 2-D hidden matrices, AdamW for the rest); its state starts fresh "
            "(an optimizer_switch event)."
        ),
    )

    @field_validator("optimizer", mode="before")
    @classmethod
    def _registered(cls, v: Any) -> Any:
        return v if v is None else OptimConfig._registered(v)


# MLflow tracking URI schemes the tracking section accepts: a SQLite file (what works
# offline without a server), an MLflow server, Databricks, or a database MLflow's
# SQLAlchemy store speaks (postgresql+psycopg2://... included).
