"""Checkpoints in object storage: background upload, remote `latest`, remote retention and
restore onto a fresh machine.

Layout under the remote URI mirrors the local one made by `training.checkpoint`:

    <uri>/step-XXXXXXXX/<data files>   uploaded first, each verified after its upload
    <uri>/step-XXXXXXXX/meta.json      uploaded last: its presence marks a finished upload
    <uri>/latest                       "step-XXXXXXXX\\n", written only after all of the above
    <uri>/RUN.json                     the ownership record (see `claim`)

`uri` is one run's own prefix (the trainer derives it from the run's name, see
`TrainConfig.remote_checkpoint_uri`). `claim()` makes sure it stays that way: at trainer start
it writes RUN.json ({"run_name", "config_fingerprint", "created"}) into an unclaimed prefix,
and refuses (RemoteOwnershipError) a prefix that RUN.json gives to another run name or
config fingerprint, before anything is restored from, uploaded to or pruned in it.

Guarantees:

* `latest` only ever names a checkpoint whose every file was uploaded and verified (size and
  sha256 from a HEAD request against the sha256 in the local meta.json), and it never moves
  backwards: before writing it we read the remote one and leave it alone if it already names
  the same or a newer step. (Read-then-write is not atomic across processes: one writer per
  prefix is assumed, as for the local checkpoint directory.)
* Uploads never slow the training loop: `submit()` hard-links the checkpoint's files into a
  private staging directory (`<local_root>/.upload-staging/`, a copy where hard links are not
  possible) and returns; one worker thread uploads checkpoints in FIFO order. Local retention
  may delete the checkpoint directory at any time after `submit()` returns.
* Transient failures are retried per file with exponential backoff. A checkpoint that still
  fails is logged loudly and training goes on; only when `max_consecutive_failures`
  checkpoints in a row failed does the next `submit()` raise `RemoteCheckpointError` (after
  queueing its checkpoint anyway, so a caller that chooses to carry on keeps trying, and a
  later success resets the count).
* Superseded uploads are skipped: when the worker picks up a checkpoint while a newer one is
  already queued (storage slower than the checkpoint interval), the older one is dropped
  unless it is a `keep_every` milestone, so the backlog and the staged disk space stay
  bounded. Pass `skip_superseded=False` to upload every checkpoint.
* Remote retention is local retention's rule (`training.retention.to_delete`): after each
  successful upload, remote checkpoints beyond the newest `keep_last` are deleted, except
  every `keep_every`-th step and the one `latest` names. meta.json is deleted first so a
  half-deleted checkpoint never looks complete.
* Nothing here logs or raises credentials: messages come from the store (which redacts its
  own) and are scrubbed once more of the credential values in the environment.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from core.errors import IntegrityError, NotFound, StorageError
from core.files import fsync_dir, pid_alive, sha256_file
from core.redact import redact
from core.retry import retry
from core.store import StorageOptions, Store, open_store
from training.checkpoint import LATEST, META, CheckpointError, step_name, write_latest
from training.retention import to_delete

__all__ = [
    "RUN_RECORD",
    "STAGING",
    "RemoteCheckpointError",
    "RemoteCheckpoints",
    "RemoteOwnershipError",
]

T = TypeVar("T")

STAGING = ".upload-staging"
RUN_RECORD = "RUN.json"  # the ownership record of a run's remote prefix
_MIB = 1024 * 1024
# Backoff doubles per attempt; cap it so a large `retries` cannot turn into hour-long sleeps.
_MAX_BACKOFF_S = 60.0
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# What a RUN.json may hold (it is read from storage: untrusted, and echoed in one line).
_RECORD_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
_RECORD_FINGERPRINT = re.compile(r"[0-9a-f]{8,64}")


class RemoteCheckpointError(RuntimeError):
    """Too many checkpoints in a row failed to upload (raised from `submit()`)."""


class RemoteOwnershipError(CheckpointError):
    """The remote prefix belongs to another run (another run name or config fingerprint),
    or its ownership record is unreadable: nothing is restored from, uploaded to or
    deleted in it. Bad input (the trainer exits 1), not a storage failure."""


class _Aborted(Exception):
    """close(drain=False) interrupted an upload."""


def _is_integrity(exc: BaseException) -> bool:
    """A fact about the remote data (missing, wrong size or sha256), not the network:
    retrying it only wastes time."""
    return isinstance(exc, IntegrityError | NotFound)


def _parse_meta(data: bytes, where: str) -> dict[str, dict[str, Any]]:
    """The `files` table of a meta.json, validated. File names must be plain names: a remote
    meta.json is untrusted input and must not make restore write outside its directory."""
    try:
        meta = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: {META} is not valid JSON ({exc})") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{where}: {META} lists no files")
    for name, want in files.items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..", META, LATEST)
            or "/" in name
            or "\\" in name
            or name.startswith(".")
        ):
            raise CheckpointError(f"{where}: {META} lists an invalid file name {name!r}")
        if (
            not isinstance(want, dict)
            or not isinstance(want.get("sha256"), str)
            or not _SHA256.match(want["sha256"])
            or not isinstance(want.get("bytes"), int)
            or want["bytes"] < 0
        ):
            raise CheckpointError(f"{where}: {META} entry for {name!r} is malformed")
    return files


def _group_steps(keys: list[str]) -> dict[int, set[str]]:
    """{step: {file names}} for keys shaped `step-XXXXXXXX/<file>`."""
    out: dict[int, set[str]] = {}
    for key in keys:
        head, sep, rest = key.partition("/")
        m = _STEP_DIR.match(head)
        if m and sep and rest and "/" not in rest:
            out.setdefault(int(m.group(1)), set()).add(rest)
    return out


def _parse_latest(data: bytes) -> int | None:
    m = _STEP_DIR.match(data.decode("utf-8", errors="replace").strip())
    return int(m.group(1)) if m else None


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
        self._options = options or StorageOptions()
        self._store: Store = open_store(uri, self._options)
        self.uri = self._store.uri
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.max_consecutive_failures = max_consecutive_failures
        self.retries = retries
        self.backoff_s = backoff_s
        self.skip_superseded = skip_superseded
        self._log_fn = log

        # One condition guards the queue, the counters and the status fields.
        self._cond = threading.Condition()
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
        self._published: int | None = None  # newest step this instance wrote to `latest`
        self._closed = False
        self._stop = threading.Event()
        self._seq = 0
        # Staging dirs carry pid + instance token so stale ones (dead pid) can be removed.
        self._token = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._cleaned_roots: set[Path] = set()
        # Daemon: an interpreter exit without close() must not hang on a stalled upload; the
        # remote side stays consistent (latest is written last) whatever point it stops at.
        self._worker = threading.Thread(target=self._run, name="remote-checkpoints", daemon=True)
        self._worker.start()

    # -- public API ----------------------------------------------------------------------

    def submit(self, local_root: Path, step: int, rewind: bool = False) -> None:
        """Queue the upload of local checkpoint `step` and return at once. Raises
        RemoteCheckpointError if the last `max_consecutive_failures` checkpoints all failed
        (this one is still queued).

        `rewind`: the first checkpoint after a rollback. `latest` normally never moves back
        (an old upload finishing late must not hide a newer one); after a rollback it must,
        or a fresh machine would resume on the abandoned trajectory. Remote steps newer than
        `step` are deleted once `latest` names it."""
        local_root = Path(local_root)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"RemoteCheckpoints for {self.uri} is closed")
            too_many = self._consecutive_failures >= self.max_consecutive_failures
            failure_run = list(self._failure_run)
            last_error = self._last_error
            self._seq += 1
            seq = self._seq
        try:
            staged = self._stage(local_root, step, seq)
        except (OSError, CheckpointError) as exc:
            # A local problem is still a checkpoint that did not reach storage: count it.
            self._record_failure(step, exc)
        else:
            with self._cond:
                self._queue.append(_Job(step, staged, rewind))
                self._pending += 1
                self._cond.notify_all()
        if too_many:
            steps = ", ".join(step_name(s) for s in failure_run)
            raise RemoteCheckpointError(
                self._scrub(
                    f"{len(failure_run)} checkpoints in a row failed to upload to {self.uri} "
                    f"({steps}); last error: {last_error}. Local checkpoints are intact; "
                    f"{step_name(step)} was queued anyway."
                )
            )

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted checkpoint was uploaded, skipped or given up on.
        Raises TimeoutError if that takes longer than `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(
                    f"remote checkpoint uploads to {self.uri} still pending after {timeout} s "
                    f"({self._pending} left, in flight: {self._in_flight})"
                )

    def close(self, drain: bool = True) -> None:
        """Stop the worker. With `drain` (the default) pending uploads finish first;
        without, queued ones are dropped and the one in flight is abandoned between
        attempts (latest is untouched by an abandoned upload)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if drain:
            self.wait()
        else:
            self._stop.set()
            with self._cond:
                dropped = [job for job in self._queue if job is not None]
                self._queue.clear()
                self._pending -= len(dropped)
            for job in dropped:
                shutil.rmtree(job.staged, ignore_errors=True)
            if dropped:
                self._log(
                    "remote checkpoint: WARNING closing without drain, dropped queued uploads "
                    f"of {', '.join(step_name(j.step) for j in dropped)}"
                )
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._worker.join()

    def __enter__(self) -> RemoteCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def status(self) -> dict[str, Any]:
        """A snapshot: uploaded/failed/skipped steps, failures in a row, the last error
        (already scrubbed), what is pending, and the last upload's size and speed."""
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
                "latest": self._published,
                "last_upload": dict(self._last_upload) if self._last_upload else None,
            }

    def claim(self, run_name: str, fingerprint: str) -> None:
        """Make sure this prefix is this run's before anything touches its checkpoints.

        No RUN.json: write one (with a warning when the prefix already holds checkpoints,
        made by a Ballast from before ownership records: they are adopted). A RUN.json with
        this run name and config fingerprint: nothing to do. Anything else raises
        RemoteOwnershipError (one line: the URI, both runs, how to fix it). StorageError
        when storage cannot be reached (after retries)."""
        fix = ("give this run its own prefix (another run_dir or checkpoint.run_name) or "
               f"delete {self.uri} to start it over")
        data = self._retry(f"read {self.uri}/{RUN_RECORD}",
                           lambda: self._get_or_none(RUN_RECORD))
        if data is None:
            keys = self._retry(f"list {self.uri}", lambda: self._store.list(""))
            if _group_steps(keys) or LATEST in keys:
                self._log(f"remote checkpoint: WARNING {self.uri} holds checkpoints but no "
                          f"{RUN_RECORD} (written by an older Ballast); adopting them as run "
                          f"{run_name!r} (config fingerprint {fingerprint})")
            record = {"run_name": run_name, "config_fingerprint": fingerprint,
                      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            body = (json.dumps(record, indent=2) + "\n").encode()
            self._retry(f"write {self.uri}/{RUN_RECORD}", lambda: self._store.put(RUN_RECORD, body))
            # Read it back: of two runs starting at once on an empty prefix, one that wrote
            # first and reads the other's record stops below. That narrows the race, it does
            # not close it (no conditional writes here): one writer per prefix is assumed.
            data = self._retry(f"read {self.uri}/{RUN_RECORD}",
                               lambda: self._get_or_none(RUN_RECORD))
            if data is None:
                raise StorageError(f"{self.uri}/{RUN_RECORD} vanished right after its write")
        try:
            owner = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            owner = None
        if (not isinstance(owner, dict)
                or not isinstance(owner.get("run_name"), str)
                or not _RECORD_NAME.fullmatch(owner["run_name"])
                or not isinstance(owner.get("config_fingerprint"), str)
                or not _RECORD_FINGERPRINT.fullmatch(owner["config_fingerprint"])):
            raise RemoteOwnershipError(self._scrub(
                f"{self.uri}/{RUN_RECORD} is not a valid ownership record, so which run "
                f"{self.uri} belongs to is unknown; not resuming from, uploading to or pruning "
                f"it (this run: {run_name!r}, config fingerprint {fingerprint}): {fix}"))
        other, other_fp = owner["run_name"], owner["config_fingerprint"]
        if (other, other_fp) != (run_name, fingerprint):
            changed = " (the model or optimizer changed)" if other == run_name else ""
            raise RemoteOwnershipError(self._scrub(
                f"{self.uri} belongs to run {other!r} (config fingerprint {other_fp}), not to "
                f"this run {run_name!r} (config fingerprint {fingerprint}){changed}; not "
                f"resuming from, uploading to or pruning it: {fix}"))

    def remote_steps(self) -> list[int]:
        """Steps with a meta.json remotely (finished uploads; not re-verified here)."""
        keys = self._retry(f"list {self.uri}", lambda: self._store.list(""))
        return sorted(s for s, names in _group_steps(keys).items() if META in names)

    def restore_latest(self, local_root: Path) -> int | None:
        """Download the newest complete remote checkpoint into `local_root` and point the
        local `latest` at it; return its step, or None when the remote holds none.

        The step `latest` names is tried first, then older ones newest-first; a partial or
        corrupt one is skipped with a warning. Steps newer than `latest` are ignored: their
        upload never committed. Raises StorageError when storage cannot be reached (after
        retries): "unreachable" must not read as "nothing to resume from"."""
        local_root = Path(local_root)
        local_root.mkdir(parents=True, exist_ok=True)
        latest = self._read_latest(warn=True)
        keys = self._retry(f"list {self.uri}", lambda: self._store.list(""))
        by_step = _group_steps(keys)
        if latest is not None:
            if latest not in by_step:
                self._log(
                    f"remote checkpoint: WARNING {self.uri}/{LATEST} names {step_name(latest)}, "
                    "which does not exist remotely; trying older checkpoints"
                )
            candidates = [latest, *sorted((s for s in by_step if s < latest), reverse=True)]
        else:
            candidates = sorted(by_step, reverse=True)
        step = self._restore_first(candidates, by_step, local_root)
        if step is None:
            if candidates:
                self._log(f"remote checkpoint: WARNING no complete checkpoint under {self.uri}")
            return None
        write_latest(local_root, step)
        self._log(
            f"remote checkpoint: restored {self.uri}/{step_name(step)} into "
            f"{local_root / step_name(step)}"
        )
        return step

    def restore_at_most(self, local_root: Path, max_step: int) -> int | None:
        """Download the newest complete remote checkpoint at or before `max_step` (a
        rollback target that is no longer on local disk); None when there is none."""
        local_root = Path(local_root)
        local_root.mkdir(parents=True, exist_ok=True)
        keys = self._retry(f"list {self.uri}", lambda: self._store.list(""))
        by_step = _group_steps(keys)
        candidates = sorted((s for s in by_step if s <= max_step), reverse=True)
        return self._restore_first(candidates, by_step, local_root)

    def _restore_first(self, candidates: list[int], by_step: dict[int, set[str]],
                       local_root: Path) -> int | None:
        """Restore the first of `candidates` (newest first) that is complete and verifies;
        each partial or corrupt one is skipped with a warning. Its step, or None."""
        for step in candidates:
            try:
                self._restore_one(step, by_step.get(step, set()), local_root)
            except (IntegrityError, CheckpointError) as exc:
                self._log(
                    f"remote checkpoint: WARNING skipping {self.uri}/{step_name(step)}, it is "
                    f"partial or corrupt: {self._scrub(str(exc))}"
                )
                continue
            return step
        return None

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
                if (newer and self.skip_superseded and not self._milestone(job.step)
                        and not job.rewind):
                    with self._cond:
                        self._skipped.append(job.step)
                    self._log(
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

    def _milestone(self, step: int) -> bool:
        return bool(self.keep_every) and step % (self.keep_every or 1) == 0

    def _process(self, job: _Job) -> None:
        t0 = time.monotonic()
        try:
            if job.rewind:
                self._step_latest_back(job.step)
            total = self._upload(job)
            published = (self._rewind_latest(job.step) if job.rewind
                         else self._publish_latest(job.step))
        except _Aborted:
            self._log(f"remote checkpoint: upload of {step_name(job.step)} abandoned (closing)")
            return
        except Exception as exc:  # anything, a bug included, must not kill the worker
            self._record_failure(job.step, exc)
            return
        seconds = max(time.monotonic() - t0, 1e-9)
        with self._cond:
            self._uploaded.append(job.step)
            self._consecutive_failures = 0
            self._failure_run = []
            self._last_upload = {
                "step": job.step,
                "bytes": total,
                "seconds": seconds,
                "mb_per_s": total / _MIB / seconds,
            }
        note = f"latest -> {step_name(job.step)}" if published else "latest unchanged"
        self._log(
            f"remote checkpoint: uploaded {self.uri}/{step_name(job.step)} "
            f"({total / _MIB:.1f} MiB in {seconds:.2f} s, {total / _MIB / seconds:.1f} MiB/s; "
            f"{note})"
        )
        try:
            self._retain(job.step)
        except Exception as exc:  # retention is housekeeping: never a failed checkpoint
            self._log(f"remote checkpoint: WARNING remote retention failed: {exc}")

    def _plan(self, job: _Job) -> tuple[list[_File], bytes]:
        """The staged files to upload, data files first and meta.json last, each checked
        against meta.json so a locally damaged checkpoint is never published."""
        where = f"local checkpoint {step_name(job.step)}"
        meta_bytes = (job.staged / META).read_bytes()
        files_meta = _parse_meta(meta_bytes, where)
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
        files, meta_bytes = self._plan(job)
        name = step_name(job.step)
        meta_key = f"{name}/{META}"
        try:
            remote_meta = self._retry(
                f"read {self.uri}/{meta_key}", lambda: self._get_or_none(meta_key),
                fatal=_is_integrity,
            )
        except StorageError as exc:
            if not _is_integrity(exc):
                raise
            remote_meta = b""  # unreadable/corrupt remote meta.json: replace it
        if remote_meta == meta_bytes and self._remote_matches(name, files):
            # Resubmitted after a restart, or a retry of an upload that completed: nothing
            # to send, but latest may still need writing.
            self._log(f"remote checkpoint: {self.uri}/{name} already uploaded and verified")
            return sum(f.size for f in files)
        if remote_meta is not None:
            # Overwriting a different checkpoint of the same step: its meta.json goes first,
            # so it reads as incomplete, never as a mix of two checkpoints. If `latest` names
            # it that would leave latest pointing at a partial checkpoint: refuse instead.
            if self._read_latest(warn=False) == job.step:
                raise CheckpointError(
                    f"{self.uri}/{name} already holds a different checkpoint and {LATEST} "
                    "names it; refusing to overwrite it"
                )
            self._log(f"remote checkpoint: WARNING replacing a different {self.uri}/{name}")
            self._retry(f"delete {self.uri}/{meta_key}", lambda: self._store.delete(meta_key))
        for f in files:
            key = f"{name}/{f.name}"
            self._retry(
                f"upload {self.uri}/{key}",
                lambda key=key, f=f: self._put_verified(key, f),
                # A vanished staged file cannot come back by retrying.
                fatal=lambda e: isinstance(e, FileNotFoundError),
            )
        return sum(f.size for f in files)

    def _put_verified(self, key: str, f: _File) -> None:
        self._store.put_file(key, f.path)
        self._verify_remote(key, f.size, f.sha256)

    def _remote_matches(self, name: str, files: list[_File]) -> bool:
        for f in files:
            try:
                self._retry(
                    f"check {self.uri}/{name}/{f.name}",
                    lambda f=f: self._verify_remote(f"{name}/{f.name}", f.size, f.sha256),
                    fatal=_is_integrity,
                )
            except IntegrityError:
                return False
        return True

    def _publish_latest(self, step: int) -> bool:
        """Point remote `latest` at `step` unless it already names this or a newer step.
        Returns whether it was written."""
        with self._cond:
            published = self._published
        if published is not None and published >= step:
            self._log(
                f"remote checkpoint: not moving {LATEST} back from {step_name(published)} "
                f"to {step_name(step)}"
            )
            return False
        current = self._read_latest(warn=True)
        if current is not None and current >= step:
            self._log(
                f"remote checkpoint: {self.uri}/{LATEST} already names {step_name(current)}; "
                f"not moving it back to {step_name(step)}"
            )
            with self._cond:
                self._published = max(current, self._published or current)
            return False
        data = (step_name(step) + "\n").encode()
        self._retry(f"write {self.uri}/{LATEST}", lambda: self._store.put(LATEST, data))
        with self._cond:
            self._published = step
        return True

    def _step_latest_back(self, step: int) -> None:
        """Before a rewind upload replaces remote `step`: if `latest` names `step` or a newer
        one, point it at the newest complete step before `step`, so that `latest` never names
        a step being replaced or abandoned."""
        current = self._read_latest(warn=False)
        if current is None or current < step:
            return
        keys = self._retry(f"list {self.uri}", lambda: self._store.list(""))
        older = [s for s, names in _group_steps(keys).items() if s < step and META in names]
        if older:
            data = (step_name(max(older)) + "\n").encode()
            self._retry(f"write {self.uri}/{LATEST}", lambda: self._store.put(LATEST, data))
        else:
            self._retry(f"delete {self.uri}/{LATEST}", lambda: self._store.delete(LATEST))

    def _rewind_latest(self, step: int) -> bool:
        """Point remote `latest` at `step` even if it names a newer step, then delete the
        newer steps (the abandoned trajectory): `latest` first, so no reader ever follows it
        to a step being deleted."""
        data = (step_name(step) + "\n").encode()
        self._retry(f"write {self.uri}/{LATEST}", lambda: self._store.put(LATEST, data))
        with self._cond:
            self._published = step
        keys = self._retry(f"list {self.uri}", lambda: self._store.list(""))
        newer = sorted(s for s in _group_steps(keys) if s > step)
        for s in newer:
            for n in sorted(_group_steps(keys)[s], key=lambda n: n != META):  # meta.json first
                key = f"{step_name(s)}/{n}"
                self._retry(f"delete {self.uri}/{key}", lambda key=key: self._store.delete(key))
        self._log(f"remote checkpoint: rewound {LATEST} to {step_name(step)}"
                  + (f"; deleted abandoned {', '.join(step_name(s) for s in newer)}"
                     if newer else ""))
        return True

    def _retain(self, just_uploaded: int) -> None:
        keys = self._retry(f"list {self.uri}", lambda: self._store.list(""))
        by_step = _group_steps(keys)
        complete = [s for s, names in by_step.items() if META in names]
        latest = self._read_latest(warn=False)
        doomed = to_delete(complete, self.keep_last, self.keep_every,
                           () if latest is None else (latest,),
                           partial=[s for s in by_step if s not in complete],
                           uploaded=just_uploaded)
        for s in doomed:
            names = sorted(by_step[s], key=lambda n: n != META)  # meta.json first
            for n in names:
                key = f"{step_name(s)}/{n}"
                self._retry(f"delete {self.uri}/{key}", lambda key=key: self._store.delete(key))
        if doomed:
            self._log(
                "remote checkpoint: retention deleted "
                f"{', '.join(step_name(s) for s in doomed)} from {self.uri}"
            )

    def _record_failure(self, step: int, exc: BaseException) -> None:
        message = self._scrub(f"{type(exc).__name__}: {exc}")
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
        self._log(
            f"remote checkpoint: ERROR UPLOAD FAILED for {step_name(step)} to {self.uri}: "
            f"{message} ({n} in a row; {consequence}; the local checkpoint is unaffected "
            "and training continues)"
        )

    # -- restore side --------------------------------------------------------------------

    def _restore_one(self, step: int, names: set[str], local_root: Path) -> None:
        name = step_name(step)
        if META not in names:
            raise IntegrityError(f"no {META} (upload never finished)")
        meta_key = f"{name}/{META}"
        meta_bytes = self._retry(
            f"read {self.uri}/{meta_key}", lambda: self._store.get(meta_key), fatal=_is_integrity
        )
        files = _parse_meta(meta_bytes, f"{self.uri}/{name}")
        # Cheap checks (listing + HEAD) before downloading anything.
        for fname, want in files.items():
            if fname not in names:
                raise IntegrityError(f"{fname} listed in {META} is missing")
            self._retry(
                f"check {self.uri}/{name}/{fname}",
                lambda fname=fname, want=want: self._verify_remote(
                    f"{name}/{fname}", want["bytes"], want["sha256"]
                ),
                fatal=_is_integrity,
            )
        # Download into a temporary directory and rename it into place: a crash or a bad
        # file midway never leaves a partial step directory that looks like a checkpoint.
        tmp = local_root / f".{name}.restore-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            for fname, want in files.items():
                dest = tmp / fname
                self._retry(
                    f"download {self.uri}/{name}/{fname}",
                    lambda fname=fname, dest=dest: self._store.get_file(f"{name}/{fname}", dest),
                    fatal=_is_integrity,
                )
                if sha256_file(dest) != want["sha256"]:
                    raise IntegrityError(f"{fname} downloaded with a sha256 not matching {META}")
            (tmp / META).write_bytes(meta_bytes)
            for p in tmp.iterdir():
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
            final = local_root / name
            if final.exists():  # a stale local copy of the same step: the remote one wins
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(local_root)
        except StorageError as exc:
            if _is_integrity(exc) and not isinstance(exc, IntegrityError):
                raise IntegrityError(str(exc)) from None
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- storage helpers -----------------------------------------------------------------

    def _retry(
        self,
        what: str,
        fn: Callable[[], T],
        fatal: Callable[[BaseException], bool] = lambda e: False,
    ) -> T:
        """Run `fn`, retrying StorageError/OSError with exponential backoff. Errors for
        which `fatal` is true are raised at once; integrity ones as IntegrityError."""

        def on_retry(attempt: int, delay: float, exc: BaseException) -> None:
            self._log(
                f"remote checkpoint: {what} failed (attempt {attempt}/{self.retries + 1}), "
                f"retrying in {delay:.2f} s: {self._scrub(str(exc))}"
            )

        try:
            return retry(fn, attempts=self.retries + 1, base_s=self.backoff_s,
                         max_s=_MAX_BACKOFF_S, retry_on=(StorageError, OSError), fatal=fatal,
                         on_retry=on_retry, sleep=self._stop.wait)
        except (StorageError, OSError) as exc:
            if self._stop.is_set():
                raise _Aborted(what) from None
            if fatal(exc) and _is_integrity(exc) and not isinstance(exc, IntegrityError):
                raise IntegrityError(str(exc)) from None
            raise

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self._store.get(key)
        except NotFound:
            return None

    def _read_latest(self, warn: bool) -> int | None:
        """The step remote `latest` names; None if absent, unreadable or malformed."""
        try:
            data = self._retry(
                f"read {self.uri}/{LATEST}", lambda: self._get_or_none(LATEST), fatal=_is_integrity
            )
        except IntegrityError as exc:
            if warn:
                self._log(f"remote checkpoint: WARNING ignoring corrupt {LATEST}: {exc}")
            return None
        if data is None:
            return None
        step = _parse_latest(data)
        if step is None and warn:
            self._log(f"remote checkpoint: WARNING {self.uri}/{LATEST} names no checkpoint")
        return step

    def _verify_remote(self, key: str, size: int, sha256: str) -> None:
        """Raise IntegrityError unless the remote object has this size and sha256."""
        info = self._remote_info(key)
        if info is None:
            raise IntegrityError(f"{self.uri}/{key} does not exist")
        got_size, got_sha = info
        if got_size != size:
            raise IntegrityError(f"{self.uri}/{key} has {got_size} bytes, expected {size}")
        if got_sha is None:
            # Written by a tool that sets no sha256 metadata: the size is all a HEAD can
            # tell, and get_file/our own hash check the content on download.
            return
        if got_sha != sha256:
            raise IntegrityError(
                f"{self.uri}/{key} has sha256 {got_sha[:12]}…, expected {sha256[:12]}…"
            )

    def _remote_info(self, key: str) -> tuple[int, str | None] | None:
        """(size, sha256 if known) of a remote object, or None if it does not exist: a
        HEAD on S3 (our sha256 metadata, no download), the file itself locally."""
        info = self._store.stat(key)
        if info is None:
            return None
        local = self._store.local_path(key)
        if info.sha256 is None and local is not None:
            return info.size, sha256_file(local)
        return info.size, info.sha256

    # -- logging -------------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        """Second line of defence: the store already redacts its errors, but no
        credential value from the environment may ever reach a log line or exception."""
        return redact(text, (self._options.access_key_env, self._options.secret_key_env))

    def _log(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a broken log sink must not break uploads
            self._log_fn(self._scrub(line))
