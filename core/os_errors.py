"""One line for an operating-system error, for every command that writes (prep's CLI, the
trainer): the path, the cause, and what helps to act on it (the free space left on a full
disk, the file in the way of a directory, the file size limit)."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

# Errors of a write that has no file name (a write(2) on an open file): the output's.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_ERRNO_IN_TEXT = re.compile(r"\[errno (\d+)\]", re.IGNORECASE)  # pyarrow's OSErrors


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _existing(path: Path) -> Path | None:
    """`path` or its nearest ancestor that exists."""
    for p in (path, *path.parents):
        try:
            p.stat()
            return p
        except OSError:
            continue
    return None


def os_error_message(e: OSError, output: str | None = None, step: str | None = None) -> str:
    """One line for an operating-system error: the path, the cause, and what helps to
    act on it (the free space left on a full disk, the file in the way of a directory,
    the file size limit)."""
    code = e.errno if isinstance(e.errno, int) else None
    if code is None:  # pyarrow's OSErrors carry it in the text only
        m = _ERRNO_IN_TEXT.search(str(e))
        code = int(m.group(1)) if m else None
    cause = e.strerror or str(e) or type(e).__name__
    path: str | None = None
    if e.filename is not None:
        path = os.fsdecode(e.filename)
        where = path if e.filename2 is None else f"{path} -> {os.fsdecode(e.filename2)}"
        msg = f"{where}: {cause}"
    elif code in WRITE_ERRNOS and output and "://" not in output:
        path = output
        msg = f"cannot write to {output}: {cause}"
    else:
        msg = cause
    extra = [f"in step {step}"] if step else []
    if path is not None and code in (errno.EEXIST, errno.ENOTDIR):
        blocker = _existing(Path(path))
        if blocker is not None and not blocker.is_dir():
            extra.append(
                "it is a file, not a directory"
                if str(blocker) == path
                else f"{blocker} is a file, not a directory"
            )
    if code in (errno.ENOSPC, errno.EDQUOT) and (path or output):
        at = _existing(Path(path or output or "."))
        if at is not None:
            du = shutil.disk_usage(at)
            extra.append(f"{_size(du.free)} free of {_size(du.total)} on that filesystem")
    if code == errno.EFBIG:
        try:
            import resource

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY:
                extra.append(f"the file size limit (ulimit -f) is {limit} bytes")
        except (ImportError, OSError, ValueError):
            pass
    return msg + (f" ({'; '.join(extra)})" if extra else "")
