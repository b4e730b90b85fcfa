"""The layout of a run's remote prefix: every key this package reads or writes is made or
parsed here.

    <uri>/step-XXXXXXXX/<data files>   uploaded first, each verified after its upload
    <uri>/step-XXXXXXXX/meta.json      uploaded last: its presence marks a finished upload
    <uri>/latest                       "step-XXXXXXXX\\n", written only after all of the above
    <uri>/RUN.json                     the ownership record (see `claim`)

It mirrors the local directory made by `training.checkpoint.format` (same step names, same
meta.json, same `latest` body).
"""

from __future__ import annotations

import re

from training.checkpoint.format import LATEST, META, step_name

__all__ = ["LATEST", "META", "RUN_RECORD", "group_steps", "latest_body", "parse_latest", "step_key"]

RUN_RECORD = "RUN.json"  # the ownership record of a run's remote prefix
# The one step-directory pattern of the remote side: the key prefix of a step's files and
# what `latest` names.
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_key(step: int, name: str) -> str:
    """The key of file `name` of checkpoint `step`."""
    return f"{step_name(step)}/{name}"


def group_steps(keys: list[str]) -> dict[int, set[str]]:
    """{step: {file names}} for keys shaped `step-XXXXXXXX/<file>`."""
    out: dict[int, set[str]] = {}
    for key in keys:
        head, sep, rest = key.partition("/")
        m = _STEP_DIR.match(head)
        if m and sep and rest and "/" not in rest:
            out.setdefault(int(m.group(1)), set()).add(rest)
    return out


def latest_body(step: int) -> bytes:
    """What `latest` holds when it names `step`."""
    return (step_name(step) + "\n").encode()


def parse_latest(data: bytes) -> int | None:
    """The step a `latest` body names; None if it names no checkpoint."""
    m = _STEP_DIR.match(data.decode("utf-8", errors="replace").strip())
    return int(m.group(1)) if m else None
