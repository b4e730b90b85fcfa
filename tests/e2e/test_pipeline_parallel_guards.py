"""Pipeline parallelism under torchrun on CPU (gloo): the guards act as in one process, on
the loss of the last stage and the grad norm of the whole pipeline (a planted NaN and
spike; a learning-rate blow-up and its rollback to the pp=2 DCP checkpoint)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.test_pipeline_parallel import PP_MODEL
from tests.e2e.test_tensor_parallel_resume import guard_events
from tests.support.parity import assert_close, losses, one_process, run, write_config

PP2: dict[str, Any] = {"pp": 2}


@pytest.mark.slow
def test_guards_act_as_in_one_process(dataset, tmp_path):
    """A NaN loss and a loss spike, planted at the same steps: at pp=2 the guard skips the
    same steps with the same verdicts as in one process (every stage sees the last
    stage's loss and the whole pipeline's grad norm), and the runs go on to the same
    losses."""
    over: dict[str, Any] = {"guards": {"warmup_steps": 5}, "model": PP_MODEL}
    faults = ("--fault", "nan@8", "--fault", "spike@14")
    one = one_process(write_config(tmp_path, "one", dataset, **over), *faults)
    two = run(2, write_config(tmp_path, "pp", dataset, parallel=PP2, **over), *faults)
    events = guard_events(one)
    assert {e[1] for e in events} >= {9, 15}, events  # both faults were acted on
    assert guard_events(two) == events
    assert_close(losses(one), losses(two))


@pytest.mark.slow
def test_rollback_as_in_one_process(dataset, tmp_path):
    """A learning-rate blow-up (x1000 for steps 13-15, gone on the replay) rolls the run
    back to its last checkpoint (step 10, DCP at pp=2) and past the data window: the same
    guard events as in one process, and the same losses once it trains on."""
    guards = {"warmup_steps": 5, "spikes_to_rollback": 2, "window": 5}
    over: dict[str, Any] = {"guards": guards, "model": PP_MODEL}
    fault = ("--fault", "lr_blowup@12-15")
    one = one_process(write_config(tmp_path, "one", dataset, **over), *fault)
    two = run(2, write_config(tmp_path, "pp", dataset, parallel=PP2, **over), *fault)
    events = guard_events(one)
    assert any(e[0] == "rollback" for e in events), events
    assert guard_events(two) == events
    a, b = losses(one)[-5:], losses(two)[-5:]  # steps 16-20, after the replay
    assert all(abs(x - y) < 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (a, b)
