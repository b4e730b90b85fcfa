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


# The loss picture's colours, one per thing it shows, named as its caption names them:
# validation loss must not share the skipped steps' colour.
COLOURS = {
    "train": ("tab:blue", "blue"),
    "validation": ("tab:green", "green"),
    "skip": ("tab:orange", "orange"),
    "rollback": ("tab:red", "red"),
    "other": ("tab:gray", "grey"),
}


def curve_parts(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the loss picture draws, from the metrics log's records: train and validation
    (step, loss) points, and the steps of skipped batches, of rollbacks and of other events
    (a resume, a recovery, a divergence), with the other events' names."""
    events = [r for r in recs if r.get("kind") == "event" and isinstance(r.get("step"), int)]
    return {
        "train": [(r["step"], r["loss"]) for r in recs if r.get("kind") == "train"],
        "validation": [(r["step"], r["val_loss"]) for r in recs if r.get("kind") == "eval"],
        "skip": [e["step"] for e in events if e.get("event") == "skip"],
        "rollback": [e["step"] for e in events if e.get("event") == "rollback"],
        "other": [e["step"] for e in events if e.get("event") not in ("skip", "rollback")],
        "other_names": [
            str(e.get("event")) for e in events if e.get("event") not in ("skip", "rollback")
        ],
    }


def curve_legend(recs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(colour name, label) for each line the picture has, in the legend's order."""
    parts = curve_parts(recs)
    out = []
    if parts["train"]:
        out.append((COLOURS["train"][1], "train loss"))
    if parts["validation"]:
        n = len(parts["validation"])
        step, last = parts["validation"][-1]
        out.append(
            (
                COLOURS["validation"][1],
                f"validation loss ({n} eval{'s' * (n != 1)}, last {last:.4f} at step {step})",
            )
        )
    for kind, label in (("skip", "skipped step"), ("rollback", "rollback")):
        if n := len(parts[kind]):
            out.append((COLOURS[kind][1], f"{label}{'s' * (n != 1)} ({n})"))
    if parts["other"]:  # a resume, a recovery, a divergence: named, each with its count
        names = parts["other_names"]
        counts = ", ".join(f"{name} ({names.count(name)})" for name in dict.fromkeys(names))
        out.append((COLOURS["other"][1], f"other events: {counts}"))
    return out


def curve_caption(recs: list[dict[str, Any]]) -> str:
    """The legend as one line of text, for a page that shows the picture (the Prefect UI)."""
    return "; ".join(f"{colour}: {label}" for colour, label in curve_legend(recs))


def plot_loss(metrics_path: str | Path, png_path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    recs = read(metrics_path)
    parts = curve_parts(recs)
    labels = dict(curve_legend(recs))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    handles = []
    if parts["train"]:
        colour, name = COLOURS["train"]
        handles += ax.plot(
            *zip(*parts["train"], strict=True), color=colour, label=labels[name], lw=1
        )
    if parts["validation"]:
        # Markers at each evaluation, big enough that a single one reads as a point.
        colour, name = COLOURS["validation"]
        handles += ax.plot(
            *zip(*parts["validation"], strict=True),
            "o-",
            color=colour,
            label=labels[name],
            lw=1.5,
            ms=7,
            zorder=3,
        )
    for kind in ("skip", "rollback", "other"):
        colour, name = COLOURS[kind]
        for step in parts[kind]:
            ax.axvline(step, color=colour, alpha=0.5, lw=0.8)
        if parts[kind]:  # one legend entry for all the lines of a kind
            handles.append(Line2D([], [], color=colour, label=labels[name]))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("ballast training loss")
    ax.grid(alpha=0.3)
    if handles:
        ax.legend(handles=handles)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
