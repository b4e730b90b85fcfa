"""What a person sees of a training run (issue 29, item 1): human lines on stderr (progress,
validation loss, a closing block with absolute paths), the machine events in
<run_dir>/events.jsonl, and on stderr only when a launcher asks (BALLAST_EVENTS=stderr, as
the pod entrypoint does for the supervisor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from core.protocol import parse_event
from tests.support.factories import TINY
from tests.support.helpers import ROOT
from training.console import event_line, is_narrative


def run(
    dataset: str, run_dir: Path, tmp_path: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "t.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "dataset": dataset,
                "run_dir": str(run_dir),
                "steps": 6,
                "micro_batch": 4,
                "eval_every": 3,
                "eval_batches": 1,
                "model": TINY,
                "checkpoint": {"every": 3},
                "schedule": {"warmup_steps": 2},
            }
        )
    )
    return subprocess.run(
        [sys.executable, "-m", "training.train", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_a_run_by_hand_prints_lines_for_people_and_files_its_events(train_dataset, tmp_path):
    run_dir = tmp_path / "run"
    r = run(train_dataset, run_dir, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    err = r.stderr.splitlines()
    assert not [ln for ln in err if "BALLAST_EVENT" in ln]
    assert "training from step 0 (no checkpoint yet)" in err
    assert any(ln.startswith("step 6/6, loss ") and "tokens/s" in ln for ln in err), err
    assert any(ln.startswith("step 3: validation loss ") for ln in err), err
    # The closing block: where things are, as absolute paths.
    assert any(ln.startswith("training: step 6, ") for ln in err), err
    assert any(ln.startswith("validation loss: ") and "(best " in ln for ln in err), err
    assert f"final checkpoint: {run_dir}/checkpoints/step-00000006" in err
    # Blank lines are neither warnings nor errors: once in CI (not reproduced since) a
    # third-party library wrote a bare newline to stderr during a run.
    assert all(is_narrative(ln) for ln in err if ln.strip()), r.stderr
    assert (
        f"loss curve: {run_dir.resolve()}/loss.png; metrics: "
        f"{run_dir.resolve()}/metrics.jsonl; run record: "
        f"{run_dir.resolve()}/final.json" in err
    )
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "start" and events[-1]["event"] == "done"
    assert events[-1]["step"] == 6


def test_a_launched_run_also_writes_events_to_stderr(train_dataset, tmp_path):
    r = run(train_dataset, tmp_path / "run", tmp_path, BALLAST_EVENTS="stderr")
    assert r.returncode == 0, r.stderr[-2000:]
    events = [e for ln in r.stderr.splitlines() if (e := parse_event(ln)) is not None]
    assert events[0]["event"] == "start" and events[-1]["event"] == "done"
    assert "training from step 0 (no checkpoint yet)" in r.stderr.splitlines()
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_event_lines_read_as_sentences():
    assert (
        event_line({"event": "resume", "step": 120, "checkpoint": "step-00000120"})
        == "resumed from step-00000120 at step 120"
    )
    assert (
        event_line(
            {
                "event": "progress",
                "step": 40,
                "steps": 120,
                "loss": 4.12345,
                "tokens_per_s": 3120.4,
                "eta_s": 65.0,
            }
        )
        == "step 40/120, loss 4.1235, 3,120 tokens/s, ETA 1m05s"
    )
    assert (
        event_line({"event": "diverged", "step": 70, "rollbacks": 3})
        == "diverged at step 70 beyond the rollback budget (3 rollbacks): exit 3"
    )
    assert (
        event_line({"event": "batch_size", "step": 9, "accum_from": 2, "accum_to": 4})
        == "step 9: batch_size (accum_from 2, accum_to 4)"
    )
