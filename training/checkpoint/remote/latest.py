"""The remote `latest` pointer: reading it, and when it may move.

Guarantees:

* `latest` only ever names a checkpoint whose every file was uploaded and verified: the
  uploader calls `publish`/`rewind` only after that (see `uploader`), and a rewind upload
  first moves `latest` off the step it replaces (`step_back`).
* It never moves backwards: before writing it we read the remote one and leave it alone if
  it already names the same or a newer step. (Read-then-write is not atomic across
  processes: one writer per prefix is assumed, as for the local checkpoint directory. The
  RUN.json claim keeps other runs out of the prefix.)
* The exception is a rollback (`rewind`): `latest` moves back to the first checkpoint after
  it, or a fresh machine would resume on the abandoned trajectory; `latest` moves first,
  then the newer steps are deleted, so no reader ever follows it to a step being deleted.
"""

from __future__ import annotations

import threading

from core.errors import IntegrityError
from training.checkpoint.format import LATEST, META, step_name
from training.checkpoint.remote.errors import is_integrity
from training.checkpoint.remote.keys import group_steps, latest_body, parse_latest
from training.checkpoint.remote.storage import RemoteStore


def read_latest(remote: RemoteStore, warn: bool) -> int | None:
    """The step remote `latest` names; None if absent, unreadable or malformed."""
    try:
        data = remote.retry(
            f"read {remote.uri}/{LATEST}", lambda: remote.get_or_none(LATEST), fatal=is_integrity
        )
    except IntegrityError as exc:
        if warn:
            remote.log(f"remote checkpoint: WARNING ignoring corrupt {LATEST}: {exc}")
        return None
    if data is None:
        return None
    step = parse_latest(data)
    if step is None and warn:
        remote.log(f"remote checkpoint: WARNING {remote.uri}/{LATEST} names no checkpoint")
    return step


class LatestPolicy:
    """Moves remote `latest`; remembers the newest step this instance wrote to it
    (`published`, guarded by `lock`, which the uploader's status shares)."""

    def __init__(self, remote: RemoteStore, lock: threading.Condition) -> None:
        self._remote = remote
        self._lock = lock
        self.published: int | None = None

    def _write(self, data: bytes) -> None:
        r = self._remote
        r.retry(f"write {r.uri}/{LATEST}", lambda: r.store.put(LATEST, data))

    def publish(self, step: int) -> bool:
        """Point remote `latest` at `step` unless it already names this or a newer step.
        Returns whether it was written."""
        r = self._remote
        with self._lock:
            published = self.published
        if published is not None and published >= step:
            r.log(
                f"remote checkpoint: not moving {LATEST} back from {step_name(published)} "
                f"to {step_name(step)}"
            )
            return False
        current = read_latest(r, warn=True)
        if current is not None and current >= step:
            r.log(
                f"remote checkpoint: {r.uri}/{LATEST} already names {step_name(current)}; "
                f"not moving it back to {step_name(step)}"
            )
            with self._lock:
                self.published = max(current, self.published or current)
            return False
        self._write(latest_body(step))
        with self._lock:
            self.published = step
        return True

    def step_back(self, step: int) -> None:
        """Before a rewind upload replaces remote `step`: if `latest` names `step` or a newer
        one, point it at the newest complete step before `step`, so that `latest` never names
        a step being replaced or abandoned."""
        r = self._remote
        current = read_latest(r, warn=False)
        if current is None or current < step:
            return
        keys = r.list_keys()
        older = [s for s, names in group_steps(keys).items() if s < step and META in names]
        if older:
            self._write(latest_body(max(older)))
        else:
            r.retry(f"delete {r.uri}/{LATEST}", lambda: r.store.delete(LATEST))

    def rewind(self, step: int) -> bool:
        """Point remote `latest` at `step` even if it names a newer step, then delete the
        newer steps (the abandoned trajectory): `latest` first, so no reader ever follows it
        to a step being deleted."""
        r = self._remote
        self._write(latest_body(step))
        with self._lock:
            self.published = step
        by_step = group_steps(r.list_keys())
        newer = sorted(s for s in by_step if s > step)
        for s in newer:
            r.delete_step(s, by_step[s])
        r.log(
            f"remote checkpoint: rewound {LATEST} to {step_name(step)}"
            + (f"; deleted abandoned {', '.join(step_name(s) for s in newer)}" if newer else "")
        )
        return True
