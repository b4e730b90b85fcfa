"""The input formats ingest reads, one module each, registered in `FORMATS`.

A format module declares a `Format` (dataprep.formats.base): its name (the config's `format`
value), its file extensions and whether they may be gzip/zstd-compressed (or, for a format
stored as a directory, how to recognise one), its reader, and, if a big file can be read
by several workers, how to split it. Adding a format is one module plus one entry below;
the config's choices, format detection, splitting and reading all follow the registry.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable

from dataprep.formats import hf, html, jsonl, parquet, txt, warc
from dataprep.formats.base import Format, InputFile
from dataprep.formats.streams import COMPRESSIONS_SHOWN, strip_compression
from dataprep.formats.validate import RAW_LIMIT, BadRecord, RawDoc, Records

__all__ = [
    "CHOICES",
    "FORMATS",
    "RAW_LIMIT",
    "BadRecord",
    "Format",
    "InputFile",
    "RawDoc",
    "Records",
    "directory_format",
    "extensions_shown",
    "format_from_name",
]

# The order is the order the config's error message lists the choices in.
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        jsonl.FORMAT,
        parquet.FORMAT,
        txt.FORMAT,
        hf.FORMAT,
        warc.FORMAT,
        warc.WET_FORMAT,
        html.FORMAT,
    )
}

# The config's `format` values: a registered name, or auto (told by extension, or by
# directory contents for a directory format).
CHOICES: tuple[str, ...] = ("auto", *FORMATS)


def format_from_name(name: str) -> str | None:
    """The format a file name implies (`x.jsonl.zst` -> jsonl), or None if unknown."""
    stem, compressed = strip_compression(name)
    ext = posixpath.splitext(stem.lower())[1]
    fmt = next((f for f in FORMATS.values() if ext in f.extensions), None)
    if fmt is None or (compressed and not fmt.compressible):
        return None
    return fmt.name


def directory_format(has: Callable[[str], bool]) -> Format | None:
    """The directory format a directory is (`has(name)`: whether it holds a file of
    that name), or None for a plain directory."""
    return next((f for f in FORMATS.values() if f.is_dir is not None and f.is_dir(has)), None)


def extensions_shown(each: bool) -> str:
    """The known file extensions for messages. each=True: per format, with the
    compressions it takes (".jsonl, .json, each optionally .gz/.zst, .parquet"); False:
    all of them, then the compressions once."""
    # Those that take compressed files first (jsonl, txt, then parquet), as messages always
    # listed them.
    files = sorted((f for f in FORMATS.values() if f.extensions), key=lambda f: not f.compressible)
    if not each:
        exts = [e for f in files for e in f.extensions]
        return ", ".join([*exts, f"optionally {COMPRESSIONS_SHOWN}"])
    shown = []
    for f in files:
        exts = ", ".join(f.extensions)
        if f.compressible:
            exts += (
                f", each optionally {COMPRESSIONS_SHOWN}"
                if len(f.extensions) > 1
                else f"[{COMPRESSIONS_SHOWN}]"
            )
        shown.append(exts)
    return ", ".join(shown)
