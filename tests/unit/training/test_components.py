"""Trainer components: a recipe option is one module. A toy option defined here, added to the
registry and nothing else, gets its hooks called, its state checkpointed and restored on
resume, and its fields into the eval record and final.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.factories import train_config
from training import checkpoint as ckpt
from training import components
from training.components.base import Component
from training.config import parse_train_config
from training.metrics import read
from training.trainer import Trainer


class AppliedSteps(Component):
    """Counts applied optimizer steps and the step ends it saw; reports them."""

    name = key = "applied_steps"

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        self.applied = 0
        self.ends: list[bool] = []
        self.restored: Any = "never"

    def state_dict(self) -> Any:
        return {"applied": self.applied}

    def load_state_dict(self, state: Any | None) -> None:
        self.restored = state
        if state is not None:
            self.applied = state["applied"]

    def after_update(self) -> None:
        self.applied += 1

    def step_end(self, applied: bool, host: list[float], grad_norm: float, accum: int) -> Any:
        self.ends.append(applied)
        return {"applied_so_far": self.applied}

    def eval_fields(self) -> dict[str, Any]:
        return {"applied_steps": self.applied}

    def final_fields(self) -> dict[str, Any]:
        return {"applied_steps": self.applied}


class StopAtThree(Component):
    name = "stop_at_three"

    @property
    def stopped(self) -> bool:
        return self.t.state.step >= 3


def config(dataset: str, run_dir: Path, steps: int) -> Any:
    return parse_train_config(
        train_config(
            dataset,
            run_dir,
            steps=steps,
            eval_every=2,
            checkpoint={"every": 2, "keep_last": 5},
            schedule={"warmup_steps": 1},
        )
    )


@pytest.fixture
def with_toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        components, "REGISTRY", [*components.REGISTRY, (AppliedSteps, lambda cfg: True)]
    )


def test_a_new_component_needs_only_its_module(train_dataset, tmp_path, with_toy):
    t = Trainer(config(train_dataset, tmp_path, steps=4))
    toy = t.component("applied_steps")
    assert isinstance(toy, AppliedSteps)
    assert t.run() == 0
    assert toy.applied == 4 and toy.ends == [True] * 4
    assert toy.restored == "never"  # a fresh run restores nothing
    evals = [r for r in read(tmp_path / "metrics.jsonl") if r["kind"] == "eval"]
    assert [(r["step"], r["applied_steps"]) for r in evals] == [(2, 2), (4, 4)]
    assert json.loads((tmp_path / "final.json").read_text())["applied_steps"] == 4
    state = ckpt.load(tmp_path / "checkpoints", 2, verified=False)
    assert state["applied_steps"] == {"applied": 2}

    # Resumed with more steps: the count goes on from the checkpoint's.
    t2 = Trainer(config(train_dataset, tmp_path, steps=6))
    toy2 = t2.component("applied_steps")
    assert isinstance(toy2, AppliedSteps)
    assert t2.run() == 0
    assert toy2.restored == {"applied": 4} and toy2.applied == 6


def test_step_results_carry_each_components_value(train_dataset, tmp_path, with_toy):
    t = Trainer(config(train_dataset, tmp_path, steps=2))
    try:
        out = t.train_step()
    finally:
        t.loader.close()
        t.ckpts.close()
    assert out.extras["applied_steps"] == {"applied_so_far": 1}


def test_a_component_can_end_the_run(train_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(
        components, "REGISTRY", [*components.REGISTRY, (StopAtThree, lambda cfg: True)]
    )
    assert Trainer(config(train_dataset, tmp_path, steps=10)).run() == 0
    assert json.loads((tmp_path / "final.json").read_text())["step"] == 3


def test_options_off_build_only_the_always_on(train_dataset, tmp_path):
    t = Trainer(config(train_dataset, tmp_path, steps=2))
    try:
        assert [c.name for c in t.components] == ["schedule_change", "progress"]
        # Nothing beyond the trainer's own entries in a default checkpoint.
        assert set(t.snapshot()) == {"scaler", "rng", "guard", "config", "trainer"}
    finally:
        t.loader.close()
        t.ckpts.close()
