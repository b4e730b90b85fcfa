"""Exact substring dedup (dataprep/substring.py has the algorithm and its semantics): spans
of at least `min_tokens` units repeated anywhere in the corpus, over every dataset version,
are cut out of the documents; a document left shorter than `min_doc_chars` is dropped as
`substring_dup`. Steps, each bounded by `dedup.substring.max_memory`:

    hash   (per shard)      every window's hash, one entry per distinct hash with its first
                            position, sorted and split by the hash's top bits into files
                            substring/windows/<shard>/BB-IIIII.npy (sorted a range of hash
                            values at a time, from local scratch, when the shard's windows
                            exceed the bound)
    select (per partition)  a range of hash values over every shard of the version: the
                            repeated hashes and the occurrence that stays ->
                            substring/dups/<shard>/BB-QQQQQ.npy for this run's shards; the
                            number of partitions is chosen from the hash step's counts, so
                            no partition holds more entries than the bound allows
    apply  (per shard)      cut the marked windows' byte ranges; documents, accounting,
                            substring/removed/<shard>.npy (bytes removed per kept row, for
                            the provenance)

Earlier versions' shards take part in select (their hash files are kept) and come first in
input order; they lose nothing themselves."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.store import Store
from dataprep import substring as sub
from dataprep.config import PrepConfig, SubstringDedupConfig
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

STAGE = "substring"
REASON = "substring_dup"
# The provenance statistic (core/provenance.py) of each kept document: bytes this stage cut.
PROVENANCE_STAT = "substring.removed_bytes"
# Bytes of working memory per entry at the step's peak: the hash step holds hash and
# position (16), the stable sort's index (8), the sorted copies (16) and the distinct
# entries (up to 16 more); select holds hash, position and shard (20), the sort's index,
# the sorted copies and the repeated entries it returns (up to 20 more).
HASH_ENTRY_BYTES = 64
SELECT_ENTRY_BYTES = 80
APPLY_ENTRY_BYTES = 48  # a repeated hash and its kept position (16), the bitmap (<= 32)
# Taken off max_memory before entries: the worker's interpreter and libraries (~200 MiB
# of RSS with pyarrow and numpy loaded) and a batch's temporaries (~60 bytes per byte of
# sub.BATCH_BYTES).
FIXED_BYTES = 256 << 20
MIN_ENTRIES = 1 << 12  # however small the bound, a pass holds at least this many
FILE_ENTRIES = 1 << 20  # entries per hash file at most (16 MiB): select reads whole files
MAX_BITS = 20  # at most 2**20 partitions (a corpus of ~10**13 windows at 1 GiB)


def settings(cfg: PrepConfig) -> SubstringDedupConfig:
    s = cfg.dedup.substring
    assert s is not None
    return s


def enabled(cfg: PrepConfig) -> bool:
    return cfg.dedup.substring is not None


def windows_key(shard: str) -> str:
    """The hash step's marker for a shard (its files' bits and entry counts): written
    last, so its presence means the shard's hash files are complete."""
    return f"substring/windows/{shard}.json"


def bucket_key(shard: str, bits: int, idx: int) -> str:
    return f"substring/windows/{shard}/{bits:02d}-{idx:05d}.npy"


def dups_key(shard: str, part: str) -> str:
    return f"substring/dups/{shard}/{part}.npy"


def select_key(part: str) -> str:
    return f"substring/select/{part}.json"


def removed_key(shard: str) -> str:
    return f"substring/removed/{shard}.npy"


def _save(store: Store, key: str, arr: np.ndarray) -> int:
    buf = io.BytesIO()
    np.save(buf, arr)
    data = buf.getvalue()
    store.put(key, data)
    return len(data)


def _load(store: Store, key: str) -> np.ndarray:
    return np.load(io.BytesIO(store.get(key)))


def _entries(budget: int, per_entry: int) -> int:
    return max(MIN_ENTRIES, (budget - FIXED_BYTES) // per_entry)


def _bits_for(n: int, cap: int) -> int:
    """The fewest top bits that split n uniformly spread entries into parts of <= cap."""
    bits = 0
    while bits < MAX_BITS and n > cap << bits:
        bits += 1
    return bits


def _top(h: np.ndarray, bits: int) -> np.ndarray:
    """The top `bits` bits of each hash (0 when bits is 0: a shift by 64 is undefined)."""
    if bits == 0:
        return np.zeros(len(h), dtype=np.uint64)
    return h >> np.uint64(64 - bits)


def hash_shard(cfg: PrepConfig, input_stage: str, shard: str) -> int:
    """Write the shard's distinct window hashes with their first positions (see the
    module docstring). Returns the number of windows."""
    s = settings(cfg)
    store = output_store(cfg)
    column = read_docs(store, input_stage, shard).column("text")
    units = sum(sub.count_units(d, o, s.unit) for _, d, o in sub.batches(column))
    cap = _entries(s.max_memory - column.nbytes, HASH_ENTRY_BYTES)
    pass_bits = _bits_for(units, cap)
    bits = max(pass_bits, _bits_for(units, FILE_ENTRIES))
    counts = np.zeros(1 << bits, dtype=np.int64)
    disk = 0
    with tempfile.TemporaryDirectory(prefix="ballast-substring-") as scratch:
        n_windows, passes = _window_runs(cfg, column, pass_bits, scratch)
        for p, entries in enumerate(passes):
            h, pos = sub.distinct(entries[:, 0], entries[:, 1])
            del entries
            # The pass's hashes are sorted, so each file's entries are one slice.
            first = p << (bits - pass_bits)
            idx = np.arange(first, first + (1 << (bits - pass_bits)), dtype=np.uint64)
            cuts = np.searchsorted(_top(h, bits), np.append(idx, idx[-1] + np.uint64(1)))
            for i, a, b in zip(idx.tolist(), cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
                counts[i] = b - a
                if b > a:
                    disk += _save(
                        store, bucket_key(shard, bits, i), np.stack([h[a:b], pos[a:b]], 1)
                    )
    marker = {
        "bits": bits,
        "counts": counts.tolist(),
        "windows": n_windows,
        "distinct": int(counts.sum()),
        "passes": 1 << pass_bits,
        "disk_bytes": disk,
    }
    store.put(windows_key(shard), json.dumps(marker, sort_keys=True).encode())
    return n_windows


def _window_runs(
    cfg: PrepConfig, column: pa.ChunkedArray, pass_bits: int, scratch: str
) -> tuple[int, Iterator[np.ndarray]]:
    """Every window's (hash, position), as one (n, 2) array per pass (range of hash
    values), and the number of windows. The text is hashed once: with one pass the entries
    stay in memory; with more, each goes to its pass's file in local `scratch`, and a pass
    reads back only its own."""
    s = settings(cfg)
    hasher = sub.Hasher(cfg.seed)
    n_passes = 1 << pass_bits
    mem: list[np.ndarray] = []
    n_windows = 0
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(open(os.path.join(scratch, f"{p:05d}"), "wb"))
            for p in range(n_passes if n_passes > 1 else 0)
        ]
        for row0, data, off in sub.batches(column):
            w = sub.windows(hasher, data, off, s.min_tokens, s.unit)
            n_windows += len(w.hash)
            entries = np.stack([w.hash, sub.positions(row0 + w.doc, w.index)], 1)
            if not files:
                mem.append(entries)
                continue
            top = _top(w.hash, pass_bits)
            order = np.argsort(top, kind="stable")
            entries, top = entries[order], top[order]
            cuts = np.searchsorted(top, np.arange(n_passes + 1, dtype=np.uint64))
            for p, f in enumerate(files):
                entries[cuts[p] : cuts[p + 1]].tofile(f)

    def passes() -> Iterator[np.ndarray]:
        if n_passes == 1:
            # Handed out without a reference kept here: the caller frees it when done.
            one = [np.concatenate(mem) if mem else np.zeros((0, 2), np.uint64)]
            mem.clear()
            yield one.pop()
            return
        for p in range(n_passes):
            path = os.path.join(scratch, f"{p:05d}")
            yield np.fromfile(path, dtype=np.uint64).reshape(-1, 2)
            os.unlink(path)

    return n_windows, passes()


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _marker(store: Store, shard: str) -> dict[str, Any]:
    return json.loads(store.get(windows_key(shard)))


def _estimate(markers: list[dict[str, Any]], bits: int) -> np.ndarray:
    """Entries each of the 2**bits partitions would hold: exact where a shard's files are
    as fine, else its file's count split evenly (its hashes are distinct, so uniform)."""
    out = np.zeros(1 << bits, dtype=np.float64)
    for m in markers:
        c = np.asarray(m["counts"], dtype=np.float64)
        b = int(m["bits"])
        if bits <= b:
            out += c.reshape(1 << bits, -1).sum(axis=1)
        else:
            out += np.repeat(c / (1 << (bits - b)), 1 << (bits - b))
    return out


def plan(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    """How select splits the hash values (once every shard is hashed): into 2**bits
    ranges by top bits, the fewest such that no range holds more entries than
    max_memory allows."""
    store = output_store(cfg)
    markers = [_marker(store, s) for s in shards]
    cap = _entries(settings(cfg).max_memory, SELECT_ENTRY_BYTES)
    bits = 0
    while bits < MAX_BITS and _estimate(markers, bits).max(initial=0) > cap:
        bits += 1
    return {"partition_bits": bits}


def partitions(planned: dict[str, Any]) -> list[str]:
    """The select step's items, "BB-QQQQQ": range QQQQQ of 2**BB."""
    bits = int(planned["partition_bits"])
    return [f"{bits:02d}-{q:05d}" for q in range(1 << bits)]


def _part_range(part: str) -> tuple[int, int]:
    bits, q = part.split("-")
    return int(bits), int(q)


def _read_part(store: Store, shard: str, marker: dict[str, Any], bits: int, q: int):
    """The shard's entries whose hashes fall in partition q of 2**bits: whole files where
    they are finer, a filtered file where coarser."""
    b = int(marker["bits"])
    if bits <= b:
        files = range(q << (b - bits), (q + 1) << (b - bits))
    else:
        files = range(q >> (bits - b), (q >> (bits - b)) + 1)
    parts = [_load(store, bucket_key(shard, b, i)) for i in files if marker["counts"][i]]
    arr = np.concatenate(parts) if parts else np.zeros((0, 2), np.uint64)
    if bits > b:
        arr = arr[_top(arr[:, 0], bits) == np.uint64(q)]
    return arr


def select(cfg: PrepConfig, prior: list[str], new: list[str], part: str) -> int:
    """Find the repeated hashes of one partition over every shard of the version (earlier
    versions' first, in input order) and write, for each of this run's shards that holds
    some, its list: hash and the position that stays (sub.NONE: none)."""
    s = settings(cfg)
    store = output_store(cfg)
    bits, q = _part_range(part)
    shards = [*prior, *new]
    hs, ps, gs = [], [], []
    for g, shard in enumerate(shards):
        arr = _read_part(store, shard, _marker(store, shard), bits, q)
        hs.append(arr[:, 0])
        ps.append(arr[:, 1])
        gs.append(np.full(len(arr), g, dtype=np.int32))
    h = _cat(hs, np.uint64)
    del hs
    p = _cat(ps, np.uint64)
    del ps
    g = _cat(gs, np.int32)
    del gs
    entries = len(h)
    shard_of, dup_h, keep = sub.select(h, p, g, s.keep == "first")
    del h, p, g
    n_new = 0
    # Entries come sorted by hash; a stable sort by shard keeps each shard's list sorted.
    order = np.argsort(shard_of, kind="stable")
    shard_of, dup_h, keep = shard_of[order], dup_h[order], keep[order]
    cuts = np.searchsorted(shard_of, np.arange(len(shards) + 1))
    for gi in range(len(prior), len(shards)):
        a, b = int(cuts[gi]), int(cuts[gi + 1])
        if b > a:
            _save(store, dups_key(shards[gi], part), np.stack([dup_h[a:b], keep[a:b]], 1))
            n_new += b - a
    repeated = len(np.unique(dup_h))
    record = {"entries": entries, "repeated_hashes": repeated, "new_entries": n_new}
    version_store(cfg).put(select_key(part), json.dumps(record, sort_keys=True).encode())
    return repeated


def shard_dups(
    store: Store, shard: str, cap: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The shard's repeated hashes and, for each, the position that stays: in groups of
    whole partition files of at most `cap` entries (a file alone may be more: select
    bounded it), each sorted by hash. None: one group."""
    prefix = f"substring/dups/{shard}/"
    sizes = store.list_sizes(prefix)
    group: list[str] = []
    held = 0
    for key in sorted(k for k in sizes if k.endswith(".npy")):
        n = sizes[key] // 16  # 16 bytes an entry (and a header of less than one entry)
        if group and cap is not None and held + n > cap:
            yield _dups(store, group)
            group, held = [], 0
        group.append(key)
        held += n
    if group:
        yield _dups(store, group)


def _dups(store: Store, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    arr = np.concatenate([_load(store, k) for k in keys])
    return arr[:, 0].copy(), arr[:, 1].copy()


def removed_ranges(
    cfg: PrepConfig,
    column: pa.ChunkedArray,
    dups: Iterable[tuple[np.ndarray, np.ndarray]],
) -> dict[int, list[tuple[int, int]]]:
    """Per row with marked windows: the byte ranges to remove (merged, sorted; in bytes
    mode shrunk to whole characters). `dups`: groups of repeated hashes (sorted) with the
    position that stays, each group's windows marked in a pass of its own (a union of
    the passes' ranges is the union of all), so only one group is held at a time."""
    s = settings(cfg)
    hasher = sub.Hasher(cfg.seed)
    rows, starts, ends = [], [], []
    for dup_hash, dup_keep in dups:
        repeated = sub.Repeated(dup_hash, dup_keep)
        for row0, data, off in sub.batches(column):
            w = sub.windows(hasher, data, off, s.min_tokens, s.unit)
            m = repeated.marked(w, row0 + w.doc)
            if m.any():
                d, a, b = sub.union(w.doc[m], w.start[m], w.end[m])
                rows.append(d + row0)
                starts.append(a)
                ends.append(b)
    if not rows:
        return {}
    d, a, b = sub.union(np.concatenate(rows), np.concatenate(starts), np.concatenate(ends))
    out: dict[int, list[tuple[int, int]]] = {}
    if s.unit == "bytes":  # whole characters only: the documents' bytes are needed
        edited = np.unique(d)
        texts = column.take(pa.array(edited, pa.int64())).to_pylist()
        data_of = {int(r): t.encode("utf-8") for r, t in zip(edited, texts, strict=True)}
    for r, x, y in zip(d.tolist(), a.tolist(), b.tolist(), strict=True):
        if s.unit == "bytes":
            x, y = sub.char_aligned(data_of[r], x, y)
            if x >= y:
                continue
        out.setdefault(r, []).append((x, y))
    return out


def apply_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    s = settings(cfg)
    store = output_store(cfg)
    docs = read_docs(store, input_stage, shard)
    # The text is held about three times (read, a new column for the edited documents, the
    # filtered table when some are dropped) beside the groups.
    cap = _entries(s.max_memory - 3 * docs.nbytes, APPLY_ENTRY_BYTES)
    ranges = removed_ranges(cfg, docs["text"], shard_dups(store, shard, cap))
    nbytes = pc.binary_length(docs["text"]).to_numpy(zero_copy_only=False)
    sources = docs["source"].to_pylist()
    edited_rows = sorted(ranges)
    texts = docs["text"].take(pa.array(edited_rows, pa.int64())).to_pylist() if edited_rows else []
    new_text: dict[int, str] = {}
    drop: dict[int, str] = {}
    per_source: dict[str, dict[str, int]] = {}
    for row, text in zip(edited_rows, texts, strict=True):
        rs = ranges[row]
        out = sub.cut(text.encode("utf-8"), rs).decode("utf-8")
        n_removed = int(nbytes[row]) - len(out.encode("utf-8"))
        src = per_source.setdefault(
            sources[row], {"edited": 0, "bytes_removed": 0, "spans_removed": 0}
        )
        if len(out.strip()) < s.min_doc_chars:
            drop[row] = f"{n_removed} bytes in {len(rs)} repeated spans removed, " + (
                f"{len(out.strip())} characters left"
            )
            continue
        new_text[row] = out
        src["edited"] += 1
        src["bytes_removed"] += n_removed
        src["spans_removed"] += len(rs)
    del texts
    stats = ShardStats()
    dropped = DroppedRows()
    keep = np.ones(docs.num_rows, dtype=bool)
    if drop:
        keep[list(drop)] = False
    kept_bytes = nbytes.astype(np.int64).copy()
    removed = np.zeros(docs.num_rows, dtype=np.int64)
    for row, text in new_text.items():
        kept_bytes[row] = len(text.encode("utf-8"))
        removed[row] = int(nbytes[row]) - kept_bytes[row]
    for row in range(docs.num_rows):
        st = stats[sources[row]]
        st.add_in(int(nbytes[row]))
        if keep[row]:
            st.add_kept(int(kept_bytes[row]))
        else:
            st.add_dropped(REASON, int(nbytes[row]))
    if drop:
        rows = sorted(drop)
        taken = docs.take(pa.array(rows, pa.int64()))
        for k, row in enumerate(rows):
            dropped.add(
                taken["id"][k].as_py(),
                sources[row],
                REASON,
                drop[row],
                doc_location(taken["meta"][k].as_py(), shard, row),
                taken["text"][k].as_py(),
            )
    # Each copy of the text is a shard's worth of memory: a new text column only when a
    # document changed, a filtered table only when one was dropped, no combined chunks.
    kept = docs.select(DOC_SCHEMA.names)
    del docs
    if new_text:
        values = [new_text.pop(r, None) for r in range(kept.num_rows)]
        col = pc.coalesce(pa.array(values, pa.string()), kept["text"])
        del values
        kept = kept.set_column(kept.schema.get_field_index("text"), "text", col)
        del col
    if drop:
        kept = kept.filter(pa.array(keep))
    _save(store, removed_key(shard), removed[keep])
    return write_shard(
        store,
        STAGE,
        shard,
        kept,
        dropped,
        stats,
        {"substring": dict(sorted(per_source.items()))},
    )


def removed_bytes(store: Store, shard: str) -> np.ndarray:
    """Bytes the stage removed from each document it kept of `shard`, in its order."""
    return _load(store, removed_key(shard))


def summary(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    """The report's entry: per source, documents edited, bytes and spans removed from this
    run's documents; the partitions select used, the repeated hashes it found, and the
    bytes of window hashes the run's shards keep on disk (for later versions)."""
    store = output_store(cfg)
    edits: dict[str, dict[str, int]] = {}
    disk, windows = 0, 0
    for shard in shards:
        for src, c in read_done(store, STAGE, shard).get("substring", {}).items():
            e = edits.setdefault(src, {"edited": 0, "bytes_removed": 0, "spans_removed": 0})
            for k in e:
                e[k] += int(c.get(k, 0))
        m = _marker(store, shard)
        disk += int(m["disk_bytes"])
        windows += int(m["windows"])
    vstore = version_store(cfg)
    parts = sorted(k for k in vstore.list("substring/select/") if k.endswith(".json"))
    records = [json.loads(vstore.get(k)) for k in parts]
    s = settings(cfg)
    return {
        "unit": s.unit,
        "min_tokens": s.min_tokens,
        "keep": s.keep,
        "windows": windows,
        "partitions": len(records),
        "max_partition_entries": max((r["entries"] for r in records), default=0),
        "repeated_hashes": sum(r["repeated_hashes"] for r in records),
        "hash_disk_bytes": disk,
        "sources": dict(sorted(edits.items())),
    }
