"""Guarantee: nothing the remote side logs or raises carries a credential. Messages come
from the store (which redacts its own) and every log line, error message and status field
made here goes through `Scrubber` once more, which removes the credential values in the
environment."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from core.redact import redact
from core.store import StorageOptions


class Scrubber:
    """Scrubs text of the credentials named by `options`, and logs scrubbed lines."""

    def __init__(self, options: StorageOptions, log: Callable[[str], None]) -> None:
        self._env = (options.access_key_env, options.secret_key_env)
        self._log_fn = log

    def scrub(self, text: str) -> str:
        """Second line of defence: the store already redacts its errors, but no
        credential value from the environment may ever reach a log line or exception."""
        return redact(text, self._env)

    def log(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a broken log sink must not break uploads
            self._log_fn(self.scrub(line))
