"""Stability guards: no false positives on a clean run, non-finite and spike skips that leave
the statistics alone, rollbacks on sustained divergence, an abort that names what happened,
and a state that resumes exactly."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator

import numpy as np
import pytest

from training.config import GuardConfig
from training.guards import Decision, StabilityGuard

Step = tuple[int, float, float]


def clean_run(
    seed: int, n: int = 2000, loss_noise: float = 0.03, grad_noise: float = 0.15
) -> Iterator[Step]:
    """A healthy pre-training curve: loss falls fast then slowly, with relative gaussian
    noise; the grad norm falls too, with log-normal (right-skewed) noise."""
    r = random.Random(seed)
    for t in range(n):
        loss = (2.5 + 8.0 * math.exp(-t / 150)) * (1 + loss_noise * r.gauss(0, 1))
        grad = (0.3 + 3.0 * math.exp(-t / 100)) * math.exp(grad_noise * r.gauss(0, 1))
        yield t, loss, grad


def flat_run(seed: int, start: int, n: int) -> Iterator[Step]:
    """A plateau: loss ~3.0 (2 % noise), grad norm ~1.0 (log-normal, sigma 0.1)."""
    r = random.Random(seed)
    for t in range(start, start + n):
        yield t, 3.0 * (1 + 0.02 * r.gauss(0, 1)), math.exp(0.1 * r.gauss(0, 1))


def ids(step: int) -> list[str]:
    return [f"doc-{step}-a", f"doc-{step}-b"]


def feed(guard: StabilityGuard, steps: Iterator[Step] | list[Step]) -> list[Decision]:
    return [guard.observe(t, loss, g, ids(t)) for t, loss, g in steps]


def warm(cfg: GuardConfig | None = None, n: int = 200, seed: int = 0) -> StabilityGuard:
    guard = StabilityGuard(cfg or GuardConfig())
    assert all(d.action == "ok" for d in feed(guard, flat_run(seed, 0, n)))
    return guard


def stats(guard: StabilityGuard) -> tuple[dict, dict]:
    s = guard.state_dict()
    return s["loss_stats"], s["grad_stats"]


# -- no false positives --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_clean_noisy_decreasing_run_has_no_skips(seed):
    guard = StabilityGuard(GuardConfig())
    decisions = feed(guard, clean_run(seed))
    assert [d.detail for d in decisions if d.action != "ok"] == []
    assert guard.skipped_non_finite == guard.skipped_spikes == guard.rollbacks == 0
    assert guard.events == []
    # The checks really ran (z-scores reported after warm-up).
    assert decisions[-1].loss_z is not None and decisions[-1].grad_z is not None


@pytest.mark.parametrize("seed", range(5))
def test_noisier_skewed_run_has_no_skips(seed):
    # 5 % loss noise and a strongly skewed grad norm (log-normal sigma 0.4): the grad z-score
    # is taken on log(grad norm), so the long right tail is not called a spike (a z-score on
    # the raw grad norm calls one on 3 of these 5 seeds).
    guard = StabilityGuard(GuardConfig())
    decisions = feed(guard, clean_run(seed, loss_noise=0.05, grad_noise=0.4))
    assert [d.detail for d in decisions if d.action != "ok"] == []


# -- non-finite ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss", "grad", "reason"),
    [
        (math.nan, 1.0, "non_finite_loss"),
        (math.inf, 1.0, "non_finite_loss"),
        (-math.inf, 1.0, "non_finite_loss"),
        (3.0, math.nan, "non_finite_grad"),
        (3.0, math.inf, "non_finite_grad"),
        (math.nan, math.inf, "non_finite_loss"),
    ],
)
def test_non_finite_is_skipped_counted_and_leaves_stats(loss, grad, reason):
    guard = warm()
    before = stats(guard)
    d = guard.observe(200, loss, grad, ["x1", "x2"])
    assert (d.action, d.reason) == ("skip", reason)
    assert guard.skipped_non_finite == 1 and guard.skipped_spikes == 0
    assert stats(guard) == before
    assert d.event is not None and d.event["event"] == "skip"
    assert d.event["sample_ids"] == ["x1", "x2"]
    json.dumps(d.event, allow_nan=False)  # NaN/inf are written as strings
    # The next finite step is checked against the same statistics and accepted.
    assert guard.observe(201, 3.0, 1.0).action == "ok"


def test_non_finite_is_skipped_during_warmup_and_is_not_an_accepted_step():
    guard = StabilityGuard(GuardConfig(warmup_steps=5))
    assert guard.observe(0, math.nan, 1.0).action == "skip"
    assert guard.state_dict()["loss_stats"]["n"] == 0
    feed(guard, flat_run(0, 1, 5))
    assert guard.state_dict()["loss_stats"]["n"] == 5


def test_disabled_guard_only_skips_non_finite():
    guard = warm(GuardConfig(enabled=False))
    assert guard.observe(200, 15.0, 50.0).action == "ok"  # a spike, but guards are off
    assert all(d.action == "ok" for d in feed(guard, [(t, 30.0, 9.0) for t in range(201, 260)]))
    assert guard.observe(260, math.nan, 1.0).reason == "non_finite_loss"
    assert guard.observe(261, 3.0, math.inf).reason == "non_finite_grad"
    assert guard.skipped_non_finite == 2 and guard.skipped_spikes == guard.rollbacks == 0


def test_nonfinite_steps_in_a_row_are_a_divergence():
    # The default budget: 5 non-finite steps in a row (NaN weights: every step is NaN, and
    # skipping them for ever would end a NaN run "done").
    guard = warm()
    decisions = [guard.observe(t, math.nan, math.nan, ids(t)) for t in range(200, 205)]
    assert [d.action for d in decisions] == ["skip"] * 4 + ["rollback"]
    d = decisions[-1]
    assert d.reason == "divergence" and d.event is not None
    assert (d.event["start_step"], d.event["end_step"], d.event["trigger"]) == (
        200,
        204,
        "non_finite",
    )
    assert d.event["sample_ids"] == [i for t in range(200, 205) for i in ids(t)]
    assert "5 non-finite steps in a row (steps 200..204; limit max_nonfinite_steps=5)" in (d.detail)
    assert guard.skipped_non_finite == 4  # the fifth is reported by the rollback
    json.dumps(d.event, allow_nan=False)


def test_a_finite_step_breaks_the_nonfinite_streak():
    guard = warm(GuardConfig(max_nonfinite_steps=3))
    seq = [
        (math.nan, 1.0),
        (3.0, math.inf),
        (3.0, 1.0),
        (math.inf, 1.0),
        (math.nan, 1.0),
        (3.0, 1.0),
    ]
    decisions = [guard.observe(200 + i, x, g) for i, (x, g) in enumerate(seq)]
    assert [d.action for d in decisions] == ["skip", "skip", "ok", "skip", "skip", "ok"]
    assert guard.state_dict()["nonfinite_streak"] == 0


def test_nonfinite_streak_rolls_back_even_with_the_guards_off_and_then_aborts():
    guard = warm(GuardConfig(enabled=False, max_nonfinite_steps=2, max_rollbacks=1))
    assert [guard.observe(t, math.nan, 1.0).action for t in (200, 201)] == ["skip", "rollback"]
    guard.rolled_back(to_step=150, from_step=201)
    d = [guard.observe(t, 3.0, math.nan) for t in (160, 161)][-1]
    assert (d.action, d.reason) == ("abort", "rollback_budget_exhausted")
    assert "rollback 1: divergence over steps 200..201 (non_finite)" in d.detail
    assert "now: divergence over steps 160..161: 2 non-finite steps in a row" in d.detail


def test_trainer_reported_divergence_uses_the_same_budget():
    guard = warm(GuardConfig(max_rollbacks=1))
    d = guard.divergence(220, "non_finite_val_loss", "validation loss nan at step 220")
    assert (d.action, d.reason) == ("rollback", "divergence")
    assert d.event is not None and (d.event["start_step"], d.event["trigger"]) == (
        220,
        "non_finite_val_loss",
    )
    guard.rolled_back(to_step=200, from_step=220)
    guard.observe(201, math.nan, 1.0)  # a non-finite streak in progress: its start counts
    d = guard.divergence(202, "non_finite_weights", "non-finite weights at step 202")
    assert (d.action, d.reason) == ("abort", "rollback_budget_exhausted")
    assert d.event is not None and d.event["start_step"] == 201
    assert "rollback 1: divergence over steps 220..220 (non_finite_val_loss)" in d.detail
    assert "now: divergence over steps 201..202: non-finite weights at step 202" in d.detail


def test_nonfinite_streak_survives_a_resume_and_old_state_loads():
    guard = warm(GuardConfig(max_nonfinite_steps=3))
    guard.observe(200, math.nan, 1.0)
    guard.observe(201, math.nan, 1.0)
    state = json.loads(json.dumps(guard.state_dict(), allow_nan=False))
    restored = StabilityGuard(GuardConfig(max_nonfinite_steps=3))
    restored.load_state_dict(state)
    assert restored.observe(202, math.nan, 1.0).action == "rollback"
    # A checkpoint written before the streak was kept in the state still resumes.
    for key in ("nonfinite_streak", "nonfinite_start"):
        del state[key]
    restored = StabilityGuard(GuardConfig(max_nonfinite_steps=3))
    restored.load_state_dict(state)
    assert restored.observe(202, math.nan, 1.0).action == "skip"


# -- spikes --------------------------------------------------------------------------------


def test_loss_spike_after_warmup_is_skipped_with_its_sample_ids():
    guard = StabilityGuard(GuardConfig())
    decisions = feed(guard, clean_run(3, n=400))
    assert all(d.action == "ok" for d in decisions)
    before = stats(guard)
    # 5x the current loss level (~2.6 at step 400).
    d = guard.observe(400, 5 * 2.6, 0.31, ["bad-1", "bad-2", 17])
    assert (d.action, d.reason) == ("skip", "loss_spike")
    assert d.loss_z is not None and d.loss_z > 6
    assert d.event is not None
    assert d.event["sample_ids"] == ["bad-1", "bad-2", 17]
    assert d.event["z"] == d.loss_z and d.event["step"] == 400
    assert "loss=13" in d.detail and "vs 6" in d.detail
    assert guard.skipped_spikes == 1 and guard.events == [d.event]
    assert stats(guard) == before  # a spike does not drag the mean up
    assert guard.observe(401, 2.6, 0.31).action == "ok"


def test_spike_during_warmup_is_not_called():
    guard = StabilityGuard(GuardConfig(warmup_steps=50))
    feed(guard, flat_run(0, 0, 20))
    d = guard.observe(20, 15.0, 1.0)
    assert d.action == "ok" and d.loss_z is None
    assert guard.skipped_spikes == 0 and guard.events == []


def test_warmup_counts_accepted_steps_only():
    guard = StabilityGuard(GuardConfig(warmup_steps=10))
    feed(guard, flat_run(0, 0, 9))
    guard.observe(9, math.nan, 1.0)  # not accepted: the warm-up is not over yet
    assert guard.observe(10, 3.0, 1.0).loss_z is None
    assert guard.observe(11, 15.0, 1.0).reason == "loss_spike"


def test_grad_norm_spike():
    guard = warm()
    d = guard.observe(200, 3.0, 20.0, ids(200))
    assert (d.action, d.reason) == ("skip", "grad_spike")
    assert d.event is not None and d.event["z"] == d.grad_z and d.grad_z > 6
    assert d.event["sample_ids"] == ids(200)
    assert guard.skipped_spikes == 1


def test_downward_outliers_do_not_blind_the_guard():
    # An (almost) empty batch: loss ~0 and grad norm 0. Accepted, but it enters the
    # statistics clipped, so the variance is not blown up and a spike right after is caught.
    guard = warm()
    std_before = guard.loss_stats.std()
    assert guard.observe(200, 0.0, 0.0).action == "ok"
    assert guard.loss_stats.std() < 2 * std_before
    assert guard.observe(201, 6.0, 1.0).reason == "loss_spike"
    assert guard.observe(202, 3.0, 10.0).reason == "grad_spike"


# -- rollbacks -----------------------------------------------------------------------------


def spikes_at(guard: StabilityGuard, steps: list[int], start: int, end: int) -> list[Decision]:
    """Flat steps from `start` to `end` (exclusive) with a 5x loss spike at `steps`."""
    out = []
    for t, loss, g in flat_run(start, start, end - start):
        out.append(guard.observe(t, 15.0 if t in steps else loss, g, ids(t)))
    return out


def test_k_spikes_in_window_roll_back():
    guard = warm()
    decisions = spikes_at(guard, [200, 210, 220], 200, 221)
    actions = [(d.action, d.reason) for d in decisions if d.action != "ok"]
    assert actions == [("skip", "loss_spike"), ("skip", "loss_spike"), ("rollback", "divergence")]
    ev = decisions[-1].event
    assert ev is not None and ev["event"] == "rollback"
    assert (ev["start_step"], ev["end_step"], ev["trigger"]) == (200, 220, "spikes")
    assert ev["spike_steps"] == [200, 210, 220]
    # Every sample seen in the divergence, in order.
    assert ev["sample_ids"] == [i for t in range(200, 221) for i in ids(t)]
    assert "200..220" in decisions[-1].detail
    assert guard.skipped_spikes == 2  # the third spike is reported by the rollback
    assert guard.rollbacks == 0  # counted when the trainer reports it did it


def test_rollback_event_caps_sample_ids():
    guard = warm()
    d = spikes_at(guard, [200, 230, 249], 200, 250)[-1]
    assert d.action == "rollback" and d.event is not None
    assert d.event["sample_ids"] == [i for t in range(200, 250) for i in ids(t)][-64:]


def test_spikes_further_apart_than_the_window_do_not_roll_back():
    guard = warm()
    decisions = spikes_at(guard, [200, 250, 300, 350], 200, 360)
    assert [d.action for d in decisions if d.action != "ok"] == ["skip"] * 4


def test_loss_above_factor_times_mean_for_m_steps_rolls_back():
    # Spike calls effectively off, so only the level rule can fire.
    cfg = GuardConfig(loss_z=1e9, grad_z=1e9, divergence_factor=1.5, divergence_steps=5)
    guard = warm(cfg)
    decisions = []
    stats_at_first_high = None
    for k in range(1, 40):
        t = 199 + k
        if stats_at_first_high is None and 3.0 * 1.1**k > 1.5 * guard.loss_stats.mean:
            stats_at_first_high = stats(guard)
        decisions.append(guard.observe(t, 3.0 * 1.1**k, 1.0, ids(t)))
        if decisions[-1].action != "ok":
            break
    d = decisions[-1]
    assert (d.action, d.reason) == ("rollback", "divergence")
    high = [x for x in decisions[:-1] if x.detail]
    assert len(high) == 4 and all(x.action == "ok" for x in high)  # applied, not skipped
    assert "in a row" in high[0].detail
    # High steps are kept out of the statistics: the mean did not follow the divergence.
    assert stats(guard) == stats_at_first_high
    assert d.event is not None and d.event["trigger"] == "loss_level"
    assert d.event["end_step"] - d.event["start_step"] == 4
    assert d.event["high_streak"] == 5


def test_a_normal_step_breaks_the_high_loss_streak():
    cfg = GuardConfig(loss_z=1e9, grad_z=1e9, divergence_factor=1.5, divergence_steps=5)
    guard = warm(cfg)
    seq = [10.0] * 4 + [3.0] + [10.0] * 4 + [3.0]
    decisions = [guard.observe(200 + i, x, 1.0) for i, x in enumerate(seq)]
    assert all(d.action == "ok" for d in decisions)
    assert guard.state_dict()["high_streak"] == 0


def test_rolled_back_counts_and_resets_window_and_streaks_but_keeps_stats():
    guard = warm()
    assert spikes_at(guard, [200, 210, 220], 200, 221)[-1].action == "rollback"
    kept = stats(guard)
    guard.rolled_back(to_step=150, from_step=220)
    assert guard.rollbacks == 1
    s = guard.state_dict()
    assert s["spike_steps"] == [] and s["high_streak"] == 0 and s["recent"] == []
    assert stats(guard) == kept  # running statistics survive a rollback
    # Replaying from step 151: the old spikes are forgotten, so two new ones only skip...
    decisions = spikes_at(guard, [160, 170], 151, 200)
    assert [d.action for d in decisions if d.action != "ok"] == ["skip", "skip"]
    # ...and the third within the window rolls back again.
    assert guard.observe(180, 15.0, 1.0).action == "rollback"
    assert guard.skipped_spikes == 4
    assert [h["from_step"] for h in guard.rollback_history] == [220]


def test_rolled_back_can_restore_the_checkpoints_statistics():
    guard = warm(n=150)
    at_checkpoint = guard.state_dict()
    feed(guard, flat_run(9, 150, 50))
    spikes_at(guard, [200, 210, 220], 200, 221)
    guard.rolled_back(to_step=150, from_step=220, stats_from=at_checkpoint)
    assert stats(guard) == (at_checkpoint["loss_stats"], at_checkpoint["grad_stats"])
    assert guard.rollbacks == 1 and guard.skipped_spikes == 2  # counters are kept


def test_rollback_budget_exhausted_aborts_naming_steps_and_data():
    guard = warm(GuardConfig(max_rollbacks=1))
    assert spikes_at(guard, [200, 210, 220], 200, 221)[-1].action == "rollback"
    guard.rolled_back(to_step=150, from_step=220)
    d = spikes_at(guard, [160, 170, 180], 151, 181)[-1]
    assert (d.action, d.reason) == ("abort", "rollback_budget_exhausted")
    assert "rollback budget" in d.detail and "max_rollbacks=1" in d.detail
    assert "rollback 1: divergence over steps 200..220" in d.detail
    assert "from step 220 to step 150" in d.detail
    assert "now: divergence over steps 160..180" in d.detail
    assert "doc-220-b" in d.detail and "doc-180-b" in d.detail  # the data involved
    assert d.event is not None and d.event["event"] == "abort"
    assert d.event["rollbacks"][0]["start_step"] == 200
    assert d.event["rollbacks"][0]["sample_ids"][-1] == "doc-220-b"
    assert d.event["sample_ids"][-1] == "doc-180-b"


def test_zero_rollback_budget_aborts_at_the_first_divergence():
    guard = warm(GuardConfig(max_rollbacks=0))
    d = spikes_at(guard, [200, 201, 202], 200, 203)[-1]
    assert d.reason == "rollback_budget_exhausted"
    assert "0 of max_rollbacks=0" in d.detail


# -- state, events -------------------------------------------------------------------------


def eventful_run() -> list[Step]:
    """Warm-up, NaNs, spikes, a spike-window rollback, then a jump to a high loss level."""
    steps = list(clean_run(11, n=300))
    steps[120] = (120, math.nan, 1.0)
    steps[130] = (130, 2.9, math.inf)
    steps[150] = (150, 40.0, 1.0)
    steps[200] = (200, 3.0, 30.0)
    for t in (240, 250, 260):
        steps[t] = (t, 40.0, 0.5)
    for t in range(270, 285):
        steps[t] = (t, 20.0, 0.5)
    return steps


def play(guard: StabilityGuard, steps: list[Step]) -> list[Decision]:
    out = []
    for t, loss, g in steps:
        d = guard.observe(t, loss, g, ids(t))
        out.append(d)
        if d.action == "rollback":
            guard.rolled_back(to_step=t - 50, from_step=t)
    return out


def test_eventful_run_exercises_every_kind_of_decision():
    guard = StabilityGuard(GuardConfig(divergence_factor=2.0, loss_z=1e3))
    reasons = {d.reason for d in play(guard, eventful_run())}
    assert reasons >= {"non_finite_loss", "non_finite_grad", "grad_spike", "divergence"}
    guard = StabilityGuard(GuardConfig())
    reasons = {d.reason for d in play(guard, eventful_run())}
    assert reasons >= {
        "non_finite_loss",
        "non_finite_grad",
        "loss_spike",
        "grad_spike",
        "divergence",
        "rollback_budget_exhausted",
    }
    assert guard.rollbacks == 3


@pytest.mark.parametrize(
    "cfg",
    [GuardConfig(), GuardConfig(divergence_factor=2.0, loss_z=1e3), GuardConfig(max_rollbacks=1)],
)
@pytest.mark.parametrize("split", [10, 125, 245, 265, 275, 290])
def test_state_dict_round_trip_resumes_exactly(cfg, split):
    steps = eventful_run()
    original = StabilityGuard(cfg)
    play(original, steps[:split])
    # Through JSON, as a checkpoint would store it.
    state = json.loads(json.dumps(original.state_dict(), allow_nan=False))
    restored = StabilityGuard(cfg)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert play(restored, steps[split:]) == play(original, steps[split:])
    assert restored.state_dict() == original.state_dict()
    assert restored.events == original.events


def test_load_state_dict_rejects_another_version():
    guard = StabilityGuard(GuardConfig())
    state = guard.state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        guard.load_state_dict(state)


def test_events_are_json_serialisable_and_in_order():
    guard = StabilityGuard(GuardConfig(max_rollbacks=1))
    decisions = play(guard, eventful_run())
    non_ok = [d.event for d in decisions if d.action != "ok"]
    assert non_ok == guard.events and len(non_ok) > 5
    for ev in guard.events:
        line = json.dumps(ev, allow_nan=False, sort_keys=True)
        assert json.loads(line) == ev
        assert ev["kind"] == "event" and ev["event"] in ("skip", "rollback", "abort")
    assert [ev["step"] for ev in guard.events] == sorted(ev["step"] for ev in guard.events)
    assert all(d.event is None for d in decisions if d.action == "ok")


def test_numpy_sample_ids_become_plain_ints():
    guard = warm()
    d = guard.observe(200, 15.0, 1.0, np.arange(3, dtype=np.int64))
    assert d.event is not None and d.event["sample_ids"] == [0, 1, 2]
    assert all(type(i) is int for i in d.event["sample_ids"])
    json.dumps(guard.state_dict(), allow_nan=False)


def test_a_decisions_event_is_a_copy():
    guard = warm()
    d = guard.observe(200, 15.0, 1.0, ["a"])
    assert d.event is not None
    d.event["sample_ids"].append("mutated")
    assert guard.events[0]["sample_ids"] == ["a"]
