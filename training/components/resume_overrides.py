"""`resume_overrides`: what a resumed run changes from its checkpoint: the optimizer (a
switch with fresh state, e.g. AdamW to Muon part-way) and the peak learning rates (the muP
and layer-wise multipliers of each group are kept). Applied after every restore and
idempotent: a later resume finds them applied and records nothing.

Once a switch is configured, each checkpoint records which optimizer's state it holds, so a
restore before or after the switch builds the right optimizer first."""

from __future__ import annotations

import contextlib
from typing import Any

from training import checkpoint as ckpt
from training import distributed
from training.components.base import Component
from training.optim import build_optimizer


class ApplyResumeOverrides(Component):
    name = "resume_overrides"

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        assert t.cfg.resume_overrides is not None
        self.ro = t.cfg.resume_overrides
        self.switching = self.ro.optimizer is not None
        self.optim_name: str = t.cfg.optim.name

    def trainer_state(self) -> dict[str, Any]:
        # Which optimizer's state this is, once a switch is configured.
        return {"optimizer": self.optim_name} if self.switching else {}

    def before_restore(self, step: int) -> None:
        if self.switching:
            saved = self._saved_optimizer(step)
            if saved != self.optim_name:  # it was written before or after a switch
                self._set_optimizer(saved)

    def after_restore(self, st: dict[str, Any]) -> None:
        self._apply(int(st["trainer"]["step"]))

    def _saved_optimizer(self, step: int) -> str:
        """The optimizer checkpoint `step` holds the state of (read by rank 0; the restore
        that follows checks the checksums and reports a bad checkpoint)."""
        t = self.t
        name = None
        if t.world.is_main:
            with contextlib.suppress(ckpt.CheckpointError, KeyError):
                name = ckpt.load(t.ckpt_dir, step, verified=True)["trainer"].get("optimizer")
        name = distributed.broadcast_object(name, t.world, t.device)
        return name or t.cfg.optim.name

    def _set_optimizer(self, name: str) -> None:
        """A new optimizer `name` over the model, fresh state; the checkpoints follow it."""
        t = self.t
        t.optimizer = build_optimizer(t.model, t.cfg.optim.model_copy(update={"name": name}))
        t.ckpts.optimizer = t.optimizer
        self.optim_name = name

    def _apply(self, step: int) -> None:
        """The optimizer switch, then the peak lrs; events at the next step."""
        ro, t = self.ro, self.t
        if ro.optimizer is not None and ro.optimizer != self.optim_name:
            t.pending_events.append(
                {
                    "event": "optimizer_switch",
                    "step": step,
                    "from": self.optim_name,
                    "to": ro.optimizer,
                }
            )
            self._set_optimizer(ro.optimizer)
        changed = False
        for g in t.optimizer.param_groups:
            base = ro.muon_lr if g.get("muon") else ro.lr
            if base is None:
                continue
            new = base * g.get("lr_scale", 1.0) * g.get("lr_mult", 1.0)
            changed = changed or new != g["initial_lr"]
            g["initial_lr"] = new
        if changed:
            t.pending_events.append(
                {"event": "lr_override", "step": step, "lr": ro.lr, "muon_lr": ro.muon_lr}
            )
