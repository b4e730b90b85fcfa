"""Throughput, MFU and the "progress" event: tokens/s for each train record, MFU against
the peak of the GPU present (training/flops.py; not logged on the CPU or an unknown GPU),
and a progress event (step, loss, tokens/s, ETA) after the first step, then at most every
PROGRESS_EVERY_S seconds, and at the last step: enough for a live view (the supervisor logs
it, the Prefect flow keeps a progress artifact), few lines in a week-long log."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from training.components.base import Component
from training.flops import device_peak_flops

PROGRESS_EVERY_S = 30.0


def mfu(
    tokens_per_s: float, flops_per_token: float, peak: tuple[str, float] | None, world_size: int
) -> dict[str, float]:
    """{"mfu": model FLOPs utilisation} over every rank's GPU, or {} without a known
    peak. Tokens are the real (non-padding) ones trained, so padding is not counted as
    useful work, and recomputation (activation checkpointing) is not counted either."""
    if peak is None:
        return {}
    return {"mfu": tokens_per_s * flops_per_token / (peak[1] * world_size)}


class Progress(Component):
    name = "progress"

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        self.flops_per_token = t.model.flops_per_token(t.data.seq_len)
        self.peak = device_peak_flops(t.device, t.cfg.precision.dtype)
        if t.device.type == "cuda" and self.peak is None and t.world.is_main:
            print(
                f"note: no peak FLOP/s known for {torch.cuda.get_device_name(t.device)} "
                f"at {t.cfg.precision.dtype} (training/flops.py): MFU is not logged",
                file=sys.stderr,
            )

    def begin(self) -> None:
        """The loop starts: throughput and ETA are over this attempt's own steps."""
        s = self.t.state
        self.t_last, self.tokens_last = time.perf_counter(), s.tokens_seen
        self.t_start, self.step_start, self.tokens_start = self.t_last, s.step, s.tokens_seen
        self.t_progress, self.progressed = self.t_last, False

    def speed(self) -> dict[str, float]:
        """tokens/s (and MFU) since the last train record."""
        now, tokens = time.perf_counter(), self.t.state.tokens_seen
        tokens_per_s = (tokens - self.tokens_last) / max(now - self.t_last, 1e-9)
        self.t_last, self.tokens_last = now, tokens
        return {
            "tokens_per_s": tokens_per_s,
            **mfu(tokens_per_s, self.flops_per_token, self.peak, self.t.world.size),
        }

    def train_record(self, out: Any) -> dict[str, Any]:
        """The metrics log's "train" record of the step just counted (`out`: its
        StepResult), with the throughput and MFU since the last one."""
        t, s = self.t, self.t.state
        return {
            "kind": "train",
            "step": s.step,
            "loss": out.loss,
            "ce": out.ce,
            "z_loss": out.z_loss,
            "lr": out.lr,
            "grad_norm": out.grad_norm,
            **self.speed(),
            "tokens_seen": s.tokens_seen,
            "accum": out.accum,
            # The sampler position after the step: `ballast blame` maps steps to data.
            "samples_seen": s.samples_seen,
            "skipped": t.guard.skipped_non_finite + t.guard.skipped_spikes,
            "rollbacks": len(s.rollbacks),
            "loss_scale": t.scaler.get_scale() if t.scaler.is_enabled() else None,
        }

    def report(self, loss: float) -> None:
        """After a train record: the progress event, when one is due."""
        s, steps, now = self.t.state, self.t.cfg.steps, self.t_last
        if s.step == steps or now - self.t_progress >= PROGRESS_EVERY_S or not self.progressed:
            self.t.emit(
                self.event(
                    loss,
                    now - self.t_start,
                    s.step - self.step_start,
                    s.tokens_seen - self.tokens_start,
                )
            )
            self.t_progress, self.progressed = now, True

    def event(self, loss: float, took: float, steps: int, tokens: int) -> dict[str, Any]:
        """Step, loss, and tokens/s and ETA over the `steps` steps (`tokens` tokens, `took`
        seconds) this attempt has trained so far."""
        s, total = self.t.state, self.t.cfg.steps
        took = max(took, 1e-9)
        eta = (total - s.step) * took / steps if steps > 0 else None
        return {
            "event": "progress",
            "step": s.step,
            "steps": total,
            "loss": round(float(loss), 5),
            "tokens_seen": s.tokens_seen,
            "tokens_per_s": round(tokens / took, 1),
            "eta_s": None if eta is None else round(eta, 1),
        }
