"""What the trainer says while it runs: lines for a person, events for machines.

A person reads one line per event on stderr (`step 40/120, loss 4.1234, 3,120 tokens/s,
ETA 1m05s`), the validation loss at each evaluation, and a closing block (final and best
validation loss, checkpoints local and remote, where the curve and metrics are), as prep's
CLI ends with its accounting.

Machines read `BALLAST_EVENT {json}` lines (core/protocol.py). A run started by the pod
entrypoint (training.entrypoint: the local job backend and Kubernetes, whose supervisor
reads events from the job's log) sets BALLAST_EVENTS=stderr and writes them to stderr
beside the human lines; a run started by hand (`ballast train`, `python -m training.train`)
appends them to <run_dir>/events.jsonl instead, so its terminal shows only the human lines.
Only rank 0 speaks.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

from core.protocol import format_event

EVENTS_ENV = "BALLAST_EVENTS"
EVENTS_FILE = "events.jsonl"

# The async checkpoint writer's thread reports "checkpoint at step N" while the training
# loop prints progress: `print` writes the text and its newline as two writes, so two
# threads' lines could interleave into "checkpoint at step 6step 9/9, ..." plus a bare blank
# line (seen twice in CI). One lock, one write per line.
_WRITE = threading.Lock()


def write_line(line: str) -> None:
    """One whole line to stderr, safe from any thread (the remote uploader logs too)."""
    with _WRITE:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


# The shapes of the narrative lines (progress, evaluations, routine events, the closing
# block): a log reader that wants only warnings and errors drops these.
NARRATIVE = re.compile(
    r"^(step \d+/\d+, loss |step \d+: validation loss |step \d+: evals "
    r"|training from step 0 |resumed from "
    r"|checkpoint at step \d+$|training finished at step |training: step \d+, "
    r"|validation loss: |final checkpoint: |loss curve: )"
)


def is_narrative(line: str) -> bool:
    """True for a line the console prints as a matter of course (not a warning or error)."""
    return NARRATIVE.match(line) is not None


def _eta(seconds: float) -> str:
    s = int(seconds)
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
    )


def progress_line(ev: dict[str, Any]) -> str:
    """A "progress" event as one line: step, loss, throughput, ETA."""
    parts = [f"step {ev.get('step')}/{ev.get('steps')}"]
    if isinstance(ev.get("loss"), int | float):
        parts.append(f"loss {ev['loss']:.4f}")
    if isinstance(ev.get("tokens_per_s"), int | float):
        parts.append(f"{ev['tokens_per_s']:,.0f} tokens/s")
    if isinstance(ev.get("eta_s"), int | float):
        parts.append(f"ETA {_eta(ev['eta_s'])}")
    return ", ".join(parts)


def regression_line(ev: dict[str, Any]) -> str:
    """`step 600: eval regression: owt bpb 2.31 (best 1.84 at step 400, 9.3 standard
    errors worse); since step 400: 71% web-garbage, 29% owt; warn`."""
    drop, se = ev.get("drop"), ev.get("stderr")
    sigmas = f", {drop / se:.1f} standard errors worse" if drop and se else ""
    line = (
        f"step {ev.get('step')}: eval regression: {ev.get('task')} {ev.get('metric')} "
        f"{ev.get('value', float('nan')):.4g} (best {ev.get('best', float('nan')):.4g} at step "
        f"{ev.get('best_step')}{sigmas})"
    )
    sources = ev.get("sources") or []
    if sources:
        shares = ", ".join(f"{s['share']:.0%} {s['source']}" for s in sources[:4])
        line += f"; since step {ev.get('best_step')}: {shares}"
    return line + f"; {ev.get('action', 'warn')}"


def event_line(ev: dict[str, Any]) -> str:
    """Any trainer event as one line a person reads."""
    kind = ev.get("event")
    if kind == "progress":
        return progress_line(ev)
    if kind == "start":
        return "training from step 0 (no checkpoint yet)"
    if kind == "resume":
        return f"resumed from {ev.get('checkpoint')} at step {ev.get('step')}"
    if kind == "checkpoint":
        return f"checkpoint at step {ev.get('step')}"
    if kind == "done":
        why = " (early stopping)" if ev.get("reason") == "early_stopping" else ""
        return (
            f"training finished at step {ev.get('step')}{why}, "
            f"{ev.get('tokens_seen', 0):,} tokens seen"
        )
    if kind == "diverged":
        return (
            f"diverged at step {ev.get('step')} beyond the rollback budget "
            f"({ev.get('rollbacks')} rollbacks): exit 3"
        )
    if kind == "eval_regression":
        return regression_line(ev)
    rest = ", ".join(f"{k} {v}" for k, v in ev.items() if k not in ("event", "step"))
    return f"step {ev.get('step')}: {kind}" + (f" ({rest})" if rest else "")


class Console:
    """Where rank 0's lines and events go (see the module docstring)."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.is_main = is_main
        self.events_to_stderr = os.environ.get(EVENTS_ENV) == "stderr"
        self.events_path = run_dir / EVENTS_FILE

    def say(self, line: str) -> None:
        if self.is_main:
            write_line(line)

    def event(self, event: dict[str, Any], say: bool = True) -> None:
        """`say`: False when a fuller account follows (the closing block after "done")."""
        if not self.is_main:
            return
        if say:
            self.say(event_line(event))
        if self.events_to_stderr:
            write_line(format_event(event))
        else:
            with _WRITE, open(self.events_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(event, default=str) + "\n")


def closing_block(
    final: dict[str, Any], evals: list[dict[str, Any]], run_dir: Path, remote: str | None
) -> list[str]:
    """The lines a finished run ends with (`final`: final.json's content; `evals`: the
    metrics log's eval records)."""
    lines = [
        f"training: step {final['step']}, {final['tokens_seen']:,} tokens seen"
        + (f", {len(final['rollbacks'])} rollbacks" if final.get("rollbacks") else "")
        + (
            f", {final['skipped_non_finite'] + final['skipped_spikes']} steps skipped"
            if final.get("skipped_non_finite") or final.get("skipped_spikes")
            else ""
        )
    ]
    finite = [
        e
        for e in evals
        if isinstance(e.get("val_loss"), int | float) and e["val_loss"] == e["val_loss"]
    ]
    if finite:
        last, best = finite[-1], min(finite, key=lambda e: e["val_loss"])
        lines.append(
            f"validation loss: {last['val_loss']:.4f} at step {last['step']} "
            f"(best {best['val_loss']:.4f} at step {best['step']})"
        )
    lines.append(
        f"final checkpoint: {final['checkpoint']}" + (f" (copied to {remote})" if remote else "")
    )
    lines.append(
        f"loss curve: {(run_dir / 'loss.png').resolve()}; metrics: "
        f"{(run_dir / 'metrics.jsonl').resolve()}; run record: "
        f"{(run_dir / 'final.json').resolve()}"
    )
    return lines
