"""The compiled kernels (`dataprep._native`, built from native/*.cpp by the install) and
how prep chooses between them and the Python implementation.

Every kernel has a Python twin that stays the reference: the tests compare the two on
the shared corpora and on random text, and the Python one runs wherever the native one
is missing (a checkout without a compiler, `BALLAST_NATIVE=0`) or declines a document
it does not handle exactly (rare scripts, special cases).

`BALLAST_NATIVE=0` forces the Python path everywhere, e.g. to compare outputs or to rule
the native code out when chasing a bug.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pyarrow as pa

try:
    from dataprep import _native as _module
except ImportError as exc:  # no compiler at install time, or a source tree never built
    _module = None
    IMPORT_ERROR: str | None = str(exc)
else:
    IMPORT_ERROR = None


def module() -> ModuleType | None:
    """The extension module when it is built and not switched off, else None."""
    if _module is None or os.environ.get("BALLAST_NATIVE", "1") == "0":
        return None
    return _module


def built() -> bool:
    """Whether the extension module was built and imports (whatever BALLAST_NATIVE says)."""
    return _module is not None


def text_column(arr: pa.Array | pa.ChunkedArray) -> tuple[Any, Any, int, int, bool]:
    """A string column as the kernels read it (native/arrow_text.h): its offsets buffer,
    data buffer, offset, length and whether the offsets are 64-bit. No copy for a single
    chunk; a chunked column is combined first."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_string(arr.type) or pa.types.is_binary(arr.type):
        large = False
    elif pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type):
        large = True
    else:
        raise TypeError(f"text column: expected a string array, got {arr.type}")
    _validity, offsets, data = arr.buffers()
    return offsets, data, arr.offset, len(arr), large
