"""html: a page per file (`.html`, `.htm`, optionally gzip/zstd-compressed), its main text
extracted as `ingest.extract` says (dataprep/extract.py). Location: `<rel>`. Never split.

`html_doc` is also the warc reader's: a page's body in, a document or the reason it has
none out."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dataprep.extract import extractor_for
from dataprep.formats.base import Format, InputFile
from dataprep.formats.streams import CHUNK, STREAM_ERRORS, open_stream
from dataprep.formats.validate import BadRecord, RawDoc, Records, bad, corrupt


def extract_config(recs: Records) -> Any:
    """ingest.extract, or its defaults when unset."""
    if recs.extract is not None:
        return recs.extract
    from dataprep.config import ExtractConfig  # not at import: config imports formats

    return ExtractConfig()


def html_doc(
    recs: Records,
    body: bytes,
    declared: str | None,
    meta: dict,
    doc_id: str,
    loc: str,
    size: int,
) -> RawDoc | BadRecord:
    """One page: `body` (its bytes, at most max_bytes + 1 of them), the charset its HTTP
    headers declare, its metadata (`url` is passed to the extractor); `size`: the record's
    bytes in the input, for the accounting."""
    cfg = extract_config(recs)
    if not body.strip():
        return bad("empty_body", "the page has no content", loc, body, doc_id, size)
    if len(body) > cfg.max_bytes:
        return bad(
            "too_large",
            f"HTML body is {size} bytes or more, over ingest.extract.max_bytes={cfg.max_bytes}",
            loc,
            body,
            doc_id,
            size,
        )
    r = extractor_for(cfg)(body, declared, meta.get("url"))
    if r.text is None:
        return bad(r.reason, r.detail, loc, body, doc_id, size)
    meta["charset"] = r.charset
    return recs.text(r.text, meta, doc_id, loc, body, size)


def read(recs: Records, f: InputFile, path: str) -> Iterator[RawDoc | BadRecord]:
    rel = f.rel
    doc_id = f"{recs.name}/{rel}"
    limit = extract_config(recs).max_bytes
    with open_stream(path) as fh:
        try:
            body = fh.read(limit + 1)
            size = len(body)
            if size > limit:  # counted whole, not kept
                while more := fh.read(CHUNK):
                    size += len(more)
        except STREAM_ERRORS as e:
            yield corrupt(rel, e)
            return
    yield html_doc(recs, body, None, {"content_type": "text/html"}, doc_id, rel, size)


FORMAT = Format(name="html", read=read, extensions=(".html", ".htm"), compressible=True)
