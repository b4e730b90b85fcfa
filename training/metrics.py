"""Training metrics: one JSON object per line (steps, evals and guard events), and a
loss-curve PNG at the end."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

from core.files import write_atomic


class Sink(Protocol):
    """A second writer of every record (TensorBoard's event files)."""

    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class MetricsLog:
    """Appends records as whole lines: a write that fails part-way (a full disk) is cut back
    to the line before it, so the file never ends in half a record."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.sinks: list[Sink] = []

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, sort_keys=True) + "\n").encode()
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            if e.filename is None:
                e.filename = str(self.path)
            raise
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for sink in self.sinks:
            sink.close()


def open_log(
    path: Path, is_main: bool, tensorboard: Path | None, purge_step: int | None
) -> MetricsLog:
    """Rank 0's metrics log at `path` (other ranks write nowhere), with TensorBoard's event
    files in `tensorboard` as a second sink when set (steps after `purge_step` dropped)."""
    log = MetricsLog(path if is_main else os.devnull)
    if tensorboard is not None and is_main:
        from training.tensorboard_log import TensorBoardLog

        log.sinks.append(TensorBoardLog(tensorboard, purge_step=purge_step))
    return log


def scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """A record's numbers as (name, value), the names MLflow and TensorBoard both show:
    `<kind>/<key>` (train/loss, eval/val_loss, noise_scale/b_noise), a per-layer list as
    `<kind>/<key>/<layer>` (stats/attn_logit_max/0), and an event as `events/<event>` = 1
    at its step. Flags, text and missing values (null) are left out."""
    kind = record.get("kind", "record")
    if kind == "event":
        return [(f"events/{record.get('event', 'event')}", 1.0)]
    out: list[tuple[str, float]] = []
    for key, v in sorted(record.items()):
        if key in ("kind", "step") or isinstance(v, bool):
            continue
        if isinstance(v, int | float):
            out.append((f"{kind}/{key}", float(v)))
        elif (
            isinstance(v, list)
            and v
            and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
        ):
            out += [(f"{kind}/{key}/{i}", float(x)) for i, x in enumerate(v)]
    return out


def truncate_after(path: str | Path, step: int) -> None:
    """On resume from checkpoint `step`, drop what was logged after it: those steps are
    about to be trained again, and the log must read as if the run never stopped."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if rec.get("step", -1) <= step:
            kept.append(line)
    write_atomic(path, "".join(k + "\n" for k in kept))


def read(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def plot_loss(metrics_path: str | Path, png_path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read(metrics_path)
    train = [(r["step"], r["loss"]) for r in recs if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in recs if r.get("kind") == "eval"]
    events = [r for r in recs if r.get("kind") == "event"]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", lw=1.5, ms=3)
    for e in events:
        ax.axvline(
            e["step"], color="red" if e.get("event") == "rollback" else "orange", alpha=0.3, lw=0.8
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("ballast training (red: rollbacks, orange: skipped steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
