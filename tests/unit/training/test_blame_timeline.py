"""`ballast blame`'s timeline from metrics records: steps numbered as the trainer numbers
them (step N is the N-th optimizer step: its train record and guard events say N;
checkpoint step-N is the state after it)."""

from __future__ import annotations

from typing import Any

import pytest

from training.blame import BlameError, Timeline

MB = 4  # micro_batch; accum 1: a step takes 4 samples


def train(n: int, skipped: int = 0) -> dict[str, Any]:
    return {"kind": "train", "step": n, "accum": 1, "samples_seen": MB * n, "skipped": skipped}


def event(kind: str, n: int, **kw: Any) -> dict[str, Any]:
    return {"kind": "event", "event": kind, "step": n, **kw}


def test_a_skip_is_the_step_of_its_train_record_and_the_last_step_is_the_last():
    recs = [train(1), train(2), event("skip", 3, reason="loss_spike"), train(3, 1)]
    recs += [train(n, 1) for n in range(4, 7)]
    t = Timeline.from_records(recs, MB)
    (e,) = t.events
    (b,) = e.batches
    assert (b.step, b.start, b.skipped) == (3, 8, "loss_spike")
    assert t.batch(6).start == 20
    with pytest.raises(BlameError, match=r"step 7 was not trained: the run's last step is 6$"):
        t.batch(7)
    with pytest.raises(BlameError, match="step 0 is not in the metrics log"):
        t.batch(0)


def test_a_rollback_window_and_the_step_that_called_it():
    # Steps 5 and 6 diverge; the guard's call at step 6 (not applied, no train record)
    # rolls back to checkpoint step-4 (the one before step 5).
    recs = [train(n) for n in range(1, 6)]
    recs.append(event("rollback", 6, start_step=5, end_step=6, to_step=4, reason="divergence"))
    # The sampler position is kept: the retrained step 5 takes step 6's batch.
    recs += [{**train(n), "samples_seen": MB * (n + 1)} for n in (5, 6)]
    t = Timeline.from_records(recs, MB)
    (e,) = t.events
    assert [(b.step, b.start, b.skipped) for b in e.batches] == [(5, 16, None), (6, 20, "rollback")]
    assert sorted(b.step for b in t.abandoned) == [5, 6]
    assert all(b.rolled_back for b in t.abandoned)
    assert [t.batch(n).start for n in (5, 6)] == [20, 24]  # step 5's old data is skipped


def test_a_divergence_found_after_its_step_is_that_steps_batch():
    # A non-finite validation loss after step 4 (counted, logged): rollback to step-3.
    recs = [train(n) for n in range(1, 5)]
    recs.append(
        event("rollback", 4, start_step=4, end_step=4, to_step=3, trigger="non_finite_val_loss")
    )
    t = Timeline.from_records(recs, MB)
    (e,) = t.events
    (b,) = e.batches
    assert (b.step, b.start, b.skipped, b.rolled_back) == (4, 12, "rollback", True)
    assert [a.step for a in t.abandoned] == [4]  # once
    assert sorted(t.steps) == [1, 2, 3]


def test_steps_between_sparse_train_records():
    t = Timeline.from_records([train(n) for n in (2, 4, 6)], MB)  # log_every: 2
    assert [t.batch(n).start for n in (1, 3, 5)] == [0, 8, 16]


def test_a_resume_drops_what_came_after_its_checkpoint():
    # Killed after step 5's skip event; resumed from checkpoint step-4: step 5 is redone.
    recs = [train(n) for n in range(1, 5)] + [event("skip", 5, reason="loss_spike")]
    recs += [event("resume", 4, checkpoint="step-00000004"), train(5), train(6)]
    t = Timeline.from_records(recs, MB)
    assert t.events == [] and t.steps[5].skipped is None
