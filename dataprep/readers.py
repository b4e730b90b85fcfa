"""Ingest's inputs: which files a source names, in which parts, read by which format.

`resolve_inputs` turns a source's `paths` (local globs, files, directories, directories of
a directory format such as `datasets` save_to_disk output, s3 prefixes and globs) into a
sorted list of `InputFile`s. It only lists and stats, so every configuration mistake
(nothing matched, unreadable file, unknown or conflicting format, unreachable bucket)
surfaces as an `IngestError` before any work starts.

`split_input` cuts a big local uncompressed file into parts (by its format's splitter:
jsonl by lines, parquet by row groups) that read, one after the other, exactly as the
whole file does.

`read_file` streams one input (or part) into `RawDoc`s and `BadRecord`s with its format's
reader (dataprep.formats). A bad record never stops the file: it is yielded with a reason and
an exact location so it can be quarantined and counted (its `size` is the whole record's,
though `raw` is cut for display). Only a broken stream (truncated gzip/zstd, unreadable
parquet/hf) ends a file early, and that too is yielded, as `corrupt_file`, rather than
raised.

Locations are each format's (see its module), all 1-based. A document without a usable
`id_field` gets the id `<source>/<location>`, which is stable as long as the file keeps its
name relative to the configured path.
"""

from __future__ import annotations

import contextlib
import glob
import os
import posixpath
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from fnmatch import fnmatchcase

from core.store import StorageError, StorageOptions, Store, open_store
from dataprep.config import ExtractConfig, SourceConfig
from dataprep.formats import (
    FORMATS,
    BadRecord,
    Format,
    InputFile,
    RawDoc,
    Records,
    directory_format,
    extensions_shown,
    format_from_name,
)
from dataprep.formats.streams import is_compressed

__all__ = ["IngestError", "local_input", "read_file", "read_local", "resolve_inputs", "split_input"]


class IngestError(ValueError):
    """A problem with a source's inputs, found before any work starts."""


# --------------------------------------------------------------------------------------
# Resolving inputs
# --------------------------------------------------------------------------------------


def _local_dir_format(path: str) -> Format | None:
    return directory_format(lambda name: os.path.isfile(os.path.join(path, name)))


def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


class _Resolver:
    def __init__(self, source: SourceConfig, storage: StorageOptions):
        self.source = source
        self.storage = storage
        # The directory format the source names, if it names one.
        wanted = FORMATS.get(source.format)
        self.want_dir = wanted if wanted is not None and wanted.is_dir is not None else None

    def error(self, path: str, msg: str) -> IngestError:
        return IngestError(f"source {self.source.name!r}: {path}: {msg}")

    def file_format(self, path: str, name: str) -> str:
        """Format of an explicitly named or glob-matched file; raises on unknown/conflict."""
        want = self.source.format
        known = format_from_name(name)
        if self.want_dir is not None:
            raise self.error(
                path, f"format is {want}, but this is a file, not a {self.want_dir.dir_noun}"
            )
        if want == "auto":
            if known is None:
                raise self.error(
                    path,
                    f"cannot tell the format from the extension (known: "
                    f"{extensions_shown(each=True)}); set the source's `format` or narrow "
                    "the path",
                )
            return known
        if known is not None and known != want:
            raise self.error(path, f"the extension says {known}, but the source's format is {want}")
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

    def input(self, uri: str, rel: str, fmt: str, size: int, version: str = "") -> InputFile:
        return InputFile(self.source.name, uri, rel, fmt, size, version=version)

    def local_file(self, path: str, rel: str, fmt: str) -> InputFile:
        st = os.stat(path)
        return self.input(path, rel, fmt, st.st_size, f"{st.st_size}-{st.st_mtime_ns}")

    def dir_input(self, fmt: Format, path: str, rel: str) -> InputFile:
        """A directory of a directory format: one input."""
        if self.source.format not in ("auto", fmt.name):
            raise self.error(
                path, f"is a {fmt.dir_noun}, but the source's format is {self.source.format}"
            )
        self.check_readable(path, is_dir=True)
        size, newest = _tree_stat(path)
        return self.input(path, rel, fmt.name, size, f"{size}-{newest}")

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
            if (fmt := _local_dir_format(path)) is not None:
                return [self.dir_input(fmt, path, _rel(path, parent))]
            if self.want_dir is not None:
                raise self.error(
                    path,
                    f"format is {self.want_dir.name}, but this directory {self.want_dir.dir_hint}",
                )
            out = self.walk(path, parent)
            if not out:
                raise self.error(path, self.nothing_in_dir())
            return out
        self.check_readable(path)
        fmt = self.file_format(path, os.path.basename(path))
        return [self.local_file(path, os.path.basename(path), fmt)]

    def nothing_in_dir(self) -> str:
        if self.source.format == "auto":
            dirs = " or ".join(f.dir_noun for f in FORMATS.values() if f.is_dir is not None)
            return f"directory holds no input files ({extensions_shown(each=False)}) and no {dirs}"
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
                if (dir_fmt := _local_dir_format(sub)) is not None:
                    dirs.remove(d)  # its files are the dataset, not inputs
                    if self.source.format in ("auto", dir_fmt.name):
                        out.append(self.dir_input(dir_fmt, sub, _rel(sub, base)))
            for name in sorted(files):
                if name.startswith("."):
                    continue
                fmt = self.dir_member_format(name)
                if fmt is None:
                    continue
                p = os.path.join(dirpath, name)
                self.check_readable(p)
                out.append(self.local_file(p, _rel(p, base), fmt))
        return out

    def local_glob(self, pattern: str) -> list[InputFile]:
        parts = pattern.split(os.sep)
        fixed = next(i for i, p in enumerate(parts) if _has_magic(p))
        base = os.sep.join(parts[:fixed]) or os.sep
        if not os.path.isdir(base):
            raise self.error(pattern, f"glob base directory {base} does not exist")
        matches = sorted(glob.glob(pattern, recursive=True))
        dir_fmts = {
            m: fmt
            for m in matches
            if os.path.isdir(m) and (fmt := _local_dir_format(m)) is not None
        }
        out: list[InputFile] = []
        for m in matches:
            if _inside_dir_format(m, base):
                # Files (and a DatasetDict's split directories) inside a saved dataset
                # belong to that dataset.
                continue
            if m in dir_fmts:
                out.append(self.dir_input(dir_fmts[m], m, _rel(m, base)))
            elif os.path.isdir(m):
                continue  # directories from `**` are containers; their files match alone
            else:
                self.check_readable(m)
                fmt = self.file_format(m, os.path.basename(m))
                out.append(self.local_file(m, _rel(m, base), fmt))
        if not out:
            raise self.error(pattern, "glob matches no files")
        return out

    # -- s3 ------------------------------------------------------------------------------

    def s3(self, uri: str) -> list[InputFile]:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise self.error(uri, "names no bucket (expected s3://bucket/prefix)")
        try:
            store = open_store(f"s3://{bucket}", self.storage)
        except (StorageError, ImportError) as e:
            raise self.error(uri, f"cannot open the bucket: {e}") from e
        return [self.s3_version(store, f) for f in self.s3_listed(store, uri, bucket, key)]

    def s3_version(self, store: Store, f: InputFile) -> InputFile:
        """`f` with its ETag, from one HEAD request per object (the listing has the ETags,
        but Store.list_sizes keeps only the sizes)."""
        key = f.uri.removeprefix("s3://").partition("/")[2]
        try:
            info = store.stat(key)
        except StorageError as e:
            raise self.error(f.uri, f"cannot read the object's metadata: {e}") from e
        if info is None:
            raise self.error(f.uri, "disappeared while the inputs were listed")
        return replace(f, size=info.size, version=info.version)

    def s3_listed(self, store: Store, uri: str, bucket: str, key: str) -> list[InputFile]:
        parts = [p for p in key.split("/") if p]
        fixed = next((i for i, p in enumerate(parts) if _has_magic(p)), None)
        if fixed is None:
            prefix = "/".join(parts)
            # One listing serves both readings of the uri: an object, or a "directory".
            sizes = self.s3_list(store, uri, prefix)
            if prefix and prefix in sizes and not key.endswith("/"):
                obj = f"s3://{bucket}/{prefix}"  # normalised, so duplicates are spotted
                fmt = self.file_format(obj, posixpath.basename(prefix))
                return [self.input(obj, posixpath.basename(prefix), fmt, sizes[prefix])]
            keys = [k for k in sizes if k.startswith(f"{prefix}/")] if prefix else list(sizes)
            self.refuse_s3_dir_format(uri, keys)
            base = posixpath.dirname(prefix)
            out = []
            for k in keys:
                rel = _key_rel(k, base)
                fmt = self.dir_member_format(posixpath.basename(k))
                if fmt is not None and not _hidden_key(k[len(prefix) :]):
                    out.append(self.input(f"s3://{bucket}/{k}", rel, fmt, sizes[k]))
            if not out:
                raise self.error(uri, self.nothing_in_dir() if keys else "matches no objects")
            return out
        base = "/".join(parts[:fixed])
        pat = parts[fixed:]
        sizes = self.s3_list(store, uri, f"{base}/" if base else "")
        self.refuse_s3_dir_format(uri, list(sizes))
        out = []
        for k in sizes:
            rel = _key_rel(k, base)
            if not _hidden_key(rel) and _match_parts(pat, rel.split("/")):
                fmt = self.file_format(f"s3://{bucket}/{k}", posixpath.basename(k))
                out.append(self.input(f"s3://{bucket}/{k}", rel, fmt, sizes[k]))
        if not out:
            raise self.error(uri, "glob matches no objects")
        return out

    def s3_list(self, store: Store, uri: str, prefix: str) -> dict[str, int]:
        """Every key under `prefix` with its size, sorted by key."""
        try:
            return dict(sorted(store.list_sizes(prefix).items()))
        except StorageError as e:
            raise self.error(uri, f"cannot list objects: {e}") from e

    def refuse_s3_dir_format(self, uri: str, keys: list[str]) -> None:
        names = {posixpath.basename(k) for k in keys}
        fmt = directory_format(names.__contains__)
        if fmt is not None:
            raise self.error(
                uri,
                f"holds a {fmt.dir_noun}; reading those from s3 is not "
                "supported: download it and give the local path",
            )


def _rel(path: str, base: str) -> str:
    return os.path.relpath(path, base).replace(os.sep, "/")


def _key_rel(key: str, base: str) -> str:
    return key[len(base) + 1 :] if base else key


def _hidden_key(key: str) -> bool:
    return any(p.startswith(".") for p in key.split("/"))


def _inside_dir_format(path: str, base: str) -> bool:
    d = os.path.dirname(path)
    while len(d) > len(base):
        if _local_dir_format(d) is not None:
            return True
        d = os.path.dirname(d)
    return False


def _tree_stat(path: str) -> tuple[int, int]:
    """The bytes of a directory's files and the newest one's mtime in ns."""
    total = newest = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            # A size is only a planning hint; an unreadable file fails at load time.
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(dirpath, name))
                total += st.st_size
                newest = max(newest, st.st_mtime_ns)
    return total, newest


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


def split_input(f: InputFile, unit_bytes: int) -> list[InputFile]:
    """`f` as consecutive parts of about `unit_bytes` each, so that several workers can
    read one big file; `[f]` when it is not bigger than that or cannot be split.

    Only local, uncompressed files of a format with a splitter are split (jsonl by byte
    ranges that start at line starts, parquet by runs of row groups). A compressed stream
    (.gz, .zst) has no random access, so a part would have to decompress everything before
    it. s3 objects are not split: a reader downloads the whole object before reading
    (ranged GETs would be the way to change that).

    Each part knows the number of its first line/row, so reading the parts one after the
    other yields exactly what reading the whole file does (ids, locations, bad records)."""
    if f.size <= unit_bytes or f.is_part or f.uri.startswith("s3://"):
        return [f]
    split = FORMATS[f.format].split
    if split is None or is_compressed(f.uri):
        return [f]
    return split(f, unit_bytes)


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


def read_local(
    source: SourceConfig,
    f: InputFile,
    path: str,
    max_doc_bytes: int,
    extract: ExtractConfig | None = None,
) -> Iterator[RawDoc | BadRecord]:
    """`read_file` of an input whose bytes are at the local `path` (see local_input).
    `extract`: ingest.extract, for the HTML formats."""
    fmt = FORMATS.get(f.format)
    if fmt is None:
        raise IngestError(f"source {source.name!r}: {f.uri}: unknown format {f.format!r}")
    if f.is_part and (f.part_kind != fmt.parts or is_compressed(path)):
        # split_input never makes such a part; reading the whole file would duplicate it.
        raise IngestError(
            f"source {source.name!r}: {f.uri}: cannot read this part "
            f"({f.start=}, {f.end=}, {f.row_groups=}) of a {f.format} file"
        )
    yield from fmt.read(Records(source, max_doc_bytes, extract), f, path)


@contextlib.contextmanager
def local_input(source: SourceConfig, f: InputFile, storage: StorageOptions) -> Iterator[str]:
    """A local path holding `f`'s bytes: the file itself, or an s3 object downloaded to a
    temporary directory (removed at the end of the block)."""
    if not f.uri.startswith("s3://"):
        yield f.uri
        return
    fmt = FORMATS.get(f.format)
    if fmt is not None and fmt.is_dir is not None:
        raise IngestError(
            f"source {source.name!r}: {f.uri}: {f.format} datasets cannot be read from s3"
        )
    bucket, _, key = f.uri.removeprefix("s3://").partition("/")
    with tempfile.TemporaryDirectory(prefix="ballast-read-") as tmp:
        # Keep the object's name: the compression is told by its extension.
        local = os.path.join(tmp, posixpath.basename(key) or "object")
        open_store(f"s3://{bucket}", storage).get_file(key, local)
        yield local


def read_file(
    source: SourceConfig, f: InputFile, storage: StorageOptions, max_doc_bytes: int
) -> Iterator[RawDoc | BadRecord]:
    """Stream one input's documents and bad records, in file order. Never raises for bad
    content; a file that vanished or a store that fails mid-run does raise (OSError,
    StorageError), since retrying is the fix there, not quarantine."""
    with local_input(source, f, storage) as path:
        yield from read_local(source, f, path, max_doc_bytes)
