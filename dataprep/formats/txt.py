"""txt: plain UTF-8 text, optionally gzip/zstd-compressed. The source's `txt_unit` says
what a document is: the whole file (location `<rel>`) or each blank-line-separated
paragraph (`<rel>#para=<n>`, 1-based). Never split."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import BinaryIO

from dataprep.formats.base import Format, InputFile
from dataprep.formats.streams import CHUNK, STREAM_ERRORS, is_compressed, open_stream
from dataprep.formats.validate import RAW_LIMIT, BadRecord, RawDoc, Records, bad, corrupt


def read(recs: Records, f: InputFile, path: str) -> Iterator[RawDoc | BadRecord]:
    rel, max_doc_bytes = f.rel, recs.max_bytes
    with open_stream(path) as fh:
        if recs.source.txt_unit == "file":
            doc_id = f"{recs.name}/{rel}"
            data, size = b"", 0
            try:
                data = fh.read(max_doc_bytes + 1)
                size = len(data)
                if size > max_doc_bytes:  # not kept, but counted whole (bytes_in)
                    if is_compressed(path):
                        while more := fh.read(CHUNK):
                            size += len(more)
                    else:
                        size = os.fstat(fh.fileno()).st_size
            except STREAM_ERRORS as e:
                if size > max_doc_bytes:
                    yield _doc(recs, data, rel, doc_id, True, size)
                yield corrupt(rel, e)
                return
            yield _doc(recs, data, rel, doc_id, size > max_doc_bytes, size)
            return
        yield from _paragraphs(recs, fh, rel, max_doc_bytes)


def _paragraphs(
    recs: Records, fh: BinaryIO, rel: str, max_doc_bytes: int
) -> Iterator[RawDoc | BadRecord]:
    lines: list[bytes] = []
    size = 0
    para = 0
    too_large = False
    readline = fh.readline
    limit = max_doc_bytes + 2

    def emit() -> RawDoc | BadRecord:
        loc = f"{rel}#para={para}"
        return _doc(
            recs,
            b"".join(lines).rstrip(b"\r\n"),
            loc,
            f"{recs.name}/{loc}",
            too_large,
            size if too_large else None,
        )

    try:
        while True:
            line = readline(limit)
            if not line:
                break
            if line.isspace():
                if lines:
                    yield emit()
                    lines, size, too_large = [], 0, False
                continue
            if not lines:
                para += 1
            size += len(line)
            if size > max_doc_bytes:
                too_large = True
            # Past the limit keep only what the quarantine record shows: memory stays bounded.
            if not too_large or size - len(line) < RAW_LIMIT:
                lines.append(line)
        if lines:
            yield emit()
    except STREAM_ERRORS as e:
        yield corrupt(f"{rel}#para={para + (0 if lines else 1)}", e)


def _doc(
    recs: Records, data: bytes, loc: str, doc_id: str, too_large: bool, size: int | None = None
) -> RawDoc | BadRecord:
    """`size`: the document's bytes in the input when `data` is not all of them (a
    too-large document is only partly kept) or not just them (a file's last newline)."""
    if too_large:
        n = len(data) if size is None else size
        return bad(
            "too_large",
            f"document is {n} bytes, over max_doc_bytes={recs.max_bytes}",
            loc,
            data,
            doc_id,
            n,
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return bad(
            "invalid_utf8",
            f"invalid UTF-8 at byte {e.start} of the document: {e.reason}",
            loc,
            data,
            doc_id,
            size,
        )
    if text.startswith("\ufeff"):
        text = text[1:]
    return recs.text(text, {}, doc_id, loc, data, size)


FORMAT = Format(name="txt", read=read, extensions=(".txt",), compressible=True)
