"""Web input: main-content extraction quality per engine and setting, WARC reading +
extraction throughput per core, and the whole prep from a WARC of a few thousand pages.

    python -m benchmarks.web_extract [--pages N] [--prep-pages 3000] [--skip-prep]
        [--out benchmarks/results/web_extract.json]

Quality: the shared WARC's HTML pages that have a reference (their reST source, PROVENANCE
.md) are extracted by each engine/setting and by a naive tag stripper; the extracted text
and the reference (reST markup stripped: directives' and roles' names, labels, option lines,
heading underlines) are lowercased and cut into words, and token precision = |common| /
|extracted|, recall = |common| / |reference| (multisets, summed over all pages: micro
averages). The reference is the author's text, so navigation, sidebars and footers count
against precision, and text the page generates (index entries, signatures) against it too;
absolute numbers are a floor, the comparison between engines is the point.

Throughput: `dataprep.formats.warc` reading the whole shared WARC (324 records) in this
process, per engine, with the time cap's helper process (timeout_s set) and without
(timeout_s null): MB/s of the compressed file and of the archive's bytes, one core.

Prep: the WARC's pages repeated under new URLs (each copy with a line that makes it unique,
so exact dedup keeps it; near dedup is off) up to --prep-pages, written with warcio, then
`ballast prep` in its own process (workers 2): wall time, pages/s, peak RSS.
"""

from __future__ import annotations

import argparse
import gzip
import html as html_lib
import io
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, SHARED, have_shared, machine, run_prep_process, write_json

WARC = "web_python_docs.warc.gz"
REFERENCE = "web_python_docs.reference.jsonl"
_WORD = re.compile(r"[a-z0-9_]+")
# Settings measured: (engine, favor); resiliparse has no precision knob (docs/prep.md).
SETTINGS = [
    ("resiliparse", "balanced"),
    ("resiliparse", "recall"),
    ("trafilatura", "balanced"),
    ("trafilatura", "precision"),
    ("trafilatura", "recall"),
]


# ---- the reference -------------------------------------------------------------------
_RST_LABEL = re.compile(r"^\s*\.\. _[^:]*:.*$", re.M)  # .. _target:
_RST_DIRECTIVE = re.compile(r"\.\. [\w:-]+::")  # .. c:function:: (arguments stay: shown)
_RST_COMMENT = re.compile(r"^\.\.(?!\s+[\w:-]+::)\s.*$", re.M)  # .. a comment
_RST_OPTION = re.compile(r"^\s+:[\w-]+:(\s.*)?$", re.M)  # :noindex:, :synopsis: ...
_RST_ROLE = re.compile(r":[\w:+.-]+:(?=`)")  # :c:func:`x` -> `x`
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+<>_.:])\1{2,}\s*$", re.M)


def strip_rst(text: str) -> str:
    for pat in (_RST_LABEL, _RST_COMMENT, _RST_OPTION, _RST_UNDERLINE):
        text = pat.sub("", text)
    return _RST_ROLE.sub("", _RST_DIRECTIVE.sub("", text))


def words(text: str) -> Counter[str]:
    return Counter(_WORD.findall(text.lower()))


# ---- the pages ---------------------------------------------------------------------
def load_pages() -> list[tuple[str, bytes, str | None]]:
    """(url, body, declared charset) of every 200 text/html response in the shared WARC."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    out = []
    with open(SHARED / WARC, "rb") as fh:
        for r in ArchiveIterator(fh, record_types=WarcRecordType.response):
            body = r.reader.read()
            if r.http_headers.status_code == 200 and r.http_content_type == "text/html":
                out.append((r.headers.get("WARC-Target-URI"), body, r.http_charset))
    return out


def load_reference() -> dict[str, str]:
    import json

    with open(SHARED / REFERENCE, encoding="utf-8") as f:
        return {d["url"]: d["reference_rst"] for d in map(json.loads, f)}


_SCRIPT = re.compile(r"<(script|style|noscript)\b.*?</\1\s*>", re.S | re.I)
_TAG = re.compile(r"<[^>]+>")


def naive(html: str) -> str:
    """The baseline: drop scripts and styles, then every tag; unescape entities."""
    return html_lib.unescape(_TAG.sub(" ", _SCRIPT.sub(" ", html)))


# ---- quality -----------------------------------------------------------------------
def score(
    pages: list[tuple[str, bytes, str | None]], ref: dict[str, str], fn: Callable[..., str]
) -> dict[str, Any]:
    common = n_ext = n_ref = empty = 0
    t0 = time.perf_counter()
    for url, body, charset in pages:
        ext = words(fn(body, charset, url))
        want = words(strip_rst(ref[url]))
        common += sum((ext & want).values())
        n_ext += sum(ext.values())
        n_ref += sum(want.values())
        empty += not ext
    wall = time.perf_counter() - t0
    p = common / n_ext if n_ext else 0.0
    r = common / n_ref if n_ref else 0.0
    return {
        "precision": round(p, 4),
        "recall": round(r, 4),
        "f1": round(2 * p * r / (p + r), 4) if p + r else 0.0,
        "pages_without_text": empty,
        "ms_per_page": round(1000 * wall / len(pages), 2),
    }


def quality(pages: list[tuple[str, bytes, str | None]], ref: dict[str, str]) -> dict[str, Any]:
    from dataprep.extract import decode_html, extract_page

    scored = [p for p in pages if p[0] in ref]
    out: dict[str, Any] = {"pages": len(scored)}
    out["naive_tag_strip"] = score(scored, ref, lambda b, c, u: naive(decode_html(b, c)[0]))
    for engine, favor in SETTINGS:

        def fn(b: bytes, c: str | None, u: str, e: str = engine, f: str = favor) -> str:
            return extract_page(b, c, u, e, f).text or ""

        out[f"{engine}/{favor}"] = s = score(scored, ref, fn)
        print(f"  {engine}/{favor}: {s}", flush=True)
    return out


# ---- throughput --------------------------------------------------------------------
def throughput() -> dict[str, Any]:
    from dataprep.config import ExtractConfig, SourceConfig
    from dataprep.extract import _close_all
    from dataprep.formats import InputFile, RawDoc
    from dataprep.readers import read_local

    path = SHARED / WARC
    size = path.stat().st_size
    raw = len(gzip.decompress(path.read_bytes()))
    src = SourceConfig(name="web", paths=[str(path)])
    f = InputFile("web", str(path), path.name, "warc", size)
    out: dict[str, Any] = {"file_mb": round(size / 1e6, 2), "archive_mb": round(raw / 1e6, 2)}

    def run(cfg: ExtractConfig) -> tuple[float, int]:
        t0 = time.perf_counter()
        kept = sum(isinstance(r, RawDoc) for r in read_local(src, f, str(path), 1 << 24, cfg))
        return time.perf_counter() - t0, kept

    for engine in ("resiliparse", "trafilatura"):
        for cap in (None, 10.0):
            cfg = ExtractConfig(engine=engine, timeout_s=cap)
            run(cfg)  # warm: imports, the helper's start
            # Interleaved with nothing else here: run alone on a quiet machine (ENVIRONMENT.md).
            wall, kept = min(run(cfg) for _ in range(2 if engine == "resiliparse" else 1))
            key = f"{engine}/{'helper' if cap else 'in_process'}"
            out[key] = {
                "seconds": round(wall, 3),
                "pages": kept,
                "file_mb_per_s": round(size / 1e6 / wall, 2),
                "archive_mb_per_s": round(raw / 1e6 / wall, 2),
                "pages_per_s": round(kept / wall, 1),
            }
            print(f"  {key}: {out[key]}", flush=True)
    _close_all()
    return out


# ---- whole prep --------------------------------------------------------------------
def write_volume(pages: list[tuple[str, bytes, str | None]], n: int, path: Path) -> None:
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as out:
        w = WARCWriter(out, gzip=True)
        for i in range(n):
            url, body, _ = pages[i % len(pages)]
            copy = i // len(pages)
            if copy:
                url = f"{url}?copy={copy}"
                body = body.replace(b"<body", f"<p>copy {copy} of this page</p><body".encode(), 1)
            http = StatusAndHeaders(
                "200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1"
            )
            w.write_record(
                w.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=http)
            )


def whole_prep(pages: list[tuple[str, bytes, str | None]], n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="web-extract-") as tmp:
        work = Path(tmp)
        warc = work / "volume.warc.gz"
        write_volume(pages, n, warc)
        cfg = {
            "output": str(work / "out"),
            "workers": 2,
            "sources": [{"name": "web", "paths": [str(warc)]}],
            "dedup": {"near": False},
            "quality": ["url", {"length": {"min_chars": 200}}],
            "pack": {"seq_len": 1024},
        }
        r = run_prep_process(cfg, work)
        ingest = r["report"]["stages"]["ingest"]["sources"]["web"]
        return {
            "pages": n,
            "file_mb": round(warc.stat().st_size / 1e6, 2),
            "wall_s": round(r["wall"], 2),
            "pages_per_s": round(n / r["wall"], 1),
            "peak_rss_mib": round(r["peak_rss"] / 2**20),
            "ingest": {"docs_in": ingest["docs_in"], "kept": ingest["kept"]},
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=None, help="score only the first N pages")
    ap.add_argument("--prep-pages", type=int, default=3000)
    ap.add_argument("--skip-prep", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "web_extract.json"))
    a = ap.parse_args()
    if not have_shared(WARC, REFERENCE):
        print(f"skipped: {SHARED / WARC} or its reference is not here")
        return
    pages = load_pages()
    ref = load_reference()
    scored = pages[: a.pages] if a.pages else pages
    print(f"quality on {sum(p[0] in ref for p in scored)} pages with a reference:", flush=True)
    result: dict[str, Any] = {
        "machine": machine(),
        "versions": {p: version(p) for p in ("resiliparse", "trafilatura", "fastwarc")},
        "quality": quality(scored, ref),
    }
    print(f"  naive tag strip: {result['quality']['naive_tag_strip']}")
    print("throughput (one process, the whole shared WARC):", flush=True)
    result["throughput"] = throughput()
    if not a.skip_prep:
        print(f"whole prep of {a.prep_pages} pages:", flush=True)
        result["prep"] = whole_prep(pages, a.prep_pages)
        print(f"  {result['prep']}")
    print(f"wrote {write_json(a.out, result)}")


if __name__ == "__main__":
    main()
