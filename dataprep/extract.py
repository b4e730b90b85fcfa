"""Main-content extraction for the web formats (warc, html): an HTML body's bytes in, the
page's main text out, or the reason it has none (`extract_timeout`, `extract_failed`,
`no_main_content`), which the reader quarantines with the page's location.

Decoding: a BOM, else the charset the HTTP headers declare (if the body decodes with it),
else the page's `<meta charset>`, else uchardet's guess (resiliparse), with UTF-8 and
cp1252 as fallbacks, so that every body decodes to something.

The time cap: with `timeout_s` set, pages are extracted in a helper process (one per
reading thread, started on first use and kept), and a page that runs past the cap has
its helper killed and is quarantined; the next page starts a new helper. A hang in an
extractor (C code included, which no signal or thread can interrupt) therefore stops
one page, not the worker. Threads and signals were not used: ingest runs in process-pool
workers, Prefect's thread runner and Dask workers, and SIGALRM only reaches the main
thread. What it costs is measured by `python -m benchmarks.web_extract`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from dataprep.config import ExtractConfig

ENGINES = ("resiliparse", "trafilatura")
FAVORS = ("balanced", "precision", "recall")

_BOMS = (
    (b"\xef\xbb\xbf", "utf-8"),
    (b"\xff\xfe", "utf-16-le"),
    (b"\xfe\xff", "utf-16-be"),
)


@dataclass(frozen=True, slots=True)
class Extracted:
    """A page's main text, or why it has none (`text` None, `reason` and `detail` set)."""

    text: str | None
    charset: str = ""
    reason: str = ""
    detail: str = ""


def decode_html(body: bytes, declared: str | None = None) -> tuple[str, str]:
    """`body` as text, and the name of the charset it was decoded with."""
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    for bom, name in _BOMS:
        if body.startswith(bom):
            return body[len(bom) :].decode(name, "replace"), name
    if declared:
        try:
            return body.decode(declared), declared
        except (LookupError, UnicodeDecodeError):
            pass  # a wrong or unknown declaration is common; detect instead
    name = detect_encoding(body, from_html_meta=True)
    return bytes_to_str(body, name, errors="replace"), name


def extract_text(html: str, engine: str, favor: str = "balanced", url: str | None = None) -> str:
    """The main text of a decoded page ('' when the engine finds none). Raises whatever
    the engine raises on a page it cannot parse."""
    if engine == "resiliparse":
        from resiliparse.extract.html2text import extract_plain_text

        # resiliparse has one main-content heuristic and no precision/recall knob; `recall`
        # also keeps comment sections (measured: benchmarks/web_extract.py).
        return extract_plain_text(
            html,
            preserve_formatting=True,
            main_content=True,
            list_bullets=True,
            alt_texts=False,
            comments=favor == "recall",
            noscript=False,
        )
    if engine == "trafilatura":
        import trafilatura

        # deduplicate=False: trafilatura's cache spans documents, which would make a
        # page's text depend on what the same worker read before it.
        text = trafilatura.extract(
            html,
            url=url,
            favor_precision=favor == "precision",
            favor_recall=favor == "recall",
            include_comments=False,
            include_tables=True,
            deduplicate=False,
            with_metadata=False,
        )
        return text or ""
    raise ValueError(f"unknown extraction engine {engine!r} (known: {', '.join(ENGINES)})")


def extract_page(
    body: bytes, declared: str | None, url: str | None, engine: str, favor: str
) -> Extracted:
    """Decode and extract one page in this process: never raises for bad content."""
    try:
        html, charset = decode_html(body, declared)
    except Exception as e:  # a codec bug on hostile bytes: the page, not the run
        return Extracted(None, "", "extract_failed", f"cannot decode: {type(e).__name__}: {e}")
    try:
        text = extract_text(html, engine, favor, url)
    except RecursionError:
        return Extracted(None, charset, "extract_failed", f"{engine}: nested too deeply")
    except Exception as e:
        return Extracted(None, charset, "extract_failed", f"{engine}: {type(e).__name__}: {e}")
    if not text.strip():
        return Extracted(None, charset, "no_main_content", f"{engine} found no main text")
    return Extracted(text, charset)


# --------------------------------------------------------------------------------------
# The helper process that enforces the time cap
# --------------------------------------------------------------------------------------

_LEN = struct.Struct("<Q")


def _write_frame(fh: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(_LEN.pack(len(data)) + data)
    fh.flush()


def _read_exact(fh: BinaryIO, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        more = fh.read(n - len(buf))
        if not more:
            return None
        buf += more
    return buf


def _serve(engine: str, favor: str) -> None:
    """The helper's loop: (body, declared, url) frames in on stdin, Extracted fields out
    on stdout, until stdin closes (the reader finished or died)."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    # Anything an engine prints must not corrupt the frames.
    sys.stdout = sys.stderr
    extract_text("<html><body><p>warm up</p></body></html>", engine, favor)
    while True:
        head = _read_exact(inp, _LEN.size)
        if head is None:
            return
        data = _read_exact(inp, _LEN.unpack(head)[0])
        if data is None:
            return
        body, declared, url = pickle.loads(data)
        r = extract_page(body, declared, url, engine, favor)
        _write_frame(out, (r.text, r.charset, r.reason, r.detail))


class Extractor:
    """Extracts pages with one config; with a time cap, through a helper process it
    starts on first use and restarts after a page that ran past the cap. Not for sharing
    between threads (see `extractor_for`)."""

    def __init__(self, engine: str, favor: str, timeout_s: float | None):
        self.engine, self.favor, self.timeout_s = engine, favor, timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0  # helpers killed or found dead, for tests and the benchmark

    def __call__(self, body: bytes, declared: str | None, url: str | None) -> Extracted:
        if self.timeout_s is None:
            return extract_page(body, declared, url, self.engine, self.favor)
        proc = self._helper()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _write_frame(proc.stdin, (body, declared, url))
        except (BrokenPipeError, OSError):
            return self._lost("the extraction helper exited before reading the page")
        deadline = time.monotonic() + self.timeout_s
        fd = proc.stdout.fileno()
        # Select on the raw descriptor: the helper writes a whole frame at once, so once
        # its first bytes are readable the rest follows without waiting on the engine.
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                self.restarts += 1
                return Extracted(
                    None,
                    "",
                    "extract_timeout",
                    f"{self.engine} ran past ingest.extract.timeout_s={self.timeout_s:g}",
                )
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                break
        head = _read_exact(proc.stdout, _LEN.size)
        data = None if head is None else _read_exact(proc.stdout, _LEN.unpack(head)[0])
        if data is None:
            return self._lost("the extraction helper died on this page")
        text, charset, reason, detail = pickle.loads(data)
        return Extracted(text, charset, reason, detail)

    def _lost(self, detail: str) -> Extracted:
        code = self._proc.poll() if self._proc is not None else None
        self.close()
        self.restarts += 1
        if code is not None and code < 0:
            detail += f" (signal {-code})"
        elif code:
            detail += f" (exit status {code})"
        return Extracted(None, "", "extract_failed", detail)

    def _helper(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
            }
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "dataprep.extract", self.engine, self.favor],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
        return self._proc

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for fh in (proc.stdin, proc.stdout):
            if fh is not None:
                with contextlib.suppress(OSError):
                    fh.close()


_local = threading.local()
_all: list[Extractor] = []


def extractor_for(cfg: ExtractConfig) -> Extractor:
    """This thread's extractor for `cfg`, kept for the life of the process so a worker
    starts its helper once, not once per unit."""
    cache: dict[tuple[str, str, float | None], Extractor] = _local.__dict__.setdefault("by_cfg", {})
    key = (cfg.engine, cfg.favor, cfg.timeout_s)
    ex = cache.get(key)
    if ex is None:
        ex = cache[key] = Extractor(*key)
        _all.append(ex)
    return ex


@atexit.register
def _close_all() -> None:
    # A pool worker leaving by os._exit skips this; its helpers then see stdin close.
    for ex in _all:
        ex.close()


if __name__ == "__main__":
    _serve(*sys.argv[1:3])
