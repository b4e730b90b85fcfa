"""`ballast blame`: from a training step back to its documents. A garbage document (a run
of slashes, with quality off for its source) is injected into a corpus; the spike guard
skips the steps it lands in, and blame must name its file and line for each of them. The
mapping itself is checked against the trainer's own record: every guard event carries
the dataset rows of its batch (`sample_ids`), before and after a rollback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.factories import train_config
from tests.support.helpers import ROOT, assert_one_line_error, cli_env, run_cli, shared_file
from training.console import event_line
from training.metrics import read

GARBAGE_LINE = 4  # the line of junk.jsonl that holds the slashes


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("blame")
    text = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:20_000]
    (tmp / "plays.txt").write_text(text, encoding="utf-8")
    rows: list[dict[str, Any]] = [{"text": f"Line {i} of a harmless file."} for i in range(3)]
    # 256 bytes of "/": four packed rows of 64 byte tokens, a loss spike wherever it lands.
    rows.insert(GARBAGE_LINE - 1, {"text": "/" * 256})
    (tmp / "junk.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "prep.yaml").write_text(
        yaml.safe_dump(
            {
                "output": str(tmp / "prep"),
                "workers": 1,
                "sources": [
                    {"name": "plays", "paths": [str(tmp / "plays.txt")], "txt_unit": "paragraph"},
                    {"name": "junk", "paths": [str(tmp / "junk.jsonl")], "quality": []},
                ],
                "dedup": {"exact": True, "near": False},
                "quality": ["length"],
                "pack": {"seq_len": 64},
                "dataset": {"validation_fraction": 0.05},
            }
        )
    )
    r = run_cli("prep", str(tmp / "prep.yaml"), "--no-progress")
    assert r.returncode == 0, r.stderr
    return tmp


def train(tmp: Path, name: str, *faults: str) -> Path:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            train_config(
                str(tmp / "prep" / "dataset"),
                tmp / name,
                seed=0,
                steps=150,
                micro_batch=2,
                eval_every=1000,
                eval_batches=1,
                optim={"lr": 3e-3},
                schedule={"warmup_steps": 5},
                checkpoint={"every": 20, "keep_last": 1},
                # A short EMA: a 150-step run's early loss drop would otherwise dominate the
                # variance for the whole run and hide the spikes.
                guards={"warmup_steps": 20, "spikes_to_rollback": 10, "ema_beta": 0.9},
            )
        )
    )
    if faults:  # the trainer's fault hooks: its module entry point takes them
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "training.train",
                "--config",
                str(cfg),
                *(a for f in faults for a in ("--fault", f)),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=cli_env(),
        )
    else:
        r = run_cli("train", str(cfg))
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp / name


def blame_json(run: Path, *args: str) -> Any:
    r = run_cli("blame", str(run), *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def events(run: Path) -> list[dict[str, Any]]:
    return [
        json.loads(ln)
        for ln in (run / "metrics.jsonl").read_text().splitlines()
        if '"kind": "event"' in ln
    ]


def test_blame_names_the_garbage_document_of_each_skipped_step(prepared: Path) -> None:
    run = train(prepared, "run")
    garbage = f"{prepared / 'junk.jsonl'}:{GARBAGE_LINE}"
    report = blame_json(run, "--event")
    skips = [e for e in report if e["event"]["event"] == "skip"]
    assert skips, "the garbage document caused no skipped step"
    for e in skips:
        (batch,) = e["batches"]
        assert batch["skipped"] == "loss_spike"
        paths = {d["path"] for row in batch["rows"] for d in row["documents"]}
        assert garbage in paths, (e["event"]["step"], paths)
        # The rows blame computed are the rows the trainer's guard recorded for the step.
        assert [row["row"] for row in batch["rows"]] == e["event"]["sample_ids"]
    text = run_cli("blame", str(run), "--event")
    assert text.returncode == 0 and text.stdout.count(garbage) >= len(skips)
    # The metrics log's own events name it too (the guard's describe hook).
    for ev in (e for e in events(run) if e["event"] == "skip"):
        assert garbage in {d["path"] for d in ev["documents"]}
    # --doc: every skipped step is among the steps that trained on the document.
    hits = blame_json(run, "--doc", f"junk/junk.jsonl:{GARBAGE_LINE}")
    assert hits["documents"][0]["path"] == garbage
    skipped_steps = {h["step"] for h in hits["steps"] if h["skipped"]}
    assert skipped_steps == {e["event"]["step"] for e in skips}
    # The Prefect artifact rows of the train flow name it as well.
    from flows.train import _guard_events

    rows = _guard_events(run / "metrics.jsonl")
    assert len(rows) == len(skips) and all(garbage in r["documents"] for r in rows)


def test_blame_follows_the_sampler_through_a_rollback(prepared: Path) -> None:
    """A transient LR blow-up makes the guard roll back (and skip the window's data), then
    an injected spike at step 111 (`spike@110`: after 110 steps) is skipped: blame's rows
    for every event's batches equal the ids the guard recorded, and `--step 111` gives
    that step's rows."""
    run = train(prepared, "rb", "lr_blowup@60-70", "spike@110")
    report = blame_json(run, "--event")
    kinds = [e["event"]["event"] for e in report]
    assert "rollback" in kinds and kinds.index("rollback") < len(kinds) - 1
    for e in report:
        rows = [row["row"] for b in e["batches"] for row in b["rows"]]
        assert rows == e["event"]["sample_ids"], e["event"]["step"]
    (late,) = [e for e in report if e["event"]["step"] == 111]
    step = blame_json(run, "--step", "111")
    assert [row["row"] for row in step["rows"]] == late["event"]["sample_ids"]
    assert step["step"] == 111 and step["skipped"] == "loss_spike"
    # The rolled-back window's steps are on the abandoned timeline.
    rb = next(e for e in report if e["event"]["event"] == "rollback")
    first = rb["event"]["start_step"]
    again = blame_json(run, "--step", str(first))
    assert again["abandoned"] and not again["rolled_back"]
    assert again["samples"][0] != again["abandoned"][0]["samples"][0]  # data skipped


def test_blame_numbers_steps_as_the_trainer_does(prepared: Path) -> None:
    """One numbering: the last step is the one the console's "step 150/150" names, and
    a skip event's step is the step whose train record counts the skip."""
    run = prepared / "run"
    if not (run / "metrics.jsonl").is_file():
        run = train(prepared, "run")
    said = [
        event_line(e)
        for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
        if e["event"] == "progress"
    ]
    assert said[-1].startswith("step 150/150, "), said
    last = blame_json(run, "--step", "150")
    assert last["step"] == 150 and "train_record_step" not in last
    r = run_cli("blame", str(run), "--step", "151")
    assert r.returncode == 1
    assert_one_line_error(r, "step 151 was not trained: the run's last step is 150")
    r = run_cli("blame", str(run), "--step", "0")
    assert r.returncode == 1
    assert_one_line_error(r, "steps count from 1")
    trains = [r for r in read(run / "metrics.jsonl") if r.get("kind") == "train"]
    counted = {
        r["step"]
        for p, r in zip([{"skipped": 0}, *trains[:-1]], trains, strict=True)
        if r["skipped"] > p["skipped"]
    }
    skips = {e["step"] for e in events(run) if e["event"] == "skip"}
    assert skips and skips == counted
    for n in sorted(skips)[:3]:
        assert blame_json(run, "--step", str(n))["skipped"] == "loss_spike"
    text = run_cli("blame", str(run), "--step", str(min(skips)))
    assert text.stdout.startswith(f"step {min(skips)}: samples "), text.stdout


def test_blame_bad_requests(prepared: Path, tmp_path: Path) -> None:
    run = prepared / "run"
    if not (run / "metrics.jsonl").is_file():
        run = train(prepared, "run")
    r = run_cli("blame", str(run), "--step", "5000")
    assert r.returncode == 1
    assert_one_line_error(r, "step 5000 was not trained")
    r = run_cli("blame", str(run), "--doc", "no/such:1")
    assert r.returncode == 1
    assert_one_line_error(r, "no/such:1")
    r = run_cli("blame", str(tmp_path / "none"), "--event")
    assert r.returncode == 1
    assert_one_line_error(r, "no such run directory")
    r = run_cli("blame", str(run), "--step", "3", "--dataset", str(tmp_path))
    assert r.returncode == 1
    assert_one_line_error(r, "manifest.json")
