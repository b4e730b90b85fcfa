"""File helpers for every layer: sha256, temporary names beside their destination, and
write-to-temp-then-rename (a reader sees the whole old file or the whole new one)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_umask() -> int:
    # os.umask can only be read by setting it, and it is process-wide: done once, here at
    # import (before any thread of ours runs), never per write.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()
# The mode a plain open(path, "w") gives a new file under this umask; mkstemp's 0600 is
# widened to it, so the output is as readable as any other file its user writes.
FILE_MODE = 0o666 & ~UMASK


def temp_beside(dest: Path) -> tuple[int, Path]:
    """A new, empty temporary file next to `dest` (same filesystem, so it can be renamed
    onto it atomically), under a hidden temporary name (see `is_temp_name`) and with the
    mode of a normal new file (FILE_MODE), not mkstemp's 0600. Returns (fd, path)."""
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    return fd, Path(name)


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of our temporary names (".<key name>.<random>.tmp"): a
    file being written, or one left behind by a killed writer. Such files are never keys."""
    return name.startswith(".") and name.endswith(".tmp")


def remove_temp_files(root: Path) -> list[Path]:
    """Delete every temporary-named file under the directory `root` (debris of killed
    writes) and return them. Only for a directory no other process is writing into."""
    removed = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if is_temp_name(name):
                p = Path(dirpath, name)
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def write_atomic(path: str | Path, data: bytes | str, fsync: bool = False) -> None:
    """Write `data` to `path` through a temporary file beside it and a rename, so a
    reader (or a crash) never sees a half-written file. With `fsync`, the bytes and the
    rename are durable when this returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


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


def run_forwarding_signals(cmd: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run `cmd` as a child with SIGTERM and SIGINT forwarded to it, and return its exit
    code (negative: killed by that signal). For a launcher that must pass a stop on (PID 1
    of a pod gets the SIGTERM, not its child); the previous handlers come back after."""
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
