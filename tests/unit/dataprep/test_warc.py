"""The warc, wet and html formats: every record accounted (kept, or dropped with a reason
and its offset), damage recovered from, ids stable."""

from __future__ import annotations

import gzip
import io
import os
from collections import Counter
from pathlib import Path

import pytest
from fastwarc.warc import ArchiveIterator, WarcRecordType

from dataprep.config import ExtractConfig, SourceConfig
from dataprep.formats import BadRecord, InputFile, RawDoc
from dataprep.readers import read_local
from tests.unit.dataprep.warc_files import Rec, crawl, page, write_warc

SHARED_WARC = Path(__file__).resolve().parents[4] / "shared" / "data" / "web_python_docs.warc.gz"


def read(
    path: Path, fmt: str = "warc", extract: ExtractConfig | None = None
) -> list[RawDoc | BadRecord]:
    src = SourceConfig(name="web", paths=[str(path)], format=fmt)
    f = InputFile("web", str(path), path.name, fmt, path.stat().st_size)
    # No time cap unless a test asks: these pages are small, and the helper process is
    # tested on its own.
    ex = extract if extract is not None else ExtractConfig(timeout_s=None)
    return list(read_local(src, f, str(path), 16 << 20, ex))


def at(r: RawDoc | BadRecord) -> str:
    """A record's location without its URL: `<rel>#offset=<n>`."""
    return r.location.partition(" url=")[0]


def reasons(out: list[RawDoc | BadRecord]) -> list[str]:
    return ["kept" if isinstance(r, RawDoc) else r.reason for r in out]


def offsets(path: Path) -> list[int]:
    """Record offsets in the decompressed archive, by fastwarc on its own."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    it = ArchiveIterator(io.BytesIO(data), record_types=WarcRecordType.any_type)
    return [r.stream_pos for r in it]


CRAWL_REASONS = [
    "not_a_page",  # warcinfo
    "kept",
    "kept",
    "not_html",
    "http_status",
    "http_status",
    "empty_body",
    "kept",
    "not_a_page",  # request
]


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("version", ["WARC/1.0", "WARC/1.1"])
def test_every_record_accounted(tmp_path: Path, gz: bool, version: str) -> None:
    p = tmp_path / ("c.warc.gz" if gz else "c.warc")
    write_warc(p, crawl(), gzip=gz, version=version)
    out = read(p)
    assert reasons(out) == CRAWL_REASONS
    # Each at its record's offset, which is also its id, then the record's URL.
    assert [at(r) for r in out] == [f"{p.name}#offset={o}" for o in offsets(p)]
    assert [r.location.partition(" url=")[2] for r in out] == ["", *(c.url for c in crawl())]
    kept = [r for r in out if isinstance(r, RawDoc)]
    assert [d.id for d in kept] == [f"web/{at(d)}" for d in kept]
    one = kept[0]
    assert one.meta["url"] == "https://a.example/one"
    assert one.meta["http_status"] == 200
    assert one.meta["content_type"] == "text/html"
    assert one.meta["warc_record_id"].startswith("<urn:uuid:")
    assert one.meta["date"].startswith("20")
    # Main content: the article, without the navigation and the footer.
    assert "oneword59" in one.text
    assert "Copyright footer" not in one.text and "About" not in one.text
    details = {r.reason: r.detail for r in out if isinstance(r, BadRecord)}
    assert details["not_html"] == "Content-Type image/png"
    assert "HTTP status" in details["http_status"]


def test_whole_file_gzip_reads_as_per_record(tmp_path: Path) -> None:
    plain = tmp_path / "c.warc"
    write_warc(plain, crawl(), gzip=False)
    whole = tmp_path / "w.warc.gz"
    whole.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = read(plain), read(whole)
    assert reasons(a) == reasons(b) == CRAWL_REASONS
    assert [r.location.split("#")[1] for r in a] == [r.location.split("#")[1] for r in b]


def test_ids_are_stable_across_reads_and_id_field(tmp_path: Path) -> None:
    p = tmp_path / "c.warc.gz"
    write_warc(p, crawl())
    assert [r.id for r in read(p)] == [r.id for r in read(p)]
    src = SourceConfig(name="web", paths=[str(p)], id_field="url")
    f = InputFile("web", str(p), p.name, "warc", 0)
    docs = [
        r
        for r in read_local(src, f, str(p), 1 << 20, ExtractConfig(timeout_s=None))
        if isinstance(r, RawDoc)
    ]
    assert [d.id for d in docs] == [
        "https://a.example/one",
        "https://a.example/two",
        "https://a.example/three",
    ]


@pytest.mark.parametrize("gz", [True, False])
def test_truncated_archive_keeps_the_records_before_the_break(tmp_path: Path, gz: bool) -> None:
    p = tmp_path / ("c.warc.gz" if gz else "c.warc")
    write_warc(p, crawl(), gzip=gz)
    full = p.read_bytes()
    # Cut inside the third page's record (the 8th record), wherever it falls.
    cut_at = _record_start(p, 7) + 200
    for cut in (cut_at, cut_at + 7, len(full) - 3):
        p.write_bytes(full[:cut])
        out = read(p)
        got = reasons(out)
        assert got[:7] == CRAWL_REASONS[:7], cut
        # What follows is accounted: the cut record (truncated) or the broken stream.
        assert got[7:] and set(got[7:]) <= {"truncated", "corrupt_file", "not_a_page", "kept"}
        assert "truncated" in got[7:] or "corrupt_file" in got[7:] or cut == len(full) - 3
        assert sum(isinstance(r, RawDoc) for r in out) >= 2


def _record_start(p: Path, i: int) -> int:
    """Byte offset of record i in the file as stored (compressed offsets for .gz)."""
    it = ArchiveIterator(open(p, "rb"), record_types=WarcRecordType.any_type)  # noqa: SIM115
    return [r.stream_pos for r in it][i]


def test_wrong_content_length_and_garbage_are_recovered_from(tmp_path: Path) -> None:
    p = tmp_path / "c.warc"
    write_warc(p, crawl(), gzip=False)
    data = p.read_bytes()
    starts = offsets(p)
    # Record 2 ("two") declares 40 bytes fewer than it has; garbage before record 6.
    head_end = data.index(b"\r\n\r\n", starts[2])
    cl = data.rindex(b"Content-Length: ", starts[2], head_end)
    n = int(data[cl + 16 : head_end])
    bad = data[:cl] + f"Content-Length: {n - 40}".encode() + data[head_end:]
    shift = len(bad) - len(data)
    g = starts[6] + shift
    bad = bad[:g] + b"this is not a record\r\n" * 3 + bad[g:]
    p.write_bytes(bad)
    out = read(p)
    # The short record is quarantined with the rest of its bytes (up to the next header);
    # the garbage is; every record after either is read again.
    assert reasons(out) == [
        "not_a_page",
        "kept",
        "corrupt_record",
        "corrupt_file",
        "not_html",
        "http_status",
        "http_status",
        "corrupt_file",
        "empty_body",
        "kept",
        "not_a_page",
    ]
    assert out[3].location == f"c.warc#offset={starts[3] + shift - 44}"
    assert out[3].size == 44  # the 40 bytes the length left out, and the record's end
    assert at(out[8]) == f"c.warc#offset={g + 66}"  # where reading resumed
    broken = [r for r in out if isinstance(r, BadRecord) and r.reason == "corrupt_file"]
    assert all(r.location.startswith("c.warc#offset=") for r in broken)
    assert all(r.size > 0 for r in broken)


def test_garbage_file_is_one_corrupt_record(tmp_path: Path) -> None:
    p = tmp_path / "g.warc"
    p.write_bytes(b"<html>not an archive</html>\n" * 10)
    out = read(p)
    assert reasons(out) == ["corrupt_file"]
    assert out[0].location == "g.warc#offset=0"


def test_gzip_named_warc_is_refused_with_a_hint(tmp_path: Path) -> None:
    p = tmp_path / "c.warc"
    write_warc(p, crawl(), gzip=True)
    out = read(p)
    assert reasons(out) == ["corrupt_file"]
    assert ".warc.gz" in out[0].detail


def test_charsets_and_content_encodings(tmp_path: Path) -> None:
    text = "Ça coûte très cher à Zürich, déjà vu. " * 20
    sjis = "日本語のテキストです。" * 30
    body_latin = f"<html><body><article><p>{text}</p></article></body></html>".encode("cp1252")
    body_meta = (
        '<html><head><meta charset="shift_jis"></head><body><article><p>'
        f"{sjis}</p></article></body></html>"
    ).encode("shift_jis")
    gz_body = gzip.compress(page("Zipped"))
    bomb = gzip.compress(b"<html><body>" + b"a" * (3 << 20) + b"</body></html>")
    recs = [
        Rec("https://x/latin", body_latin, content_type="text/html; charset=windows-1252"),
        Rec("https://x/meta", body_meta, content_type="text/html"),
        Rec("https://x/gz", gz_body, http_extra=[("Content-Encoding", "gzip")]),
        Rec("https://x/bomb", bomb, http_extra=[("Content-Encoding", "gzip")]),
        Rec("https://x/br", b"\x00\x01", http_extra=[("Content-Encoding", "br")]),
        Rec("https://x/untyped", page("Untyped"), content_type=None),
    ]
    p = tmp_path / "c.warc.gz"
    write_warc(p, recs)
    out = read(p, extract=ExtractConfig(timeout_s=None, max_bytes=1 << 20))[1:]
    assert reasons(out) == ["kept", "kept", "kept", "too_large", "unsupported_encoding", "kept"]
    assert "coûte très cher à Zürich" in out[0].text
    assert "日本語のテキストです" in out[1].text
    assert out[1].meta["charset"].lower().replace("_", "-") in ("shift-jis", "sjis", "cp932")
    assert "zippedword5" in out[2].text
    assert "untypedword5" in out[5].text


def test_extraction_timeout_quarantines_the_page(tmp_path: Path) -> None:
    # resiliparse's main-content pass is quadratic in nesting depth: 20k nested divs take
    # seconds to minutes; the helper process is killed at the cap and the next page is
    # read by a new one.
    bomb = ("<html><body>" + "<div>" * 20000 + "x" + "</div>" * 20000 + "</body></html>").encode()
    recs = [
        Rec("https://x/a", page("Before")),
        Rec("https://x/bomb", bomb),
        Rec("https://x/b", page("After")),
    ]
    p = tmp_path / "c.warc.gz"
    write_warc(p, recs)
    out = read(p, extract=ExtractConfig(engine="resiliparse", timeout_s=1.0))
    assert reasons(out) == ["not_a_page", "kept", "extract_timeout", "kept"]
    assert "timeout_s=1" in out[2].detail
    assert "afterword3" in out[3].text


def test_wet(tmp_path: Path) -> None:
    text = "Plain text a crawler extracted.\nSecond line of it."
    recs = [
        Rec("https://x/a", text.encode(), kind="conversion", content_type="text/plain"),
        Rec("https://x/b", b"", kind="conversion", content_type="text/plain"),
        Rec("https://x/c", b"\xff\xfe bad", kind="conversion", content_type="text/plain"),
    ]
    p = tmp_path / "c.warc.wet.gz"
    write_warc(p, recs)
    out = read(p, fmt="wet")
    assert reasons(out) == ["not_a_page", "kept", "empty_text", "invalid_utf8"]
    assert out[1].text == text
    assert out[1].meta["url"] == "https://x/a"
    assert out[1].meta["content_type"] == "text/plain"


def test_html_files(tmp_path: Path) -> None:
    d = tmp_path / "pages"
    d.mkdir()
    (d / "a.html").write_bytes(page("Alpha"))
    (d / "b.htm").write_bytes(b"")
    (d / "c.html.gz").write_bytes(gzip.compress(page("Gamma")))
    out = {}
    for name in sorted(os.listdir(d)):
        out[name] = read(d / name, fmt="html")
    assert reasons(out["a.html"]) == ["kept"] and "alphaword7" in out["a.html"][0].text
    assert out["a.html"][0].id == "web/a.html"
    assert reasons(out["b.htm"]) == ["empty_body"]
    assert reasons(out["c.html.gz"]) == ["kept"]


@pytest.mark.skipif(not SHARED_WARC.exists(), reason="shared/data is not here")
def test_shared_crawl_every_record_accounted() -> None:
    out = read(SHARED_WARC)
    c = Counter(reasons(out))
    # PROVENANCE.md: 1 warcinfo, 317 pages, 3 images, a 404, a 301, a CSS file.
    assert dict(c) == {"not_a_page": 1, "kept": 317, "not_html": 4, "http_status": 2}
    assert len(out) == len(offsets(SHARED_WARC))


def test_every_web_reason_in_the_code_is_tested() -> None:
    # Each reason the web readers and the extractor can give appears in an expectation of
    # the web tests (the text formats' reasons are the adversarial corpus's).
    import re

    from tests.support.helpers import ROOT

    src = ROOT / "dataprep"
    code = "\n".join(
        (src / f).read_text(encoding="utf-8")
        for f in ("formats/warc.py", "formats/html.py", "extract.py")
    )
    in_code = set(re.findall(r'(?:BadRecord|\bbad)\(\s*"([a-z0-9_]+)"', code))
    in_code |= set(re.findall(r'Extracted\([^)]*?"([a-z_]+)"', code))
    assert {"not_html", "extract_timeout", "truncated"} <= in_code  # the scan finds them
    # This test's own text (its literals above) is left out of what is searched.
    tests = "\n".join(
        (ROOT / "tests" / f)
        .read_text(encoding="utf-8")
        .split("def test_every_web_reason_in_the_code_is_tested")[0]
        for f in (
            "unit/dataprep/test_warc.py",
            "e2e/test_warc_split.py",
            "unit/dataprep/test_extract.py",
            "e2e/test_web_prep.py",
        )
    )
    untested = sorted(r for r in in_code if f'"{r}"' not in tests)
    assert untested == []
