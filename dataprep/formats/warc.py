"""warc and wet: web archives (WARC/1.0 and 1.1; gzip per record, whole-file gzip, zstd or
uncompressed), read with fastwarc.

warc: each `response` (or `resource`) record with an HTML body and HTTP status 200 becomes
one document of the page's main text (dataprep/extract.py). wet: each `conversion` record
(Common Crawl's own text extraction) becomes one document of its text. Every other record
is accounted, never skipped: `not_a_page` (warcinfo, request, metadata, ...), `not_html`,
`http_status`, `empty_body`, `unsupported_encoding`, `too_large`, `truncated` (fewer bytes
than its Content-Length), the extractor's reasons, and `corrupt_file` for bytes that hold no
readable record, with the record that precedes them quarantined as `corrupt_record` (its
Content-Length does not end where a record starts). Reading resumes at the next record
header after damage in the archive's (decompressed) bytes; a broken compressed stream ends
the file, keeping every record before the break.

Locations: `<rel>#offset=<n> url=<url>`: the byte offset of the record in the
(decompressed) archive, then its WARC-Target-URI (whitespace and control characters
%-escaped, cut at URL_CHARS), when it has one. The location is what every later stage's
dropped rows, the dataset's provenance and `ballast blame` name a document by, so the page's
URL goes wherever the document does. Ids stay `<source>/<rel>#offset=<n>` (without the URL).
Metadata: url, date (WARC-Date), content_type, warc_record_id, http_status (warc), charset
(as decoded), and warc_refers_to (wet).

Splitting: an uncompressed archive bigger than a unit is split into parts that start at
records (`split`); a compressed one (.warc.gz, Common Crawl's form) is one unit: where a
gzip member starts in the decompressed stream is only known by decompressing everything
before it (docs/prep.md, "Web input").
"""

from __future__ import annotations

import contextlib
import re
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

from fastwarc.warc import ArchiveIterator, WarcRecordType

from dataprep.formats.base import Format, InputFile
from dataprep.formats.html import extract_config, html_doc
from dataprep.formats.streams import CHUNK, STREAM_ERRORS, open_stream
from dataprep.formats.validate import BadRecord, RawDoc, Records, bad

_HTML_TYPES = ("text/html", "application/xhtml+xml")
_HEADER_LIMIT = 1 << 20  # bytes of HTTP headers looked at; more is not a web page
_RECORD_START = re.compile(rb"WARC/1\.[01]\r?\n")
_GZIP_MAGIC = b"\x1f\x8b"
URL_CHARS = 2048  # of a URL in a location (meta keeps it whole)
_URL_ESCAPE = re.compile(r"[\x00-\x20\x7f]")


class _Counted:
    """A stream that knows its absolute position: fastwarc takes record offsets from
    `tell()` (and needs one), and a pass that resumes after damage starts mid-file."""

    def __init__(self, fh: BinaryIO, base: int):
        self.fh, self.pos = fh, base

    def read(self, n: int = -1) -> bytes:
        # read1: at most one read below, so the bytes before a break in a compressed
        # stream come back before the error does (a buffered read(n) drops them).
        b = self.fh.read1(n)
        self.pos += len(b)
        return b

    def tell(self) -> int:
        return self.pos


def _open_at(path: str, pos: int) -> BinaryIO:
    """`path` decompressed (as its extension says), positioned at `pos`."""
    fh = open_stream(path)
    if pos:
        if fh.seekable() and not path.lower().endswith((".gz", ".zst", ".zstd")):
            fh.seek(pos)
        else:  # a compressed stream: decompress up to there (only after damage)
            left = pos
            while left > 0 and (b := _read_upto(fh, min(left, CHUNK))):
                left -= len(b)
    return fh


def _read_upto(fh: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes, fewer at the end of the stream or where it breaks."""
    parts, left = [], n
    try:
        while left > 0 and (b := fh.read1(left)):
            parts.append(b)
            left -= len(b)
    except STREAM_ERRORS:
        pass
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class _Broken:
    """Bytes [start, end) of the archive hold no readable record (end None: to the end)."""

    start: int
    end: int | None
    detail: str
    # The record before `start` ends where no record starts: its length is suspect.
    suspect: bool


def _block_end(path: str, pos: int) -> int:
    """Where the record at `pos` ends by its own Content-Length (pos + 1 if its header
    cannot be read again)."""
    with _open_at(path, pos) as fh:
        head = _read_upto(fh, 64 << 10)
    end = head.find(b"\r\n\r\n")
    m = re.search(rb"\ncontent-length:[ \t]*(\d+)", head[:end].lower())
    if end < 0 or m is None:
        return pos + 1
    return pos + end + 4 + int(m.group(1))


def _next_start(path: str, frm: int) -> int | None:
    """The first record header at or after `frm`, or None."""
    with _open_at(path, frm) as fh:
        pos, tail = frm, b""
        try:
            while block := fh.read1(CHUNK):
                buf = tail + block
                m = _RECORD_START.search(buf)
                if m is not None:
                    return pos - len(tail) + m.start()
                tail = buf[-16:]
                pos += len(block)
        except STREAM_ERRORS:
            return None
    return None


def _walk(path: str, start: int = 0) -> Iterator[tuple[int, Any] | _Broken]:
    """(offset, record) for every record fastwarc reads, each to be consumed before the
    next is asked for, and a `_Broken` for every damaged stretch, from which it goes on at
    the next record header. `start`: 0, or the offset of a record this walk from 0 finds,
    from which it then finds what it does from 0 (fastwarc carries nothing from one
    record to the next)."""
    with open_stream(path) as raw:
        if raw.read(2) == _GZIP_MAGIC:
            yield _Broken(0, None, "the file is gzip-compressed: name it .warc.gz", False)
            return
    while True:
        last: int | None = None
        with _open_at(path, start) as raw:
            fh = _Counted(raw, start)
            try:
                # parse_http=False: the reader parses HTTP itself from the whole block, so
                # that a short block is seen (fastwarc pads nothing, it just stops early).
                for r in ArchiveIterator(
                    fh,
                    record_types=WarcRecordType.any_type,
                    parse_http=False,
                    stream_detect=False,
                ):
                    last = r.stream_pos
                    yield last, r
                return
            except STREAM_ERRORS as e:
                at = start if last is None else _block_end(path, last)
                msg = f"the compressed stream is broken: {type(e).__name__}: {e}"
                yield _Broken(at, None, msg + "; nothing after this can be read", False)
                return
            except OSError as e:
                at = start if last is None else _block_end(path, last)
                err = f"{type(e).__name__}: {e}"
        # Resume at the next record header; a pass that read nothing moves on by a byte at
        # least, so a run of damage always ends.
        nxt = _next_start(path, at if last is not None else start + 1)
        yield _Broken(at, nxt, f"no readable WARC record here ({err})", last is not None)
        if nxt is None:
            return
        start = nxt


def _http(block: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """(status, lower-cased headers, body) of an HTTP response block; None if the block is
    not one."""
    if not block.startswith(b"HTTP/"):
        return None
    end, sep = block.find(b"\r\n\r\n", 0, _HEADER_LIMIT), 4
    if end < 0:
        end, sep = block.find(b"\n\n", 0, _HEADER_LIMIT), 2
    if end < 0:
        return None
    lines = block[:end].decode("latin-1").splitlines()
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, colon, v = line.partition(":")
        if colon:
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers, block[end + sep :]


def _media_type(value: str) -> tuple[str, str | None]:
    """('text/html', 'utf-8') from 'text/html; charset="UTF-8"'."""
    media, *params = value.split(";")
    charset = None
    for p in params:
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset":
            charset = v.strip().strip("\"'") or None
    return media.strip().lower(), charset


def _dechunk(body: bytes) -> bytes | None:
    """A chunked transfer-encoded body decoded, or None if it is not well-formed."""
    out, pos = [], 0
    while True:
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            n = int(body[pos:eol].split(b";")[0], 16)
        except ValueError:
            return None
        if n == 0:
            return b"".join(out)
        out.append(body[eol + 2 : eol + 2 + n])
        pos = eol + 2 + n + 2


def _decode_body(body: bytes, headers: dict[str, str], limit: int) -> tuple[bytes | None, str]:
    """The payload without transfer and content encodings, at most `limit` + 1 bytes
    (a compressed bomb stops there); (None, why) when it cannot be decoded."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        # Crawlers usually store bodies de-chunked but keep the header; only undo it when
        # the body really is chunked.
        chunks = _dechunk(body)
        if chunks is not None:
            body = chunks
    enc = headers.get("content-encoding", "").strip().lower()
    if enc in ("", "identity", "none"):
        return body, ""
    if enc in ("gzip", "x-gzip", "deflate"):
        for wbits in (47, -15):  # gzip or zlib (auto), then raw deflate
            try:
                return zlib.decompressobj(wbits).decompress(body, limit + 1), ""
            except zlib.error:
                continue
        # Many archives store the decoded body but keep the header.
        return body, ""
    return None, f"Content-Encoding {enc} is not supported (gzip and deflate are)"


def _headers_text(r: Any) -> str:
    return "\r\n".join(f"{k}: {v}" for k, v in r.headers.items())


def read(recs: Records, f: InputFile, path: str) -> Iterator[RawDoc | BadRecord]:
    """The records (and damaged stretches) that start in bytes [f.start, f.end) of the
    archive: all of them for a whole file; a part (`split`) starts at a record and ends
    where the next part's first record starts. A record is yielded when the next item
    comes: damage right after it makes it a `corrupt_record`."""
    wet = f.format == "wet"
    stop = sys.maxsize if f.end is None else f.end
    pending: RawDoc | BadRecord | None = None
    with contextlib.closing(_walk(path, f.start)) as walk:
        for item in walk:
            if isinstance(item, _Broken):
                if item.start >= stop:
                    break
                if pending is not None:
                    if item.suspect and isinstance(pending, RawDoc):
                        pending = bad(
                            "corrupt_record",
                            "the record's Content-Length does not end where a record starts "
                            f"(at byte {item.start}): its length is wrong or what follows is "
                            "damaged",
                            pending.location,
                            pending.text,
                            pending.id,
                        )
                    yield pending
                    pending = None
                loc = f"{f.rel}#offset={item.start}"
                size = 0 if item.end is None else item.end - item.start
                yield bad("corrupt_file", item.detail, loc, "", None, size)
                continue
            pos, r = item
            if pos >= stop:
                break
            if pending is not None:
                yield pending
            pending = _record(recs, f.rel, pos, r, wet)
    if pending is not None:
        yield pending


def part_starts(path: str, unit_bytes: int) -> list[int]:
    """The offset of the first eligible record at or after each multiple of `unit_bytes`
    (0 first, no repeats), found by the whole-file read's own walk (headers only: fastwarc
    skips the blocks, about 6 GB/s from the page cache). Eligible: a record that directly
    follows a record, so that a part ending there ends as the whole-file read goes on (no
    damage between the two decides the fate of the one before)."""
    starts, nominal = [0], unit_bytes
    after_record = False
    for item in _walk(path):
        if isinstance(item, _Broken):
            after_record = False
            continue
        pos = item[0]
        if after_record and pos >= nominal:
            starts.append(pos)
            nominal = (pos // unit_bytes + 1) * unit_bytes
        after_record = True
    return starts


def split(f: InputFile, unit_bytes: int) -> list[InputFile]:
    """An uncompressed archive as parts that start at records (see `part_starts`); a
    compressed one is never given (readers.split_input): see docs/prep.md for why."""
    starts = part_starts(f.uri, unit_bytes)
    if len(starts) == 1:
        return [f]
    parts = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else None
        size = (f.size if end is None else end) - start
        parts.append(replace(f, size=size, start=start, end=end, file_size=f.size))
    return parts


def location(rel: str, pos: int, url: str | None) -> str:
    """`<rel>#offset=<pos> url=<url>` (without ` url=` when there is no URL): one line, the
    URL one token after `url=`."""
    loc = f"{rel}#offset={pos}"
    if not url:
        return loc
    if len(url) > URL_CHARS:
        url = url[:URL_CHARS] + "..."
    return f"{loc} url={_URL_ESCAPE.sub(lambda m: f'%{ord(m.group()):02X}', url)}"


def _record(recs: Records, rel: str, pos: int, r: Any, wet: bool) -> RawDoc | BadRecord:
    h = r.headers
    url = h.get("WARC-Target-URI")
    loc = location(rel, pos, url)
    meta: dict[str, Any] = {
        "url": url,
        "date": h.get("WARC-Date"),
        "warc_record_id": h.get("WARC-Record-ID"),
    }
    doc_id = f"{recs.name}/{rel}#offset={pos}"
    idf = recs.id_field
    if idf is not None and isinstance(meta.get(idf), str) and meta[idf]:
        doc_id = meta[idf]
    # The header, not fastwarc's record_type: it reads types it does not know (and some
    # it does, such as `request` from some writers) as `unknown`.
    rtype = (h.get("WARC-Type") or "").strip().lower()
    declared_s = h.get("Content-Length")
    if declared_s is None or not declared_s.strip().isdigit():
        r.consume()
        return bad(
            "truncated", "the record has no valid Content-Length", loc, _headers_text(r), doc_id, 0
        )
    declared = int(declared_s)
    page_types = ("conversion",) if wet else ("response", "resource")
    if rtype not in page_types:
        _, got, err = _read_block(r, declared, 0)
        if got < declared:
            return _truncated(r, loc, doc_id, got, declared, err)
        return bad(
            "not_a_page",
            f"WARC-Type {rtype or '(none)'} (a {'wet' if wet else 'warc'} document is a "
            f"{' or '.join(page_types)} record)",
            loc,
            _headers_text(r),
            doc_id,
            declared,
        )
    limit = extract_config(recs).max_bytes if not wet else recs.max_bytes
    cap = limit + _HEADER_LIMIT
    block, got, err = _read_block(r, declared, cap)
    if got < declared:
        return _truncated(r, loc, doc_id, got, declared, err)
    if wet:
        return _wet_doc(recs, block, meta, doc_id, loc, declared, h)
    return _warc_doc(recs, r, block, meta, doc_id, loc, declared, limit)


def _read_block(r: Any, declared: int, cap: int) -> tuple[bytes, int, str]:
    """The record's first `cap` + 1 bytes at most, how many it has in all, and why it
    ended early ('' if it did not): a broken stream shows here as a short record."""
    block, got = b"", 0
    try:
        block = r.reader.read(min(declared, cap + 1)) if cap else b""
        got = len(block)
        if got < declared and (cap == 0 or got > cap):
            got += r.consume()
    except (*STREAM_ERRORS, OSError) as e:
        return block, got, f": {type(e).__name__}: {e}"
    return block, got, ""


def _truncated(r: Any, loc: str, doc_id: str, got: int, declared: int, err: str) -> BadRecord:
    return bad(
        "truncated",
        f"the record ends after {got} of its {declared} bytes (Content-Length){err}",
        loc,
        _headers_text(r),
        doc_id,
        got,
    )


def _wet_doc(
    recs: Records, block: bytes, meta: dict, doc_id: str, loc: str, size: int, h: Any
) -> RawDoc | BadRecord:
    meta["content_type"] = (h.get("Content-Type") or "text/plain").split(";")[0].strip()
    if refers := h.get("WARC-Refers-To"):
        meta["warc_refers_to"] = refers
    if len(block) > recs.max_bytes:
        return bad(
            "too_large",
            f"text is {size} bytes, over max_doc_bytes={recs.max_bytes}",
            loc,
            block,
            doc_id,
            size,
        )
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as e:
        return bad(
            "invalid_utf8",
            f"invalid UTF-8 at byte {e.start} of the text: {e.reason}",
            loc,
            block,
            doc_id,
            size,
        )
    return recs.text(text, meta, doc_id, loc, block, size)


def _warc_doc(
    recs: Records,
    r: Any,
    block: bytes,
    meta: dict,
    doc_id: str,
    loc: str,
    size: int,
    limit: int,
) -> RawDoc | BadRecord:
    if (r.headers.get("WARC-Type") or "").strip().lower() == "resource":
        status, headers, body = None, {}, block
        content_type = r.headers.get("Content-Type") or ""
    else:
        parsed = _http(block)
        if parsed is None:
            return bad(
                "not_a_page",
                "the response record holds no HTTP response",
                loc,
                _headers_text(r),
                doc_id,
                size,
            )
        status, headers, body = parsed
        content_type = headers.get("content-type", "")
        meta["http_status"] = status
    media, charset = _media_type(content_type)
    meta["content_type"] = media or None
    if status is not None and status != 200:
        return bad("http_status", f"HTTP status {status}", loc, block[:4096], doc_id, size)
    if media and media not in _HTML_TYPES:
        return bad("not_html", f"Content-Type {media}", loc, _headers_text(r), doc_id, size)
    body, why = _decode_body(body, headers, limit)
    if body is None:
        return bad("unsupported_encoding", why, loc, _headers_text(r), doc_id, size)
    if not media and not _looks_html(body):
        return bad(
            "not_html", "no Content-Type, and the body is not HTML", loc, body[:4096], doc_id, size
        )
    return html_doc(recs, body, charset, meta, doc_id, loc, size)


def _looks_html(body: bytes) -> bool:
    head = body[:1024].lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html")) or b"<html" in head


FORMAT = Format(
    name="warc",
    read=read,
    extensions=(".warc",),
    compressible=True,
    parts="bytes",
    split=split,
)
WET_FORMAT = Format(
    name="wet", read=read, extensions=(".wet",), compressible=True, parts="bytes", split=split
)
