"""The input-format contract: an `InputFile` (one input, or a part of one), and the
`Format` that each module in this package declares for the registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from dataprep.formats.validate import BadRecord, RawDoc, Records

PartKind = Literal["bytes", "row_groups"]


@dataclass(frozen=True, slots=True)
class InputFile:
    source: str  # source name
    uri: str  # absolute local path or s3://bucket/key
    rel: str  # stable name used in ids (posix, relative to the path's fixed base dir)
    format: str  # resolved: a name in dataprep.formats.FORMATS
    # bytes (for planning units): of the part, for a part; 0 for s3 objects when the store
    # cannot say
    size: int
    # A part of the file (see `Format.split`); the defaults mean the whole file.
    # bytes: the lines that *start* in bytes [start, end) (end None: to the end of file).
    start: int = 0
    end: int | None = None
    # row_groups: row groups [first, stop) (None: all of them).
    row_groups: tuple[int, int] | None = None
    # 1-based number of the part's first line or row, so that locations and ids in a part
    # are those of a read of the whole file.
    first_record: int = 1
    # What tells a change of the file without reading it (dataprep/inputs.py): local
    # "<size>-<mtime_ns>" (a directory input: its size and newest file's), S3 the ETag.
    version: str = ""
    # The whole file's size, for a part (None: `size` is the whole file's).
    file_size: int | None = None

    @property
    def is_part(self) -> bool:
        return self.part_kind is not None

    @property
    def part_kind(self) -> PartKind | Literal["mixed"] | None:
        """Which kind of part this is; None for the whole file."""
        by_bytes = self.start != 0 or self.end is not None
        if self.row_groups is None:
            return "bytes" if by_bytes else None
        return "mixed" if by_bytes else "row_groups"


# Streams one local file (`path`: `f.uri`, or where an s3 object was downloaded to) as
# documents and bad records, in file order; never raises for bad content.
Reader = Callable[[Records, InputFile, str], Iterator[RawDoc | BadRecord]]
# `f` (local, uncompressed, bigger than `unit_bytes`) as consecutive parts of about
# `unit_bytes` that read, one after the other, exactly as the whole file does; [f] when it
# cannot be split.
Splitter = Callable[[InputFile, int], list[InputFile]]
# Given "is there a file of this name in the directory", whether the directory is one
# input of a directory format.
DirTest = Callable[[Callable[[str], bool]], bool]


@dataclass(frozen=True)
class Format:
    """One input format. A file format is told by its file extensions; a directory format
    (a dataset saved as a directory of files) by `is_dir`, and is read from local disk
    only."""

    name: str  # the config's `format` value
    read: Reader
    # File extensions, lower case, as ".jsonl"; empty for a directory format.
    extensions: tuple[str, ...] = ()
    # Also taken gzip/zstd-compressed (".jsonl.gz", ".jsonl.zst"): for formats read as a
    # byte stream, whose reader opens the file with streams.open_stream (which
    # decompresses); not for those that seek in the file.
    compressible: bool = False
    # A big local uncompressed file is split into parts of this kind, by `split`.
    parts: PartKind | None = None
    split: Splitter | None = None
    # Directory formats: the test, what such a directory is called in messages, and why
    # a directory is not one (for a source that names this format).
    is_dir: DirTest | None = None
    dir_noun: str = ""
    dir_hint: str = ""

    def __post_init__(self) -> None:
        if (self.parts is None) != (self.split is None):
            raise ValueError(f"format {self.name}: give both parts and split, or neither")
        if (self.is_dir is None) == (not self.extensions):
            raise ValueError(f"format {self.name}: give either extensions or is_dir")
