"""What ranks a search's trials: the validation loss (the default), or a benchmark the
trial scores in its training loop (`downstream/<task>/<metric>`, the name MLflow and
TensorBoard give it: training/metrics.py `scalars`), read from the trial's metrics log; and
whether lower or higher is better."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from training.config import TrainConfig

VAL_LOSS = "val_loss"
PREFIX = "downstream/"
TASK_METRICS = ("acc", "acc_per_char", "acc_per_token", "bpb")
# Lower is better for losses and bits; higher for accuracies.
LOWER_IS_BETTER = ("val_loss", "bpb")

Direction = Literal["minimize", "maximize"]


@dataclass(frozen=True)
class Objective:
    name: str  # as the config has it: val_loss, downstream/arc_easy/acc
    kind: str  # the metrics log's record kind that carries it: eval | downstream
    field: str  # its key in those records: val_loss, arc_easy/acc
    direction: Direction

    @property
    def label(self) -> str:
        """For a person: `validation loss`, `downstream/arc_easy/acc`."""
        return "validation loss" if self.name == VAL_LOSS else self.name

    def values(self, metrics: Path) -> list[tuple[int, float]]:
        """(step, value) of each record the trial has logged so far that carries the
        objective; a line the trainer is writing right now is skipped until it is whole."""
        return [(step, float(rec[self.field])) for step, rec in self._records(metrics)]

    def missing(self, metrics: Path) -> str:
        """Why a finished trial has no value: the line a failed trial's message carries."""
        recs = [rec for rec in _lines(metrics) if rec.get("kind") == self.kind]
        if not recs:
            return f"its metrics log has no {self.kind} record (objective {self.name})"
        have = sorted(k for k in recs[-1] if "/" in k and not k.endswith(("_stderr", "/n")))
        return (
            f"its {self.kind} records have no {self.field} (objective {self.name}); "
            f"they have: {', '.join(have) or 'nothing'}"
        )

    def _records(self, metrics: Path) -> list[tuple[int, dict[str, object]]]:
        return [
            (rec["step"], rec)
            for rec in _lines(metrics)
            if rec.get("kind") == self.kind
            and isinstance(rec.get("step"), int)
            and isinstance(rec.get(self.field), int | float)
        ]


# The default: the validation loss the trainer logs every `eval_every` steps.
VALIDATION = Objective(VAL_LOSS, "eval", VAL_LOSS, "minimize")


def _lines(metrics: Path) -> list[dict[str, object]]:
    try:
        text = metrics.read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def parse_objective(name: str, direction: Direction | None, proxy: TrainConfig) -> Objective:
    """The objective `name`, checked against the proxy's training config (a downstream
    task or text set its `evals:` section scores, a metric that set has); ValueError with
    what would be right."""
    if name == VAL_LOSS:
        return Objective(VAL_LOSS, "eval", VAL_LOSS, direction or "minimize")
    if not name.startswith(PREFIX) or name.count("/") != 2:
        raise ValueError(
            f"neither {VAL_LOSS} nor {PREFIX}<task>/<metric> (e.g. {PREFIX}arc_easy/acc)"
        )
    task, metric = name[len(PREFIX) :].split("/")
    evals = proxy.evals
    if evals is None:
        raise ValueError(
            f"the base config has no evals section to score {task!r} (evals: {{tasks: [{task}]}})"
        )
    tasks = [t.name for t in evals.task_list()]
    texts = [t.name for t in evals.texts]
    if task in tasks:
        metrics: tuple[str, ...] = TASK_METRICS
    elif task in texts:
        metrics = ("bpb",)
    else:
        raise ValueError(
            f"the evals section scores no {task!r} (its tasks and text sets: "
            f"{', '.join(tasks + texts)})"
        )
    if metric not in metrics:
        raise ValueError(f"{task} has no metric {metric!r} (it has: {', '.join(metrics)})")
    default: Direction = "minimize" if metric in LOWER_IS_BETTER else "maximize"
    return Objective(name, "downstream", f"{task}/{metric}", direction or default)
