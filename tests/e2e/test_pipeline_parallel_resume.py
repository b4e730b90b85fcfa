"""Pipeline parallelism under torchrun on CPU (gloo): checkpoints resumed on another mesh
(test_pipeline_parallel.py has the model, the parity check, export and the refusals;
test_pipeline_parallel_guards.py the guards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_pipeline_parallel import PP_MODEL
from tests.support.parity import (
    assert_close,
    assert_same_weights,
    final_params,
    losses,
    one_process,
    run,
    write_config,
)
from training import checkpoint as ckpt
from training.metrics import read

PP2: dict[str, Any] = {"pp": 2}


# A constant schedule: the stopped run's `steps: 10` must not change its LR.
SCHEDULE = {"kind": "constant"}


@pytest.fixture(scope="module")
def uninterrupted(dataset, tmp_path_factory) -> Path:
    """20 steps in one process: the run every resharded one must equal (run once)."""
    tmp = tmp_path_factory.mktemp("ref")
    return one_process(write_config(tmp, "ref", dataset, model=PP_MODEL, schedule=SCHEDULE))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "then"),
    [("pp2", "one"), ("one", "pp2"), ("fsdp2", "pp2")],
    ids=["pp2_to_1", "1_to_pp2", "fsdp2_to_pp2"],
)
def test_resumes_on_another_mesh(dataset, tmp_path, uninterrupted, first, then):
    """10 steps on one mesh, the next 10 on another: the same losses and final weights as
    an uninterrupted single-process run. pp=2 -> 1 reads the stages' DCP checkpoint in one
    process; 1 -> pp=2 splits a plain checkpoint over the stages; fsdp2 -> pp=2 reads a DCP
    checkpoint whose optimizer groups are by position into stages that hold some of them."""
    ref, schedule = uninterrupted, SCHEDULE
    meshes: dict[str, tuple[int, dict[str, Any]]] = {
        "one": (1, {}),
        "pp2": (2, {"parallel": PP2}),
        "fsdp2": (2, {"parallel": "fsdp2"}),
    }
    (n_first, over_first), (n_then, over_then) = meshes[first], meshes[then]
    p = write_config(
        tmp_path, "moved", dataset, model=PP_MODEL, steps=10, schedule=schedule, **over_first
    )
    moved = run(n_first, p)
    assert ckpt.latest_step(moved / "checkpoints") == 10
    p = write_config(tmp_path, "moved", dataset, model=PP_MODEL, schedule=schedule, **over_then)
    run(n_then, p)
    recs = read(moved / "metrics.jsonl")
    assert any(r.get("event") == "resume" and r["step"] == 10 for r in recs)
    worst = assert_close(losses(ref), losses(moved))
    cfg = yaml.safe_load(p.read_text())
    w = assert_same_weights(final_params(ref, 20, cfg), final_params(moved, 20, cfg))
    print(f"\n{first} -> {then}: max relative difference: loss {worst:.2e}, weights {w:.2e}")
