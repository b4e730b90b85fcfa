"""What a resumed run says when it was asked for something its checkpoint contradicts: fewer
steps than it has trained (issue 27, defect 5), or another total that reshapes the schedule
(defect 6)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.factories import train_config
from training import checkpoint as ckpt
from training.config import parse_train_config
from training.metrics import read
from training.trainer import Trainer


def train(dataset: str, run_dir: Path, steps: int, **over: object) -> int:
    return Trainer(
        parse_train_config(
            {
                **train_config(
                    dataset,
                    run_dir,
                    steps=steps,
                    eval_every=100,
                    eval_batches=1,
                    checkpoint={"every": 4},
                ),
                **over,
            }
        )
    ).run()


def test_fewer_steps_than_trained_is_refused_in_one_line(train_dataset, tmp_path, capfd):
    assert train(train_dataset, tmp_path, steps=8) == 0
    capfd.readouterr()
    assert train(train_dataset, tmp_path, steps=4) == 1
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error")]
    assert err == [
        f"error: run dir {tmp_path} is already at step 8, past steps: 4; nothing "
        "to train (raise steps, or give this run a run_dir of its own)"
    ]
    # Nothing was trained or rewritten: the run still ends at step 8.
    assert max(r["step"] for r in read(tmp_path / "metrics.jsonl") if r["kind"] == "train") == 8


def test_a_finished_run_relaunched_says_so_and_succeeds(train_dataset, tmp_path, capfd):
    assert train(train_dataset, tmp_path, steps=4) == 0
    capfd.readouterr()
    assert train(train_dataset, tmp_path, steps=4) == 0  # a Job's restart must stay exit 0
    assert f"note: run dir {tmp_path} is already at step 4 of 4; nothing to train" in (
        capfd.readouterr().err
    )


def test_extending_a_cosine_run_warns_of_the_lr_jump(train_dataset, tmp_path, capfd):
    assert train(train_dataset, tmp_path, steps=8) == 0
    capfd.readouterr()
    assert train(train_dataset, tmp_path, steps=12) == 0
    err = capfd.readouterr().err
    assert "warning: steps changed from 8 (checkpoint step-00000008) to 12: the cosine " in err
    [ev] = [r for r in read(tmp_path / "metrics.jsonl") if r.get("event") == "schedule_change"]
    assert (ev["step"], ev["steps_from"], ev["steps_to"]) == (8, 8, 12)
    assert ev["lr_mult_to"] > ev["lr_mult_from"]  # the decay is undone: the lr rises
    trains = {r["step"]: r["lr"] for r in read(tmp_path / "metrics.jsonl") if r["kind"] == "train"}
    assert trains[9] > trains[8]


@pytest.mark.parametrize("schedule", [{"kind": "wsd", "decay_fraction": 0.2}, {"kind": "constant"}])
def test_schedules_that_extend_smoothly_say_nothing(train_dataset, tmp_path, capfd, schedule):
    over = {
        "schedule": {"warmup_steps": 2, **schedule},
        "checkpoint": {"every": 4, "keep_last": 10},
    }
    assert train(train_dataset, tmp_path, steps=20, **over) == 0
    # As if interrupted at step 8, in WSD's stable phase (its decay starts at step 16).
    root = tmp_path / "checkpoints"
    for step in ckpt.steps(root):
        if step > 8:
            shutil.rmtree(root / ckpt.step_name(step))
    ckpt.write_latest(root, 8)
    capfd.readouterr()
    assert train(train_dataset, tmp_path, steps=40, **over) == 0
    assert "steps changed" not in capfd.readouterr().err
    assert not [r for r in read(tmp_path / "metrics.jsonl") if r.get("event") == "schedule_change"]
