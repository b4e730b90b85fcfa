"""Line-level dedup within a source: a line found in more than `max_docs` of a source's
documents (navigation, cookie banners, footers) is removed from every new document of that
source; a document left with nothing but whitespace is dropped as `lines:empty`. Only
sources that set `line_dedup` take part; the others' documents pass unchanged.

Steps, as exact dedup's:

    count  (per shard)  each document's distinct line hashes -> lines/hashes/<shard>.npy
    select (once)       documents per (source, line hash) over every shard of the version,
                        in passes by hash value -> lines/common.npy (version store)
    apply  (per shard)  remove the common lines; documents and accounting as other stages

A line is compared stripped, with runs of whitespace as one space; a line shorter than
`min_line_chars` after that is never counted nor removed. Lines are split on "\\n" only,
and every line that stays is kept byte for byte."""

from __future__ import annotations

import io
from array import array
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from core.store import Store
from dataprep.config import LineDedupConfig, PrepConfig
from dataprep.layout import (
    DroppedRows,
    ShardStats,
    doc_location,
    output_store,
    read_docs,
    read_done,
    version_store,
    write_shard,
)
from dataprep.records import DOC_SCHEMA
from dataprep.stages.exact import npy_rows

STAGE = "lines"
COMMON_KEY = "lines/common.npy"  # written once select is done
EMPTY = "lines:empty"
# (source, hash) entries one pass of `select` sorts at once (about 48 bytes each with the
# sort's index and sorted copies): more and the entries are split into passes by hash.
PASS_LINES = 1 << 24


def hashes_key(shard: str) -> str:
    return f"lines/hashes/{shard}.npy"


def enabled(cfg: PrepConfig) -> bool:
    return any(s.line_dedup is not None for s in cfg.sources)


def _settings(cfg: PrepConfig) -> dict[str, tuple[int, LineDedupConfig]]:
    """Each source that dedups its lines: its index in the config (its id in the hash
    files: the config, and so the order, is fixed for an output) and its settings."""
    return {
        s.name: (i, s.line_dedup) for i, s in enumerate(cfg.sources) if s.line_dedup is not None
    }


def _line_hash(line: str, min_chars: int) -> int | None:
    norm = " ".join(line.split())
    if len(norm) < min_chars:
        return None
    return xxhash.xxh3_64_intdigest(norm.encode("utf-8"))


def _save(store: Store, key: str, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr)
    store.put(key, buf.getvalue())


def _load(store: Store, key: str) -> np.ndarray:
    return np.load(io.BytesIO(store.get(key)))


def count_shard(cfg: PrepConfig, input_stage: str, shard: str) -> int:
    """Write (source id, line hash) rows, each document's distinct lines once: a row then
    counts one document."""
    store = output_store(cfg)
    docs = read_docs(store, input_stage, shard)
    settings = _settings(cfg)
    sids, hashes = array("Q"), array("Q")  # 8 bytes an entry, not a Python int's 32
    for text, src in zip(docs["text"].to_pylist(), docs["source"].to_pylist(), strict=True):
        if src not in settings:
            continue
        sid, ld = settings[src]
        seen = {
            h for line in text.split("\n") if (h := _line_hash(line, ld.min_line_chars)) is not None
        }
        hashes.extend(sorted(seen))
        sids.extend([sid] * len(seen))
    rows = np.column_stack([np.frombuffer(sids, np.uint64), np.frombuffer(hashes, np.uint64)])
    _save(store, hashes_key(shard), rows)
    return len(rows)


def _rows(store: Store, shard: str) -> int:
    """Rows of a shard's hash file, from its header alone."""
    return npy_rows(store, hashes_key(shard))


def select(cfg: PrepConfig, prior: list[str], new: list[str]) -> int:
    """Find the (source, line hash) pairs seen in more than the source's `max_docs`
    documents, over this version's shards and those of the earlier versions it builds on
    (`prior`: their documents count, though they lose nothing themselves). Holds at most
    PASS_LINES entries at once: a larger corpus is counted in passes, each over the hashes
    in one range of values (equal hashes share a pass, so each count is complete)."""
    store = output_store(cfg)
    shards = [*prior, *new]
    total = sum(_rows(store, s) for s in shards)
    n_pass = max(1, -(-total // PASS_LINES))
    limit = np.zeros(len(cfg.sources), dtype=np.int64)
    for sid, ld in _settings(cfg).values():
        limit[sid] = ld.max_docs
    found = []
    for p in range(n_pass):
        parts = []
        for s in shards:
            h = _load(store, hashes_key(s))
            parts.append(h[h[:, 1] % np.uint64(n_pass) == p] if n_pass > 1 else h)
        pairs = np.concatenate(parts) if parts else np.zeros((0, 2), np.uint64)
        del parts
        pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
        start = np.ones(len(pairs), dtype=bool)
        start[1:] = (pairs[1:] != pairs[:-1]).any(axis=1)
        first = np.flatnonzero(start)
        docs = np.diff(np.append(first, len(pairs)))
        first = first[docs > limit[pairs[first, 0].astype(np.int64)]]
        found.append(pairs[first])
        del pairs
    common = np.concatenate(found) if found else np.zeros((0, 2), np.uint64)
    common = common[np.lexsort((common[:, 1], common[:, 0]))]  # the same for any n_pass
    _save(version_store(cfg), COMMON_KEY, common)
    return len(common)


def _common_by_source(cfg: PrepConfig) -> dict[int, np.ndarray]:
    """The common lines' hashes per source id, sorted."""
    common = _load(version_store(cfg), COMMON_KEY)
    if not len(common):  # no line was common enough anywhere
        return {}
    sids, starts = np.unique(common[:, 0], return_index=True)
    ends = [*starts[1:], len(common)]
    return {int(sid): common[a:b, 1] for sid, a, b in zip(sids, starts, ends, strict=True)}


def _strip_common(text: str, common: np.ndarray, min_chars: int) -> tuple[str, int]:
    """The text without its common lines, and how many lines went."""
    lines = text.split("\n")
    hashes = [_line_hash(line, min_chars) for line in lines]
    cand = [i for i, h in enumerate(hashes) if h is not None]
    if not cand:
        return text, 0
    arr = np.array([hashes[i] for i in cand], dtype=np.uint64)
    pos = np.minimum(np.searchsorted(common, arr), len(common) - 1)
    hit = {i for i, found in zip(cand, common[pos] == arr, strict=True) if found}
    if not hit:
        return text, 0
    return "\n".join(line for i, line in enumerate(lines) if i not in hit), len(hit)


def apply_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    store = output_store(cfg)
    docs = read_docs(store, input_stage, shard)
    nbytes = pc.binary_length(docs["text"]).to_pylist()
    ids, texts, sources, metas = (docs[c].to_pylist() for c in ("id", "text", "source", "meta"))
    settings = _settings(cfg)
    by_source = _common_by_source(cfg)
    stats = ShardStats()
    dropped = DroppedRows()
    removed: dict[str, int] = {}
    kept: dict[str, list[str]] = {"id": [], "text": [], "source": [], "meta": []}
    for row, text in enumerate(texts):
        src = sources[row]
        st = stats[src]
        st.add_in(nbytes[row])
        out, n = text, 0
        if src in settings:
            sid, ld = settings[src]
            if sid in by_source:
                out, n = _strip_common(text, by_source[sid], ld.min_line_chars)
        if n:
            removed[src] = removed.get(src, 0) + n
        if n and not out.strip():
            st.add_dropped(EMPTY, nbytes[row])
            dropped.add(
                ids[row],
                src,
                EMPTY,
                f"{n} common lines removed",
                doc_location(metas[row], shard, row),
                text,
            )
            continue
        st.add_kept(nbytes[row] if not n else len(out.encode("utf-8")))
        kept["id"].append(ids[row])
        kept["text"].append(out)
        kept["source"].append(src)
        kept["meta"].append(metas[row])
    return write_shard(
        store,
        STAGE,
        shard,
        pa.table(kept, schema=DOC_SCHEMA),
        dropped,
        stats,
        {"lines_removed": dict(sorted(removed.items()))},
    )


def summary(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    """The report's entry: per source, the common lines found over the version and the
    lines removed from this run's documents."""
    names = {sid: name for name, (sid, _ld) in _settings(cfg).items()}
    common = {names[sid]: len(h) for sid, h in _common_by_source(cfg).items()}
    store = output_store(cfg)
    removed: dict[str, int] = {}
    for shard in shards:
        for src, n in read_done(store, STAGE, shard).get("lines_removed", {}).items():
            removed[src] = removed.get(src, 0) + n
    return {
        "common_lines": dict(sorted(common.items())),
        "lines_removed": dict(sorted(removed.items())),
    }
