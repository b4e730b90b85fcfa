"""Exact substring deduplication (Lee et al. 2022, "Deduplicating Training Data Makes Language
Models Better"), the algorithm without I/O; dataprep/stages/substring.py runs it over shards.

A *window* is `k` consecutive units of one document: whitespace-separated tokens (runs of
bytes other than ASCII space, \\t, \\n, \\r, \\v, \\f; two windows are equal when their tokens
are, whatever whitespace separates them) or UTF-8 bytes. A window never crosses a document
boundary. Every window gets a 64-bit hash; a window whose hash occurs more than once in the
corpus is *repeated*. Which occurrences are *marked*:

    keep="none"   every occurrence of a repeated window (as google-research's
                  deduplicate-text-datasets: self-similar lists every position, collect
                  unites them)
    keep="first"  every occurrence but the first in input order (shard order, then row,
                  then position in the document)

A document loses the union of its marked windows' byte ranges (a token window covers its
first token's first byte to its last token's last byte; the whitespace around it stays).
In bytes mode each merged range is then shrunk to whole characters, so what remains is
valid UTF-8 and no byte outside a marked window is ever removed.

Hashes are polynomial hashes mod 2**64 over per-byte random values, position-normalised
so that equal content hashes alike wherever it is, and finished by splitmix64. Computed
with prefix sums over a batch of documents: O(1) numpy work per byte, whatever `k`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

U64 = np.uint64
# The bytes that separate tokens (str.split's ASCII whitespace; other Unicode spaces are
# token bytes: the kernel works on UTF-8 bytes and never decodes).
WHITESPACE = b" \t\n\r\x0b\x0c"
_WS = np.zeros(256, dtype=bool)
_WS[list(WHITESPACE)] = True
# A window's position: the document's row in its shard (high 32 bits, < 2**31) and the
# window's index in the document (low 32 bits); bit 63 says "seen again in this shard".
ROW_SHIFT = U64(32)
REPEATED = U64(1 << 63)
NONE = U64((1 << 64) - 1)  # no occurrence is kept (keep: none, or the first is elsewhere)
# Bytes of text hashed at once (more for a longer document): each byte costs ~60 bytes
# of temporaries in bytes mode, ~30 in tokens mode.
BATCH_BYTES = 1 << 20


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit spread over the word."""
    x = x ^ (x >> U64(30))
    x = x * U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> U64(27))
    x = x * U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


class Hasher:
    """The random byte values and odd bases one corpus is hashed with (from the seed, so
    every shard and every dataset version agree), and their powers mod 2**64."""

    def __init__(self, seed: int):
        rng = np.random.default_rng([seed, 0x5B57])
        self.table = rng.integers(0, 1 << 64, 256, dtype=np.uint64)
        self.byte_base = int(rng.integers(0, 1 << 63)) * 2 + 1  # odd: invertible mod 2**64
        self.unit_base = int(rng.integers(0, 1 << 63)) * 2 + 1
        self._powers: dict[int, np.ndarray] = {}

    def powers(self, base: int, n: int) -> np.ndarray:
        """base**0 .. base**(n-1) mod 2**64 (base may be an inverse)."""
        have = self._powers.get(base)
        if have is None or len(have) < n:
            p = np.full(max(n, 1024), base, dtype=np.uint64)
            p[0] = 1
            have = self._powers[base] = np.cumprod(p, dtype=np.uint64)
        return have[:n]

    def segments(self, values: np.ndarray, base: int, starts: np.ndarray, ends: np.ndarray):
        """Hash of values[s:e] for each (s, e): sum values[q] * base**(q - s), so equal
        content hashes alike at any position."""
        n = len(values)
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(values * self.powers(base, n), out=prefix[1:])
        inv = pow(base, -1, 1 << 64)
        return (prefix[ends] - prefix[starts]) * self.powers(inv, n + 1)[starts]


@dataclass
class Windows:
    """The windows of a batch of documents, in (document, position) order."""

    hash: np.ndarray  # uint64
    doc: np.ndarray  # int64: the document's index in the batch
    index: np.ndarray  # int64: the window's index in its document
    start: np.ndarray  # int64: byte offset of the window in its document
    end: np.ndarray  # int64: end byte offset (exclusive)


def tokens(data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end byte offsets (into `data`) of every token of the documents whose text
    is data[offsets[i]:offsets[i+1]]; a token never runs from one document into the next."""
    if len(data) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    n = len(data)
    word = np.zeros(n + 2, dtype=np.int8)  # 1 on token bytes, 0 around the batch
    word[1:-1] = ~_WS[data]
    edge = word[1:] - word[:-1]  # +1 where a token starts, -1 where one ended
    is_start, is_end = edge == 1, edge == -1
    # A token running over a document boundary is two: one ends there, one starts there.
    inner = offsets[1:-1]
    inner = inner[(inner > 0) & (inner < n)]
    split = inner[(word[inner] == 1) & (word[inner + 1] == 1)]
    is_start[split] = True
    is_end[split] = True
    return np.flatnonzero(is_start), np.flatnonzero(is_end)


def count_units(data: np.ndarray, offsets: np.ndarray, unit: str) -> int:
    """Units (tokens or bytes) of a batch: an upper bound on its windows."""
    return len(tokens(data, offsets)[0]) if unit == "tokens" else len(data)


def windows(hasher: Hasher, data: np.ndarray, offsets: np.ndarray, k: int, unit: str) -> Windows:
    """Every window of `k` units of the batch's documents (see the module docstring)."""
    values = hasher.table[data]
    if unit == "tokens":
        t_start, t_end = tokens(data, offsets)
        t_hash = _mix(hasher.segments(values, hasher.byte_base, t_start, t_end))
        t_doc = np.searchsorted(offsets, t_start, side="right") - 1
        m = len(t_start)
        if m < k:
            return _empty()
        j = np.arange(m - k + 1)
        j = j[t_doc[j + k - 1] == t_doc[j]]  # the window's tokens are all in one document
        h = _mix(hasher.segments(t_hash, hasher.unit_base, j, j + k) ^ U64(k))
        doc = t_doc[j]
        first_token = np.searchsorted(t_doc, np.arange(len(offsets) - 1), side="left")
        base = offsets[doc]
        return Windows(h, doc, j - first_token[doc], t_start[j] - base, t_end[j + k - 1] - base)
    lengths = np.diff(offsets)
    per_doc = np.maximum(lengths - k + 1, 0)
    total = int(per_doc.sum())
    if total == 0:
        return _empty()
    doc = np.repeat(np.arange(len(per_doc)), per_doc)
    index = np.arange(total) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
    p = offsets[doc] + index
    h = _mix(hasher.segments(values, hasher.byte_base, p, p + k) ^ U64(k))
    return Windows(h, doc, index, index, index + k)


def _empty() -> Windows:
    z = np.zeros(0, np.int64)
    return Windows(np.zeros(0, np.uint64), z, z, z, z)


def batches(column: pa.ChunkedArray | pa.Array) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """The column's text as (first row, UTF-8 bytes, offsets) batches of whole documents,
    about BATCH_BYTES each, read in place from the Arrow buffers."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    row0 = 0
    for chunk in chunks:
        n = len(chunk)
        if n == 0:
            continue
        _, off_buf, data_buf = chunk.buffers()
        width = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
        off = np.frombuffer(off_buf, dtype=width)[chunk.offset : chunk.offset + n + 1]
        off = off.astype(np.int64)
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else None
        a = 0
        while a < n:
            # the documents that fit in BATCH_BYTES from document a (at least one)
            b = int(np.searchsorted(off, off[a] + BATCH_BYTES, side="right")) - 1
            b = min(max(b, a + 1), n)
            lo, hi = int(off[a]), int(off[b])
            chunk_data = data[lo:hi] if data is not None else np.zeros(0, np.uint8)
            yield row0 + a, chunk_data, off[a : b + 1] - lo
            a = b
        row0 += n


def positions(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    return (rows.astype(np.uint64) << ROW_SHIFT) | index.astype(np.uint64)


def distinct(hashes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One entry per hash, sorted by hash: its first position (the least: positions
    ascend in input order), with REPEATED set when the hash occurs more than once."""
    if len(hashes) == 0:
        return hashes, pos
    order = np.argsort(hashes)  # quicksort: 4x a stable sort; ties are settled below
    h = hashes[order]
    start = np.ones(len(h), dtype=bool)
    start[1:] = h[1:] != h[:-1]
    firsts = np.flatnonzero(start)
    first_pos = np.minimum.reduceat(pos[order], firsts)
    again = np.diff(np.append(firsts, len(h))) > 1
    return h[firsts], first_pos | np.where(again, REPEATED, U64(0))


def select(
    hashes: np.ndarray, pos: np.ndarray, shard: np.ndarray, keep_first: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The repeated hashes among the shards' distinct entries (`shard`: each entry's
    shard index in input order; within a shard a hash appears once). Returns, for every
    entry of a repeated hash, in hash order: its shard, the hash, and the position in that
    shard to keep (its first occurrence, when it is the corpus's first and keep_first) or
    NONE."""
    order = np.argsort(hashes)  # quicksort; the first shard of each hash is found below
    h, p, s = hashes[order], pos[order], shard[order]
    start = np.ones(len(h), dtype=bool)
    start[1:] = h[1:] != h[:-1]
    firsts = np.flatnonzero(start)
    sizes = np.diff(np.append(firsts, len(h)))
    repeated = (sizes > 1) | ((p[firsts] & REPEATED) != 0)
    take = np.repeat(repeated, sizes)
    h, p, s = h[take], p[take], s[take]
    keep = np.full(len(h), NONE, dtype=np.uint64)
    if keep_first and len(h):
        starts = np.flatnonzero(np.diff(h, prepend=~h[:1]) != 0)
        lead = np.repeat(np.minimum.reduceat(s, starts), np.diff(np.append(starts, len(h))))
        first = s == lead  # the hash's entry in its first shard (one: distinct per shard)
        keep[first] = p[first] & ~REPEATED
    return s, h, keep


class Repeated:
    """A shard's repeated hashes (sorted) and, for each, the position that stays (NONE:
    none does), with a bitmap of their top bits: most windows are not repeated, and one
    bitmap probe turns them away faster than a binary search."""

    def __init__(self, hashes: np.ndarray, keep: np.ndarray):
        self.hash, self.keep = hashes, keep
        self.bits = min(26, max(10, len(hashes).bit_length() + 4))
        self.seen = np.zeros(1 << self.bits, dtype=bool)
        self.seen[hashes >> U64(64 - self.bits)] = True

    def marked(self, w: Windows, rows: np.ndarray) -> np.ndarray:
        """Which windows are marked; `rows`: each window's row in the shard."""
        out = np.zeros(len(w.hash), dtype=bool)
        if len(self.hash) == 0 or len(w.hash) == 0:
            return out
        cand = np.flatnonzero(self.seen[w.hash >> U64(64 - self.bits)])
        h = w.hash[cand]
        at = np.minimum(np.searchsorted(self.hash, h), len(self.hash) - 1)
        hit = self.hash[at] == h
        out[cand] = hit & (self.keep[at] != positions(rows[cand], w.index[cand]))
        return out


def union(doc: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Merge byte ranges per document (input in document order; within one, any order)
    into disjoint ranges, sorted. Returns (doc, start, end)."""
    if len(doc) == 0:
        return doc, start, end
    order = np.lexsort((start, doc))
    d, s, e = doc[order], start[order], end[order]
    # Running maximum of the ends within each document: a range opens a new merged one
    # when it starts past every earlier range's end.
    key = d.astype(np.int64) * (int(e.max()) + 1)
    reach = np.maximum.accumulate(key + e) - key
    new = np.ones(len(d), dtype=bool)
    new[1:] = (d[1:] != d[:-1]) | (s[1:] > reach[:-1])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(d)) - 1
    return d[starts], s[starts], reach[ends]


def char_aligned(data: bytes, start: int, end: int) -> tuple[int, int]:
    """[start, end) shrunk to whole UTF-8 characters of `data`."""
    while start < end and (data[start] & 0xC0) == 0x80:
        start += 1
    while end > start and end < len(data) and (data[end] & 0xC0) == 0x80:
        end -= 1
    return start, end


def cut(data: bytes, ranges: list[tuple[int, int]]) -> bytes:
    """`data` without the (disjoint, sorted) byte ranges."""
    out, at = [], 0
    for s, e in ranges:
        out.append(data[at:s])
        at = e
    out.append(data[at:])
    return b"".join(out)


_TOKEN = re.compile(rb"[^ \t\n\r\x0b\x0c]+")


def reference_ranges(docs: list[str], k: int, unit: str, keep: str) -> list[list[tuple[int, int]]]:
    """The semantics above, executed literally: every window compared by content (no hash),
    in a dict. Memory grows with the corpus times k: for tests and benchmarks only."""
    occurrences: list[tuple[object, int, int, int]] = []
    for d, text in enumerate(docs):
        b = text.encode("utf-8")
        if unit == "tokens":
            toks = [(m.start(), m.end(), m.group()) for m in _TOKEN.finditer(b)]
            for i in range(len(toks) - k + 1):
                key = tuple(t[2] for t in toks[i : i + k])
                occurrences.append((key, d, toks[i][0], toks[i + k - 1][1]))
        else:
            occurrences += [(b[i : i + k], d, i, i + k) for i in range(len(b) - k + 1)]
    count = Counter(o[0] for o in occurrences)
    seen: set[object] = set()
    marks: list[list[tuple[int, int]]] = [[] for _ in docs]
    for key, d, s, e in occurrences:
        if count[key] < 2:
            continue
        if keep == "first" and key not in seen:
            seen.add(key)
            continue
        marks[d].append((s, e))
    out = []
    for d, ms in enumerate(marks):
        merged: list[list[int]] = []
        for s, e in sorted(ms):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        spans = [(s, e) for s, e in merged]
        if unit == "bytes":
            b = docs[d].encode("utf-8")
            spans = [r for r in (char_aligned(b, s, e) for s, e in spans) if r[0] < r[1]]
        out.append(spans)
    return out
