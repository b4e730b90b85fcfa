"""What the `train` flow shows on the Prefect UI's Artifacts page. While the run goes on:
`train-attempts` (a row per attempt) and `train-progress` (the bar, with step, loss, tokens/s
and ETA in its description), one artifact each per flow run, updated in place (PATCH
/artifacts/{id}: Prefect 3 has no update for tables in its Python API, its REST API updates
any artifact's data and description). The in-loop evals' latest results ride in the
progress description, and each eval regression gets a table of its own
(flows/train_evals.py). At the end: `train-summary` and `train-loss-curve`, markdown with
the picture inline (an image artifact prints its whole URL under the picture, and a data
URL is tens of kilobytes of text)."""

from __future__ import annotations

import base64
import json
import math
import re
import time
from pathlib import Path
from typing import Any
from uuid import UUID

from core.files import write_atomic
from flows.train_evals import EvalReport
from infra.supervisor import Attempt
from training.console import progress_line

ATTEMPTS_KEY = "train-attempts"
PROGRESS_KEY = "train-progress"
SUMMARY_KEY = "train-summary"
CURVE_KEY = "train-loss-curve"

# The attempts table's columns: few and short, so the table fits the page; what an ending
# means at length (a crash's signal, a pod's reason) goes in the description above it.
COLUMNS = ("attempt", "ending", "resumed from", "step", "checkpoint", "loss", "minutes", "then")
# Endings whose detail says nothing a person needs ("exit code 0", "pid 1234").
_PLAIN = ("done", "running", None)


def attempt_record(a: Attempt) -> dict[str, Any]:
    """An attempt as one row of the table, plus its `detail` (for the description). The
    checkpoint is never past the step: both come from the trainer's events, and a
    checkpoint's event is a step reached."""
    p = a.progress or {}
    step = max(x for x in (a.step_reached, a.checkpoint, 0) if x is not None)
    ending = a.ending or "running"
    if a.exit_code not in (None, 0) and ending != "cancelled":
        ending += f" (exit {a.exit_code})"
    loss = p.get("loss")
    return {
        "attempt": a.number,
        "ending": ending,
        "resumed from": ("adopted, " if a.adopted else "") + (a.resumed_from or ""),
        "step": step if a.step_reached is not None or a.checkpoint is not None else None,
        "checkpoint": a.checkpoint,
        "loss": round(loss, 4) if isinstance(loss, float) and math.isfinite(loss) else None,
        "minutes": round(((a.ended_at or time.time()) - a.started_at) / 60, 1),
        "then": short_action(a.next_action),
        "detail": "" if a.ending in _PLAIN else a.detail,
    }


def short_action(action: str) -> str:
    """The supervisor's next action, short: `restart with rollback: --recover
    --lr-scale=0.5 --rollback-to=20 --skip-to-sample=4096` -> `rollback to 20, lr x0.5`."""
    if not action:
        return ""
    if action.startswith("stop: "):
        why = action.removeprefix("stop: ")
        return "stop" if why in ("done", "cancelled", "bad_input") else f"stop: {why}"
    if action == "restart with resume":
        return "resume"
    if action.startswith("restart with rollback"):
        to = re.search(r"--rollback-to=(\d+)", action)
        lr = re.search(r"--lr-scale=([0-9.eE+-]+)", action)
        return (
            "rollback"
            + (f" to {to.group(1)}" if to else "")
            + (f", lr x{lr.group(1)}" if lr and float(lr.group(1)) != 1 else "")
        )
    return action


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: r.get(k) for k in COLUMNS} for r in records]


def attempts_description(job: str, records: list[dict[str, Any]]) -> str:
    lines = [
        f"Attempts of job `{job}` (one `-a<N>` per attempt): how each ended, the step it "
        "reached, its newest checkpoint, its loss, and what the supervisor did next."
    ]
    details = [
        f"- attempt {r['attempt']}: {r['ending']}: {r['detail']}" for r in records if r["detail"]
    ]
    return "\n\n".join([lines[0], "\n".join(details)] if details else lines)


def _json_table(rows: list[dict[str, Any]]) -> str:
    # As TableArtifact.format writes a table: JSON text, NaN as null.
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return json.dumps([{k: clean(v) for k, v in r.items()} for r in rows])


def update_artifact(artifact_id: UUID, data: Any = None, description: str | None = None) -> None:
    """Change an artifact in place: no new version, no new card on the Artifacts page."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    fields: dict[str, Any] = {}
    if data is not None:
        fields["data"] = data
    if description is not None:
        fields["description"] = description
    with get_client(sync_client=True) as client:
        client.update_artifact(artifact_id, ArtifactUpdate(**fields))


def find_artifact(flow_run_id: UUID | str, key: str) -> UUID | None:
    """The artifact `key` of one flow run (the newest, should there be several)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(str(flow_run_id))]),
            )
        )
    return max(arts, key=lambda a: a.created).id if arts else None


def post_attempts(
    records: list[dict[str, Any]],
    job: str,
    artifact_id: UUID | None = None,
    flow_run_id: UUID | str | None = None,
) -> UUID:
    """The attempts table: created once (in the running flow, or for `flow_run_id` from a
    hook outside it), then updated in place. Returns its id."""
    rows, description = table_rows(records), attempts_description(job, records)
    if artifact_id is not None:
        update_artifact(artifact_id, _json_table(rows), description)
        return artifact_id
    if flow_run_id is None:
        from prefect.artifacts import create_table_artifact

        return create_table_artifact(key=ATTEMPTS_KEY, table=rows, description=description)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    with get_client(sync_client=True) as client:
        return client.create_artifact(
            ArtifactCreate(
                key=ATTEMPTS_KEY,
                type="table",
                data=_json_table(rows),
                flow_run_id=UUID(str(flow_run_id)),
                description=description,
            )
        ).id


class LiveReport:
    """The attempts table and the progress bar of one flow run, kept current: rows are also
    written to `rows_file`, where the cancellation hook (another process, maybe) finds
    them; and the in-loop evals from `metrics`, the run's metrics log (flows/train_evals.py):
    the latest results under the progress line, and a table for each regression as soon as
    the log has it."""

    def __init__(self, run_name: str, job: str, rows_file: Path, metrics: Path) -> None:
        from prefect.artifacts import create_progress_artifact

        self.job, self.rows_file = job, rows_file
        self.evals = EvalReport(metrics)
        self.attempts_id: UUID | None = None
        self.progress_id = create_progress_artifact(
            0.0, key=PROGRESS_KEY, description=f"Training {run_name}: waiting for its first step"
        )

    def attempts(self, attempts: list[Attempt]) -> None:
        records = [attempt_record(a) for a in attempts]
        write_atomic(self.rows_file, json.dumps(records, indent=1, default=str))
        self.attempts_id = post_attempts(records, self.job, self.attempts_id)

    def progress(self, a: Attempt, attempts: list[Attempt]) -> None:
        ev = a.progress or {}
        if isinstance(ev.get("step"), int) and ev.get("steps"):
            update_artifact(
                self.progress_id,
                100.0 * min(ev["step"] / ev["steps"], 1.0),
                self._with_evals(f"**{progress_line(ev)}** (attempt {a.number})"),
            )
        if attempts:  # the running attempt's step, loss and checkpoint
            self.attempts(attempts)

    def finish(self, ok: bool, line: str) -> None:
        update_artifact(self.progress_id, 100.0 if ok else None, self._with_evals(line))

    def _with_evals(self, line: str) -> str:
        self.evals.poll()
        return "\n\n".join(x for x in (line, self.evals.markdown()) if x)


def data_uri(png: Path) -> str:
    """The picture itself, inline: the UI shows it without reaching the worker's disk."""
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def curve_md(png: Path, caption: str) -> str:
    """The loss curve as markdown: the picture, and under it what its colours mean."""
    return f"![loss curve]({data_uri(png)})\n\n{caption}"
