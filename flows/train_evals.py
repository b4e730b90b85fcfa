"""What the `train` flow shows of the trainer's in-loop evals (the `evals` config section,
training/components/evals.py): the latest "downstream" record as a Markdown table (each
task's and text set's metrics, value ± standard error, at its step) in the `train-progress`
description and the `train-summary`, and a `train-eval-regression` table artifact for each
eval_regression event (task, metric, the two steps and values, the drop in standard errors,
the action, and what was trained on in between: sources by share, the top documents with
their locations).

Both come from the run dir's metrics.jsonl, read as it grows (the flow reads the same file
for the validation loss and the guard events; on Kubernetes it is a volume the flow sees)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from training.console import regression_line

REGRESSION_KEY = "train-eval-regression"
# The metric columns of the table, in the order a reader compares them; a text set has bpb
# only. Labels short enough that five sets fit the progress card.
METRICS = (("acc", "acc"), ("acc_per_char", "acc/char"), ("acc_per_token", "acc/token"))
BPB = ("bpb", "bits/byte")
TOP_DOCUMENTS = 8


class MetricsTail:
    """The records a metrics log gained since the last look: whole lines only (the trainer
    may be writing one), read from where the last look stopped. A resume from a checkpoint
    rewrites the log shorter (training.metrics.truncate_after, an atomic replace: a new
    file), which may have grown past the old offset by the next look: a new file or a
    shorter one is read again from its start."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.inode = path, 0, -1
        self.restarted = False  # the last look found the log rewritten

    def new(self) -> list[dict[str, Any]]:
        self.restarted = False
        try:
            st = self.path.stat()
            size = st.st_size
            if st.st_ino != self.inode or size < self.offset:
                self.restarted = self.inode != -1
                self.offset, self.inode = 0, st.st_ino
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].decode("utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


def is_regression(rec: dict[str, Any]) -> bool:
    return rec.get("kind") == "event" and rec.get("event") == "eval_regression"


def regression_key(ev: dict[str, Any]) -> str:
    """An event's identity: the same regression read twice (the log read again after a
    resume) is posted once; a step trained again after a rollback gives another value."""
    return json.dumps([ev.get(k) for k in ("step", "task", "metric", "best_step", "value")])


def sets_of(rec: dict[str, Any]) -> list[str]:
    """The task and text set names of a downstream record, in its order (`<set>/n`)."""
    return [k[: -len("/n")] for k in rec if k.endswith("/n")]


def _cell(rec: dict[str, Any], key: str) -> str:
    v = rec.get(key)
    if not isinstance(v, int | float):
        return ""
    se = rec.get(f"{key}_stderr")
    if isinstance(se, int | float) and math.isfinite(se):
        return f"{v:.4g} ± {se:.2g}"
    return f"{v:.4g}"


def downstream_md(rec: dict[str, Any] | None, heading: str = "Downstream evals") -> str:
    """The record as a table: a row per task or text set, its item count and each metric
    with its standard error; the step (and the EMA weights, when those were scored) above."""
    if not rec or not sets_of(rec):
        return ""
    names = sets_of(rec)
    cols = [c for c in (*METRICS, BPB) if any(f"{n}/{c[0]}" in rec for n in names)]
    weights = " (EMA weights)" if rec.get("weights") == "ema" else ""
    lines = [
        f"**{heading}** at step {rec.get('step')}{weights}, value ± standard error:",
        "",
        "| task | n | " + " | ".join(label for _, label in cols) + " |",
        "|---|---:|" + "---:|" * len(cols),
    ]
    for n in names:
        count = rec.get(f"{n}/n")
        items = str(int(count)) if isinstance(count, int | float) else ""
        lines.append(
            f"| {n} | {items} | " + " | ".join(_cell(rec, f"{n}/{m}") for m, _ in cols) + " |"
        )
    return "\n".join(lines)


def downstream_text(
    rec: dict[str, Any] | None, regressions: list[dict[str, Any]] | None = None
) -> list[str]:
    """The latest results and the regressions for a terminal (`python -m flows.train`):
    a line per task or text set with each metric it has."""
    if not rec or not sets_of(rec):
        return []
    lines = [f"  downstream evals:  step {rec.get('step')}"]
    width = max(len(n) for n in sets_of(rec))
    for n in sets_of(rec):
        cells = [
            f"{label} {_cell(rec, f'{n}/{m}')}" for m, label in (*METRICS, BPB) if f"{n}/{m}" in rec
        ]
        lines.append(f"    {n:<{width}}  " + ", ".join(cells))
    lines += [f"  {regression_line(ev)}" for ev in regressions or []]
    return lines


def _source_share(ev: dict[str, Any]) -> list[str]:
    return [
        f"{s.get('share', 0):.0%} {s.get('source')} ({s.get('tokens', 0):,} tokens)"
        for s in ev.get("sources") or []
    ]


def regression_table(ev: dict[str, Any]) -> list[dict[str, Any]]:
    """An eval_regression event as a two-column table, a field a row: read top to bottom
    it says what fell, by how much, what the run did, and what it trained on in between
    (a row per source, most tokens first, then a row per document with its location)."""
    drop, se = ev.get("drop"), ev.get("stderr")
    sigmas = (
        f"{drop / se:.1f} standard errors"
        if isinstance(drop, int | float) and isinstance(se, int | float) and se > 0
        else "n/a"
    )
    value, best = ev.get("value"), ev.get("best")
    rows: list[tuple[str, Any]] = [
        ("task", ev.get("task")),
        ("metric", ev.get("metric")),
        ("steps (best -> now)", f"{ev.get('best_step')} -> {ev.get('step')}"),
        (
            "value (best -> now)",
            f"{best:.4g} -> {value:.4g}"
            if isinstance(best, int | float) and isinstance(value, int | float)
            else "",
        ),
        ("drop", f"{sigmas} (threshold k = {ev.get('k')})"),
        ("action", ev.get("action")),
    ]
    looked = ev.get("rows_looked_up")
    window = f"{ev.get('rows', 0):,} rows" + (
        f" ({looked:,} looked up)" if isinstance(looked, int) and looked != ev.get("rows") else ""
    )
    rows.append(("trained on since the best step", window))
    if ev.get("documents_error"):
        rows.append(("documents", f"unknown: {ev['documents_error']}"))
    rows += [("source", s) for s in _source_share(ev)]
    docs = ev.get("documents") or []
    for i, d in enumerate(docs[:TOP_DOCUMENTS], 1):
        where = d.get("path") or d.get("location") or d.get("id")
        rows.append((f"document {i}", f"{where} ({d.get('source')}, {d.get('tokens')} tokens)"))
    more = int(ev.get("documents_total", len(docs)) or 0) - min(len(docs), TOP_DOCUMENTS)
    if more > 0:
        rows.append(("documents not shown", str(more)))
    return [{"field": k, "value": v} for k, v in rows]


def regression_description(ev: dict[str, Any], run_dir: Path) -> str:
    return (
        f"**{regression_line(ev)}**\n\n"
        "Each document's tokens are those of the rows looked up in the window; "
        f"`ballast blame {run_dir} --step N` lists a step's batch in full."
    )


def post_regression(ev: dict[str, Any], run_dir: Path) -> Any:
    """A `train-eval-regression` table artifact for one event (a new one per event: the
    flow run's Artifacts tab lists each)."""
    from prefect.artifacts import create_table_artifact

    return create_table_artifact(
        key=REGRESSION_KEY,
        table=regression_table(ev),
        description=regression_description(ev, run_dir),
    )


def regressions_md(events: list[dict[str, Any]] | None) -> str:
    """The summary's list of regressions, one line each."""
    if not events:
        return ""
    lines = [f"**Eval regressions**: {len(events)} (a `{REGRESSION_KEY}` table each)", ""]
    return "\n".join(lines + [f"- {regression_line(ev)}" for ev in events])


class EvalReport:
    """The evals of one flow run as the run goes: the latest downstream record, and a table
    artifact posted once for each regression event as soon as the flow sees it. What the
    log holds when the report starts (an earlier flow run's training of the same run dir)
    is listed in the summary but not posted again: that run posted its tables."""

    def __init__(self, metrics: Path) -> None:
        self.tail = MetricsTail(metrics)
        self.run_dir = metrics.parent
        self.latest: dict[str, Any] | None = None
        self.regressions: list[dict[str, Any]] = []
        self._posted: set[str] = set()
        self.poll(post=False)

    def poll(self, post: bool = True) -> bool:
        """Read what the log gained; post new regressions. True when anything changed."""
        changed = False
        records = self.tail.new()
        if self.tail.restarted:  # resumed: the steps after the checkpoint are trained again
            self.latest, changed = None, True
        for rec in records:
            if rec.get("kind") == "downstream":
                if self.latest is None or rec.get("step", -1) >= self.latest.get("step", -1):
                    self.latest, changed = rec, True
            elif is_regression(rec) and regression_key(rec) not in self._posted:
                self._posted.add(regression_key(rec))
                self.regressions.append(rec)
                if post:
                    post_regression(rec, self.run_dir)
                changed = True
        return changed

    def markdown(self) -> str:
        parts = (downstream_md(self.latest), regressions_md(self.regressions))
        return "\n\n".join(x for x in parts if x)
