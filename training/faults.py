"""Hooks the training loop calls at fixed points, and the faults that tests inject through
them. The base `Hooks` does nothing, so a production run pays a few no-op calls per step
and the loop has no fault branches of its own.

Hook points, in the order one step meets them: `before_step` (nothing trained yet),
`lr_factor` (multiplies the scheduled learning rate), `loss` (each micro-batch's loss,
before its backward pass), and `after_save` (rank 0, once a checkpoint is in place).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class Hooks:
    """No-op hooks: what the trainer uses unless a test passes something else."""

    def before_step(self, step: int, rollbacks: list[dict[str, Any]]) -> None:
        """Step `step` is about to run; `rollbacks`: the run's rollback history so far."""

    def lr_factor(self, step: int, rollbacks: list[dict[str, Any]]) -> float:
        return 1.0

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def after_save(self, step: int, root: Path) -> None:
        """Checkpoint `step` is in place under `root` (rank 0; maybe a background thread)."""


@dataclass
class Faults(Hooks):
    """Injected faults, for tests of the guards: NaN loss at steps, loss x factor at
    steps (a spike), and the learning rate x factor over a step range (a real blow-up)."""

    nan_at: set[int] = field(default_factory=set)
    spike_at: set[int] = field(default_factory=set)
    spike_factor: float = 50.0
    lr_blowup: tuple[int, int] | None = None
    lr_blowup_factor: float = 1000.0
    persist: bool = False
    kill_at: set[int] = field(default_factory=set)  # SIGKILL itself (a crash, every time)

    @classmethod
    def parse(cls, specs: list[str]) -> Faults:
        """From the CLI's `--fault` values (subprocess tests)."""
        f = cls()
        for spec in specs:
            kind, _, at = spec.partition("@")
            if kind == "nan":
                f.nan_at |= {int(s) for s in at.split(",")}
            elif kind == "spike":
                f.spike_at |= {int(s) for s in at.split(",")}
            elif kind == "kill":
                f.kill_at |= {int(s) for s in at.split(",")}
            elif kind in ("lr_blowup", "lr_blowup_persistent"):
                a, b = at.split("-")
                f.lr_blowup = (int(a), int(b))
                f.persist = kind == "lr_blowup_persistent"
            else:
                raise ValueError(
                    f"unknown fault {spec!r} (nan@S, spike@S, kill@S, lr_blowup@A-B, "
                    "lr_blowup_persistent@A-B)"
                )
        return f

    def before_step(self, step: int, rollbacks: list[dict[str, Any]]) -> None:
        if step in self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def lr_factor(self, step: int, rollbacks: list[dict[str, Any]]) -> float:
        blow = self.lr_blowup
        # A transient fault: it hits the first pass over those steps, not the replay
        # after a rollback (unless `persist`, which tests the rollback budget; it lasts
        # until the supervisor's recovery, which tests that).
        persists = self.persist and not any(
            r.get("reason") == "supervisor_recovery" for r in rollbacks
        )
        if blow and blow[0] <= step < blow[1] and (persists or not rollbacks):
            return self.lr_blowup_factor
        return 1.0

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if step in self.nan_at:
            loss = loss * float("nan")
        if step in self.spike_at:
            loss = loss * self.spike_factor
        return loss
