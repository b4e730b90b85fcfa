"""What a run read, and whether the inputs changed since: the groundwork of incremental
prep (issue 12).

- `check_overlap`: the output and the inputs must not contain one another (a re-run would
  read its own output as input), refused before any work.
- The inventory: per input file its source, uri, rel, format, size and version tag
  (local: "<size>-<mtime_ns>", S3: the ETag), listed at plan time and kept in the output
  as INVENTORY_KEY when the output is made; and per part of a file that an ingest unit
  read, the sha256 of its bytes [start, end), kept in the unit's done marker. A jsonl file
  split into byte ranges has one part per unit, so "the first N bytes are unchanged" can be
  checked part by part; a parquet file split by row groups has byte ranges that tile the
  file (from the row groups' offsets); any other input is one part, [0, size). A directory
  input (hf) is hashed as a tree and can only be unchanged or changed.
- `compare_inputs`: recorded vs current inventory, into unchanged / new / grown / changed /
  removed; `check_inputs` applies it when a run finds an existing output.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.store import NotFound, StorageOptions, Store, open_store
from dataprep.config import PrepConfig
from dataprep.formats import FORMATS, InputFile
from dataprep.readers import IngestError

# The inventory listed when the output was made: {"files": [file entry, ...]} (no parts).
INVENTORY_KEY = "_inputs.json"
INGEST_DONE_PREFIX = "_done/ingest/"
_CHUNK = 1 << 20
_SHOWN = 3  # file names shown per class in a refusal


class InputsChanged(RuntimeError):
    """An existing output was made from other inputs than those found now."""


# --------------------------------------------------------------------------------------
# Overlap of inputs and output
# --------------------------------------------------------------------------------------


def _fixed_base(path: str) -> str:
    """A path or URI up to its first glob segment (the path itself if it has none)."""
    parts = path.split("/")
    fixed = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))
    return "/".join(parts[:fixed]) or "/"


def _segments(location: str) -> tuple[str, ...]:
    """A comparable form: ("s3:", bucket, *key parts) or the resolved local path's parts."""
    if location.startswith("s3://"):
        return ("s3:", *(p for p in location[len("s3://") :].split("/") if p))
    path = os.path.realpath(os.path.expanduser(location.removeprefix("file://")))
    return tuple(p for p in path.split(os.sep) if p)


def _under(inner: tuple[str, ...], outer: tuple[str, ...]) -> bool:
    return inner[: len(outer)] == outer


def check_overlap(cfg: PrepConfig) -> None:
    """Raise IngestError when the output lies under an input path (a directory, a file or
    a glob's fixed base directory) of any source, or an input under the output. Reads
    nothing: the paths alone decide (local paths with symlinks resolved)."""
    out = _segments(cfg.output)
    for src in cfg.sources:
        for raw in src.paths:
            base = _fixed_base(
                raw if raw.startswith("s3://") else os.path.abspath(os.path.expanduser(raw))
            )
            seg = _segments(base)
            if _under(out, seg):
                raise IngestError(
                    f"the output {cfg.output} lies inside source {src.name!r}'s input {raw}: "
                    "a re-run would read the output as input; choose an output outside "
                    "every input"
                )
            if _under(seg, out):
                raise IngestError(
                    f"source {src.name!r}'s input {raw} lies inside the output {cfg.output}: "
                    "the run would read its own files; choose an output outside every input"
                )


# --------------------------------------------------------------------------------------
# The inventory
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """Bytes [start, end) of a file, as one ingest unit read them, and their sha256."""

    start: int
    end: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "sha256": self.sha256}


@dataclass(frozen=True)
class FileRecord:
    source: str
    uri: str
    rel: str
    format: str
    size: int  # of the whole file (a directory input: of its files together)
    version: str  # local "<size>-<mtime_ns>" (a directory: of its newest file), S3 ETag
    parts: tuple[Part, ...] = ()  # sorted by start; empty: not (yet) read

    @property
    def key(self) -> tuple[str, str]:
        return (self.source, self.uri)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "uri": self.uri,
            "rel": self.rel,
            "format": self.format,
            "size": self.size,
            "version": self.version,
            "parts": [p.to_json() for p in self.parts],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileRecord:
        return cls(
            d["source"],
            d["uri"],
            d["rel"],
            d["format"],
            int(d["size"]),
            str(d["version"]),
            tuple(Part(int(p["start"]), int(p["end"]), p["sha256"]) for p in d.get("parts", ())),
        )


def listed(files: Iterable[InputFile]) -> list[FileRecord]:
    """The whole files behind `files` (parts of one file count once), without parts."""
    out: dict[tuple[str, str], FileRecord] = {}
    for f in files:
        out.setdefault(
            (f.source, f.uri),
            FileRecord(
                f.source,
                f.uri,
                f.rel,
                f.format,
                f.size if f.file_size is None else f.file_size,
                f.version,
            ),
        )
    return list(out.values())


def with_parts(files: Iterable[FileRecord], parts: Iterable[dict[str, Any]]) -> list[FileRecord]:
    """`files` with the parts that ingest markers recorded (`part_entry` dicts)."""
    by_file: dict[tuple[str, str], list[Part]] = {}
    for p in parts:
        by_file.setdefault((p["source"], p["uri"]), []).append(
            Part(int(p["start"]), int(p["end"]), p["sha256"])
        )
    return [
        FileRecord(
            f.source,
            f.uri,
            f.rel,
            f.format,
            f.size,
            f.version,
            tuple(sorted(set(by_file.get(f.key, ())), key=lambda p: p.start)),
        )
        for f in files
    ]


def part_entry(f: InputFile, part: Part) -> dict[str, Any]:
    """What an ingest unit's done marker records of one file (or part) it read."""
    return {
        "source": f.source,
        "uri": f.uri,
        "version": f.version,
        "size": f.size if f.file_size is None else f.file_size,
        **part.to_json(),
    }


def marker_parts(
    store: Store, markers: Iterable[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Every part recorded by the ingest markers in `store` (or in `markers`)."""
    if markers is None:
        markers = (
            json.loads(store.get(k)) for k in store.list(INGEST_DONE_PREFIX) if k.endswith(".json")
        )
    return [p for m in markers for p in m.get("inputs", ())]


def read_inventory(store: Store) -> list[FileRecord] | None:
    """The inventory listed when the output was made; None for an output made before
    inventories were kept."""
    if not store.exists(INVENTORY_KEY):
        return None
    return [FileRecord.from_json(d) for d in json.loads(store.get(INVENTORY_KEY))["files"]]


def inventory_bytes(files: Sequence[FileRecord]) -> bytes:
    return json.dumps({"files": [f.to_json() for f in files]}, indent=1, sort_keys=True).encode()


# --------------------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------------------


def sha256_range(path: str, start: int = 0, end: int | None = None) -> tuple[int, str]:
    """(end, sha256) of bytes [start, end) of a file (end None: to its end; a file
    shorter than `end` stops at its end, so the returned end says what was hashed)."""
    h = hashlib.sha256()
    pos = start
    with open(path, "rb", buffering=0) as fh:
        fh.seek(start)
        while end is None or pos < end:
            block = fh.read(_CHUNK if end is None else min(_CHUNK, end - pos))
            if not block:
                break
            h.update(block)
            pos += len(block)
    return pos, h.hexdigest()


def sha256_tree(path: str) -> tuple[int, str]:
    """(bytes, sha256) of a directory's files: names (relative, sorted) and contents."""
    h = hashlib.sha256()
    total = 0
    for dirpath, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(dirpath, name)
            h.update(os.path.relpath(p, path).replace(os.sep, "/").encode() + b"\0")
            n, digest = sha256_range(p)
            h.update(f"{n}:{digest}\0".encode())
            total += n
    return total, h.hexdigest()


def _row_group_offsets(path: str) -> list[int]:
    """The byte offset where each row group of a parquet file starts."""
    import pyarrow.parquet as pq

    md = pq.read_metadata(path)
    out = []
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        starts = []
        for c in range(rg.num_columns):
            col = rg.column(c)
            first = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                first = min(first, col.dictionary_page_offset)
            starts.append(first)
        out.append(min(starts))
    return out


def hash_input(f: InputFile, path: str) -> Part:
    """The part of the file at `path` (`f`'s bytes, or a local copy of them) that `f`
    reads, hashed: one sequential read of those bytes, before the format's reader reads
    them (hashing inside the readers is not clean: jsonl reads a line past its part's
    end, parquet reads through Arrow, a too-large txt document is skipped unread)."""
    if os.path.isdir(path):
        size, digest = sha256_tree(path)
        return Part(0, size, digest)
    if f.row_groups is not None:
        # Row-group parts hash byte ranges that tile the file: part k from the start of
        # its first row group (0 for the first part) to where the next part starts (the
        # end of the file, footer included, for the last).
        import pyarrow as pa

        first, stop = f.row_groups
        try:
            offsets = _row_group_offsets(path)
        except (pa.ArrowException, OSError):
            offsets = []  # damaged since it was split: the reader reports it
        if len(offsets) >= stop:
            start = 0 if first == 0 else offsets[first]
            end = offsets[stop] if stop < len(offsets) else None
            end_, digest = sha256_range(path, start, end)
            return Part(start, end_, digest)
        end, digest = sha256_range(path)  # every part records the whole file
        return Part(0, end, digest)
    end, digest = sha256_range(path, f.start, f.end)
    return Part(f.start, end, digest)


# --------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputChanges:
    """Recorded vs current inputs, per class, as (source, uri) keys in inventory order."""

    unchanged: tuple[tuple[str, str], ...] = ()
    new: tuple[tuple[str, str], ...] = ()
    grown: tuple[tuple[str, str], ...] = ()  # larger, and what was read is still its start
    changed: tuple[tuple[str, str], ...] = ()  # edited, truncated, replaced
    removed: tuple[tuple[str, str], ...] = ()
    # Why each changed file counts as changed (a short phrase), by key.
    why: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def all_unchanged(self) -> bool:
        return not (self.new or self.grown or self.changed or self.removed)

    def describe(self) -> str:
        """One line: the count and the first few names per class that differs."""
        out = []
        for name in ("changed", "removed", "grown", "new"):
            keys: tuple[tuple[str, str], ...] = getattr(self, name)
            if not keys:
                continue
            shown = [k[1] + (f" ({self.why[k]})" if k in self.why else "") for k in keys[:_SHOWN]]
            more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
            out.append(f"{len(keys)} {name} ({', '.join(shown)}{more})")
        return "; ".join(out)


# sha256 of bytes [start, end) of the file as it is now, or None if that cannot be read
# (a directory input, a file shorter than `end`, a file gone).
RangeHash = Callable[[FileRecord, int, int], "str | None"]


def _covers(parts: tuple[Part, ...], size: int) -> bool:
    """Whether the parts tile [0, size) exactly: every byte read was hashed."""
    pos = 0
    for p in parts:
        if p.start != pos:
            return False
        pos = p.end
    return pos == size


def _first_mismatch(rec: FileRecord, now: FileRecord, read: RangeHash) -> Part | None:
    """The first recorded part whose bytes are not the same now, if any."""
    return next((p for p in rec.parts if read(now, p.start, p.end) != p.sha256), None)


def compare_inputs(
    recorded: Sequence[FileRecord], current: Sequence[FileRecord], read: RangeHash
) -> InputChanges:
    """Classify every input file. Pure apart from `read`, which is asked only about files
    whose size or version tag differ:
    - unchanged: same size and version tag (nothing read), or same size and every byte
      recorded still hashes the same (a copy or `touch` changes only the tag);
    - grown: larger, and every recorded part still hashes the same (rows appended);
    - changed: anything else for a file in both (edited in the middle, truncated,
      replaced; or parts were never recorded, so the change cannot be told apart);
    - removed / new: in one inventory only."""
    now = {f.key: f for f in current}
    was = {f.key: f for f in recorded}
    unchanged, grown, changed, removed = [], [], [], []
    why: dict[tuple[str, str], str] = {}
    for rec in recorded:
        cur = now.get(rec.key)
        if cur is None:
            removed.append(rec.key)
            continue
        if cur.size == rec.size and cur.version == rec.version:
            unchanged.append(rec.key)
            continue
        verifiable = (
            _covers(rec.parts, rec.size)
            and FORMATS.get(rec.format) is not None
            and FORMATS[rec.format].is_dir is None
        )
        if cur.size < rec.size:
            changed.append(rec.key)
            why[rec.key] = f"truncated or edited: {rec.size} -> {cur.size} bytes"
        elif not verifiable:
            changed.append(rec.key)
            why[rec.key] = "modified; what was read cannot be checked"
        elif (bad := _first_mismatch(rec, cur, read)) is not None:
            changed.append(rec.key)
            why[rec.key] = f"bytes {bad.start}-{bad.end} differ"
        elif cur.size == rec.size:
            unchanged.append(rec.key)
        else:
            grown.append(rec.key)
    new = tuple(f.key for f in current if f.key not in was)
    return InputChanges(tuple(unchanged), new, tuple(grown), tuple(changed), tuple(removed), why)


class CurrentBytes:
    """A RangeHash over the files as they are now: local files read in place; an S3
    object downloaded once (the Store interface has no ranged reads). A context manager:
    the downloads are removed at its end."""

    def __init__(self, storage: StorageOptions):
        self.storage = storage
        self.copies: dict[str, str] = {}
        self.tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> CurrentBytes:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()

    def local(self, uri: str) -> str:
        if not uri.startswith("s3://"):
            return uri
        if uri not in self.copies:
            if self.tmp is None:
                self.tmp = tempfile.TemporaryDirectory(prefix="ballast-inputs-")
            bucket, _, key = uri.removeprefix("s3://").partition("/")
            # Keep the object's name in a directory of its own.
            local = os.path.join(
                self.tmp.name, str(len(self.copies)), posixpath.basename(key) or "object"
            )
            os.makedirs(os.path.dirname(local))
            open_store(f"s3://{bucket}", self.storage).get_file(key, local)
            self.copies[uri] = local
        return self.copies[uri]

    def __call__(self, f: FileRecord, start: int, end: int) -> str | None:
        try:
            path = self.local(f.uri)
            if os.path.isdir(path):
                return None
            got, digest = sha256_range(path, start, end)
        except (OSError, NotFound):
            return None
        return digest if got == end else None


def check_inputs(
    store: Store, cfg: PrepConfig, files: Iterable[InputFile], log: Callable[[str], None]
) -> None:
    """Before any work, once the output is claimed: record the inventory in a fresh
    output; in one made before, compare. All unchanged: one log line, and the run resumes.
    Anything else: InputsChanged naming what differs. An output made before inventories
    were kept (ingest markers, no inventory) resumes unchecked. (This is for the first
    version, not yet finished; once it is, dataprep/versions.py compares instead.)"""
    current = listed(files)
    recorded = read_inventory(store)
    if recorded is None:
        if not store.list(INGEST_DONE_PREFIX):
            # Fresh (or claimed by a run that stopped before reading anything). Of two
            # racing runs one writes it; both listed the same inputs.
            store.put_if_absent(INVENTORY_KEY, inventory_bytes(current))
        return
    now = {f.key: (f.size, f.version) for f in current}
    if any(now.get(r.key, (r.size, r.version)) != (r.size, r.version) for r in recorded):
        # Some file's size or tag differs: what was read (the parts' hashes) decides.
        recorded = with_parts(recorded, marker_parts(store))
    with CurrentBytes(cfg.storage) as read:
        changes = compare_inputs(recorded, current, read)
    if changes.all_unchanged:
        log(
            f"inputs unchanged since the last run of this output ({len(current)} files): "
            "finished work is not redone"
        )
        return
    raise InputsChanged(
        f"the inputs of {cfg.output} changed before its first version was finished: "
        f"{changes.describe()}; restore them to finish that version (later data then goes "
        "into a version of its own), or use a new output"
    )
