"""Retrying access to a run's remote prefix, shared by every part of the remote side.

Guarantee: transient failures are retried per operation (per file, for uploads and
downloads) with exponential backoff: `retries` extra attempts after the first one, the n-th
retry waiting `backoff_s * 2**(n-1)` seconds (at most 60 s). Facts about the data (a missing
object, a wrong size or sha256) are not retried. Setting `stop` ends the waits between
attempts: the operation then raises `Aborted`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from core.errors import BucketMissing, IntegrityError, NotFound, StorageError
from core.retry import retry
from core.store import StorageOptions, Store, open_store
from training.checkpoint.format import META
from training.checkpoint.remote.errors import Aborted, is_integrity
from training.checkpoint.remote.keys import step_key
from training.checkpoint.remote.redact import Scrubber

T = TypeVar("T")

# Backoff doubles per attempt; cap it so a large `retries` cannot turn into hour-long sleeps.
_MAX_BACKOFF_S = 60.0


class RemoteStore:
    """The store under `uri`, with retries, the stop switch and scrubbed logging."""

    def __init__(
        self,
        uri: str,
        options: StorageOptions,
        retries: int,
        backoff_s: float,
        log: Callable[[str], None],
    ) -> None:
        self.store: Store = open_store(uri, options)
        self.uri = self.store.uri
        self.retries = retries
        self.backoff_s = backoff_s
        self.scrubber = Scrubber(options, log)
        self.stop = threading.Event()

    def scrub(self, text: str) -> str:
        return self.scrubber.scrub(text)

    def log(self, line: str) -> None:
        self.scrubber.log(line)

    def retry(
        self,
        what: str,
        fn: Callable[[], T],
        fatal: Callable[[BaseException], bool] = lambda e: False,
    ) -> T:
        """Run `fn`, retrying StorageError/OSError with exponential backoff. Errors for
        which `fatal` is true are raised at once; integrity ones as IntegrityError."""

        def on_retry(attempt: int, delay: float, exc: BaseException) -> None:
            self.log(
                f"remote checkpoint: {what} failed (attempt {attempt}/{self.retries + 1}), "
                f"retrying in {delay:.2f} s: {self.scrub(str(exc))}"
            )

        def fatal_or_no_bucket(e: BaseException) -> bool:
            return isinstance(e, BucketMissing) or fatal(e)  # no retry fixes a wrong URI

        try:
            return retry(
                fn,
                attempts=self.retries + 1,
                base_s=self.backoff_s,
                max_s=_MAX_BACKOFF_S,
                retry_on=(StorageError, OSError),
                fatal=fatal_or_no_bucket,
                on_retry=on_retry,
                sleep=self.stop.wait,
            )
        except (StorageError, OSError) as exc:
            if self.stop.is_set():
                raise Aborted(what) from None
            if fatal(exc) and is_integrity(exc) and not isinstance(exc, IntegrityError):
                raise IntegrityError(str(exc)) from None
            raise

    def get_or_none(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except NotFound:
            return None

    def list_keys(self) -> list[str]:
        """Every key under the prefix."""
        return self.retry(f"list {self.uri}", lambda: self.store.list(""))

    def delete_step(self, step: int, names: set[str]) -> None:
        """Delete checkpoint `step`'s files, meta.json first: a half-deleted checkpoint never
        looks complete."""
        for n in sorted(names, key=lambda n: n != META):
            key = step_key(step, n)
            self.retry(f"delete {self.uri}/{key}", lambda key=key: self.store.delete(key))
