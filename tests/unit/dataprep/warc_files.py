"""Small WARC files for the web-input tests, written with warcio (a second, independent
implementation of the format from fastwarc, which reads them)."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter


def page(title: str, words: int = 60) -> bytes:
    """An HTML page with navigation and a footer around a main article."""
    para = " ".join(f"{title.lower()}word{i}" for i in range(words))
    return (
        f"<!doctype html><html><head><title>{title}</title></head><body>"
        "<nav><a href='/'>Home</a> <a href='/about'>About</a></nav>"
        f"<main><article><h1>{title}</h1><p>{para}.</p><p>{para} again, with more to say.</p>"
        "</article></main><footer>Copyright footer text</footer></body></html>"
    ).encode()


@dataclass
class Rec:
    url: str
    body: bytes
    kind: str = "response"  # WARC-Type
    status: str = "200 OK"
    content_type: str | None = "text/html; charset=utf-8"
    http_extra: list[tuple[str, str]] = field(default_factory=list)


def write_warc(path: Path, recs: list[Rec], gzip: bool = True, version: str = "WARC/1.0") -> None:
    with open(path, "wb") as out:
        w = WARCWriter(out, gzip=gzip, warc_version=version)
        w.write_record(w.create_warcinfo_record(path.name, {"software": "tests"}))
        for r in recs:
            if r.kind == "response":
                headers = list(r.http_extra)
                if r.content_type is not None:
                    headers.insert(0, ("Content-Type", r.content_type))
                http = StatusAndHeaders(r.status, headers, protocol="HTTP/1.1")
                rec = w.create_warc_record(
                    r.url, "response", payload=io.BytesIO(r.body), http_headers=http
                )
            else:
                rec = w.create_warc_record(
                    r.url,
                    r.kind,
                    payload=io.BytesIO(r.body),
                    warc_content_type=r.content_type or "",
                )
            w.write_record(rec)


def crawl() -> list[Rec]:
    """What a crawl holds: pages, and records that are not pages."""
    return [
        Rec("https://a.example/one", page("One")),
        Rec("https://a.example/two", page("Two")),
        Rec(
            "https://a.example/logo.png",
            b"\x89PNG\r\n\x1a\n" + bytes(200),
            content_type="image/png",
        ),
        Rec(
            "https://a.example/gone", b"<html><body>Not found</body></html>", status="404 Not Found"
        ),
        Rec("https://a.example/old", b"", status="301 Moved Permanently"),
        Rec("https://a.example/empty", b""),
        Rec("https://a.example/three", page("Three")),
        Rec(
            "https://a.example/req",
            b"GET /req HTTP/1.1\r\n\r\n",
            kind="request",
            content_type="application/http; msgtype=request",
        ),
    ]
