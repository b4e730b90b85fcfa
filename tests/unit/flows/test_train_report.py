"""What the train flow's artifacts say (issue 29, item 2): an attempts table that fits the
page and never puts the checkpoint past the step reached, and a loss picture whose colours
tell validation loss from skipped steps, with a marker a single evaluation shows as."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from flows.train_report import COLUMNS, attempt_record, short_action, table_rows
from infra.supervisor import Attempt
from training.metrics import COLOURS, curve_caption, plot_loss, read


def _attempt(**over: object) -> Attempt:
    a = Attempt(0, "train-demo-2a9a53-8cd334-a0", [], time.time() - 90)
    for k, v in over.items():
        setattr(a, k, v)
    return a


def test_checkpoint_is_never_past_the_step_reached():
    # The trainer's checkpoint event at 75 came after its last progress event at 73.
    row = attempt_record(_attempt(step_reached=73, checkpoint=75, progress={"step": 73}))
    assert (row["step"], row["checkpoint"]) == (75, 75)


def test_attempts_table_has_few_short_columns():
    a = _attempt(
        ending="diverged",
        exit_code=3,
        detail="diverged at step 31 beyond the rollback budget (1 rollbacks): exit 3",
        resumed_from="fresh",
        step_reached=31,
        checkpoint=30,
        progress={"step": 31, "loss": 7.123456},
        next_action="restart with rollback: --recover --lr-scale=0.5 --rollback-to=20 "
        "--skip-to-sample=4096",
        ended_at=time.time(),
    )
    (row,) = table_rows([attempt_record(a)])
    assert tuple(row) == COLUMNS and len(COLUMNS) <= 8
    assert row["ending"] == "diverged (exit 3)" and row["then"] == "rollback to 20, lr x0.5"
    assert row["loss"] == 7.1235
    assert all(len(str(v)) <= 24 for v in row.values()), row


@pytest.mark.parametrize(
    ("action", "short"),
    [
        ("stop: done", "stop"),
        ("stop: budget exhausted", "stop: budget exhausted"),
        ("restart with resume", "resume"),
        ("restart with rollback: --recover --lr-scale=1", "rollback"),
    ],
)
def test_next_action_is_short(action: str, short: str):
    assert short_action(action) == short


def _metrics(path: Path, evals: list[int], skips: list[int] = ()) -> Path:
    recs = [{"kind": "train", "step": s, "loss": 5 - s / 20} for s in range(1, 41)]
    recs += [{"kind": "eval", "step": s, "val_loss": 5 - s / 25} for s in evals]
    recs += [{"kind": "event", "event": "skip", "step": s, "reason": "spike"} for s in skips]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _pixels(png: Path, colour: str) -> int:
    """How many pixels of the picture are (nearly) `colour`."""
    import matplotlib.colors
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    want = np.array(matplotlib.colors.to_rgb(colour))
    return int((np.abs(img - want).max(axis=-1) < 0.02).sum())


def test_one_evaluation_is_a_visible_point_in_its_own_colour(tmp_path: Path):
    png = tmp_path / "loss.png"
    plot_loss(_metrics(tmp_path / "m.jsonl", evals=[40]), png)
    # A marker of a few hundred pixels (and its legend entry), and nothing in the skipped
    # steps' colour: there are none.
    assert _pixels(png, COLOURS["validation"][0]) > 80
    assert _pixels(png, COLOURS["skip"][0]) == 0


def test_skipped_steps_and_validation_loss_have_different_colours(tmp_path: Path):
    m = _metrics(tmp_path / "m.jsonl", evals=[20, 40], skips=[12, 30])
    plot_loss(m, tmp_path / "loss.png")
    assert COLOURS["validation"][0] != COLOURS["skip"][0]
    assert _pixels(tmp_path / "loss.png", COLOURS["skip"][0]) > 0
    assert curve_caption(read(m)) == (
        "blue: train loss; green: validation loss (2 evals, last 3.4000 at step 40); "
        "orange: skipped steps (2)"
    )
