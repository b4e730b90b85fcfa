"""List files that rules read (blocklists, word lists, boilerplate strings): one entry a
line, blank lines and lines starting with `#` skipped."""

from __future__ import annotations

import os
from functools import lru_cache


def read_list(path: str) -> tuple[str, ...]:
    """The stripped entries of the list file at `path`.

    Raises ValueError naming the path when it cannot be read. A file is read once per
    process while unchanged: the quality stage builds its rules once per shard."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    return _read(path, st.st_mtime_ns, st.st_size)


def readable_list(path: str | None) -> str | None:
    """A `field_validator` body for an optional list-file key: the config is refused at
    load time, naming the path, rather than when the first shard reaches the rule."""
    if path is not None:
        read_list(path)
    return path


@lru_cache(maxsize=16)
def _read(path: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    del mtime_ns, size  # part of the cache key only: an edited file is read again
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"cannot read {path}: not UTF-8 text") from None
    entries = (line.strip() for line in lines)
    return tuple(e for e in entries if e and not e.startswith("#"))
