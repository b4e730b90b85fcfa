"""Uploading checkpoints in the background: the queue and its one worker thread.

Guarantees:

* Uploads never slow the training loop: `submit()` hard-links the checkpoint's files into a
  private staging directory (`<local_root>/.upload-staging/`, a copy where hard links are not
  possible) and returns; one worker thread uploads checkpoints in FIFO order. Local retention
  may delete the checkpoint directory at any time after `submit()` returns.
* Every file is verified after its upload (size and sha256 from a HEAD request against the
  sha256 in the local meta.json), data files first and meta.json last; only then is remote
  `latest` moved (`latest.LatestPolicy`), and then remote retention runs.
* A checkpoint whose upload still fails after the per-file retries (`storage`) is logged
  loudly and training goes on; only when `max_consecutive_failures` checkpoints in a row
  failed does the next `submit()` raise `RemoteCheckpointError` (after queueing its
  checkpoint anyway, so a caller that chooses to carry on keeps trying, and a later success
  resets the count).
* Superseded uploads are skipped: when the worker picks up a checkpoint while a newer one is
  already queued (storage slower than the checkpoint interval), the older one is dropped
  unless it is a `keep_every` milestone, so the backlog and the staged disk space stay
  bounded. `skip_superseded=False` uploads every checkpoint.
"""

from __future__ import annotations

import collections
import hashlib
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import IntegrityError, StorageError
from core.files import pid_alive, sha256_file
from training.checkpoint.format import LATEST, META, CheckpointError, step_name
from training.checkpoint.remote.errors import Aborted, RemoteCheckpointError, is_integrity
from training.checkpoint.remote.keys import step_key
from training.checkpoint.remote.latest import LatestPolicy, read_latest
from training.checkpoint.remote.retention import retain
from training.checkpoint.remote.storage import RemoteStore
from training.checkpoint.remote.verify import parse_meta, verify_object

STAGING = ".upload-staging"
_MIB = 1024 * 1024


@dataclass(frozen=True)
class _File:
    name: str
    path: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class _Job:
    step: int
    staged: Path
    rewind: bool = False  # after a rollback: `latest` moves back, newer remote steps go
    submitted: float = 0.0  # time.monotonic() at submit()


class Uploader:
    """The upload queue of one RemoteCheckpoints. `cond` guards the queue, the counters and
    the status fields (and `latest.published`)."""

    def __init__(
        self,
        remote: RemoteStore,
        latest: LatestPolicy,
        cond: threading.Condition,
        keep_last: int,
        keep_every: int | None,
        max_consecutive_failures: int,
        skip_superseded: bool,
    ) -> None:
        self._remote = remote
        self._latest = latest
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.max_consecutive_failures = max_consecutive_failures
        self.skip_superseded = skip_superseded

        self._cond = cond
        self._queue: collections.deque[_Job | None] = collections.deque()
        self._pending = 0  # queued + in flight
        self._in_flight: int | None = None
        self._uploaded: list[int] = []
        self._failed: list[int] = []
        self._skipped: list[int] = []
        self._consecutive_failures = 0
        self._failure_run: list[int] = []
        self._last_error: str | None = None
        self._last_upload: dict[str, float] | None = None
        self._closed = False
        self._seq = 0
        # Since when a checkpoint has been waiting to reach the remote (the submit time of
        # the oldest one submitted after the last upload that succeeded); None: none waits.
        self._behind_since: float | None = None
        # The ownership check, made again after each upload (set by RemoteCheckpoints.claim).
        self.reclaim: Any = None
        self._last_submitted: int | None = None
        # Staging dirs carry pid + instance token so stale ones (dead pid) can be removed.
        self._token = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._cleaned_roots: set[Path] = set()
        # Daemon: an interpreter exit without close() must not hang on a stalled upload; the
        # remote side stays consistent (latest is written last) whatever point it stops at.
        self._worker = threading.Thread(target=self._run, name="remote-checkpoints", daemon=True)
        self._worker.start()

    @property
    def uri(self) -> str:
        return self._remote.uri

    def submit(self, local_root: Path, step: int, rewind: bool = False) -> None:
        local_root = Path(local_root)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"RemoteCheckpoints for {self.uri} is closed")
            too_many = self._consecutive_failures >= self.max_consecutive_failures
            failure_run = list(self._failure_run)
            last_error = self._last_error
            self._seq += 1
            seq = self._seq
            now = time.monotonic()
            if self._behind_since is None:
                self._behind_since = now
            self._last_submitted = step
        try:
            staged = self._stage(local_root, step, seq)
        except (OSError, CheckpointError) as exc:
            # A local problem is still a checkpoint that did not reach storage: count it.
            self._record_failure(step, exc)
        else:
            with self._cond:
                self._queue.append(_Job(step, staged, rewind, now))
                self._pending += 1
                self._cond.notify_all()
        if too_many:
            steps = ", ".join(step_name(s) for s in failure_run)
            raise RemoteCheckpointError(
                self._remote.scrub(
                    f"{len(failure_run)} checkpoints in a row failed to upload to {self.uri} "
                    f"({steps}); last error: {last_error}. Local checkpoints are intact; "
                    f"{step_name(step)} was queued anyway."
                )
            )

    def wait(self, timeout: float | None = None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(
                    f"remote checkpoint uploads to {self.uri} still pending after {timeout} s "
                    f"({self._pending} left, in flight: {self._in_flight})"
                )

    def close(self, drain: bool = True) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if drain:
            self.wait()
        else:
            self._remote.stop.set()
            with self._cond:
                dropped = [job for job in self._queue if job is not None]
                self._queue.clear()
                self._pending -= len(dropped)
            for job in dropped:
                shutil.rmtree(job.staged, ignore_errors=True)
            if dropped:
                self._remote.log(
                    "remote checkpoint: WARNING closing without drain, dropped queued uploads "
                    f"of {', '.join(step_name(j.step) for j in dropped)}"
                )
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._worker.join()

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {
                "uri": self.uri,
                "uploaded": list(self._uploaded),
                "failed": list(self._failed),
                "skipped": list(self._skipped),
                "consecutive_failures": self._consecutive_failures,
                "last_error": self._last_error,
                "pending": self._pending,
                "in_flight": self._in_flight,
                "latest": self._latest.published,
                "last_upload": dict(self._last_upload) if self._last_upload else None,
            }

    # -- submit side ---------------------------------------------------------------------

    def _stage(self, local_root: Path, step: int, seq: int) -> Path:
        """Hard-link (or copy) the checkpoint's files into a private directory, so local
        retention deleting the checkpoint cannot pull files out from under the upload.
        `checkpoint.save` never rewrites a file in place, so a link is a stable snapshot."""
        src = local_root / step_name(step)
        if not (src / META).is_file():
            raise CheckpointError(f"{src} is not a complete local checkpoint (no {META})")
        staging_root = local_root / STAGING
        self._clean_stale_staging(staging_root)
        dest = staging_root / f"{step_name(step)}.{self._token}.{seq}"
        dest.mkdir(parents=True)
        try:
            for entry in src.iterdir():
                if not entry.is_file():
                    continue
                try:
                    os.link(entry, dest / entry.name)
                except OSError:
                    # Other filesystem, or links not supported/allowed: copy instead.
                    shutil.copy2(entry, dest / entry.name)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return dest

    def _clean_stale_staging(self, staging_root: Path) -> None:
        """Remove staging dirs left by dead processes (once per root per instance)."""
        if staging_root in self._cleaned_roots:
            return
        self._cleaned_roots.add(staging_root)
        if not staging_root.is_dir():
            return
        for entry in staging_root.iterdir():
            parts = entry.name.split(".")
            if len(parts) == 4 and parts[1].isdigit() and not pid_alive(int(parts[1])):
                shutil.rmtree(entry, ignore_errors=True)

    # -- worker --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                job = self._queue.popleft()
                if job is None:
                    return
                self._in_flight = job.step
                newer = [j.step for j in self._queue if j is not None and j.step > job.step]
            try:
                if (
                    newer
                    and self.skip_superseded
                    and not self._milestone(job.step)
                    and not job.rewind
                ):
                    with self._cond:
                        self._skipped.append(job.step)
                    self._remote.log(
                        f"remote checkpoint: skipping {step_name(job.step)}, superseded by "
                        f"queued {step_name(max(newer))}"
                    )
                else:
                    self._process(job)
            finally:
                shutil.rmtree(job.staged, ignore_errors=True)
                with self._cond:
                    self._in_flight = None
                    self._pending -= 1
                    self._cond.notify_all()

    def behind(self) -> tuple[float, int | None, int | None]:
        """(seconds the oldest checkpoint not yet in the remote has waited, 0 when none
        waits; the last step uploaded by this process; the last step submitted)."""
        with self._cond:
            since = self._behind_since
            last = self._uploaded[-1] if self._uploaded else None
            return (0.0 if since is None else time.monotonic() - since), last, self._last_submitted

    def _milestone(self, step: int) -> bool:
        return bool(self.keep_every) and step % (self.keep_every or 1) == 0

    def _process(self, job: _Job) -> None:
        t0 = time.monotonic()
        try:
            if job.rewind:
                self._latest.step_back(job.step)
            total = self._upload(job)
            published = (
                self._latest.rewind(job.step) if job.rewind else self._latest.publish(job.step)
            )
            if self.reclaim is not None:
                self.reclaim()
        except Aborted:
            self._remote.log(
                f"remote checkpoint: upload of {step_name(job.step)} abandoned (closing)"
            )
            return
        except Exception as exc:  # anything, a bug included, must not kill the worker
            self._record_failure(job.step, exc)
            return
        seconds = max(time.monotonic() - t0, 1e-9)
        with self._cond:
            self._uploaded.append(job.step)
            self._consecutive_failures = 0
            self._failure_run = []
            waiting = [j.submitted for j in self._queue if j is not None]
            self._behind_since = min(waiting) if waiting else None
            self._last_upload = {
                "step": job.step,
                "bytes": total,
                "seconds": seconds,
                "mb_per_s": total / _MIB / seconds,
            }
        note = f"latest -> {step_name(job.step)}" if published else "latest unchanged"
        self._remote.log(
            f"remote checkpoint: uploaded {self.uri}/{step_name(job.step)} "
            f"({total / _MIB:.1f} MiB in {seconds:.2f} s, {total / _MIB / seconds:.1f} MiB/s; "
            f"{note})"
        )
        try:
            retain(self._remote, self.keep_last, self.keep_every, job.step)
        except Exception as exc:  # retention is housekeeping: never a failed checkpoint
            self._remote.log(f"remote checkpoint: WARNING remote retention failed: {exc}")

    def _plan(self, job: _Job) -> tuple[list[_File], bytes]:
        """The staged files to upload, data files first and meta.json last, each checked
        against meta.json so a locally damaged checkpoint is never published."""
        where = f"local checkpoint {step_name(job.step)}"
        meta_bytes = (job.staged / META).read_bytes()
        files_meta = parse_meta(meta_bytes, where)
        files: list[_File] = []
        for name, want in files_meta.items():
            path = job.staged / name
            if not path.is_file():
                raise CheckpointError(f"{where}: {name} listed in {META} is missing")
            digest = sha256_file(path)
            size = path.stat().st_size
            if digest != want["sha256"] or size != want["bytes"]:
                raise CheckpointError(f"{where}: {name} does not match its {META} entry")
            files.append(_File(name, path, size, digest))
        meta_sha = hashlib.sha256(meta_bytes).hexdigest()
        files.append(_File(META, job.staged / META, len(meta_bytes), meta_sha))
        return files, meta_bytes

    def _upload(self, job: _Job) -> int:
        """Upload and verify every file of `job`; returns the bytes it covers."""
        r = self._remote
        files, meta_bytes = self._plan(job)
        name = step_name(job.step)
        meta_key = step_key(job.step, META)
        try:
            remote_meta = r.retry(
                f"read {self.uri}/{meta_key}",
                lambda: r.get_or_none(meta_key),
                fatal=is_integrity,
            )
        except StorageError as exc:
            if not is_integrity(exc):
                raise
            remote_meta = b""  # unreadable/corrupt remote meta.json: replace it
        if remote_meta == meta_bytes and self._remote_matches(job.step, files):
            # Resubmitted after a restart, or a retry of an upload that completed: nothing
            # to send, but latest may still need writing.
            r.log(f"remote checkpoint: {self.uri}/{name} already uploaded and verified")
            return sum(f.size for f in files)
        if remote_meta is not None:
            # Overwriting a different checkpoint of the same step: its meta.json goes first,
            # so it reads as incomplete, never as a mix of two checkpoints. If `latest` names
            # it that would leave latest pointing at a partial checkpoint: refuse instead.
            if read_latest(r, warn=False) == job.step:
                raise CheckpointError(
                    f"{self.uri}/{name} already holds a different checkpoint and {LATEST} "
                    "names it; refusing to overwrite it"
                )
            r.log(f"remote checkpoint: WARNING replacing a different {self.uri}/{name}")
            r.retry(f"delete {self.uri}/{meta_key}", lambda: r.store.delete(meta_key))
        for f in files:
            key = step_key(job.step, f.name)
            r.retry(
                f"upload {self.uri}/{key}",
                lambda key=key, f=f: self._put_verified(key, f),
                # A vanished staged file cannot come back by retrying.
                fatal=lambda e: isinstance(e, FileNotFoundError),
            )
        return sum(f.size for f in files)

    def _put_verified(self, key: str, f: _File) -> None:
        self._remote.store.put_file(key, f.path)
        verify_object(self._remote, key, f.size, f.sha256)

    def _remote_matches(self, step: int, files: list[_File]) -> bool:
        for f in files:
            key = step_key(step, f.name)
            try:
                self._remote.retry(
                    f"check {self.uri}/{key}",
                    lambda key=key, f=f: verify_object(self._remote, key, f.size, f.sha256),
                    fatal=is_integrity,
                )
            except IntegrityError:
                return False
        return True

    def _record_failure(self, step: int, exc: BaseException) -> None:
        message = self._remote.scrub(f"{type(exc).__name__}: {exc}")
        with self._cond:
            self._failed.append(step)
            self._consecutive_failures += 1
            self._failure_run.append(step)
            self._last_error = message
            n = self._consecutive_failures
        left = self.max_consecutive_failures - n
        consequence = (
            f"{left} more in a row and submit() raises"
            if left > 0
            else "the next submit() raises RemoteCheckpointError"
        )
        self._remote.log(
            f"remote checkpoint: ERROR UPLOAD FAILED for {step_name(step)} to {self.uri}: "
            f"{message} ({n} in a row; {consequence}; the local checkpoint is unaffected "
            "and training continues)"
        )
