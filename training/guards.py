"""Stability guards: decide, step by step, whether the trainer applies the update, skips
the batch, rolls back to the last good checkpoint, or gives up.

One module, pure Python (floats in, decisions out; no torch), acting in the architecture's
order on every step:

1. Non-finite loss or gradient norm -> ``skip`` (``non_finite_loss`` / ``non_finite_grad``).
2. Loss or grad-norm spike against a running estimate -> ``skip`` (``loss_spike`` /
   ``grad_spike``). No spike calls during the first ``cfg.warmup_steps`` accepted steps.
   The loss z-score is on the loss itself; the grad-norm z-score on ``log(grad_norm)``.
3. Sustained divergence -> ``rollback`` (``divergence``): ``cfg.spikes_to_rollback`` spikes
   within the last ``cfg.window`` steps, or the loss above ``cfg.divergence_factor`` x its
   running mean for ``cfg.divergence_steps`` checked steps in a row, or
   ``cfg.max_nonfinite_steps`` non-finite steps in a row (trigger ``non_finite``: the
   weights are most likely NaN already, and skipping for ever would end a NaN run "done").
   The trainer reports divergences it finds itself (a non-finite validation loss, non-finite
   weights at a checkpoint) through ``divergence()``, with the same rollback budget.
4. A rollback called for when ``cfg.max_rollbacks`` have already happened -> ``abort``
   (``rollback_budget_exhausted``); the trainer prints ``Decision.detail`` and exits 3.

Choices (the "why" is in the comments below):

- Running statistics are exponentially weighted mean and variance with *normalised* weights,
  i.e. bias-corrected like Adam: after one value the mean is that value (no pull towards an
  arbitrary initial 0), and after t values they are the exact weighted mean/variance of
  those t values with weights proportional to ``beta**age``. They are updated with West's
  incremental formula, which never subtracts two large squares (no cancellation when the
  loss is large and its noise small).
- Only *accepted* steps update the statistics: non-finite steps, spikes, and "high" steps
  (loss above ``divergence_factor`` x mean, but no spike) do not. Otherwise a spike would
  drag the mean up, and a slow divergence would be followed by its own mean and never be
  called. A high step that is not a spike is still applied (``ok``): only a streak of them
  is evidence of divergence.
- The grad norm is positive, multiplicative and right-skewed (log-normal-like), so its
  z-score is taken on ``log(grad_norm)``: on the raw value a skewed but healthy run calls
  false spikes (simulated: log-normal noise of sigma 0.25 gave ~7e-5 false calls per step
  at grad_z=6, none in log space). The event reports the geometric running mean
  (``grad_mean``) and the standard deviation of the log (``grad_log_std``).
- The z-score denominator is ``sqrt(var + floor**2 + EPS)``, floor = ``REL_STD_FLOOR *
  |mean|`` for the loss and ``REL_STD_FLOOR`` for log(grad norm) (the same 0.1 %, relative):
  it stops a (near-)constant sequence, whose variance is ~0, from calling float jitter a
  spike. A real spike is far larger than 0.1 %.
- Downward outliers (z below ``-loss_z`` / ``-grad_z``: an almost empty or trivially
  predictable batch, a zero grad norm) are accepted, but the value that enters the
  statistics is clipped to ``mean - threshold * std``: one such batch would otherwise inflate
  the variance and hide real spikes for ~1/(1-ema_beta) steps, while a genuine downward
  level shift still pulls the mean down, only a bounded amount per step.
- The checks start after ``max(cfg.warmup_steps, 2)`` accepted steps: a variance needs two
  values, so ``warmup_steps: 0`` means "from the third step".
- ``enabled: false`` keeps only the non-finite skips (an update with a NaN in it would
  destroy the weights, so that check is never switched off); every finite step is ``ok``.
  Statistics are still kept, so turning the guards on at a resume starts from settled stats.
- ``rolled_back()`` counts the rollback, records it for the abort message, and resets the
  spike window, the high-loss streak and the recent sample ids (they describe the abandoned
  timeline, whose step numbers are about to be reused). The running statistics are kept by
  default: they were built from accepted steps only, i.e. from before the divergence, so
  protection continues at once instead of re-warming up exposed. The trainer may instead
  pass the guard state saved in the checkpoint it rolled back to (``stats_from=``), which
  restores the statistics that match those weights exactly while keeping the counters and
  the rollback history. The trainer must NOT ``load_state_dict`` the checkpoint's guard
  state on a rollback: that would forget the rollbacks and the budget would never run out.
- ``skipped_spikes`` counts ``skip`` decisions for spikes; a spike that triggers a rollback
  or an abort is reported by that decision instead.
- Non-finite steps neither extend nor break the high-loss streak and are not spikes: with
  fp16 loss scaling an inf gradient norm is routine and must not lead to rollbacks (the
  trainer hands such overflow steps to the grad scaler, not to the guard). Only a streak of
  ``max_nonfinite_steps`` of them in a row is a divergence (any finite step ends the
  streak), whether the guards are enabled or not: the non-finite check is never off.

Step numbers are the caller's, used as given: the trainer passes each step's own number
(step N is the N-th optimizer step, 1-based), so an event's ``step``, its window
``start_step..end_step`` and every detail name a step as its train record does. A rollback
for a window starting at ``start_step`` goes to a checkpoint before that step (at most
``start_step - 1``: checkpoint N is the state after step N); ``rolled_back()`` takes the
checkpoint's step (``to_step``) and the step that called the rollback (``from_step``).

Events (``Decision.event``, also appended to ``StabilityGuard.events``) are plain
JSON-serialisable dicts shaped for ``training.metrics.MetricsLog``:
``{"kind": "event", "event": "skip" | "rollback" | "abort", "reason": ..., "step": ...,
"loss": ..., "grad_norm": ..., "z": ..., "sample_ids": [...], ...}``. Non-finite floats are
written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON has no NaN).

After an ``abort`` the trainer is expected to stop; the guard does not refuse further calls.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from training.config import GuardConfig

Action = Literal["ok", "skip", "rollback", "abort"]
Reason = Literal[
    "ok",
    "non_finite_loss",
    "non_finite_grad",
    "loss_spike",
    "grad_spike",
    "divergence",
    "rollback_budget_exhausted",
]
# How a divergence was called: "spikes", "loss_level" (or both, joined by "+"), "non_finite"
# (a streak of non-finite steps), or whatever the trainer passes to divergence()
# ("non_finite_val_loss", "non_finite_weights").

STATE_VERSION = 1
EPS = 1e-12
# Relative floor on the standard deviation used in z-scores (see the module docstring).
REL_STD_FLOOR = 1e-3
# log() of a grad norm of 0 (or below): finite, and then clipped like any downward outlier.
MIN_GRAD_NORM = 1e-30
# Sample ids kept per step in the recent-data buffer and per rollback/abort event. The
# buffer holds this many steps, so it always has the last MAX_IDS ids of any step range.
MAX_IDS = 64
# Ids shown per rollback in the human-readable abort message (the event has all kept ones).
MAX_IDS_IN_DETAIL = 16

SampleIds = Sequence[str] | Sequence[int] | None


@dataclass
class Decision:
    action: Action
    reason: Reason
    detail: str  # human-readable: values vs thresholds ("" for a plain ok)
    event: dict[str, Any] | None  # the metrics-log event for this action (None for ok)
    # z-scores of this step against the statistics before it (None before the checks start,
    # on non-finite steps, or when the guards are disabled): handy for the step log.
    loss_z: float | None = None
    grad_z: float | None = None


class RunningStats:
    """Exponentially weighted mean and variance with normalised (bias-corrected) weights."""

    __slots__ = ("beta", "mean", "n", "relative_floor", "var")

    def __init__(self, beta: float, relative_floor: bool):
        self.beta = beta
        # Floor of the std: REL_STD_FLOOR x |mean| (raw values), or REL_STD_FLOOR itself (logs,
        # where a constant offset already is a relative change).
        self.relative_floor = relative_floor
        self.n = 0
        self.mean = 0.0
        self.var = 0.0

    def update(self, x: float) -> None:
        self.n += 1
        # Weight of the newest value among all n: (1 - beta) / (1 - beta**n). It is 1 for the
        # first value (mean = x, var = 0) and tends to 1 - beta: the bias correction.
        alpha = (1.0 - self.beta) / (1.0 - self.beta**self.n)
        delta = x - self.mean
        self.mean += alpha * delta
        # West (1979): exact weighted variance, no difference of large squares. Inputs are
        # fp32 values from torch, so delta**2 cannot overflow a Python float.
        self.var = (1.0 - alpha) * (self.var + alpha * delta * delta)

    def std(self) -> float:
        floor = REL_STD_FLOOR * abs(self.mean) if self.relative_floor else REL_STD_FLOOR
        return math.sqrt(self.var + floor * floor + EPS)

    def z(self, x: float) -> float:
        return (x - self.mean) / self.std()

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "var": self.var}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.n = int(d["n"])
        self.mean = float(d["mean"])
        self.var = float(d["var"])


def _num(x: float | None) -> float | str | None:
    """A float for a strict-JSON event: non-finite values become "nan" / "inf" / "-inf"."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _ids(ids: SampleIds) -> list[str | int]:
    # Plain str/int only, so events and state stay JSON- and weights_only-safe even when the
    # trainer hands over numpy integers or tensors' .tolist() values.
    if ids is None:
        return []
    out: list[str | int] = []
    for i in ids:
        if isinstance(i, str):
            out.append(i)
        else:
            try:
                out.append(int(i))
            except (TypeError, ValueError):
                out.append(str(i))
    return out


def _fmt_ids(ids: list[str | int]) -> str:
    if not ids:
        return "(none recorded)"
    shown = ", ".join(map(str, ids[-MAX_IDS_IN_DETAIL:]))
    more = len(ids) - MAX_IDS_IN_DETAIL
    return f"{shown} (+{more} earlier)" if more > 0 else shown


class StabilityGuard:
    """Per-step stability decisions; see the module docstring for the policy."""

    def __init__(
        self, cfg: GuardConfig, describe: Callable[[list[str | int]], dict[str, Any]] | None = None
    ):
        self.cfg = cfg
        # Fields an event gets about its sample ids (the trainer's: the documents of those
        # dataset rows, from the dataset's provenance); None: the ids alone.
        self.describe = describe
        self.loss_stats = RunningStats(cfg.ema_beta, relative_floor=True)
        self.grad_stats = RunningStats(cfg.ema_beta, relative_floor=False)  # of log(grad_norm)
        self.skipped_non_finite = 0
        self.skipped_spikes = 0
        self.rollbacks = 0
        self.events: list[dict[str, Any]] = []
        # Steps of the spikes in the current window (oldest first).
        self._spike_steps: deque[int] = deque()
        # Consecutive checked steps with loss > divergence_factor x mean, and the first one.
        self._high_streak = 0
        self._high_start: int | None = None
        # Consecutive non-finite steps, and the first one.
        self._nonfinite_streak = 0
        self._nonfinite_start: int | None = None
        # (step, last MAX_IDS ids) of the latest MAX_IDS steps that came with ids.
        self._recent: deque[tuple[int, list[str | int]]] = deque(maxlen=MAX_IDS)
        # The divergence behind the last rollback decision, until rolled_back() files it.
        self._pending: dict[str, Any] | None = None
        self._history: list[dict[str, Any]] = []

    # -- the per-step check -----------------------------------------------------------------

    def observe(
        self, step: int, loss: float, grad_norm: float, sample_ids: SampleIds = None
    ) -> Decision:
        cfg = self.cfg
        loss, grad_norm = float(loss), float(grad_norm)
        if sample_ids is not None and len(sample_ids):
            # Only the tail is normalised per step; the full list only for an event.
            self._recent.append((step, _ids(sample_ids[-MAX_IDS:])))

        # 1. Non-finite: never applied, never part of the statistics; a streak of them is a
        # divergence.
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            if self._nonfinite_streak == 0:
                self._nonfinite_start = step
            self._nonfinite_streak += 1
            start = step if self._nonfinite_start is None else self._nonfinite_start
            if self._nonfinite_streak >= cfg.max_nonfinite_steps:
                trigger = (
                    f"{self._nonfinite_streak} non-finite steps in a row (steps "
                    f"{start}..{step}; limit max_nonfinite_steps="
                    f"{cfg.max_nonfinite_steps}); the weights are probably NaN"
                )
                return self._diverge(
                    step,
                    loss,
                    grad_norm,
                    start,
                    "non_finite",
                    trigger,
                    f"loss={loss}, grad_norm={grad_norm}",
                    {"nonfinite_streak": self._nonfinite_streak},
                )
            self.skipped_non_finite += 1
            reason: Reason = "non_finite_loss" if not math.isfinite(loss) else "non_finite_grad"
            what = "loss" if reason == "non_finite_loss" else "grad norm"
            detail = (
                f"step {step}: non-finite {what} (loss={loss}, grad_norm={grad_norm}; "
                f"{self._nonfinite_streak}/{cfg.max_nonfinite_steps} in a row)"
            )
            return self._emit("skip", reason, detail, step, loss, grad_norm, _ids(sample_ids))
        self._nonfinite_streak = 0
        self._nonfinite_start = None

        log_grad = math.log(max(grad_norm, MIN_GRAD_NORM))
        if not cfg.enabled or self.loss_stats.n < max(cfg.warmup_steps, 2):
            # Warm-up (or guards off): every finite step feeds the statistics unclipped.
            self.loss_stats.update(loss)
            self.grad_stats.update(log_grad)
            return Decision("ok", "ok", "", None)

        # 2. Spikes, against the statistics of the accepted steps before this one.
        lz = self.loss_stats.z(loss)
        gz = self.grad_stats.z(log_grad)
        loss_spike = lz > cfg.loss_z
        grad_spike = gz > cfg.grad_z
        spike = loss_spike or grad_spike
        threshold = cfg.divergence_factor * self.loss_stats.mean
        high = loss > threshold
        if high:
            if self._high_streak == 0:
                self._high_start = step
            self._high_streak += 1
        else:
            self._high_streak = 0
            self._high_start = None
        if spike:
            self._spike_steps.append(step)
        while self._spike_steps and self._spike_steps[0] <= step - cfg.window:
            self._spike_steps.popleft()

        # 3. Sustained divergence: a spike streak in the window, or a high-loss streak.
        by_spikes = spike and len(self._spike_steps) >= cfg.spikes_to_rollback
        by_level = self._high_streak >= cfg.divergence_steps
        if by_spikes or by_level:
            return self._divergence(step, loss, grad_norm, lz, gz, threshold, by_spikes, by_level)

        if spike:
            self.skipped_spikes += 1
            reason = "loss_spike" if loss_spike else "grad_spike"
            detail = (
                f"step {step}: {reason.replace('_', ' ')}: "
                f"{self._values(loss, lz, grad_norm, gz)}; "
                f"{len(self._spike_steps)}/{cfg.spikes_to_rollback} spikes in the last "
                f"{cfg.window} steps"
            )
            return self._emit(
                "skip",
                reason,
                detail,
                step,
                loss,
                grad_norm,
                _ids(sample_ids),
                z=lz if loss_spike else gz,
                loss_z=lz,
                grad_z=gz,
                extra=self._stats_fields(),
            )
        if high:
            # Applied, but kept out of the statistics so the mean cannot follow a divergence.
            detail = (
                f"step {step}: loss {loss:.6g} above {cfg.divergence_factor:g} x mean "
                f"= {threshold:.6g} ({self._high_streak}/{cfg.divergence_steps} in a row)"
            )
            return Decision("ok", "ok", detail, None, lz, gz)
        self._accept(loss, log_grad)
        return Decision("ok", "ok", "", None, lz, gz)

    def divergence(
        self, step: int, trigger: str, what: str, start_step: int | None = None
    ) -> Decision:
        """A divergence the trainer found itself (`trigger` e.g. "non_finite_val_loss";
        `what`: a human-readable description): ``rollback``, or ``abort`` when the budget
        is spent, exactly as for the guard's own divergences. The divergence is taken to
        start at `start_step` (default: the current non-finite streak's start, else
        `step`): the rollback goes to a checkpoint before it."""
        if start_step is None:
            start_step = step if self._nonfinite_start is None else self._nonfinite_start
        return self._diverge(step, math.nan, math.nan, min(start_step, step), trigger, what, "", {})

    # -- rollbacks ----------------------------------------------------------------------------

    def rolled_back(
        self, to_step: int, from_step: int, stats_from: dict[str, Any] | None = None
    ) -> None:
        """The trainer restored checkpoint `to_step` when step `from_step` called for a
        rollback. Counts it, files it
        for the abort message, and resets what describes the abandoned steps. `stats_from`:
        optionally the guard state saved with that checkpoint, whose running statistics then
        replace the current ones (counters and rollback history are kept either way)."""
        self.rollbacks += 1
        record = {"to_step": int(to_step), "from_step": int(from_step)}
        pending = self._pending or {
            "start_step": None,
            "end_step": None,
            "trigger": None,
            "sample_ids": [],
        }
        self._history.append({**pending, **record})
        self._pending = None
        self._spike_steps.clear()
        self._high_streak = 0
        self._high_start = None
        self._nonfinite_streak = 0
        self._nonfinite_start = None
        self._recent.clear()
        if stats_from is not None:
            self.loss_stats.load_state_dict(stats_from["loss_stats"])
            self.grad_stats.load_state_dict(stats_from["grad_stats"])

    def reset_budget(self) -> None:
        """A fresh rollback budget (the supervisor's recovery); the history stays."""
        self.rollbacks = 0
        self._pending = None
        self._spike_steps.clear()
        self._high_streak = 0
        self._high_start = None
        self._nonfinite_streak = 0
        self._nonfinite_start = None
        self._recent.clear()

    @property
    def rollback_history(self) -> list[dict[str, Any]]:
        """One dict per rollback done: to_step, from_step, start_step, end_step, trigger,
        sample_ids (copies; JSON-serialisable)."""
        return [dict(h, sample_ids=list(h["sample_ids"])) for h in self._history]

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed for an exact resume, as plain JSON types."""
        return {
            "version": STATE_VERSION,
            "loss_stats": self.loss_stats.state_dict(),
            "grad_stats": self.grad_stats.state_dict(),
            "skipped_non_finite": self.skipped_non_finite,
            "skipped_spikes": self.skipped_spikes,
            "rollbacks": self.rollbacks,
            "events": [_copy_event(e) for e in self.events],
            "spike_steps": list(self._spike_steps),
            "high_streak": self._high_streak,
            "high_start": self._high_start,
            "nonfinite_streak": self._nonfinite_streak,
            "nonfinite_start": self._nonfinite_start,
            "recent": [[s, list(i)] for s, i in self._recent],
            "pending": None if self._pending is None else _copy_event(self._pending),
            "history": [_copy_event(h) for h in self._history],
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("version") != STATE_VERSION:
            raise ValueError(
                f"guard state version {d.get('version')!r} is not "
                f"{STATE_VERSION}; this checkpoint was written by another version"
            )
        self.loss_stats.load_state_dict(d["loss_stats"])
        self.grad_stats.load_state_dict(d["grad_stats"])
        self.skipped_non_finite = int(d["skipped_non_finite"])
        self.skipped_spikes = int(d["skipped_spikes"])
        self.rollbacks = int(d["rollbacks"])
        self.events = [_copy_event(e) for e in d["events"]]
        self._spike_steps = deque(int(s) for s in d["spike_steps"])
        self._high_streak = int(d["high_streak"])
        self._high_start = None if d["high_start"] is None else int(d["high_start"])
        # Absent from checkpoints written before the streak existed (same version: the
        # field is optional, so those still resume).
        self._nonfinite_streak = int(d.get("nonfinite_streak", 0))
        start = d.get("nonfinite_start")
        self._nonfinite_start = None if start is None else int(start)
        self._recent = deque(((int(s), list(i)) for s, i in d["recent"]), maxlen=MAX_IDS)
        self._pending = None if d["pending"] is None else _copy_event(d["pending"])
        self._history = [_copy_event(h) for h in d["history"]]

    # -- internals ------------------------------------------------------------------------------

    def _accept(self, loss: float, log_grad: float) -> None:
        # Downward outliers enter clipped (winsorised) to mean - threshold x std; upward ones
        # never get here (they are spikes).
        ls, gs = self.loss_stats, self.grad_stats
        ls.update(max(loss, ls.mean - self.cfg.loss_z * ls.std()))
        gs.update(max(log_grad, gs.mean - self.cfg.grad_z * gs.std()))

    def _values(self, loss: float, lz: float, grad_norm: float, gz: float) -> str:
        # Only formatted for non-ok decisions: observe() runs on every step.
        ls, gs, cfg = self.loss_stats, self.grad_stats, self.cfg
        return (
            f"loss={loss:.6g} (mean {ls.mean:.6g}, std {ls.std():.3g}, "
            f"z={lz:.2f} vs {cfg.loss_z:g}), grad_norm={grad_norm:.6g} (geometric mean "
            f"{math.exp(gs.mean):.6g}, log-std {gs.std():.3g}, z={gz:.2f} vs {cfg.grad_z:g})"
        )

    def _stats_fields(self) -> dict[str, Any]:
        return {
            "loss_mean": self.loss_stats.mean,
            "loss_std": self.loss_stats.std(),
            "grad_mean": math.exp(self.grad_stats.mean),
            "grad_log_std": self.grad_stats.std(),
        }

    def _ids_in(self, start: int, end: int) -> list[str | int]:
        ids: list[str | int] = []
        for s, step_ids in self._recent:
            if start <= s <= end:
                ids.extend(step_ids)
        return ids[-MAX_IDS:]

    def _divergence(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lz: float,
        gz: float,
        threshold: float,
        by_spikes: bool,
        by_level: bool,
    ) -> Decision:
        cfg = self.cfg
        starts: list[int] = []
        triggers: list[str] = []
        if by_spikes:
            starts.append(self._spike_steps[0])
            triggers.append(
                f"{len(self._spike_steps)} spikes in the last {cfg.window} steps "
                f"(steps {list(self._spike_steps)}; limit {cfg.spikes_to_rollback})"
            )
        if by_level and self._high_start is not None:
            starts.append(self._high_start)
            triggers.append(
                f"loss above {cfg.divergence_factor:g} x mean = {threshold:.6g} for "
                f"{self._high_streak} steps in a row (limit {cfg.divergence_steps})"
            )
        # "spikes", "loss_level" or "spikes+loss_level"
        trigger = "+".join(t for t, on in (("spikes", by_spikes), ("loss_level", by_level)) if on)
        extra = {
            "spike_steps": list(self._spike_steps),
            "high_streak": self._high_streak,
            "divergence_threshold": threshold,
        }
        return self._diverge(
            step,
            loss,
            grad_norm,
            min(starts, default=step),
            trigger,
            "; ".join(triggers),
            self._values(loss, lz, grad_norm, gz),
            extra,
            lz,
            gz,
        )

    def _diverge(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        start: int,
        trigger: str,
        why: str,
        values: str,
        extra: dict[str, Any],
        lz: float | None = None,
        gz: float | None = None,
    ) -> Decision:
        """A divergence over steps start..step: ``rollback`` within the budget, else
        ``abort`` with the whole story (every rollback so far, and this one)."""
        cfg = self.cfg
        window_ids = self._ids_in(start, step)
        divergence = {
            "start_step": start,
            "end_step": step,
            "trigger": trigger,
            "sample_ids": window_ids,
        }
        extra = {
            **self._stats_fields(),
            **divergence,
            **extra,
            "rollbacks_done": self.rollbacks,
            "max_rollbacks": cfg.max_rollbacks,
        }
        what = f"divergence over steps {start}..{step}: {why}"
        if values:
            what += f"; at step {step}: {values}"
        if self.rollbacks < cfg.max_rollbacks:
            self._pending = _copy_event(divergence)
            detail = (
                f"step {step}: rolling back ({self.rollbacks + 1}/{cfg.max_rollbacks}): "
                f"{what}; data seen: {_fmt_ids(window_ids)}"
            )
            return self._emit(
                "rollback",
                "divergence",
                detail,
                step,
                loss,
                grad_norm,
                window_ids,
                z=lz,
                loss_z=lz,
                grad_z=gz,
                extra=extra,
            )

        lines = [
            f"training diverged beyond the rollback budget ({self.rollbacks} of "
            f"max_rollbacks={cfg.max_rollbacks} used) at step {step}:"
        ]
        for k, h in enumerate(self._history, 1):
            span = (
                f"divergence over steps {h['start_step']}..{h['end_step']}"
                if h["start_step"] is not None
                else "rollback requested by the trainer"
            )
            if h.get("trigger"):
                span += f" ({h['trigger']})"
            lines.append(
                f"  rollback {k}: {span}, rolled back from step {h['from_step']} "
                f"to step {h['to_step']}; data: {_fmt_ids(h['sample_ids'])}"
            )
        lines.append(f"  now: {what}")
        lines.append(f"  data: {_fmt_ids(window_ids)}")
        extra["rollbacks"] = self.rollback_history
        return self._emit(
            "abort",
            "rollback_budget_exhausted",
            "\n".join(lines),
            step,
            loss,
            grad_norm,
            window_ids,
            z=lz,
            loss_z=lz,
            grad_z=gz,
            extra=extra,
        )

    def _emit(
        self,
        action: Action,
        reason: Reason,
        detail: str,
        step: int,
        loss: float,
        grad_norm: float,
        ids: list[str | int],
        z: float | None = None,
        loss_z: float | None = None,
        grad_z: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Decision:
        event: dict[str, Any] = {
            "kind": "event",
            "event": action,
            "reason": reason,
            "step": int(step),
            "loss": _num(loss),
            "grad_norm": _num(grad_norm),
            "z": _num(z),
            "loss_z": _num(loss_z),
            "grad_z": _num(grad_z),
            "sample_ids": list(ids),
        }
        for k, v in (extra or {}).items():
            event[k] = _num(v) if isinstance(v, float) else v
        if self.describe is not None and ids:
            event.update(self.describe(list(ids)))
        event["detail"] = detail
        self.events.append(event)
        return Decision(action, reason, detail, _copy_event(event), loss_z, grad_z)


def _copy_event(e: dict[str, Any]) -> dict[str, Any]:
    # Events and records hold only JSON types; a deep-enough copy so that a caller mutating
    # a Decision's event (or a state dict) cannot change the guard's own record.
    out: dict[str, Any] = {}
    for k, v in e.items():
        if isinstance(v, list):
            out[k] = [_copy_event(x) if isinstance(x, dict) else x for x in v]
        elif isinstance(v, dict):
            out[k] = _copy_event(v)
        else:
            out[k] = v
    return out
