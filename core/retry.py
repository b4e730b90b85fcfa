"""Retry with exponential backoff, for the few places that must ride out a flaky network
(object storage uploads, the Kubernetes API)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """The wait before retry number `attempt` (1-based): base * 2**(attempt-1), capped."""
    return min(base_s * 2 ** (attempt - 1), max_s)


def retry(
    fn: Callable[[], T],
    *,
    attempts: int,
    base_s: float,
    max_s: float = 60.0,
    retry_on: tuple[type[BaseException], ...],
    fatal: Callable[[BaseException], bool] = lambda e: False,
    on_retry: Callable[[int, float, BaseException], None] = lambda n, d, e: None,
    sleep: Callable[[float], bool | None],
) -> T:
    """Call `fn` up to `attempts` times. An exception of a `retry_on` type is retried
    unless `fatal(exc)`; the last attempt's exception propagates. Before each retry
    `on_retry(attempt, delay, exc)` is called, then `sleep(delay)`; a sleep that returns
    True (an Event.wait that was set) stops retrying and re-raises the exception."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except retry_on as exc:
            if fatal(exc) or attempt == attempts:
                raise
            delay = backoff_delay(attempt, base_s, max_s)
            on_retry(attempt, delay, exc)
            if sleep(delay):
                raise
    raise ValueError("attempts must be >= 1")
