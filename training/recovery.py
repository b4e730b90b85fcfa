"""Getting a run back on track: which checkpoint to resume or roll back to (the newest
valid one, bad ones set aside), rollbacks within a run, the supervisor's recovery across
processes, and the DIVERGED marker that stops a run which diverged beyond its rollback
budget from quietly training on.

Rank 0 decides what to restore (under DDP only its disk holds the checkpoints) and
broadcasts the choice; every rank restores.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from core.errors import StorageError
from training import checkpoint as ckpt
from training import distributed
from training.config import TrainConfig
from training.distributed import World
from training.guards import Decision, StabilityGuard
from training.metrics import MetricsLog, truncate_after

if TYPE_CHECKING:
    from training.checkpoint.manager import CheckpointManager
    from training.checkpoint.remote import RemoteCheckpoints

DIVERGED_MARKER = "DIVERGED"


@dataclass(frozen=True)
class Recovery:
    """What the supervisor asks for when it restarts a run that diverged beyond its rollback
    budget (exit 3): go back to the newest checkpoint at or before `rollback_to`, skip the
    training order up to sample `skip_to_sample` (the data that led to the divergence), scale
    the learning rate by `lr_scale`, and start a fresh rollback budget."""

    rollback_to: int | None = None
    skip_to_sample: int | None = None
    lr_scale: float = 1.0


@dataclass
class State:
    """Everything besides module/optimizer state that exact resume needs."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    lr_scale: float = 1.0  # multiplied by rollback_lr_scale at each rollback
    rollbacks: list[dict[str, Any]] = field(default_factory=list)


def stopped_by_marker(run_dir: Path, recovering: bool, world: World) -> bool:
    """True when the DIVERGED marker forbids this start (exit 3). The supervisor's
    recovery (`recovering`) renames it aside instead."""
    marker = run_dir / DIVERGED_MARKER
    if marker.is_file() and recovering:
        distributed.barrier(world)  # every rank has seen the marker before it goes
        if world.is_main:
            marker.rename(run_dir / f"{DIVERGED_MARKER}.recovered-{int(time.time())}")
    elif marker.is_file():
        # torchrun restarts a worker whatever its exit code; a run that diverged
        # beyond its rollback budget must not quietly train on.
        print(
            f"{marker} exists: this run diverged beyond its rollback budget "
            f"(delete the file to train anyway):\n{marker.read_text()}",
            file=sys.stderr,
        )
        return True
    return False


class CheckpointChoice:
    """Rank 0: the checkpoint to resume or roll back to. Local checkpoints first, then
    object storage (`remote`); each one that fails verification is set aside, and a
    checkpoint_corrupt event kept in `events` until a metrics log takes it (`flush`)."""

    def __init__(self, root: Path, remote: RemoteCheckpoints | None):
        self.root, self.remote = root, remote
        self.events: list[dict[str, Any]] = []

    def set_aside(self, step: int, error: Exception, now: int) -> None:
        """Checkpoint `step` failed verification (at trainer step `now`). One warning line,
        the directory renamed aside (kept for a post mortem; retention and restores ignore
        it), and a checkpoint_corrupt event for the metrics log."""
        moved = ckpt.move_aside(self.root, step)
        where = f"moved aside to {moved.name}" if moved is not None else "nothing to move aside"
        print(
            f"warning: not using checkpoint {ckpt.step_name(step)}: {error}; {where}",
            file=sys.stderr,
            flush=True,
        )
        self.events.append(
            {
                "kind": "event",
                "event": "checkpoint_corrupt",
                "step": now,
                "checkpoint": ckpt.step_name(step),
                "checkpoint_step": step,
                "moved_to": None if moved is None else str(moved),
                "error": str(error),
            }
        )

    def newest_valid(
        self, at_most: int | None, now: int, also: int | None = None, suspect: bool = False
    ) -> int | None:
        """The newest checkpoint at or before step `at_most` (None: any) that verifies, or
        None. Local ones first, newest first (plus step `also`, which `latest` names even if
        its directory is gone); each bad one is set aside. Object storage is asked only when
        something local was bad (or `suspect`), or nothing local is left: a newer complete
        checkpoint there wins over an older local one."""
        root = self.root
        local = {c for c in ckpt.step_dirs(root) if at_most is None or c <= at_most}
        if also is not None:
            local.add(also)
        best, bad = None, suspect
        for c in sorted(local, reverse=True):
            try:
                ckpt.verify(root, c)
            except ckpt.CheckpointError as e:
                self.set_aside(c, e, now)
                bad = True
                continue
            best = c
            break
        if self.remote is None or (best is not None and not bad):
            return best
        try:
            newer = [
                r
                for r in self.remote.remote_steps()
                if (at_most is None or r <= at_most) and (best is None or r > best)
            ]
            got = self.remote.restore_at_most(root, max(newer)) if newer else None
        except StorageError as e:
            if best is None:
                raise  # unreachable is not "nothing there": a crash, restarted later
            print(
                f"warning: object storage {self.remote.uri} cannot be read ({e}); using "
                f"the local checkpoint {ckpt.step_name(best)}",
                file=sys.stderr,
                flush=True,
            )
            return best
        return got if got is not None and (best is None or got > best) else best

    def resume_step(self, now: int) -> int | None:
        """The checkpoint to resume from, None for a fresh start. `latest` names it; when
        that one is corrupt, partial or gone, the newest valid older one (local, else object
        storage) is used and `latest` moved to it. Raises CheckpointError when checkpoints
        were there but none of them is valid."""
        root = self.root
        garbled = False
        try:
            named = ckpt.latest_step(root)
        except ckpt.CheckpointError as e:
            print(
                f"warning: {e}; looking for the newest valid checkpoint",
                file=sys.stderr,
                flush=True,
            )
            named, garbled = None, True
        if named is None and not garbled:
            if self.remote is None:
                return None
            # A fresh machine: the newest complete checkpoint in object storage.
            named = self.remote.restore_latest(root)
            if named is None:
                return None
        best = self.newest_valid(named, now, also=named, suspect=garbled)
        if best is None:
            where = f"{root}" + (f" or {self.remote.uri}" if self.remote is not None else "")
            what = (
                f"{root / ckpt.LATEST} names {ckpt.step_name(named)}"
                if named is not None
                else f"{root / ckpt.LATEST} is unreadable"
            )
            raise ckpt.CheckpointError(
                f"no valid checkpoint to resume from: {what}, and no complete checkpoint "
                f"at or before it is left in {where} (bad ones were moved aside as "
                f"step-*.corrupt-*); put a good checkpoint back, or delete {root} to start "
                f"from step 0"
            )
        if best != named:
            ckpt.write_latest(root, best)
        return best

    def flush(self, log: MetricsLog) -> None:
        for ev in self.events:
            log.write(ev)
        self.events.clear()


class Recoverable(Protocol):
    """What rollbacks and recovery act on (the trainer)."""

    cfg: TrainConfig
    state: State
    guard: StabilityGuard
    world: World
    device: torch.device
    run_dir: Path
    ckpts: CheckpointManager
    choice: CheckpointChoice
    ckpt_dir: Path
    rewind_remote: bool  # the next upload to object storage follows a rollback

    def restore(
        self, step: int, modules_only: bool = False, verified: bool = False
    ) -> dict[str, Any]: ...

    def save(self) -> None: ...

    def emit(self, event: dict[str, Any]) -> None: ...

    def record(self, log: MetricsLog, event: dict[str, Any]) -> None: ...


def _steps(t: Recoverable, d: Decision) -> tuple[int, int]:
    """(the step that called the divergence, the first step of its window), numbered as
    the trainer numbers steps: step N is the N-th optimizer step. The guard's event says
    both; without one, the step being trained (`state.step + 1`)."""
    ev = d.event or {}
    step = int(ev.get("step", t.state.step + 1))
    return step, int(ev.get("start_step", step))


def diverge(t: Recoverable, d: Decision, log: MetricsLog, samples: int) -> bool:
    """Act on a divergence decision: roll back (False: train on), or, with the budget
    spent, record the abort, leave the DIVERGED marker and return True (exit 3).
    `samples`: those of the current step, not yet counted in the state."""
    s = t.state
    if d.action == "rollback":
        rollback(t, d, log)
        return False
    step, start = _steps(t, d)
    log.write({"kind": "event", **(d.event or {}), "step": step})
    print(d.detail, file=sys.stderr)
    if t.world.is_main:
        (t.run_dir / DIVERGED_MARKER).write_text(d.detail + "\n")
    t.emit(
        {
            "event": "diverged",
            "step": step,
            "start_step": start,
            # The checkpoint the supervisor's recovery goes back to (at most): the one
            # before the window's first step.
            "rollback_to": start - 1,
            "samples_seen": s.samples_seen + samples,
            "rollbacks": len(s.rollbacks),
        }
    )
    return True


def rollback(t: Recoverable, d: Decision, log: MetricsLog) -> None:
    """Back to the newest checkpoint before the trouble began; the data window in
    between is skipped (the sampler position is kept), and the LR optionally scaled."""
    s = t.state
    t.ckpts.finish()
    step, start = _steps(t, d)
    # The newest valid checkpoint before the window's first step, step-(start - 1) or
    # older (bad ones are set aside).
    before = start - 1
    target = t.choice.newest_valid(before, step) if t.world.is_main else None
    t.choice.flush(log)
    target = distributed.broadcast_object(target, t.world, t.device)
    if target is None:
        raise ckpt.CheckpointError(
            f"no valid checkpoint at or before step {before} left in {t.ckpts.root} to roll back to"
        )
    samples_seen, tokens_seen = s.samples_seen, s.tokens_seen
    history = [
        *s.rollbacks,
        {"from_step": step, "to_step": target, "reason": d.reason, "detail": d.detail},
    ]
    lr_scale = s.lr_scale * t.cfg.guards.rollback_lr_scale
    st = t.restore(target, modules_only=True, verified=True)
    t.state = State(target, samples_seen, tokens_seen, lr_scale, history)
    t.rewind_remote = True
    # The guard keeps its counters and history (the budget must run out), but takes the
    # running statistics that match the restored weights.
    t.guard.rolled_back(to_step=target, from_step=step, stats_from=st["guard"])
    log.write(
        {
            "kind": "event",
            **(d.event or {}),
            "event": "rollback",
            "step": step,
            "to_step": target,
            "lr_scale": lr_scale,
            "data_skipped": f"samples {st['trainer']['samples_seen']}..{samples_seen} "
            f"of the training order are not replayed",
        }
    )


def recover(t: Recoverable, r: Recovery, log: MetricsLog) -> None:
    """The supervisor's restart after a divergence beyond the rollback budget: like a
    rollback, but across processes, with a fresh budget (see Recovery)."""
    s = t.state
    key = {"rollback_to": r.rollback_to, "skip_to_sample": r.skip_to_sample}
    if any(
        h.get("reason") == "supervisor_recovery" and h.get("request") == key for h in s.rollbacks
    ):
        return  # applied before this process restarted (torchrun --max-restarts)
    cap = s.step if r.rollback_to is None else min(r.rollback_to, s.step)
    target = None
    if t.world.is_main:  # rank 0 decides (its disk holds the checkpoints under DDP)
        # The newest valid one at or before `cap` (local, else object storage), else the
        # one this process has just resumed from.
        target = t.choice.newest_valid(cap, s.step)
        if target is None:
            target = t.choice.newest_valid(s.step, s.step)
    t.choice.flush(log)
    target = distributed.broadcast_object(target, t.world, t.device)
    root = t.ckpts.root
    if target is None:
        raise ckpt.CheckpointError(
            f"no valid checkpoint at or before step {s.step} left in {root} to recover from"
        )
    from_step = s.step
    st = t.restore(target, verified=True)
    now = t.state
    t.state = State(
        target,
        max(now.samples_seen, r.skip_to_sample or 0),
        now.tokens_seen,
        now.lr_scale * r.lr_scale,
        [
            *now.rollbacks,
            {
                "from_step": from_step,
                "to_step": target,
                "reason": "supervisor_recovery",
                "request": key,
                "detail": f"lr x {r.lr_scale}",
            },
        ],
    )
    t.guard.reset_budget()
    if t.world.is_main:  # the abandoned trajectory must never be resumed
        for c in ckpt.steps(root):
            if c > target:
                shutil.rmtree(root / ckpt.step_name(c), ignore_errors=True)
    t.rewind_remote = True
    t.save()  # overwrites step `target` with the new position and LR scale
    t.ckpts.finish()
    event = {
        "event": "recovered",
        "step": from_step,
        "to_step": target,
        "samples_skipped": f"{st['trainer']['samples_seen']}..{t.state.samples_seen}",
        "lr_scale": t.state.lr_scale,
    }
    t.record(log, event)


def resume(t: Recoverable, metrics_path: Path) -> int | None:
    """Every rank: restore the checkpoint rank 0 picks (None: a fresh start). Under DDP
    on several nodes the other ranks' local disks hold no checkpoints (only rank 0
    writes them); restore() broadcasts the state."""
    choice: tuple[int | None, str | None] = (None, None)
    if t.world.is_main:
        removed = ckpt.clean_stale_tmp(t.ckpt_dir)
        if removed:
            print(
                f"checkpoint: removed what an interrupted checkpoint write left in "
                f"{t.ckpt_dir} (its process is gone): {', '.join(removed)}",
                file=sys.stderr,
                flush=True,
            )
        try:
            choice = (t.choice.resume_step(t.state.step), None)
        except ckpt.CheckpointError as e:
            choice = (None, str(e))
            if t.choice.events:  # what was found bad is on record all the same
                failed = MetricsLog(metrics_path)
                t.choice.flush(failed)
                failed.close()
    latest, error = distributed.broadcast_object(choice, t.world, t.device)
    if error is not None:
        raise ckpt.CheckpointError(error)
    if latest is not None:
        t.restore(latest, verified=True)
        if t.world.is_main:
            truncate_after(metrics_path, latest)
        distributed.barrier(t.world)
    return latest
