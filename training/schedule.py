"""Learning-rate schedules and batch-size warmup, as pure functions of the step so that a
resumed run recomputes exactly the same values (no scheduler state to checkpoint).

All kinds start with a linear warmup: multiplier (step + 1) / warmup_steps for
step < warmup_steps (nanoGPT's get_lr; step 0 gets a small positive lr, step warmup-1 gets 1).
After it, with p = (step - warmup) / (total - warmup) clamped to [0, 1] and m = min_lr_ratio:
- cosine: m + 0.5 * (1 + cos(pi * p)) * (1 - m)    (nanoGPT; reaches m at total_steps)
- linear: 1 - p * (1 - m)                           (OPT: "decayed to 10% of the max LR")
- wsd: 1 until the last `decay_fraction` of total_steps, then 1 - q * (1 - m) with q the
  fraction of the decay phase done (warmup-stable-decay, MiniCPM; Hägele et al. 2024,
  "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"). Linear decay
  is chosen over 1-sqrt: both papers report it, it is the simpler one, and it ends at m like
  the other kinds. The decay never starts inside the warmup.
- constant: 1.
- step: gamma ** floor((step - warmup) / step_size)  (torch's StepLR after the warmup; no
  floor, min_lr_ratio unused).
- exponential: m ** p, a geometric decay from 1 to m (ExponentialLR with the gamma that
  lands on m at total_steps; needs m > 0).
- polynomial: m + (1 - m) * (1 - p) ** power  (the polynomial decay with warmup of
  Hugging Face transformers; power 1 is `linear`).
- onecycle: the warmup is a cosine ramp from 1/d to 1, d = div_factor, i.e.
  1/d + (1 - 1/d) * 0.5 * (1 - cos(pi * (step + 1) / warmup_steps)), then the cosine decay to
  m (the learning-rate half of Smith & Topin 2019's one-cycle policy in torch's OneCycleLR
  form, anneal_strategy "cos"; momentum is not cycled).
Every kind but step reaches its end value at step == total_steps and holds it after (training
steps run 0..total_steps-1, as in nanoGPT, so the last step is one decay increment above the
floor).
"""

from __future__ import annotations

import math
from typing import Any

from training.config import ScheduleConfig


def lr_multiplier(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """The schedule's multiplier of the peak lr at `step`, in [0, 1]."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup = cfg.warmup_steps
    if step < warmup:
        if cfg.kind == "onecycle":
            start = 1.0 / cfg.div_factor
            return start + (1.0 - start) * 0.5 * (1.0 - math.cos(math.pi * (step + 1) / warmup))
        return (step + 1) / warmup
    floor = cfg.min_lr_ratio
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "wsd":
        # Decay length from the fraction, at least one step, and never overlapping warmup.
        decay_start = max(warmup, total_steps - max(1, round(cfg.decay_fraction * total_steps)))
        if step < decay_start:
            return 1.0
        return 1.0 - _progress(step, decay_start, total_steps) * (1.0 - floor)
    if cfg.kind == "step":
        return cfg.gamma ** ((step - warmup) // cfg.step_size)
    p = _progress(step, warmup, total_steps)
    if cfg.kind in ("cosine", "onecycle"):
        return floor + 0.5 * (1.0 + math.cos(math.pi * p)) * (1.0 - floor)
    if cfg.kind == "linear":
        return 1.0 - p * (1.0 - floor)
    if cfg.kind == "exponential":
        return floor**p
    if cfg.kind == "polynomial":
        return floor + (1.0 - floor) * (1.0 - p) ** cfg.power
    raise ValueError(f"unknown schedule kind {cfg.kind!r}")


def _progress(step: int, start: int, end: int) -> float:
    """Fraction of [start, end] done at `step`, clamped to [0, 1] (1 when the span is empty)."""
    if end <= start:
        return 1.0
    return min(1.0, max(0.0, (step - start) / (end - start)))


def set_lr(
    optimizer: Any, step: int, total_steps: int, cfg: ScheduleConfig, extra_scale: float = 1.0
) -> float:
    """Set every group's lr to initial_lr * lr_multiplier * extra_scale (`extra_scale`: e.g.
    the guard's lr cut after a rollback). Groups built by `training.optim.param_groups` carry
    `initial_lr` (base lr * muP `lr_scale`); one without it takes its current lr as initial
    (as torch's lr_scheduler does). Returns group 0's lr, for logging (with
    `param_groups` ordering that is the unscaled `cfg.lr` group when there are embeddings;
    a layer-wise or per-name `lr_mult` of that group is divided out, so the log shows the
    schedule's lr whatever the multipliers)."""
    mult = lr_multiplier(step, total_steps, cfg) * extra_scale
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * mult
    first = optimizer.param_groups[0]
    lr = float(first["lr"])
    return lr / first["lr_mult"] if "lr_mult" in first else lr


def accum_steps_at(step: int, cfg: ScheduleConfig, accum_steps: int, tokens_seen: int = 0) -> int:
    """Gradient-accumulation steps at `step` under batch-size warmup: a linear integer ramp
    from `cfg.batch_warmup_start_accum` at step 0 to `accum_steps` at
    `cfg.batch_warmup_steps` (floor, so non-decreasing; `accum_steps` from then on), or
    by `tokens_seen` over `cfg.batch_warmup_tokens`. Without batch warmup (no start, or a
    ramp of 0) it is `accum_steps`."""
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    start = cfg.batch_warmup_start_accum
    by_tokens = cfg.batch_warmup_tokens > 0
    ramp = cfg.batch_warmup_tokens if by_tokens else cfg.batch_warmup_steps
    if start is None or ramp == 0:
        return accum_steps
    if start > accum_steps:
        # A "warmup" that shrinks the batch is a config mistake, not a schedule.
        raise ValueError(
            f"schedule.batch_warmup_start_accum ({start}) is larger than "
            f"accum_steps ({accum_steps})"
        )
    at = tokens_seen if by_tokens else step
    if at >= ramp:
        return accum_steps
    return start + (accum_steps - start) * max(0, at) // ramp
