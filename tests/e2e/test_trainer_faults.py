"""The trainer against damaged state and numbers (issue 11): a corrupt or partial newest
checkpoint is set aside and an older valid one (local, else object storage) used; no valid
checkpoint at all is exit 1 with one line; NaN weights, a NaN validation loss and non-finite
config values never end a run "done"; and what a kill during a checkpoint write leaves is
cleaned on start. Real training on CPU with a tiny model; exit codes from subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from core.protocol import EVENT_PREFIX, EXIT_DIVERGED, EXIT_ERROR, EXIT_OK
from tests.support.factories import train_config
from tests.support.helpers import ROOT
from training import checkpoint as ckpt
from training.config import TrainConfigError, parse_train_config
from training.console import is_narrative
from training.faults import Faults
from training.metrics import read
from training.trainer import Trainer


def train(config: dict[str, Any], faults: Faults | None = None) -> int:
    return Trainer(parse_train_config(config), faults).run()


def run_cli(
    config: dict[str, Any], tmp_path: Path, *args: str, module: str = "training.train"
) -> subprocess.CompletedProcess[str]:
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", module]
    cmd += (
        ["--", "--config", str(p), *args]
        if module == "training.entrypoint"
        else ["--config", str(p), *args]
    )
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def said(stderr: str) -> list[str]:
    """stderr less the machine-readable event lines, the trainer's narrative (progress,
    evaluations, the closing block: training.console) and torchrun's and the entrypoint's
    own report of the exit code."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip()
        and not is_narrative(line)
        and not line.startswith(
            (EVENT_PREFIX, "entrypoint: torchrun exited", "entrypoint: trainer exited")
        )
    ]


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def damage(step_dir: Path, how: str) -> None:
    if how == "flipped_byte":
        flip_byte(step_dir / ckpt.STATE)
    elif how == "no_meta":
        (step_dir / ckpt.META).unlink()
    elif how == "garbled_meta":
        meta = (step_dir / ckpt.META).read_text()
        (step_dir / ckpt.META).write_text(meta[: len(meta) // 2])  # cut by a crash
    else:
        raise AssertionError(how)


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in read(run_dir / "metrics.jsonl") if r.get("event") == name]


def six_steps(ds: str, run_dir: Path, **over: Any) -> dict[str, Any]:
    """Checkpoints at 0, 3 and 6 (a constant schedule: a resume to 9 changes no LR)."""
    base = {
        "steps": 6,
        "eval_every": 100,
        "eval_batches": 1,
        "checkpoint": {"every": 3, "keep_last": 3},
        "schedule": {"kind": "constant"},
    }
    return train_config(ds, run_dir, log_every=1, **{**base, **over})


# -- 1. a corrupt or partial newest checkpoint -------------------------------------------------


@pytest.mark.parametrize("how", ["flipped_byte", "no_meta", "garbled_meta"])
def test_corrupt_newest_checkpoint_is_set_aside_and_the_previous_one_used(dataset, tmp_path, how):
    run = tmp_path / "run"
    c = six_steps(dataset, run)
    assert train(c) == EXIT_OK
    root = run / "checkpoints"
    damage(root / ckpt.step_name(6), how)

    r = run_cli(c, tmp_path, "--steps", "9")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = said(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("warning:"), lines
    assert ckpt.step_name(6) in lines[0] and "moved aside" in lines[0]
    aside = [p.name for p in root.glob(f"{ckpt.step_name(6)}.corrupt-*")]
    assert len(aside) == 1 and aside[0] in lines[0]  # renamed, not deleted
    [resume] = events(run, "resume")
    assert resume["checkpoint"] == ckpt.step_name(3)
    [bad] = events(run, "checkpoint_corrupt")
    assert bad["kind"] == "event" and bad["checkpoint"] == ckpt.step_name(6)
    assert bad["moved_to"].endswith(aside[0])
    # Trained on from step 3 to 9 (retention kept 3, dropped nothing it should not, and
    # left the set-aside directory alone).
    assert ckpt.latest_step(root) == 9
    assert ckpt.steps(root) == [0, 3, 6, 9]
    assert (root / aside[0]).is_dir()
    state = ckpt.load(root, 9)
    assert state["trainer"]["step"] == 9


def test_corrupt_checkpoint_through_the_pod_entrypoint_is_not_a_crash(dataset, tmp_path):
    """What Kubernetes and the supervisor see: exit 0 after the fallback, not 2."""
    run = tmp_path / "run"
    c = six_steps(dataset, run, steps=3)
    assert train(c) == EXIT_OK
    flip_byte(run / "checkpoints" / ckpt.step_name(3) / ckpt.STATE)
    r = run_cli(c, tmp_path, "--steps", "4", module="training.entrypoint")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    warnings = [line for line in said(r.stderr) if line.startswith("warning:")]
    assert len(warnings) == 1 and ckpt.step_name(3) in warnings[0], said(r.stderr)
    assert events(run, "resume")[0]["checkpoint"] == ckpt.step_name(0)


def test_garbled_latest_pointer_uses_the_newest_valid_checkpoint(dataset, tmp_path):
    run = tmp_path / "run"
    c = six_steps(dataset, run, steps=3)
    assert train(c) == EXIT_OK
    (run / "checkpoints" / ckpt.LATEST).write_text("\x00\x00garbage")
    c["steps"] = 4
    assert train(c) == EXIT_OK
    assert events(run, "resume")[0]["checkpoint"] == ckpt.step_name(3)
    assert ckpt.latest_step(run / "checkpoints") == 4


def test_no_valid_checkpoint_anywhere_exits_1_with_one_line(dataset, tmp_path):
    run = tmp_path / "run"
    c = six_steps(dataset, run, steps=3)
    assert train(c) == EXIT_OK
    root = run / "checkpoints"
    flip_byte(root / ckpt.step_name(3) / ckpt.STATE)
    damage(root / ckpt.step_name(0), "garbled_meta")

    r = run_cli(c, tmp_path, "--steps", "6")
    assert r.returncode == EXIT_ERROR, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = said(r.stderr)
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "no valid checkpoint" in errors[0], lines
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 2 and len(lines) == 3, lines  # one per bad checkpoint
    assert sorted(p.name.split(".")[0] for p in root.glob("step-*.corrupt-*")) == [
        ckpt.step_name(0),
        ckpt.step_name(3),
    ]
    assert [e["checkpoint"] for e in events(run, "checkpoint_corrupt")] == [
        ckpt.step_name(3),
        ckpt.step_name(0),
    ]
    # A restart does not quietly start again from step 0: still exit 1.
    c["steps"] = 6
    assert train(c) == EXIT_ERROR
    assert ckpt.steps(root) == []


def test_corrupt_local_checkpoint_is_fetched_again_from_object_storage(dataset, tmp_path):
    run = tmp_path / "run"
    store = tmp_path / "store"
    c = six_steps(dataset, run, checkpoint={"every": 3, "keep_last": 3, "remote": str(store)})
    assert train(c) == EXIT_OK
    root = run / "checkpoints"
    good = (root / ckpt.step_name(6) / ckpt.STATE).read_bytes()
    flip_byte(root / ckpt.step_name(6) / ckpt.STATE)
    damage(root / ckpt.step_name(3), "no_meta")

    r = run_cli(c, tmp_path, "--steps", "7")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    warnings = [line for line in said(r.stderr) if line.startswith("warning:")]
    assert len(warnings) == 2, said(r.stderr)
    # The newest valid checkpoint anywhere: step 6 from object storage, not step 0 on disk.
    assert events(run, "resume")[0]["checkpoint"] == ckpt.step_name(6)
    assert {e["checkpoint"] for e in events(run, "checkpoint_corrupt")} == {
        ckpt.step_name(6),
        ckpt.step_name(3),
    }
    aside = next(root.glob(f"{ckpt.step_name(6)}.corrupt-*"))
    assert (aside / ckpt.STATE).read_bytes() != good  # the damaged copy, kept
    assert ckpt.latest_step(root) == 7


def test_rollback_skips_a_corrupt_checkpoint(dataset, tmp_path):
    """A rollback target that fails verification is set aside; the rollback goes to the
    newest valid checkpoint before it, and the run completes."""

    class Damaging(Faults):
        """Step 6's checkpoint is damaged once written; steps 8 and 9 give a NaN loss on
        the first pass (two in a row: a divergence starting at step 8, whose checkpoint
        before it is the damaged step-6). Faults count the steps done before the faulty
        one: nan_at 7 is step 8."""

        def after_save(self, step: int, root: Path) -> None:
            if step == 6:
                flip_byte(root / ckpt.step_name(step) / ckpt.STATE)

        def before_step(self, step: int, rollbacks: list[dict[str, Any]]) -> None:
            self.nan_at = set() if rollbacks else {7, 8}

    run = tmp_path / "run"
    c = six_steps(
        dataset,
        run,
        steps=10,
        guards={"max_nonfinite_steps": 2, "max_rollbacks": 1},
        checkpoint={"every": 3, "keep_last": 5, "async_save": False},
    )
    assert train(c, Damaging()) == EXIT_OK
    [rollback] = events(run, "rollback")
    assert (rollback["trigger"], rollback["step"], rollback["start_step"], rollback["to_step"]) == (
        "non_finite",
        9,
        8,
        3,
    )
    assert "divergence over steps 8..9" in rollback["detail"]
    # Found while rolling back from step 9.
    [bad] = events(run, "checkpoint_corrupt")
    assert bad["checkpoint"] == ckpt.step_name(6) and bad["step"] == 9
    assert len(list((run / "checkpoints").glob(f"{ckpt.step_name(6)}.corrupt-*"))) == 1
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == 10 and len(final["rollbacks"]) == 1


# -- 2. NaN weights never end "done" -----------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (("optim", "lr"), float("inf")),
        (("optim", "lr"), float("nan")),
        (("optim", "betas"), [0.9, float("nan")]),
        (("optim", "grad_clip"), float("inf")),
        (("guards", "loss_z"), float("inf")),
        (("model", "rope_theta"), float("-inf")),
        (("schedule", "min_lr_ratio"), float("nan")),
        (("precision", "z_loss"), float("inf")),
    ],
)
def test_non_finite_config_values_are_rejected_naming_the_key(key, value):
    with pytest.raises(TrainConfigError, match=rf"{key[0]}\.{key[1]}(\[1\])?: .*finite"):
        parse_train_config({"dataset": "d", key[0]: {key[1]: value}})


def test_infinite_lr_in_yaml_exits_1(dataset, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        yaml.safe_dump(train_config(dataset, tmp_path / "run", log_every=1)).replace(
            "schedule:", "optim:\n  lr: .inf\nschedule:"
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "training.train", "--config", str(p)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == EXIT_ERROR, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "optim.lr: Input should be a finite number" in r.stderr
    assert not (tmp_path / "run").exists()


def nan_run(ds: str, run: Path, **over: Any) -> dict[str, Any]:
    """lr 2e3 (a typo for 2e-3): the weights are NaN by step ~6."""
    return train_config(ds, run, log_every=1, optim={"lr": 2.0e3}, **over)


def test_nonfinite_steps_in_a_row_roll_back_then_exit_3(dataset, tmp_path):
    run = tmp_path / "run"
    c = nan_run(
        dataset,
        run,
        steps=40,
        eval_every=100,
        checkpoint={"every": 100},
        guards={"max_rollbacks": 1},
    )
    r = run_cli(c, tmp_path)
    assert r.returncode == EXIT_DIVERGED, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "non-finite steps in a row" in r.stderr and "max_nonfinite_steps=5" in r.stderr
    [rollback] = events(run, "rollback")
    assert rollback["trigger"] == "non_finite" and rollback["to_step"] == 0
    assert rollback["end_step"] - rollback["start_step"] == 4  # 5 steps, named
    assert f"steps {rollback['start_step']}..{rollback['end_step']}" in r.stderr
    assert (run / "DIVERGED").is_file() and not (run / "final.json").exists()


def test_nan_validation_loss_is_a_divergence_not_done(dataset, tmp_path):
    run = tmp_path / "run"
    # The loss is NaN from step 6: at the evaluation after step 7, two non-finite steps in a
    # row are not yet a divergence by themselves (max_nonfinite_steps: 5).
    c = nan_run(
        dataset,
        run,
        steps=10,
        eval_every=8,
        eval_batches=2,
        checkpoint={"every": 100},
        guards={"max_rollbacks": 0},
    )
    r = run_cli(c, tmp_path)
    assert r.returncode == EXIT_DIVERGED, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "validation loss nan at step 8" in r.stderr
    [abort] = events(run, "abort")
    assert abort["trigger"] == "non_finite_val_loss" and abort["step"] == 8
    assert not (run / "final.json").exists()


def test_nan_weights_are_never_checkpointed(dataset, tmp_path):
    """lr x weight_decay = 1e40 (finite, absurd): AdamW's decoupled decay multiplies the
    weights by 1 - 1e40, so the first update makes them inf/NaN. (The guards never apply an
    update from a non-finite step, so with a merely huge LR the weights stay finite and the
    loss is what turns NaN: see the tests above.)"""
    run = tmp_path / "run"
    c = train_config(
        dataset,
        run,
        log_every=1,
        steps=6,
        eval_every=100,
        optim={"lr": 1.0e37, "weight_decay": 1e3},
        checkpoint={"every": 3, "keep_last": 5},
        guards={"max_rollbacks": 0},
    )
    r = run_cli(c, tmp_path)
    assert r.returncode == EXIT_DIVERGED, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "non-finite weights at step 3 (checkpoint not written)" in r.stderr
    assert [e["trigger"] for e in events(run, "abort")] == ["non_finite_weights"]
    root = run / "checkpoints"
    assert ckpt.steps(root) == [0]
    for s in ckpt.steps(root):
        assert all(torch.isfinite(t).all() for t in ckpt.load(root, s)["model"].values())


def test_fp16_nan_weights_are_not_taken_for_loss_scale_overflows(dataset, tmp_path):
    """With fp16 loss scaling a non-finite gradient norm is routine (the scaler skips the
    step), but a non-finite loss is not: NaN weights end in a divergence, not in "done"."""
    run = tmp_path / "run"
    c = nan_run(
        dataset,
        run,
        steps=20,
        eval_every=100,
        checkpoint={"every": 100},
        precision={"dtype": "fp16"},
        guards={"max_rollbacks": 0},
    )
    assert train(c) == EXIT_DIVERGED
    [abort] = events(run, "abort")
    assert abort["trigger"] == "non_finite"


# -- 3. what a kill during a checkpoint write leaves -------------------------------------------


def test_stale_checkpoint_temporaries_are_cleaned_on_start(dataset, tmp_path):
    run = tmp_path / "run"
    c = six_steps(dataset, run, steps=3)
    assert train(c) == EXIT_OK
    root = run / "checkpoints"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # What a SIGKILL between torch.save and the rename leaves: a temporary directory with a
    # state.pt and no meta.json, and a temporary `latest`.
    stale = root / f".{ckpt.step_name(6)}.tmp-{dead.pid}"
    stale.mkdir()
    (stale / ckpt.STATE).write_bytes((root / ckpt.step_name(3) / ckpt.STATE).read_bytes())
    stale_latest = root / f".{ckpt.LATEST}.tmp-{dead.pid}"
    stale_latest.write_text(ckpt.step_name(6) + "\n")
    live = root / f".{ckpt.step_name(9)}.tmp-{os.getpid()}"  # alive: this test
    live.mkdir()

    r = run_cli(c, tmp_path, "--steps", "4")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    lines = said(r.stderr)
    assert len(lines) == 1, lines
    assert stale.name in lines[0] and stale_latest.name in lines[0]
    assert live.name not in lines[0]
    assert not stale.exists() and not stale_latest.exists()
    assert live.is_dir()
    assert ckpt.latest_step(root) == 4
