"""Main-content extraction: decoding, the engines, and the time cap's helper process."""

from __future__ import annotations

import time

import pytest

from dataprep.extract import Extractor, decode_html, extract_page
from tests.unit.dataprep.warc_files import page


def test_decode_prefers_bom_then_a_declaration_that_fits_then_meta() -> None:
    text = "Zürich, déjà vu"
    assert decode_html(b"\xef\xbb\xbf" + text.encode(), "latin-1") == (text, "utf-8")
    assert decode_html(text.encode("cp1252"), "windows-1252")[0] == text
    # A declaration the bytes contradict is not believed.
    got, charset = decode_html(text.encode("utf-8"), "ascii")
    assert got == text and charset == "utf-8"
    meta = '<meta charset="iso-8859-7"><p>Καλημέρα</p>'.encode("iso-8859-7")
    assert "Καλημέρα" in decode_html(meta, None)[0]
    # Bytes no charset fits still decode.
    assert isinstance(decode_html(b"\xff\xfe\xfa\x80garbage", None)[0], str)


@pytest.mark.parametrize("engine", ["resiliparse", "trafilatura"])
def test_engines_keep_the_article_and_drop_the_chrome(engine: str) -> None:
    r = extract_page(page("Main"), "utf-8", "https://x/", engine, "balanced")
    assert r.text is not None and "mainword42" in r.text
    assert "Copyright footer" not in r.text


def test_a_page_without_text_says_so() -> None:
    r = extract_page(
        b"<html><body><script>x()</script></body></html>", None, None, "resiliparse", "balanced"
    )
    assert r.text is None and r.reason == "no_main_content"


def test_unknown_engine_is_a_failed_page_not_a_crash() -> None:
    r = extract_page(page("A"), None, None, "nope", "balanced")
    assert r.text is None and r.reason == "extract_failed" and "nope" in r.detail


def test_helper_gives_what_in_process_gives_and_survives_its_death() -> None:
    ex = Extractor("resiliparse", "balanced", timeout_s=30)
    try:
        body = page("Helper")
        assert ex(body, None, None) == extract_page(body, None, None, "resiliparse", "balanced")
        assert ex._proc is not None
        ex._proc.kill()
        ex._proc.wait()
        # A dead helper is replaced before the next page, which is read normally.
        assert ex(body, None, None).text is not None
    finally:
        ex.close()


def test_timeout_kills_the_helper_and_the_next_page_is_read() -> None:
    bomb = ("<html><body>" + "<div>" * 20000 + "x" + "</div>" * 20000 + "</body></html>").encode()
    ex = Extractor("resiliparse", "balanced", timeout_s=0.5)
    try:
        ex(page("Warm"), None, None)  # the helper's start is not the page's time
        t0 = time.monotonic()
        r = ex(bomb, None, None)
        assert r.reason == "extract_timeout" and time.monotonic() - t0 < 5
        assert ex.restarts == 1
        assert "afterword1" in (ex(page("After"), None, None).text or "")
    finally:
        ex.close()
