"""The run protocol between the trainer, its launchers and the CLI: exit codes and the
event lines the trainer writes to its log for the supervisor to read."""

from __future__ import annotations

import json
from typing import Any

# What a process exit means, for every launcher (local supervisor, Kubernetes pod
# failure policy, the CLI). 1 and 3 are final: restarting cannot help.
EXIT_OK = 0
EXIT_ERROR = 1  # bad input or config: a one-line message says which
EXIT_CRASHED = 2  # an unexpected exception or a lost rank: restart and resume
EXIT_DIVERGED = 3  # the loss diverged and rollback could not recover it
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command

EVENT_PREFIX = "BALLAST_EVENT "


def format_event(event: dict[str, Any]) -> str:
    """One log line carrying `event` as JSON after EVENT_PREFIX."""
    return EVENT_PREFIX + json.dumps(event, default=str)


def parse_event(line: str) -> dict[str, Any] | None:
    """The event a log line carries (anywhere in the line: launchers prefix their own
    tags), or None for an ordinary line or a malformed event."""
    i = line.find(EVENT_PREFIX)
    if i < 0:
        return None
    try:
        ev = json.loads(line[i + len(EVENT_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return ev if isinstance(ev, dict) else None
