"""The in-loop evals in the flows' artifacts, read back from a real temporary Prefect API
after real tiny training runs (12 steps at width 32, a multiple-choice task and a text set
every 2 steps, tests/support/evals.py): the latest results in `train-progress` and
`train-summary`, a `train-eval-regression` table for each regression with the documents
trained on in between, each regression posted once however often the log is read, and
the pipeline's summary and MLflow run with the benchmark numbers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.evals import evals_section
from tests.support.factories import train_config
from tests.support.tiny_run import write_configs
from training.metrics import read

STEPS = 12


def evals_config(tmp: Path, dataset: str, action: str = "warn") -> Path:
    cfg = tmp / "train.yaml"
    cfg.write_text(
        yaml.safe_dump(
            train_config(
                dataset,
                tmp / "run",
                steps=STEPS,
                eval_every=6,
                eval_batches=2,
                checkpoint={"every": 6},
                optim={"name": "adamw", "lr": 1e-2},
                evals=evals_section(tmp / "evals", action=action),
            )
        )
    )
    return cfg


async def _run_artifacts(flow_run_id: Any, key: str) -> list[Any]:
    """Every artifact `key` of one flow run, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    async with get_client() as client:
        arts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )
    return sorted(arts, key=lambda a: a.created)


def cell(rec: dict[str, Any], key: str) -> str:
    """A metric as the tables write it: value ± standard error."""
    return f"{rec[key]:.4g} ± {rec[key + '_stderr']:.2g}"


def downstream(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "downstream"]


def regressions(run_dir: Path) -> list[dict[str, Any]]:
    return [
        r
        for r in read(run_dir / "metrics.jsonl")
        if r.get("kind") == "event" and r.get("event") == "eval_regression"
    ]


@pytest.fixture(scope="module")
def trained(prefect_api, train_dataset, tmp_path_factory):
    from flows.train import train

    tmp = tmp_path_factory.mktemp("flow-evals")
    state = train(str(evals_config(tmp, train_dataset)), launch={"poll_s": 0.3}, return_state=True)
    return state.state_details.flow_run_id, state.result(), tmp / "run"


def test_summary_and_progress_show_the_latest_results(trained):
    run_id, result, run_dir = trained
    last = downstream(run_dir)[-1]
    assert last["step"] == STEPS and result["downstream"] == last
    rows = [
        f"| shake | 18 | {cell(last, 'shake/acc')} | {cell(last, 'shake/acc_per_char')} | "
        f"{cell(last, 'shake/acc_per_token')} | {cell(last, 'shake/bpb')} |",
        f"| garbage | 8 |  |  |  | {cell(last, 'garbage/bpb')} |",
    ]
    (summary,) = asyncio.run(_run_artifacts(run_id, "train-summary"))
    assert f"**Downstream evals** at step {STEPS}, value ± standard error:" in summary.data
    for row in rows:
        assert row in summary.data, summary.data
    # The progress card, updated in place, ends with the same table under its closing line.
    (progress,) = asyncio.run(_run_artifacts(run_id, "train-progress"))
    assert progress.data == 100
    assert progress.description.startswith(f"**done** at step {STEPS}")
    for row in rows:
        assert row in progress.description, progress.description


def test_the_terminal_summary_has_them_too(trained):
    from flows.train import summary_text

    _, result, run_dir = trained
    last = downstream(run_dir)[-1]
    text = summary_text(result)
    assert f"  downstream evals:  step {STEPS}\n" in text
    assert f"    garbage  bits/byte {cell(last, 'garbage/bpb')}\n" in text
    assert f"    shake    acc {cell(last, 'shake/acc')}, acc/char " in text
    assert f"  step {regressions(run_dir)[0]['step']}: eval regression: garbage bpb " in text


def test_each_regression_is_a_table_with_its_data(trained):
    run_id, result, run_dir = trained
    events = regressions(run_dir)
    # The English-trained model forgets the CJK text set: its bpb rises past its best.
    assert events and {(e["task"], e["metric"]) for e in events} == {("garbage", "bpb")}
    assert result["eval_regressions"] == events
    tables = asyncio.run(_run_artifacts(run_id, "train-eval-regression"))
    assert len(tables) == len(events)
    for art, ev in zip(tables, events, strict=True):
        assert art.type == "table"
        rows = {r["field"]: r["value"] for r in json.loads(art.data)}
        assert rows["task"] == "garbage" and rows["metric"] == "bpb"
        assert rows["steps (best -> now)"] == f"{ev['best_step']} -> {ev['step']}"
        assert ev["best_step"] < ev["step"]
        assert rows["value (best -> now)"] == f"{ev['best']:.4g} -> {ev['value']:.4g}"
        assert (
            rows["drop"] == f"{ev['drop'] / ev['stderr']:.1f} standard errors (threshold k = 2.0)"
        )
        assert rows["action"] == "warn"
        assert rows["source"].startswith("100% tiny (")  # the one source of the dataset
        docs = [r["value"] for r in json.loads(art.data) if r["field"].startswith("document ")]
        assert docs and len(docs) == min(len(ev["documents"]), 8)
        for d, want in zip(docs, ev["documents"], strict=False):
            assert d.startswith(f"{want['path']} (tiny, {want['tokens']} tokens)"), d
            assert "shakespeare.txt#para=" in d
        assert f"garbage bpb {ev['value']:.4g} (best" in art.description
    (summary,) = asyncio.run(_run_artifacts(run_id, "train-summary"))
    assert f"**Eval regressions**: {len(events)}" in summary.data
    assert f"- step {events[0]['step']}: eval regression: garbage bpb" in summary.data


def test_a_regression_is_posted_once_however_the_log_is_read(prefect_api, tmp_path):
    """A log an earlier flow run left, then read in pieces, a line cut mid-write, then
    rewritten by a resume (a new file, the regression's step trained again): the earlier
    regression is listed but not posted again, each new one gets one table, and the one
    the re-trained step gives (another value) one more."""
    from prefect import flow

    from flows.train_evals import EvalReport

    def event(step: int, value: float) -> str:
        ev = {"kind": "event", "event": "eval_regression", "step": step, "task": "t"}
        ev.update({"metric": "bpb", "value": value, "best": 1.0, "best_step": 2})
        ev.update({"drop": value - 1.0, "stderr": 0.01, "k": 3.0, "action": "warn"})
        return json.dumps(ev) + "\n"

    def down(step: int) -> str:
        return json.dumps({"kind": "downstream", "step": step, "t/bpb": 1.0, "t/n": 4.0}) + "\n"

    log = tmp_path / "metrics.jsonl"
    earlier = down(2) + event(2, 1.2)  # an earlier flow run's, which posted its own table

    @flow
    def follow() -> None:  # as the train flow does, inside its run
        log.write_text(earlier)
        report = EvalReport(log)
        assert [e["step"] for e in report.regressions] == [2]  # listed, not posted again
        assert not report.poll()
        whole = down(4) + event(4, 1.5)
        with open(log, "a") as f:
            f.write(whole[:-10])  # the event's line not yet whole
        assert report.poll() and report.latest["step"] == 4 and len(report.regressions) == 1
        with open(log, "a") as f:
            f.write(whole[-10:])
        assert report.poll() and len(report.regressions) == 2
        assert not report.poll()
        # A resume from step 2's checkpoint: the log rewritten (a new file), step 4 again.
        new = tmp_path / "new.jsonl"
        new.write_text(earlier + whole + down(6) + event(6, 1.7))
        new.replace(log)
        assert report.poll() and report.latest["step"] == 6
        assert [e["step"] for e in report.regressions] == [2, 4, 6]

    state = follow(return_state=True)
    assert state.is_completed(), state
    tables = asyncio.run(_run_artifacts(state.state_details.flow_run_id, "train-eval-regression"))
    assert [json.loads(t.data)[2]["value"] for t in tables] == ["2 -> 4", "2 -> 6"]


def test_rollback_regressions_each_get_a_table(prefect_api, train_dataset, tmp_path):
    """`action: rollback`: the trainer rolls back to the checkpoint before the best step and
    trains the window again, which regresses again (the CJK set gets worse whatever the
    English batch), until its rollback budget is spent and it exits as diverged (no
    recovery here). Each regression, at the same step but with another value, has its
    table; the flow run fails, its artifacts posted all the same."""
    from flows.train import train

    cfg = evals_config(tmp_path, train_dataset, action="rollback")
    state = train(str(cfg), launch={"poll_s": 0.3, "max_recoveries": 0}, return_state=True)
    assert state.is_failed()
    events = regressions(tmp_path / "run")
    assert len(events) >= 2 and len({e["value"] for e in events}) == len(events)
    run_id = state.state_details.flow_run_id
    tables = asyncio.run(_run_artifacts(run_id, "train-eval-regression"))
    assert len(tables) == len(events)
    for art, ev in zip(tables, events, strict=True):
        rows = {r["field"]: r["value"] for r in json.loads(art.data)}
        assert rows["action"] == "rollback"
        assert rows["value (best -> now)"] == f"{ev['best']:.4g} -> {ev['value']:.4g}"
    (summary,) = asyncio.run(_run_artifacts(run_id, "train-summary"))
    assert (
        summary.data.startswith("**diverged**")
        and f"**Eval regressions**: {len(events)}" in summary.data
    )


@pytest.fixture(scope="module")
def piped(prefect_api, tmp_path_factory):
    from flows.pipeline import pipeline

    tmp = tmp_path_factory.mktemp("pipeline-evals")
    prep_cfg, train_cfg = write_configs(tmp, steps=8, eval_every=4, checkpoint_every=4)
    doc = yaml.safe_load(train_cfg.read_text())
    doc["evals"] = evals_section(tmp / "evals", every=4)
    doc["optim"] = {"name": "adamw", "lr": 1e-2}
    doc["tracking"] = {}  # MLflow in a SQLite store under the run dir
    train_cfg.write_text(yaml.safe_dump(doc))
    state = pipeline(str(prep_cfg), str(train_cfg), launch={"poll_s": 0.3}, return_state=True)
    return state.state_details.flow_run_id, state.result(), tmp / "run"


def test_pipeline_summary_has_the_evals(piped):
    run_id, _, run_dir = piped
    last = downstream(run_dir)[-1]
    assert last["step"] == 8
    (summary,) = asyncio.run(_run_artifacts(run_id, "pipeline-summary"))
    text = summary.data
    assert "## Evals" in text and "**Latest results** at step 8" in text, text
    assert f"| shake | 18 | {cell(last, 'shake/acc')} |" in text
    assert f"| garbage | 8 |  |  |  | {cell(last, 'garbage/bpb')} |" in text
    events = regressions(run_dir)
    if events:
        assert f"**Eval regressions**: {len(events)}" in text
    else:
        assert "No eval regressions." in text


def test_mlflow_has_each_benchmark_at_each_step(piped):
    """infra/tracking.py logs every record with a step: the downstream records reach MLflow
    as downstream/<task>/<metric> (and _stderr, /n), at their steps."""
    from mlflow.tracking import MlflowClient

    _, result, run_dir = piped
    tracked = result["train"]["mlflow"]
    client = MlflowClient(tracking_uri=tracked["uri"])
    records = downstream(run_dir)
    assert [r["step"] for r in records] == [4, 8]
    for key in ("shake/acc", "shake/acc_stderr", "shake/bpb", "shake/n", "garbage/bpb"):
        got = sorted(
            (m.step, m.value)
            for m in client.get_metric_history(tracked["run_id"], f"downstream/{key}")
        )
        assert got == [(r["step"], pytest.approx(r[key])) for r in records], key
