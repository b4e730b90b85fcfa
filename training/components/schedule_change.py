"""A resumed run whose `steps` differ from its checkpoint's: the schedule is recomputed over
the new total, so the learning rate can jump (cosine from 0.0002 to 0.0008 when a 40-step run
was extended to 60). Said in one warning line and a `schedule_change` event naming the old
and new totals and the multiplier of the peak lr before and after; silent where the
schedule's value at the resume step is the same (a constant schedule, or WSD extended in its
stable phase, which extends naturally)."""

from __future__ import annotations

from typing import Any

from training import checkpoint as ckpt
from training.components.base import Component
from training.schedule import lr_multiplier


class ScheduleChange(Component):
    name = "schedule_change"

    def after_restore(self, st: dict[str, Any]) -> None:
        t = self.t
        old, new = (st.get("config") or {}).get("steps"), t.cfg.steps
        step = int(st["trainer"]["step"])
        if old is None or old == new or step >= new:
            return
        sched = t.cfg.schedule
        # Past its total a schedule holds its end value.
        before, after = lr_multiplier(step, old, sched), lr_multiplier(step, new, sched)
        if before == after:
            return
        t.console.say(
            f"warning: steps changed from {old} (checkpoint {ckpt.step_name(step)}) to "
            f"{new}: the {sched.kind} schedule is recomputed over {new} steps, so the "
            f"lr multiplier at step {step + 1} goes from {before:.4g} to {after:.4g} "
            f"(WSD or a constant schedule extend without a jump)",
        )
        t.pending_events.append(
            {
                "event": "schedule_change",
                "step": step,
                "steps_from": old,
                "steps_to": new,
                "lr_mult_from": before,
                "lr_mult_to": after,
            }
        )
