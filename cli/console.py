"""Where the `ballast` commands write what is not their result: errors, warnings and
progress, on stderr, each error one line."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def stderr_console() -> Console:
    # soft_wrap: when stderr is not a terminal rich wraps at 80 columns, and one error
    # would become several lines in a log.
    return Console(stderr=True, soft_wrap=True, highlight=False)


def print_error(message: str, label: str = "error") -> None:
    stderr_console().print(Text.assemble((f"{label}:", "bold red"), " ", message))
