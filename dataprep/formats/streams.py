"""Decompression for the formats read as byte streams (jsonl, txt): a file's compression is
told by its extension (.gz, .zst, .zstd), and a truncated stream raises one of
`STREAM_ERRORS`, which the readers quarantine as `corrupt_file`."""

from __future__ import annotations

import gzip
import io
import zlib
from typing import Any, BinaryIO

import zstandard

COMPRESSIONS = (".gz", ".zst", ".zstd")
COMPRESSIONS_SHOWN = ".gz/.zst"  # as error messages name them
CHUNK = 1 << 20  # read buffer, and the piece size where a line is skipped unkept


class _CorruptStream(Exception):
    """A compressed stream ended in the middle of a frame."""


# Errors a broken compressed stream raises while reading; anything else (a disk error,
# a bug) propagates, so that infrastructure failures are retried instead of quarantined.
STREAM_ERRORS: tuple[type[BaseException], ...] = (
    gzip.BadGzipFile,
    EOFError,
    zlib.error,
    zstandard.ZstdError,
    _CorruptStream,
)


def is_compressed(path: str) -> bool:
    """Whether `open_stream` decompresses `path` (by its extension)."""
    return path.lower().endswith(COMPRESSIONS)


def strip_compression(name: str) -> tuple[str, bool]:
    """`name` without its compression extension, and whether it had one."""
    n = name.lower()
    for c in COMPRESSIONS:
        if n.endswith(c):
            return name[: -len(c)], True
    return name, False


class _ZstdRaw(io.RawIOBase):
    """Streaming zstd decompression that notices truncation. zstandard's stream_reader
    returns a clean EOF for a file cut mid-frame, which would silently lose its tail;
    decompressobj exposes `eof`, so a frame left open at end of input is an error.
    Concatenated frames (as written by parallel compressors) are followed."""

    def __init__(self, fh: BinaryIO):
        self._fh = fh
        self._dctx = zstandard.ZstdDecompressor()
        self._d = self._dctx.decompressobj()
        self._in_frame = False
        self._buf = b""
        self._pos = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while self._pos >= len(self._buf):
            if self._done:
                return 0
            self._fill()
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def _fill(self) -> None:
        # Small input chunks bound the output of one call even for highly compressible data.
        data = self._fh.read(1 << 17)
        self._buf, self._pos = b"", 0
        if not data:
            if self._in_frame:
                raise _CorruptStream("zstd stream ends in the middle of a frame (truncated)")
            self._done = True
            return
        parts = []
        while data:
            parts.append(self._d.decompress(data))
            self._in_frame = True
            if self._d.eof:
                data = self._d.unused_data
                self._d = self._dctx.decompressobj()
                self._in_frame = False
            else:
                data = b""
        self._buf = b"".join(parts)

    def close(self) -> None:
        self._fh.close()
        super().close()


def open_stream(path: str) -> BinaryIO:
    """`path` opened for reading, decompressed as its extension says."""
    n = path.lower()
    if n.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if n.endswith((".zst", ".zstd")):
        raw = _ZstdRaw(open(path, "rb"))  # noqa: SIM115 (closed with the reader)
        return io.BufferedReader(raw, buffer_size=CHUNK)  # type: ignore[return-value]
    return open(path, "rb", buffering=CHUNK)
