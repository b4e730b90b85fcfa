"""Input resolution and record readers for ingest.

`resolve_inputs` turns a source's `paths` (local globs, files, directories, `datasets`
save_to_disk directories, s3 prefixes and globs) into a sorted list of `InputFile`s. It
only lists and stats, so every configuration mistake (nothing matched, unreadable file,
unknown or conflicting format, unreachable bucket) surfaces as an `IngestError` before
any work starts.

`split_input` cuts a big local uncompressed jsonl (by lines) or parquet file (by row
groups) into parts that read, one after the other, exactly as the whole file does.

`read_file` streams one input (or part) into `RawDoc`s and `BadRecord`s. A bad record
never stops the file: it is yielded with a reason and an exact location so it can be
quarantined and counted (its `size` is the whole record's, though `raw` is cut for
display). Only a broken stream (truncated gzip/zstd, unreadable
parquet/hf) ends a file early, and that too is yielded, as `corrupt_file`, rather than
raised.

Locations: `<rel>:<line>` (jsonl), `<rel>#row=<n>` (parquet), `<rel>[/<split>]#row=<n>`
(hf), `<rel>#para=<n>` (txt paragraphs) and `<rel>` (a whole txt file); all 1-based. A
document without a usable `id_field` gets the id `<source>/<location>`, which is stable as
long as the file keeps its name relative to the configured path.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import math
import os
import posixpath
import sys
import tempfile
import unicodedata
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Any, BinaryIO

import zstandard

from core.store import StorageError, StorageOptions, open_store
from tasks.config import SourceConfig
from tasks.records import LOCATION_KEY

__all__ = [
    "BadRecord",
    "IngestError",
    "InputFile",
    "RawDoc",
    "format_from_name",
    "read_file",
    "resolve_inputs",
    "split_input",
]


class IngestError(ValueError):
    """A problem with a source's inputs, found before any work starts."""


@dataclass(frozen=True, slots=True)
class InputFile:
    source: str  # source name
    uri: str  # absolute local path or s3://bucket/key
    rel: str  # stable name used in ids (posix, relative to the path's fixed base dir)
    format: str  # resolved: jsonl | parquet | txt | hf
    # bytes (for planning units): of the part, for a part; 0 for s3 objects when the store
    # cannot say
    size: int
    # A part of the file (see `split_input`); the defaults mean the whole file.
    # jsonl: the lines that *start* in bytes [start, end) (end None: to the end of file).
    start: int = 0
    end: int | None = None
    # parquet: row groups [first, stop) (None: all of them).
    row_groups: tuple[int, int] | None = None
    # 1-based number of the part's first line (jsonl) or row (parquet), so that locations
    # and ids in a part are those of a read of the whole file.
    first_record: int = 1

    @property
    def is_part(self) -> bool:
        return self.start != 0 or self.end is not None or self.row_groups is not None


@dataclass(slots=True)
class RawDoc:
    id: str
    text: str
    meta: dict
    location: str


@dataclass(slots=True)
class BadRecord:
    reason: str
    detail: str
    location: str
    raw: str  # the record for display: cut after RAW_LIMIT, with a marker
    id: str | None  # None when the record never parsed far enough to have an id
    # Bytes of the whole record in the input (a jsonl line without its line ending, a txt
    # file or paragraph, an arrow record rendered as JSON); 0 for a broken stream.
    size: int


# --------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------

_COMPRESSIONS = (".gz", ".zst", ".zstd")
_EXT_FORMATS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",  # one object per line, as Dolma/OLMo ship their `.json.gz` files
    ".ndjson": "jsonl",
    ".txt": "txt",
    ".parquet": "parquet",
}
_HF_DICT_MARKER = "dataset_dict.json"
_HF_MARKERS = ("dataset_info.json", "state.json")


def format_from_name(name: str) -> str | None:
    """The format a file name implies (`x.jsonl.zst` -> jsonl), or None if unknown."""
    n = name.lower()
    compressed = False
    for c in _COMPRESSIONS:
        if n.endswith(c):
            n, compressed = n[: -len(c)], True
            break
    fmt = _EXT_FORMATS.get(posixpath.splitext(n)[1])
    # Parquet compresses internally; an outer gzip layer is not something we can seek in.
    if fmt == "parquet" and compressed:
        return None
    return fmt


def _is_hf_dir(path: str) -> bool:
    if os.path.isfile(os.path.join(path, _HF_DICT_MARKER)):
        return True
    return all(os.path.isfile(os.path.join(path, m)) for m in _HF_MARKERS)


# --------------------------------------------------------------------------------------
# Resolving inputs
# --------------------------------------------------------------------------------------


def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


class _Resolver:
    def __init__(self, source: SourceConfig, storage: StorageOptions):
        self.source = source
        self.storage = storage

    def error(self, path: str, msg: str) -> IngestError:
        return IngestError(f"source {self.source.name!r}: {path}: {msg}")

    def file_format(self, path: str, name: str) -> str:
        """Format of an explicitly named or glob-matched file; raises on unknown/conflict."""
        want = self.source.format
        known = format_from_name(name)
        if want == "hf":
            raise self.error(path, "format is hf, but this is a file, not a "
                                   "datasets.save_to_disk directory")
        if want == "auto":
            if known is None:
                raise self.error(
                    path,
                    "cannot tell the format from the extension (known: .jsonl, .json, "
                    ".ndjson, each optionally .gz/.zst, .txt[.gz/.zst], .parquet); set the "
                    "source's `format` or narrow the path",
                )
            return known
        if known is not None and known != want:
            raise self.error(path, f"the extension says {known}, but the source's format is "
                                   f"{want}")
        return want

    def dir_member_format(self, name: str) -> str | None:
        """Format of a file found by walking a directory; None = not an input, skip it.
        An explicit `format` acts as a filter here, so a README.txt next to the jsonl
        shards of a `format: jsonl` source is left alone."""
        known = format_from_name(name)
        if known is None:
            return None
        if self.source.format in ("auto", known):
            return known
        return None

    def check_readable(self, path: str, is_dir: bool = False) -> None:
        mode = os.R_OK | (os.X_OK if is_dir else 0)
        if not os.access(path, mode):
            raise self.error(path, "is not readable (permission denied)")

    def input(self, uri: str, rel: str, fmt: str, size: int) -> InputFile:
        return InputFile(self.source.name, uri, rel, fmt, size)

    def hf_input(self, path: str, rel: str) -> InputFile:
        if self.source.format not in ("auto", "hf"):
            raise self.error(path, f"is a datasets.save_to_disk directory, but the source's "
                                   f"format is {self.source.format}")
        self.check_readable(path, is_dir=True)
        return self.input(path, rel, "hf", _tree_size(path))

    # -- local ---------------------------------------------------------------------------

    def local(self, raw: str) -> list[InputFile]:
        path = os.path.abspath(os.path.expanduser(raw))
        if _has_magic(path):
            return self.local_glob(path)
        if not os.path.exists(path):
            raise self.error(path, "does not exist")
        if os.path.isdir(path):
            # A directory's rel keeps the directory's own name ("web/part-0.jsonl"), as a
            # file's rel is its name: both are relative to the parent of what was named.
            parent = os.path.dirname(path.rstrip(os.sep)) or path
            if _is_hf_dir(path):
                return [self.hf_input(path, _rel(path, parent))]
            if self.source.format == "hf":
                raise self.error(path, "format is hf, but this directory has neither "
                                       f"{_HF_DICT_MARKER} nor {' + '.join(_HF_MARKERS)} "
                                       "(write it with datasets' save_to_disk)")
            out = self.walk(path, parent)
            if not out:
                raise self.error(path, self.nothing_in_dir())
            return out
        self.check_readable(path)
        fmt = self.file_format(path, os.path.basename(path))
        return [self.input(path, os.path.basename(path), fmt, os.path.getsize(path))]

    def nothing_in_dir(self) -> str:
        if self.source.format == "auto":
            return "directory holds no input files (.jsonl, .json, .ndjson, .txt, .parquet, " \
                   "optionally .gz/.zst) and no datasets.save_to_disk directory"
        return f"directory holds no {self.source.format} files"

    def walk(self, top: str, base: str) -> list[InputFile]:
        out: list[InputFile] = []

        def onerror(e: OSError) -> None:
            raise self.error(e.filename or top, f"cannot list directory: {e.strerror}")

        for dirpath, dirs, files in os.walk(top, onerror=onerror):
            # Hidden entries are editor/sync/tmp debris (LocalStore's .tmp files included).
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for d in list(dirs):
                sub = os.path.join(dirpath, d)
                if _is_hf_dir(sub):
                    dirs.remove(d)  # its arrow/json files are the dataset, not inputs
                    if self.source.format in ("auto", "hf"):
                        out.append(self.hf_input(sub, _rel(sub, base)))
            for name in sorted(files):
                if name.startswith("."):
                    continue
                fmt = self.dir_member_format(name)
                if fmt is None:
                    continue
                p = os.path.join(dirpath, name)
                self.check_readable(p)
                out.append(self.input(p, _rel(p, base), fmt, os.path.getsize(p)))
        return out

    def local_glob(self, pattern: str) -> list[InputFile]:
        parts = pattern.split(os.sep)
        fixed = next(i for i, p in enumerate(parts) if _has_magic(p))
        base = os.sep.join(parts[:fixed]) or os.sep
        if not os.path.isdir(base):
            raise self.error(pattern, f"glob base directory {base} does not exist")
        matches = sorted(glob.glob(pattern, recursive=True))
        hf_dirs = {m for m in matches if os.path.isdir(m) and _is_hf_dir(m)}
        out: list[InputFile] = []
        for m in matches:
            if _inside_hf_dir(m, base):
                # Files (and a DatasetDict's split directories) inside a saved dataset
                # belong to that dataset.
                continue
            if m in hf_dirs:
                out.append(self.hf_input(m, _rel(m, base)))
            elif os.path.isdir(m):
                continue  # directories from `**` are containers; their files match alone
            else:
                self.check_readable(m)
                fmt = self.file_format(m, os.path.basename(m))
                out.append(self.input(m, _rel(m, base), fmt, os.path.getsize(m)))
        if not out:
            raise self.error(pattern, "glob matches no files")
        return out

    # -- s3 ------------------------------------------------------------------------------

    def s3(self, uri: str) -> list[InputFile]:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise self.error(uri, "names no bucket (expected s3://bucket/prefix)")
        parts = [p for p in key.split("/") if p]
        fixed = next((i for i, p in enumerate(parts) if _has_magic(p)), None)
        try:
            store = open_store(f"s3://{bucket}", self.storage)
        except (StorageError, ImportError) as e:
            raise self.error(uri, f"cannot open the bucket: {e}") from e
        if fixed is None:
            prefix = "/".join(parts)
            # One listing serves both readings of the uri: an object, or a "directory".
            keys, sizes = self.s3_list(store, uri, prefix)
            if prefix and prefix in keys and not key.endswith("/"):
                obj = f"s3://{bucket}/{prefix}"  # normalised, so duplicates are spotted
                fmt = self.file_format(obj, posixpath.basename(prefix))
                return [self.input(obj, posixpath.basename(prefix), fmt, sizes.get(prefix, 0))]
            keys = [k for k in keys if k.startswith(f"{prefix}/")] if prefix else keys
            self.refuse_s3_hf(uri, keys)
            base = posixpath.dirname(prefix)
            out = []
            for k in keys:
                rel = _key_rel(k, base)
                fmt = self.dir_member_format(posixpath.basename(k))
                if fmt is not None and not _hidden_key(k[len(prefix) :]):
                    out.append(self.input(f"s3://{bucket}/{k}", rel, fmt, sizes.get(k, 0)))
            if not out:
                raise self.error(uri, self.nothing_in_dir() if keys else "matches no objects")
            return out
        base = "/".join(parts[:fixed])
        pat = parts[fixed:]
        keys, sizes = self.s3_list(store, uri, f"{base}/" if base else "")
        self.refuse_s3_hf(uri, keys)
        out = []
        for k in keys:
            rel = _key_rel(k, base)
            if not _hidden_key(rel) and _match_parts(pat, rel.split("/")):
                fmt = self.file_format(f"s3://{bucket}/{k}", posixpath.basename(k))
                out.append(self.input(f"s3://{bucket}/{k}", rel, fmt, sizes.get(k, 0)))
        if not out:
            raise self.error(uri, "glob matches no objects")
        return out

    def s3_list(self, store: Any, uri: str, prefix: str) -> tuple[list[str], dict[str, int]]:
        try:
            # Store.list gives keys only. A store that can also give sizes cheaply (from
            # the same listing) may offer `list_sizes`; otherwise sizes are unknown (0).
            list_sizes = getattr(store, "list_sizes", None)
            if callable(list_sizes):
                sizes: dict[str, int] = dict(list_sizes(prefix))
                return sorted(sizes), sizes
            return list(store.list(prefix)), {}
        except StorageError as e:
            raise self.error(uri, f"cannot list objects: {e}") from e

    def refuse_s3_hf(self, uri: str, keys: list[str]) -> None:
        names = {posixpath.basename(k) for k in keys}
        if _HF_DICT_MARKER in names or all(m in names for m in _HF_MARKERS):
            raise self.error(uri, "holds a datasets.save_to_disk directory; reading those "
                                  "from s3 is not supported: download it and give the local "
                                  "path")


def _rel(path: str, base: str) -> str:
    return os.path.relpath(path, base).replace(os.sep, "/")


def _key_rel(key: str, base: str) -> str:
    return key[len(base) + 1 :] if base else key


def _hidden_key(key: str) -> bool:
    return any(p.startswith(".") for p in key.split("/"))


def _inside_hf_dir(path: str, base: str) -> bool:
    d = os.path.dirname(path)
    while len(d) > len(base):
        if _is_hf_dir(d):
            return True
        d = os.path.dirname(d)
    return False


def _tree_size(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            # A size is only a planning hint; an unreadable file fails at load time.
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, name))
    return total


def _match_parts(pat: list[str], parts: list[str]) -> bool:
    """Glob match of path segments: `*`/`?`/`[..]` stay within a segment, `**` spans any
    number of segments (zero included), as in `glob.glob(..., recursive=True)`."""
    if not pat:
        return not parts
    if pat[0] == "**":
        return any(_match_parts(pat[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pat[0]) and _match_parts(pat[1:], parts[1:])


def resolve_inputs(source: SourceConfig, storage: StorageOptions) -> list[InputFile]:
    """Every input file of `source`, sorted by uri and de-duplicated (a file named by two
    entries keeps the rel of the first). Raises IngestError naming the source and path on
    any problem; only lists and stats, never reads file contents."""
    r = _Resolver(source, storage)
    by_uri: dict[str, InputFile] = {}
    for p in source.paths:
        found = r.s3(p) if p.startswith("s3://") else r.local(p)
        for f in found:
            by_uri.setdefault(f.uri, f)
    files = sorted(by_uri.values(), key=lambda f: f.uri)
    # rel is what ids are made of, so two different files must never share one.
    seen: dict[str, str] = {}
    for f in files:
        other = seen.setdefault(f.rel, f.uri)
        if other != f.uri:
            raise IngestError(
                f"source {source.name!r}: {other} and {f.uri} would both be named {f.rel!r}, "
                "so their document ids would collide; give their common parent directory "
                "or a glob from it instead"
            )
    return files


# --------------------------------------------------------------------------------------
# Splitting big inputs into parts
# --------------------------------------------------------------------------------------

_PLAN_BLOCK = 16 << 20  # bytes read at a time by the newline-counting planning pass


def _is_compressed(path: str) -> bool:
    # The same test _open_stream decides by.
    return path.lower().endswith(_COMPRESSIONS)


def split_input(f: InputFile, unit_bytes: int) -> list[InputFile]:
    """`f` as consecutive parts of about `unit_bytes` each, so that several workers can
    read one big file; `[f]` when it is not bigger than that or cannot be split.

    Only local, uncompressed files are split: jsonl by byte ranges that start at line
    starts, parquet by runs of row groups. A compressed stream (.gz, .zst) has no random
    access, so a part would have to decompress everything before it; txt paragraphs and
    hf datasets are not split either. s3 objects are not split: a reader downloads the
    whole object before reading (ranged GETs would be the way to change that).

    Each part knows the number of its first line/row, so reading the parts one after the
    other yields exactly what reading the whole file does (ids, locations, bad records)."""
    if f.size <= unit_bytes or f.is_part or f.uri.startswith("s3://"):
        return [f]
    if f.format == "jsonl" and not _is_compressed(f.uri):
        return _split_jsonl(f, unit_bytes)
    if f.format == "parquet":
        return _split_parquet(f, unit_bytes)
    return [f]


def _jsonl_part_starts(path: str, size: int, unit_bytes: int) -> list[tuple[int, int]]:
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


def _split_jsonl(f: InputFile, unit_bytes: int) -> list[InputFile]:
    starts = _jsonl_part_starts(f.uri, f.size, unit_bytes)
    if len(starts) == 1:
        return [f]  # one line longer than a unit covers the whole file
    parts = []
    for i, (start, line) in enumerate(starts):
        # The last part reads to the end of the file, as a whole-file read would.
        end = starts[i + 1][0] if i + 1 < len(starts) else None
        size = (f.size if end is None else end) - start
        parts.append(replace(f, size=size, start=start, end=end, first_record=line))
    return parts


def _split_parquet(f: InputFile, unit_bytes: int) -> list[InputFile]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        md = pq.read_metadata(f.uri)
    except (pa.ArrowException, OSError):
        return [f]  # the reader reports it, as corrupt_file
    # [first row group, stop, first row, compressed bytes]
    runs: list[list[int]] = []
    row = 1
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        nbytes = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        if runs and runs[-1][3] + nbytes <= unit_bytes:
            runs[-1][1] = i + 1
            runs[-1][3] += nbytes
        else:
            runs.append([i, i + 1, row, nbytes])
        row += rg.num_rows
    if len(runs) <= 1:
        return [f]  # one (huge) row group, or all of them within one unit
    return [replace(f, size=nbytes, row_groups=(first, stop), first_record=first_row)
            for first, stop, first_row, nbytes in runs]


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------

RAW_LIMIT = 64 * 1024
_CHUNK = 1 << 20


class _CorruptStream(Exception):
    """A compressed stream ended in the middle of a frame."""


# Errors a broken compressed stream raises while reading; anything else (a disk error,
# a bug) propagates, so that infrastructure failures are retried instead of quarantined.
_STREAM_ERRORS: tuple[type[BaseException], ...] = (
    gzip.BadGzipFile,
    EOFError,
    zlib.error,
    zstandard.ZstdError,
    _CorruptStream,
)


class _ZstdRaw(io.RawIOBase):
    """Streaming zstd decompression that notices truncation. zstandard's stream_reader
    returns a clean EOF for a file cut mid-frame, which would silently lose its tail;
    decompressobj exposes `eof`, so a frame left open at end of input is an error.
    Concatenated frames (as written by parallel compressors) are followed."""

    def __init__(self, fh: BinaryIO):
        self._fh = fh
        self._dctx = zstandard.ZstdDecompressor()
        self._d = self._dctx.decompressobj()
        self._in_frame = False
        self._buf = b""
        self._pos = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while self._pos >= len(self._buf):
            if self._done:
                return 0
            self._fill()
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def _fill(self) -> None:
        # Small input chunks bound the output of one call even for highly compressible data.
        data = self._fh.read(1 << 17)
        self._buf, self._pos = b"", 0
        if not data:
            if self._in_frame:
                raise _CorruptStream("zstd stream ends in the middle of a frame (truncated)")
            self._done = True
            return
        parts = []
        while data:
            parts.append(self._d.decompress(data))
            self._in_frame = True
            if self._d.eof:
                data = self._d.unused_data
                self._d = self._dctx.decompressobj()
                self._in_frame = False
            else:
                data = b""
        self._buf = b"".join(parts)

    def close(self) -> None:
        self._fh.close()
        super().close()


def _open_stream(path: str) -> BinaryIO:
    n = path.lower()
    if n.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if n.endswith((".zst", ".zstd")):
        raw = _ZstdRaw(open(path, "rb"))  # noqa: SIM115 (closed with the reader)
        return io.BufferedReader(raw, buffer_size=_CHUNK)  # type: ignore[return-value]
    return open(path, "rb", buffering=_CHUNK)


def _raw_bytes(b: bytes) -> str:
    if len(b) > RAW_LIMIT:
        return b[:RAW_LIMIT].decode("utf-8", "backslashreplace") + _marker(len(b), "bytes")
    return b.decode("utf-8", "backslashreplace")


def _raw_str(s: str) -> str:
    if len(s) > RAW_LIMIT:
        return s[:RAW_LIMIT] + _marker(len(s), "characters")
    return s


def _marker(total: int, unit: str) -> str:
    return f"\n…[truncated by ballast: {total} {unit} in all]"


def _render(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, default=str)
    except (ValueError, TypeError, RecursionError):
        return repr(obj)


def _bad(reason: str, detail: str, loc: str, raw: Any, doc_id: str | None,
         size: int | None = None) -> BadRecord:
    """A bad record. `raw` is the record's source bytes (a jsonl line, txt data), a str,
    or an arrow record (rendered as JSON); it is cut for display, while `size` (unless
    given) is the whole of it in bytes, line ending excluded."""
    if isinstance(raw, bytes | bytearray):
        b = bytes(raw).rstrip(b"\r\n")
        return BadRecord(reason, detail, loc, _raw_bytes(b), doc_id,
                         len(b) if size is None else size)
    s = raw if isinstance(raw, str) else _render(raw)
    if size is None:
        size = len(s.encode("utf-8", "surrogatepass"))
    return BadRecord(reason, detail, loc, _raw_str(s), doc_id, size)


def _type_name(v: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
             float: "number", type(None): "null"}
    return names.get(type(v), type(v).__name__)


# Passed through to meta as they are; floats are checked (NaN, infinities) by _jsonable.
_JSON_NON_FLOAT_SCALARS = (str, int, bool, type(None))


class _NonFinite(Exception):
    """A number that standard JSON cannot hold: NaN, Infinity, or a literal too big for
    a float (which Python would read, and write back, as Infinity)."""


def _refuse_constant(token: str) -> Any:
    raise _NonFinite(f"{token} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def _finite_float(token: str) -> float:
    v = float(token)
    if math.isinf(v):
        raise _NonFinite(f"the number {token} is out of range of a 64-bit float (it would "
                         "be read and written back as Infinity)")
    return v


# json.loads, except that NaN/Infinity/-Infinity and overflowing numbers raise _NonFinite:
# Python reads them by default, and json.dumps would write them back as non-standard JSON.
_DECODE = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float).decode


def _jsonable(v: Any) -> Any:
    """Arrow's Python values made JSON-serialisable, so meta is the same kind of thing
    whatever the input format. Raises _NonFinite for a NaN or infinite float."""
    if isinstance(v, _JSON_NON_FLOAT_SCALARS):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _NonFinite(f"holds {v!r}, which JSON cannot represent (RFC 8259 has no "
                             "NaN or Infinity)")
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, datetime | date | time):
        return v.isoformat()
    if isinstance(v, timedelta):
        return v.total_seconds()
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
    if isinstance(v, Decimal):
        return str(v)  # keeps every digit, which a float would not
    return str(v)


_MISSING = object()


class _Records:
    """Turns parsed records and texts into RawDoc/BadRecord; one per (source, file)."""

    __slots__ = ("id_field", "max_bytes", "name", "text_field")

    def __init__(self, source: SourceConfig, max_doc_bytes: int):
        self.name = source.name
        self.text_field = source.text_field
        self.id_field = source.id_field
        self.max_bytes = max_doc_bytes

    def record(self, obj: Any, loc: str, raw: Any, arrow: bool = False) -> RawDoc | BadRecord:
        """`raw` is the record's source bytes (jsonl) or the record itself (arrow); it is
        only rendered for bad records."""
        if type(obj) is not dict:
            return _bad("not_an_object", f"expected a JSON object, got {_type_name(obj)}",
                        loc, raw, None)
        idf = self.id_field
        if idf is not None and idf in obj:
            v = obj[idf]
            # type() rather than isinstance: True is an int, but never a meaningful id.
            if type(v) is str and v:
                doc_id = v
            elif type(v) is int:
                doc_id = str(v)
            else:
                got = "empty string" if v == "" else _type_name(v)
                return _bad("bad_id", f"field {idf!r} must be a non-empty string or an "
                                      f"integer, got {got}", loc, raw, None)
        else:
            doc_id = f"{self.name}/{loc}"
        tf = self.text_field
        text = obj.get(tf, _MISSING)
        if text is _MISSING:
            keys = ", ".join(list(obj)[:20]) + (", …" if len(obj) > 20 else "")
            return _bad("missing_text", f"field {tf!r} is missing; fields present: "
                                        f"{keys or '(none)'}", loc, raw, doc_id)
        if type(text) is not str:
            return _bad("wrong_type", f"field {tf!r} must be a string, got "
                                      f"{_type_name(text)}", loc, raw, doc_id)
        if LOCATION_KEY in obj and tf != LOCATION_KEY:
            # Ingest stores the document's location under this name; overwriting the
            # record's own field would lose it, so the record is kept whole here instead.
            return _bad("reserved_field", f"field {LOCATION_KEY!r} is reserved: ingest "
                                          "stores each document's location under it in "
                                          "meta; rename the field", loc, raw, doc_id)
        if arrow:
            # A new dict: `raw` is this same record and must keep its text for quarantine.
            # (Strings from arrow are valid UTF-8; floats may be NaN or infinite.)
            try:
                meta = {k: v if isinstance(v, _JSON_NON_FLOAT_SCALARS) else _jsonable(v)
                        for k, v in obj.items() if k != tf}
            except _NonFinite as e:
                return _bad("non_finite_number", _non_finite_field(obj, tf, e), loc, raw,
                            doc_id)
        else:
            del obj[tf]  # jsonl's raw is the line's bytes, so the parsed dict is ours
            meta = obj
            # A \uD800-\uDFFF escape can leave an unpaired surrogate in a value, a field
            # name or the id, which no UTF-8 writer accepts (the text is checked below).
            # Only lines with such an escape (escaped pairs are common) pay for the check.
            if (b"\\ud" in raw or b"\\uD" in raw) and (bad := _surrogate_in(meta)):
                return _bad("invalid_utf8", f"metadata has an unpaired surrogate {bad} (from "
                                            "a \\u escape), which is not UTF-8", loc, raw,
                            doc_id)
        return self.text(text, meta, doc_id, loc, raw)

    def text(self, text: str, meta: dict, doc_id: str, loc: str, raw: Any,
             size: int | None = None) -> RawDoc | BadRecord:
        """`size`: the record's bytes in the input when `raw` is not all of it."""
        # isascii() is O(1) on CPython and true for most web text: skip NFC and encoding.
        if text.isascii():
            nbytes = len(text)
        else:
            text = unicodedata.normalize("NFC", text)
            try:
                nbytes = len(text.encode("utf-8"))
            except UnicodeEncodeError as e:
                # JSON "\ud800" escapes decode to lone surrogates, which no UTF-8 writer
                # (Arrow included) accepts.
                return _bad("invalid_utf8", f"text has an unpaired surrogate "
                                            f"U+{ord(text[e.start]):04X} at character "
                                            f"{e.start}", loc, raw, doc_id, size)
        if nbytes > self.max_bytes:
            return _bad("too_large", f"text is {nbytes} bytes, over max_doc_bytes="
                                     f"{self.max_bytes}", loc, raw, doc_id, size)
        if "\x00" in text:
            return _bad("nul_bytes", f"text has a NUL character at index "
                                     f"{text.index(chr(0))}", loc, raw, doc_id, size)
        if not text or text.isspace():
            return _bad("empty_text", "text is empty" if not text else
                        "text is only whitespace", loc, raw, doc_id, size)
        return RawDoc(doc_id, text, meta, loc)


def _non_finite_field(obj: dict, tf: str, e: _NonFinite) -> str:
    """The detail for an arrow record with a NaN/infinite float: which field."""
    for k, v in obj.items():
        if k != tf:
            try:
                _jsonable(v)
            except _NonFinite:
                return f"field {k!r} {e}"
    return str(e)


def _surrogate_in(meta: dict) -> str | None:
    """'U+D800' for the first unpaired surrogate in `meta` (values and names), or None."""
    try:
        json.dumps(meta, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(e.object[e.start]):04X}"
    return None


def _corrupt(loc: str, e: BaseException) -> BadRecord:
    msg = str(e) or type(e).__name__
    return _bad("corrupt_file", f"cannot read on from here: {type(e).__name__}: {msg}",
                loc, "", None, 0)


def _line_limit(max_doc_bytes: int) -> int:
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
        more = fh.readline(_CHUNK)
        pos += len(more)
        if not more or more[-1:] == b"\n":
            return pos


def _read_jsonl(recs: _Records, path: str, rel: str, max_doc_bytes: int, start: int = 0,
                end: int | None = None, first_line: int = 1) -> Iterator[RawDoc | BadRecord]:
    """The lines that start in bytes [start, end) of an uncompressed file (all lines when
    start=0, end=None), numbered from `first_line`, the number of the first line that
    starts at or after `start`. Offsets are the whole file's (the decompressed stream's
    for a compressed one, which is always read whole)."""
    limit = _line_limit(max_doc_bytes)
    decode = _DECODE
    record = recs.record
    line_no = first_line - 1
    offset = 0  # of the current line, in the (decompressed) stream
    stop = sys.maxsize if end is None else end
    with _open_stream(path) as fh:
        readline = fh.readline
        try:
            if start > 0:
                offset = _to_line_start(fh, start)
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
                        more = readline(_CHUNK)
                        n += len(more)
                        if not more or more[-1:] == b"\n":
                            ending = len(more) - len(more.rstrip(b"\r\n"))
                            break
                    yield _bad("too_large", f"line is {n} bytes, longer than any record "
                                            f"that fits max_doc_bytes={max_doc_bytes}; "
                                            "not parsed", loc, line, None, n - ending)
                    offset += n
                    continue
                try:
                    s = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield _bad("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the "
                                               f"line (byte {offset + e.start} of the "
                                               f"stream): {e.reason}", loc, line, None)
                    offset += n
                    continue
                offset += n
                if line_no == 1 and s.startswith("\ufeff"):
                    s = s[1:]  # a UTF-8 BOM, which json.loads refuses
                try:
                    obj = decode(s)
                except ValueError as e:
                    if not s or s.isspace():
                        yield _bad("empty_line", "blank line", loc, line, None)
                    else:
                        detail = ("a UTF-8 BOM (U+FEFF) that does not start the file"
                                  if s.startswith("\ufeff") else str(e) or type(e).__name__)
                        yield _bad("invalid_json", detail, loc, line, None)
                    continue
                except RecursionError:
                    # Python's parser recurses per level; the line may well be valid JSON.
                    yield _bad("too_deep", "nested deeper than the JSON parser can follow "
                                           f"(Python's recursion limit, "
                                           f"{sys.getrecursionlimit()}); not parsed", loc,
                               line, None)
                    continue
                except _NonFinite as e:
                    yield _bad("non_finite_number", str(e), loc, line, None)
                    continue
                yield record(obj, loc, line)
        except _STREAM_ERRORS as e:
            yield _corrupt(f"{rel}:{line_no + 1}", e)


def _read_txt(recs: _Records, path: str, rel: str, unit: str, max_doc_bytes: int
              ) -> Iterator[RawDoc | BadRecord]:
    with _open_stream(path) as fh:
        if unit == "file":
            doc_id = f"{recs.name}/{rel}"
            data, size = b"", 0
            try:
                data = fh.read(max_doc_bytes + 1)
                size = len(data)
                if size > max_doc_bytes:  # not kept, but counted whole (bytes_in)
                    if _is_compressed(path):
                        while more := fh.read(_CHUNK):
                            size += len(more)
                    else:
                        size = os.fstat(fh.fileno()).st_size
            except _STREAM_ERRORS as e:
                if size > max_doc_bytes:
                    yield _txt_doc(recs, data, rel, doc_id, True, size)
                yield _corrupt(rel, e)
                return
            yield _txt_doc(recs, data, rel, doc_id, size > max_doc_bytes, size)
            return
        yield from _txt_paragraphs(recs, fh, rel, max_doc_bytes)


def _txt_paragraphs(recs: _Records, fh: BinaryIO, rel: str, max_doc_bytes: int
                    ) -> Iterator[RawDoc | BadRecord]:
    lines: list[bytes] = []
    size = 0
    para = 0
    too_large = False
    readline = fh.readline
    limit = max_doc_bytes + 2

    def emit() -> RawDoc | BadRecord:
        loc = f"{rel}#para={para}"
        return _txt_doc(recs, b"".join(lines).rstrip(b"\r\n"), loc, f"{recs.name}/{loc}",
                        too_large, size if too_large else None)

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
    except _STREAM_ERRORS as e:
        yield _corrupt(f"{rel}#para={para + (0 if lines else 1)}", e)


def _txt_doc(recs: _Records, data: bytes, loc: str, doc_id: str, too_large: bool,
             size: int | None = None) -> RawDoc | BadRecord:
    """`size`: the document's bytes in the input when `data` is not all of them (a
    too-large document is only partly kept) or not just them (a file's last newline)."""
    if too_large:
        n = len(data) if size is None else size
        return _bad("too_large", f"document is {n} bytes, over max_doc_bytes="
                                 f"{recs.max_bytes}", loc, data, doc_id, n)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return _bad("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the document: "
                                    f"{e.reason}", loc, data, doc_id, size)
    if text.startswith("\ufeff"):
        text = text[1:]
    return recs.text(text, {}, doc_id, loc, data, size)


def _read_parquet(recs: _Records, path: str, rel: str,
                  row_groups: tuple[int, int] | None = None, first_row: int = 1
                  ) -> Iterator[RawDoc | BadRecord]:
    """All rows, or those of row groups [first, stop) numbered from `first_row`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        yield _corrupt(f"{rel}#row={first_row}", e)
        return
    row = first_row - 1
    groups = None if row_groups is None else range(*row_groups)
    with pf:
        try:
            # Row batches, not whole row groups: a row group of long documents can be GBs.
            for batch in pf.iter_batches(batch_size=1024, row_groups=groups):
                for rec in batch.to_pylist():
                    row += 1
                    yield recs.record(rec, f"{rel}#row={row}", rec, arrow=True)
        except (pa.ArrowException, OSError) as e:
            yield _corrupt(f"{rel}#row={row + 1}", e)


def _read_hf(recs: _Records, path: str, rel: str) -> Iterator[RawDoc | BadRecord]:
    import datasets  # slow to import; only hf sources pay for it

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:  # datasets raises a zoo of types for a damaged directory
        yield _corrupt(f"{rel}#row=1", e)
        return
    if isinstance(loaded, datasets.DatasetDict):
        splits = [(f"{rel}/{name}", loaded[name]) for name in sorted(loaded)]
    else:
        splits = [(rel, loaded)]
    for prefix, ds in splits:
        row = 0
        # The arrow format skips feature decoding and honours an indices mapping.
        for table in ds.with_format("arrow").iter(batch_size=1024):
            for rec in table.to_pylist():
                row += 1
                yield recs.record(rec, f"{prefix}#row={row}", rec, arrow=True)


def _readable_part(f: InputFile, path: str) -> bool:
    if f.format == "jsonl":
        return f.row_groups is None and not _is_compressed(path)
    if f.format == "parquet":
        return f.start == 0 and f.end is None
    return False


def _read_local(source: SourceConfig, f: InputFile, path: str, max_doc_bytes: int
                ) -> Iterator[RawDoc | BadRecord]:
    recs = _Records(source, max_doc_bytes)
    if f.is_part and not _readable_part(f, path):
        # split_input never makes such a part; reading the whole file would duplicate it.
        raise IngestError(f"source {source.name!r}: {f.uri}: cannot read this part "
                          f"({f.start=}, {f.end=}, {f.row_groups=}) of a {f.format} file")
    if f.format == "jsonl":
        yield from _read_jsonl(recs, path, f.rel, max_doc_bytes, f.start, f.end,
                               f.first_record)
    elif f.format == "txt":
        yield from _read_txt(recs, path, f.rel, source.txt_unit, max_doc_bytes)
    elif f.format == "parquet":
        yield from _read_parquet(recs, path, f.rel, f.row_groups, f.first_record)
    elif f.format == "hf":
        yield from _read_hf(recs, path, f.rel)
    else:
        raise IngestError(f"source {source.name!r}: {f.uri}: unknown format {f.format!r}")


def read_file(source: SourceConfig, f: InputFile, storage: StorageOptions, max_doc_bytes: int
              ) -> Iterator[RawDoc | BadRecord]:
    """Stream one input's documents and bad records, in file order. Never raises for bad
    content; a file that vanished or a store that fails mid-run does raise (OSError,
    StorageError), since retrying is the fix there, not quarantine."""
    if not f.uri.startswith("s3://"):
        yield from _read_local(source, f, f.uri, max_doc_bytes)
        return
    if f.format == "hf":
        raise IngestError(f"source {source.name!r}: {f.uri}: hf datasets cannot be read "
                          "from s3")
    bucket, _, key = f.uri.removeprefix("s3://").partition("/")
    with tempfile.TemporaryDirectory(prefix="ballast-read-") as tmp:
        # Keep the object's name: the compression is told by its extension.
        local = os.path.join(tmp, posixpath.basename(key) or "object")
        open_store(f"s3://{bucket}", storage).get_file(key, local)
        yield from _read_local(source, f, local, max_doc_bytes)
