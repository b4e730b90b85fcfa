"""TensorBoard event files beside the metrics log, for people who watch runs in
TensorBoard: every record's numbers (training.metrics.scalars) as scalars at their step,
and each event as text, written by rank 0 as it trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.metrics import scalars

# What TensorBoard shows is at most this old: a live view without a write per step.
FLUSH_SECS = 10


class TensorBoardLog:
    """A MetricsLog sink. `purge_step`: the step a resumed run restarts at; TensorBoard
    then hides what an earlier process logged at that step or later (those steps are
    trained again), as the metrics log's truncation does."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            log_dir=str(log_dir), purge_step=purge_step, flush_secs=FLUSH_SECS
        )

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        for name, value in scalars(record):
            self.writer.add_scalar(name, value, step)
        if record.get("kind") == "event":
            self.writer.add_text("events", f"`{json.dumps(record, sort_keys=True)}`", step)

    def close(self) -> None:
        self.writer.close()
