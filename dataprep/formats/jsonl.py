"""jsonl: one JSON object per line (also `.json` and `.ndjson`, as Dolma/OLMo ship their
`.json.gz` files), optionally gzip/zstd-compressed. A big uncompressed file is split into
byte ranges that start at line starts. Locations: `<rel>:<line>`, 1-based."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import BinaryIO

from dataprep.formats.base import Format, InputFile
from dataprep.formats.streams import CHUNK, STREAM_ERRORS, open_stream
from dataprep.formats.validate import (
    BadRecord,
    NonFinite,
    RawDoc,
    Records,
    bad,
    corrupt,
    decode_json,
)

_PLAN_BLOCK = 16 << 20  # bytes read at a time by the newline-counting planning pass


def line_limit(max_doc_bytes: int) -> int:
    # JSON can spell one byte of text as up to 6 ("\u0001"), plus room for metadata; a
    # longer line cannot hold an acceptable document, so it is never held in memory whole.
    return 6 * max_doc_bytes + (1 << 20)


def _to_line_start(fh: BinaryIO, start: int) -> int:
    """Move `fh` to the first line start at or after `start` > 0 and return its offset:
    past the first newline at or after start - 1 (just that one byte when `start` is a line
    start already, as planned parts are)."""
    fh.seek(start - 1)
    pos = start - 1
    while True:  # in pieces: this may be the middle of a line too long to hold
        more = fh.readline(CHUNK)
        pos += len(more)
        if not more or more[-1:] == b"\n":
            return pos


def read(recs: Records, f: InputFile, path: str) -> Iterator[RawDoc | BadRecord]:
    """The lines that start in bytes [f.start, f.end) of an uncompressed file (all lines
    of a whole file), numbered from `f.first_record`, the number of the first line that
    starts at or after `f.start`. Offsets are the whole file's (the decompressed stream's
    for a compressed one, which is always read whole)."""
    rel, max_doc_bytes = f.rel, recs.max_bytes
    limit = line_limit(max_doc_bytes)
    decode = decode_json
    record = recs.record
    line_no = f.first_record - 1
    offset = 0  # of the current line, in the (decompressed) stream
    stop = sys.maxsize if f.end is None else f.end
    with open_stream(path) as fh:
        readline = fh.readline
        try:
            if f.start > 0:
                offset = _to_line_start(fh, f.start)
            # A line belongs to the part it starts in, even when it runs on past `end`.
            while offset < stop:
                line = readline(limit)
                if not line:
                    break
                line_no += 1
                n = len(line)
                loc = f"{rel}:{line_no}"
                if n >= limit and line[-1:] != b"\n":
                    ending = 0
                    while True:  # skip the rest of the line without keeping it
                        more = readline(CHUNK)
                        n += len(more)
                        if not more or more[-1:] == b"\n":
                            ending = len(more) - len(more.rstrip(b"\r\n"))
                            break
                    yield bad(
                        "too_large",
                        f"line is {n} bytes, longer than any record "
                        f"that fits max_doc_bytes={max_doc_bytes}; "
                        "not parsed",
                        loc,
                        line,
                        None,
                        n - ending,
                    )
                    offset += n
                    continue
                try:
                    s = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield bad(
                        "invalid_utf8",
                        f"invalid UTF-8 at byte {e.start} of the "
                        f"line (byte {offset + e.start} of the "
                        f"stream): {e.reason}",
                        loc,
                        line,
                        None,
                    )
                    offset += n
                    continue
                offset += n
                if line_no == 1 and s.startswith("\ufeff"):
                    s = s[1:]  # a UTF-8 BOM, which json.loads refuses
                try:
                    obj = decode(s)
                except ValueError as e:
                    if not s or s.isspace():
                        yield bad("empty_line", "blank line", loc, line, None)
                    else:
                        detail = (
                            "a UTF-8 BOM (U+FEFF) that does not start the file"
                            if s.startswith("\ufeff")
                            else str(e) or type(e).__name__
                        )
                        yield bad("invalid_json", detail, loc, line, None)
                    continue
                except RecursionError:
                    # Python's parser recurses per level; the line may well be valid JSON.
                    yield bad(
                        "too_deep",
                        "nested deeper than the JSON parser can follow "
                        f"(Python's recursion limit, "
                        f"{sys.getrecursionlimit()}); not parsed",
                        loc,
                        line,
                        None,
                    )
                    continue
                except NonFinite as e:
                    yield bad("non_finite_number", str(e), loc, line, None)
                    continue
                yield record(obj, loc, line)
        except STREAM_ERRORS as e:
            yield corrupt(f"{rel}:{line_no + 1}", e)


def part_starts(path: str, size: int, unit_bytes: int) -> list[tuple[int, int]]:
    """(byte offset, 1-based line number) of the first line of every part: the first line
    starting at or after each multiple of `unit_bytes` below `size`, without repeats (a line
    longer than a unit spans several multiples) and without the end of the file (which
    starts no line). Counts newlines in big blocks (bytes.count/find are memchr-fast, about
    1 GB/s with the reading) and stops reading after the last multiple's line start."""
    starts = [(0, 1)]
    nominal = unit_bytes  # the next multiple of unit_bytes to find a line start for
    newlines = 0  # newlines in the file before block_start + counted
    block_start = 0
    with open(path, "rb", buffering=0) as fh:
        while nominal < size:
            block = fh.read(_PLAN_BLOCK)
            if not block:
                break  # the file shrank since it was listed; the last part reads to EOF
            counted = 0  # newlines in block[:counted] are in `newlines`
            while nominal < size:
                # A line starts at p > 0 iff byte p-1 is a newline, so the first line start
                # at or after `nominal` follows the first newline at or after nominal - 1.
                q = block.find(b"\n", max(nominal - 1 - block_start, 0))
                if q < 0:
                    break  # not in this block: go on in the next one
                newlines += block.count(b"\n", counted, q + 1)
                counted = q + 1
                line_start = block_start + q + 1
                if line_start >= size:
                    nominal = size  # the file ends with that newline: no more parts
                    break
                starts.append((line_start, newlines + 1))
                # Every multiple up to line_start maps to this same line start.
                nominal = (line_start // unit_bytes + 1) * unit_bytes
            newlines += block.count(b"\n", counted)
            block_start += len(block)
    return starts


def split(f: InputFile, unit_bytes: int) -> list[InputFile]:
    starts = part_starts(f.uri, f.size, unit_bytes)
    if len(starts) == 1:
        return [f]  # one line longer than a unit covers the whole file
    parts = []
    for i, (start, line) in enumerate(starts):
        # The last part reads to the end of the file, as a whole-file read would.
        end = starts[i + 1][0] if i + 1 < len(starts) else None
        size = (f.size if end is None else end) - start
        parts.append(
            replace(f, size=size, start=start, end=end, first_record=line, file_size=f.size)
        )
    return parts


FORMAT = Format(
    name="jsonl",
    read=read,
    extensions=(".jsonl", ".json", ".ndjson"),
    compressible=True,
    parts="bytes",
    split=split,
)
