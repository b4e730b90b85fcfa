"""Checkpoints in object storage: background upload, remote `latest`, remote retention and
restore onto a fresh machine, behind one facade, `RemoteCheckpoints`.

Each concern, and the guarantees it gives, lives in its own module:

- `keys`: the layout of a run's prefix (step directories, meta.json, `latest`, RUN.json).
- `claim`: the RUN.json ownership record; a prefix is one run's, created with a conditional
  write, refused to any other run before anything touches it.
- `uploader`: the queue and its worker thread; uploads never slow the training loop, every
  file is verified, failures are counted, superseded uploads are skipped.
- `verify`: a meta.json's files table and a remote object's size and sha256.
- `latest`: when remote `latest` may move (only to a verified checkpoint, never backwards
  except after a rollback).
- `retention`: local retention's rule applied to the remote prefix.
- `restore`: the newest complete checkpoint back onto local disk.
- `storage`: retries with backoff and the stop switch; `redact`: no credential in any log
  line or error.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.store import StorageOptions
from training.checkpoint.format import step_name
from training.checkpoint.remote import claim as _claim
from training.checkpoint.remote import restore as _restore
from training.checkpoint.remote.errors import RemoteCheckpointError, RemoteOwnershipError
from training.checkpoint.remote.keys import RUN_RECORD
from training.checkpoint.remote.latest import LatestPolicy
from training.checkpoint.remote.storage import RemoteStore
from training.checkpoint.remote.uploader import STAGING, Uploader

__all__ = [
    "RUN_RECORD",
    "STAGING",
    "RemoteCheckpointError",
    "RemoteCheckpoints",
    "RemoteOwnershipError",
]


class RemoteCheckpoints:
    """Mirror local checkpoints to `uri` (s3://bucket/prefix or a local path) in the
    background, and restore the newest complete one onto a fresh machine.

    `retries` is the number of extra attempts per remote operation after the first one;
    the n-th retry waits `backoff_s * 2**(n-1)` seconds (at most 60 s). Keep the store's own
    retries low (StorageOptions.max_attempts) if you want failures to surface quickly.
    """

    def __init__(
        self,
        uri: str,
        options: StorageOptions | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        max_consecutive_failures: int = 3,
        retries: int = 5,
        backoff_s: float = 1.0,
        log: Callable[[str], None] = print,
        *,
        skip_superseded: bool = True,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        if max_consecutive_failures < 1:
            raise ValueError(
                f"max_consecutive_failures must be >= 1, got {max_consecutive_failures}"
            )
        if retries < 0 or backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0")
        options = options or StorageOptions()
        self._remote = RemoteStore(uri, options, retries, backoff_s, log)
        self.uri = self._remote.uri
        # Where the store answers, for error messages (scrubbed when used).
        self.endpoint = (
            options.endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or ("AWS S3" if self.uri.startswith("s3://") else "a local directory")
        )
        # One condition guards the queue, the counters and the status fields.
        cond = threading.Condition()
        self._latest = LatestPolicy(self._remote, cond)
        self._uploader = Uploader(
            self._remote,
            self._latest,
            cond,
            keep_last,
            keep_every,
            max_consecutive_failures,
            skip_superseded,
        )

    @property
    def keep_last(self) -> int:
        return self._uploader.keep_last

    @property
    def keep_every(self) -> int | None:
        return self._uploader.keep_every

    @property
    def max_consecutive_failures(self) -> int:
        return self._uploader.max_consecutive_failures

    @property
    def skip_superseded(self) -> bool:
        return self._uploader.skip_superseded

    @property
    def retries(self) -> int:
        return self._remote.retries

    @property
    def backoff_s(self) -> float:
        return self._remote.backoff_s

    # -- uploads (uploader) ----------------------------------------------------------------

    def submit(self, local_root: Path, step: int, rewind: bool = False) -> None:
        """Queue the upload of local checkpoint `step` and return at once. Raises
        RemoteCheckpointError if the last `max_consecutive_failures` checkpoints all failed
        (this one is still queued).

        `rewind`: the first checkpoint after a rollback. `latest` normally never moves back
        (an old upload finishing late must not hide a newer one); after a rollback it must,
        or a fresh machine would resume on the abandoned trajectory. Remote steps newer than
        `step` are deleted once `latest` names it."""
        self._uploader.submit(local_root, step, rewind)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted checkpoint was uploaded, skipped or given up on.
        Raises TimeoutError if that takes longer than `timeout` seconds."""
        self._uploader.wait(timeout)

    def check_behind(self, max_s: float) -> None:
        """RemoteCheckpointError when a checkpoint has waited more than `max_s` seconds to
        reach the remote (the store gone for good: uploads keep failing, or newer ones keep
        superseding a stalled one). A slow store that keeps up within the bound passes."""
        waited, _, _ = self._uploader.behind()
        if waited > max_s:
            raise RemoteCheckpointError(
                self._remote.scrub(
                    f"no checkpoint has reached {self.uri} for {waited / 60:.1f} min (endpoint "
                    f"{self.endpoint}; the newest there is {self._newest()}; "
                    f"checkpoint.remote_max_lag_minutes is {max_s / 60:g}). Local checkpoints are "
                    "intact: when the store is back, a restart resumes and uploads them"
                )
            )

    def ensure_last_uploaded(self) -> None:
        """After wait(): RemoteCheckpointError unless the last checkpoint submitted (the
        final one) is in the remote. A run is never "done" with its end only on local
        disk, which on Kubernetes goes with the pod."""
        _, last, submitted = self._uploader.behind()
        if submitted is not None and last != submitted:
            error = self.status.get("last_error")
            raise RemoteCheckpointError(
                self._remote.scrub(
                    f"the final checkpoint {step_name(submitted)} did not reach {self.uri} "
                    f"(endpoint {self.endpoint}; the newest there is {self._newest()}"
                    f"{f'; last error: {error}' if error else ''}). It is intact on local disk: "
                    "a restart when the store is back uploads it"
                )
            )

    def _newest(self) -> str:
        _, last, _ = self._uploader.behind()
        newest = max((s for s in (self._latest.published, last) if s is not None), default=None)
        return step_name(newest) if newest is not None else "none from this run"

    def close(self, drain: bool = True) -> None:
        """Stop the worker. With `drain` (the default) pending uploads finish first;
        without, queued ones are dropped and the one in flight is abandoned between
        attempts (latest is untouched by an abandoned upload)."""
        self._uploader.close(drain)

    def __enter__(self) -> RemoteCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def status(self) -> dict[str, Any]:
        """A snapshot: uploaded/failed/skipped steps, failures in a row, the last error
        (already scrubbed), what is pending, and the last upload's size and speed."""
        return self._uploader.status()

    # -- ownership (claim) -----------------------------------------------------------------

    def claim(self, run_name: str, fingerprint: str) -> None:
        """Make sure this prefix is this run's before anything touches its checkpoints
        (see `training.checkpoint.remote.claim`). RemoteOwnershipError if it is not."""
        _claim.claim(self._remote, run_name, fingerprint)
        # Checked again after every upload: a store that lost RUN.json gets it back.
        self._uploader.reclaim = lambda: _claim.claim(
            self._remote, run_name, fingerprint, renew=True
        )

    # -- restores (restore) ----------------------------------------------------------------

    def remote_steps(self) -> list[int]:
        """Steps with a meta.json remotely (finished uploads; not re-verified here)."""
        return _restore.remote_steps(self._remote)

    def restore_latest(self, local_root: Path) -> int | None:
        """Download the newest complete remote checkpoint into `local_root` and point the
        local `latest` at it; its step, or None when the remote holds none. StorageError
        when storage cannot be reached (see `training.checkpoint.remote.restore`)."""
        return _restore.restore_latest(self._remote, local_root)

    def restore_at_most(self, local_root: Path, max_step: int) -> int | None:
        """Download the newest complete remote checkpoint at or before `max_step` (a
        rollback target that is no longer on local disk); None when there is none."""
        return _restore.restore_at_most(self._remote, local_root, max_step)
