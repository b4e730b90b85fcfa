"""File helpers shared by checkpoints, the uploader and the dataset manifest (no torch
import here: the prep side uses it too)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
