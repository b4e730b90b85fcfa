"""Near deduplication with MinHash LSH, in steps that each run shard by shard or band by
band, exchanging files:

    signatures (per shard)  LSH band keys -> near/sig/<shard>.npz, shingle sets ->
               near/shingles/<shard>.npz
    buckets    (per band group)  documents sharing a band key -> near/buckets/band-XXX.npz
    cluster    (once)  union-find over bucket members, each link confirmed by the exact
               Jaccard of the two shingle sets -> near/dups/<shard>.parquet
    apply      (per shard)  drop every document that is not its cluster's first one

No step compares all pairs, and none holds the corpus text: buckets hold 16 bytes per
document and band, clustering loads shingle sets of candidate documents shard by shard.
"""

from __future__ import annotations

import io
import json
import os
import struct
import tempfile
import zipfile
from array import array
from collections.abc import Callable, Iterable
from functools import partial
from typing import BinaryIO

import numpy as np

from core.store import Store, open_file
from dataprep import dedup_index, minhash, native
from dataprep.config import NearDedupConfig, PrepConfig
from dataprep.layout import output_store, read_docs, version_store
from dataprep.stages.exact import apply_dups, write_dups
from dataprep.stages.near_index import (
    _band_name,
    _npz,
    _npz_member,
    bucket_key,
    bucket_with_index,
    sig_key,
)

STAGE = "near"
CLUSTER_KEY = "near/cluster.json"
BATCH_DOCS = 1000
# Earlier members of its bucket a member is checked against, at most (cluster's loop).
MAX_CHECKS = 8
# Texts are shingled from their first MAX_CHARS characters: enough to judge
# near-duplication, and one gigantic document cannot blow up a batch.
MAX_CHARS = 1_000_000


def shingles_key(shard: str) -> str:
    """Shingle sets of a shard (about the size of its text; only clustering reads them,
    and only for candidate documents)."""
    return f"near/shingles/{shard}.npz"


def bands_rows(near: NearDedupConfig) -> tuple[int, int]:
    if near.bands and near.rows:
        return near.bands, near.rows
    return minhash.choose_bands(near.threshold, near.num_perm, near.recall_at_threshold)


def _load_npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as z:
        return {k: z[k] for k in z.files}


def signature_shard(cfg: PrepConfig, input_stage: str, shard: str) -> int:
    near = cfg.dedup.near
    assert near is not None
    store = output_store(cfg)
    column = read_docs(store, input_stage, shard).column("text")
    bands, rows = bands_rows(near)
    a, b = minhash.permutations(near.num_perm, cfg.seed)
    sh_parts, off_parts, key_parts = [], [np.zeros(1, dtype=np.int64)], []
    base = 0
    # Batches of the Arrow column (slices, no copy): the native kernel reads the text in
    # place; without it, shingle_hashes_column makes the batch's Python strings. Every
    # result is per document, so where the batches fall changes no output.
    batches = (
        chunk.slice(i, BATCH_DOCS)
        for chunk in column.chunks
        for i in range(0, len(chunk), BATCH_DOCS)
    )
    for batch in batches:
        sh, off = minhash.shingle_hashes_column(batch, near.ngram, MAX_CHARS)
        sig = minhash.signatures(sh, off, a, b)
        key_parts.append(minhash.band_keys(sig, bands, rows))
        sh_parts.append(sh)
        off_parts.append(off[1:] + base)
        base += len(sh)
    keys = np.concatenate(key_parts) if key_parts else np.zeros((0, bands), np.uint64)
    shingles = np.concatenate(sh_parts) if sh_parts else np.zeros(0, np.uint32)
    # A document with no words gets no band keys: an empty set is nobody's near-duplicate.
    empty = np.diff(np.concatenate(off_parts)) == 0
    store.put(shingles_key(shard), _npz(shingles=shingles, offsets=np.concatenate(off_parts)))
    # One member per band: bucketing reads one band of every shard at a time.
    store.put(
        sig_key(shard),
        _npz(
            empty=empty, **{_band_name(b): np.ascontiguousarray(keys[:, b]) for b in range(bands)}
        ),
    )
    return len(column)


def band_groups(cfg: PrepConfig, per_task: int = 5) -> list[list[int]]:
    assert cfg.dedup.near is not None
    bands, _ = bands_rows(cfg.dedup.near)
    return [list(range(i, min(i + per_task, bands))) for i in range(0, bands, per_task)]


# Documents one bucketing pass sorts at once. A larger corpus is bucketed in passes over
# ranges of key values, so memory stays bounded however many documents there are.
BUCKET_PASS_DOCS = 1 << 21


def bucket_bands(cfg: PrepConfig, prior: list[str], new: list[str], bands: list[int]) -> int:
    """Group documents by band key for the given bands, one band at a time; keep groups
    of two or more, in key order and, inside a group, in input order. Each band is sorted
    in passes over ranges of key values (a pass's index grows with the key, so the passes
    concatenated are in key order): memory holds at most BUCKET_PASS_DOCS keys and their
    sort, not one band of the whole corpus.

    `prior`: the shards of earlier dataset versions (their signatures are the index new
    documents are deduplicated against), first in input order. Only groups holding a new
    document are kept: earlier versions never change, so their own groups decide nothing.

    With earlier versions, their band keys are looked up in the dedup index
    (dataprep/stages/near_index.py) instead of read whole: the same files come out. This
    path (BALLAST_DEDUP_INDEX=0) is its oracle."""
    if prior and dedup_index.enabled():
        groups = bucket_with_index(cfg, prior, new, bands)
        if groups is not None:
            return groups
    store = output_store(cfg)
    shards = [*prior, *new]
    live: list[np.ndarray] = []  # rows with band keys (not empty), per shard
    bases: list[int] = []
    base = 0
    for s in shards:
        empty = _npz_member(store, sig_key(s), "empty")
        live.append(np.flatnonzero(~empty))
        bases.append(base)
        base += len(empty)
    first_new = bases[len(prior)] if new else base
    n_live = sum(len(r) for r in live)
    n_pass = max(1, -(-n_live // BUCKET_PASS_DOCS))
    groups = 0
    for band in bands:
        member_parts: list[np.ndarray] = []
        size_parts: list[np.ndarray] = []
        for p in range(n_pass):
            keys, docs = [], []
            for s, rows, b0 in zip(shards, live, bases, strict=True):
                k = _npz_member(store, sig_key(s), _band_name(band))[rows]
                if n_pass > 1:
                    # (key * n_pass) >> 64, without overflow: monotonic in the key
                    sel = ((k >> np.uint64(32)) * np.uint64(n_pass)) >> np.uint64(32) == p
                    k, r = k[sel], rows[sel]
                else:
                    r = rows
                keys.append(k)
                docs.append(r + b0)
            key = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
            doc = np.concatenate(docs) if docs else np.zeros(0, np.int64)
            del keys, docs
            # by key, then input order inside a bucket (doc ascends: a stable sort keeps it)
            order = np.argsort(key, kind="stable")
            key, members = key[order], doc[order]
            del order, doc
            new = np.ones(len(key), dtype=bool)
            new[1:] = key[1:] != key[:-1]
            del key
            starts = np.flatnonzero(new)
            sizes = np.diff(np.append(starts, len(new)))
            multi = sizes >= 2
            if prior:  # members ascend in a group: a new one is there iff the last is new
                multi &= members[starts + sizes - 1] >= first_new
            member_parts.append(members[np.repeat(multi, sizes)])
            size_parts.append(sizes[multi])
        sizes = np.concatenate(size_parts) if size_parts else np.zeros(0, np.int64)
        members = np.concatenate(member_parts) if member_parts else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        groups += len(sizes)
        version_store(cfg).put(bucket_key(band), _npz(members=members, offsets=offsets))
    return groups


def _group_hashes(members: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Two independent 64-bit hashes per bucket group (members are in input order, so a
    group's member list is canonical): equal hashes mean the same group of documents."""
    if len(offsets) < 2:
        return np.zeros((0, 2), np.uint64)
    m = members.astype(np.uint64)
    starts = offsets[:-1]
    with np.errstate(over="ignore"):
        h1 = np.add.reduceat(minhash._splitmix64(m), starts)
        h2 = np.add.reduceat(minhash._splitmix64(m ^ np.uint64(0x5BD1E9955BD1E995)), starts)
    h2 ^= np.diff(offsets).astype(np.uint64)
    return np.stack([h1, h2], axis=1)


def _new_groups(store: Store, bands: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Bucket groups in band order, each kept only at its first occurrence, as (members,
    offsets) per band, and every document in them."""
    return first_occurrences(
        (z["members"], z["offsets"])
        for z in (_load_npz(store.get(bucket_key(band))) for band in range(bands))
    )


def first_occurrences(
    per_band: Iterable[tuple[np.ndarray, np.ndarray]],
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Groups (members, offsets per band, in band order), each kept only at its first
    occurrence, and the sorted documents they hold. A group seen in an earlier band changes
    nothing when seen again (each of its links was tried, or found already made, in a state
    that has only merged since), and true duplicates share most of their bands, so this
    removes most of clustering's work without changing its result."""
    seen = np.zeros(0, dtype=np.dtype((np.void, 16)))
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for members, goff in per_band:
        h = np.ascontiguousarray(_group_hashes(members, goff)).view(np.dtype((np.void, 16))).ravel()
        fresh = ~np.isin(h, seen)
        seen = np.union1d(seen, h[fresh])
        sizes = np.diff(goff)
        out.append(
            (
                members[np.repeat(fresh, sizes)],
                np.concatenate([[0], np.cumsum(sizes[fresh])]).astype(np.int64),
            )
        )
    docs = np.unique(np.concatenate([m for m, _ in out])) if out else np.zeros(0, np.int64)
    return out, docs


def shard_sets(
    store: Store, shards: list[str], si: int, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows `rows` of shard `si`'s shingle sets, concatenated, and their lengths. Only
    those rows' sets are read, from a local file or by ranged reads of the object (an
    earlier version's shard is asked for the few documents a new one nearly copies, not
    its whole text's worth of sets)."""
    key = shingles_key(shards[si])
    with open_file(store, key) as f:
        got = _stored_rows(f, rows)
    if got is not None:
        return got
    z = _load_npz(store.get(key))
    sh, off = z["shingles"], z["offsets"]
    lens = off[rows + 1] - off[rows]
    parts = [sh[off[r] : off[r + 1]] for r in rows.tolist()]
    return (np.concatenate(parts).astype(np.uint32) if parts else np.zeros(0, np.uint32)), lens


def _stored_member(f: BinaryIO, info: zipfile.ZipInfo) -> tuple[int, tuple[int, ...], np.dtype]:
    """Where an uncompressed .npy member of an open .npz starts its data, its shape and
    dtype (np.savez stores members uncompressed: a slice of one is a ranged read)."""
    f.seek(info.header_offset + 26)
    name_len, extra_len = struct.unpack("<HH", f.read(4))
    f.seek(info.header_offset + 30 + name_len + extra_len)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, _fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, _fortran, dtype = np.lib.format.read_array_header_2_0(f)
    return f.tell(), shape, dtype


def _stored_rows(f: BinaryIO, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """shard_sets from an open shingles file by ranged reads: its zip directory, its
    offsets, then each row's set. None when the file is not laid out so (a compressed
    member)."""
    with zipfile.ZipFile(f) as zf:  # a file passed in stays open
        infos = {i.filename: i for i in zf.infolist()}
    wanted = ("shingles.npy", "offsets.npy")
    if any(n not in infos or infos[n].compress_type != zipfile.ZIP_STORED for n in wanted):
        return None
    at, shape, dtype = _stored_member(f, infos["offsets.npy"])
    f.seek(at)
    off = np.frombuffer(f.read(int(np.prod(shape)) * dtype.itemsize), dtype)
    at, _shape, sdtype = _stored_member(f, infos["shingles.npy"])
    lens = off[rows + 1] - off[rows]
    parts = []
    for r in rows.tolist():
        f.seek(at + int(off[r]) * sdtype.itemsize)
        parts.append(np.frombuffer(f.read(int(off[r + 1] - off[r]) * sdtype.itemsize), sdtype))
    sets = np.concatenate(parts).astype(np.uint32) if parts else np.zeros(0, np.uint32)
    return sets, lens


class _ShingleScratch:
    """Shingle sets of the candidate documents, copied once into a local scratch file
    laid out for random access (each shard's file is read once, whatever the order of
    the pairs), and read back by pread: memory stays at one shard's sets. A set is asked
    for by the candidate's rank in `docs` (sorted), so nothing here grows with the corpus."""

    def __init__(
        self,
        store: Store,
        shards: list[str],
        offsets: np.ndarray,
        docs: np.ndarray,
        path: str,
        sets: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
    ):
        """`sets(shard index, rows)`: those rows' sets concatenated and their lengths;
        by default from the shard's shingles file (a partitioned cluster reads its own
        pieces: dataprep/stages/near_parts.py)."""
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        bounds = np.zeros(len(docs) + 1, dtype=np.int64)
        pos = 0
        shard_of = np.searchsorted(offsets, docs, side="right") - 1  # ascending, as docs
        read = sets or partial(shard_sets, store, shards)
        for si in np.unique(shard_of).tolist():
            lo, hi = (int(x) for x in np.searchsorted(shard_of, [si, si + 1]))
            chunk, lens = read(si, docs[lo:hi] - offsets[si])
            os.pwrite(self.fd, chunk.tobytes(), pos * 4)
            bounds[lo + 1 : hi + 1] = pos + np.cumsum(lens)
            pos += len(chunk)
        # array.array: its scalar reads return Python ints, several times faster than numpy's
        self.bounds = array("q", bounds.tobytes())
        self.bounds_array = bounds  # for the compiled loop

    def get(self, r: int) -> np.ndarray:
        a, b = int(self.bounds[r]), int(self.bounds[r + 1])
        return np.frombuffer(os.pread(self.fd, (b - a) * 4, a * 4), dtype=np.uint32)

    def close(self) -> None:
        os.close(self.fd)


def cluster(
    cfg: PrepConfig,
    input_stage: str,
    prior: list[str],
    new: list[str],
    max_checks: int = MAX_CHECKS,
) -> dict:
    """Union-find over bucket members, documents of `input_stage` (the stage before this
    one in the graph). Each member is linked to an earlier member of its bucket whose
    exact Jaccard reaches the threshold (the bucket's first member first, then up to
    `max_checks` others), so a chance band collision never merges clusters.
    The document that stays is the cluster's first in input order: an earlier version's
    document (`prior` shards come first) when the cluster has one; only documents of the
    `new` shards are ever dropped."""
    near = cfg.dedup.near
    assert near is not None
    store = output_store(cfg)
    shards = [*prior, *new]
    counts = [len(_npz_member(store, sig_key(s), "empty")) for s in shards]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    bands, rows = bands_rows(near)
    groups, docs = _new_groups(version_store(cfg), bands)
    # Union-find over the candidates only (bucket members), by their rank in `docs`: its
    # memory follows the documents that have a near copy, not the corpus. Ranks keep input
    # order, so the smallest rank of a set is its first document.
    groups = [(np.searchsorted(docs, m), o) for m, o in groups]
    nc = len(docs)
    with tempfile.TemporaryDirectory(prefix="ballast-near-") as tmp:
        sets = (
            _ShingleScratch(store, shards, offsets, docs, os.path.join(tmp, "shingles"))
            if near.verify
            else None
        )
        try:
            parent, queried, verified = _links(groups, nc, max_checks, near.threshold, sets)
        finally:
            if sets is not None:
                sets.close()
    roots = _roots(parent)
    candidates = len(np.unique(queried))
    del queried
    is_dup = roots != np.arange(nc)
    dup, kept_of = docs[is_dup], docs[roots[is_dup]]
    fresh = dup >= offsets[len(prior)]  # earlier versions' documents stay as they are
    dup, kept_of = dup[fresh], kept_of[fresh]
    write_dups(store, input_stage, shards, offsets, dup, kept_of, STAGE)
    summary = {
        "bands": bands,
        "rows": rows,
        "num_perm": near.num_perm,
        "threshold": near.threshold,
        "p_candidate_at_threshold": round(
            minhash.candidate_probability(near.threshold, bands, rows), 6
        ),
        "candidate_pairs": candidates,
        "confirmed_pairs": verified,
        "removed": len(dup),
        "clusters": len(np.unique(kept_of)),
    }
    # The summary is written after the duplicates: its presence means clustering is done.
    version_store(cfg).put(CLUSTER_KEY, json.dumps(summary, sort_keys=True).encode())
    return summary


def _links(
    groups: list[tuple[np.ndarray, np.ndarray]],
    nc: int,
    max_checks: int,
    threshold: float,
    sets: _ShingleScratch | None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The union-find over bucket groups: (parent, every pair queried as other * nc + m,
    pairs confirmed). Each member is linked to an earlier member of its group whose exact
    Jaccard reaches `threshold` (sets None: unverified). The compiled loop
    (native/near_cluster.cpp) when built; it takes the same pairs in the same order."""
    mod = native.module()
    if mod is not None and hasattr(mod, "near_cluster_links"):  # not in an older build
        fd, bounds = (-1, np.zeros(0, np.int64)) if sets is None else (sets.fd, sets.bounds_array)
        parent_a, queried_a, verified_n = mod.near_cluster_links(
            [
                (np.ascontiguousarray(m, np.int64), np.ascontiguousarray(o, np.int64))
                for m, o in groups
            ],
            nc,
            max_checks,
            threshold,
            fd,
            bounds,
        )
        return parent_a, queried_a, int(verified_n)
    parent = array("q", np.arange(nc, dtype=np.int64).tobytes())
    queried = array("q")  # every pair confirmed (i * nc + j), to count distinct candidates
    verified = 0

    def find(i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:  # path compression
            parent[i], i = root, parent[i]
        return root

    jaccard = minhash.jaccard
    for band_members, band_offsets in groups:
        ml, ol = band_members.tolist(), band_offsets.tolist()
        for g in range(len(ol) - 1):
            grp = ml[ol[g] : ol[g + 1]]
            for i in range(1, len(grp)):
                m = grp[i]
                for other in grp[: min(i, max_checks)]:
                    rm, ro = find(m), find(other)
                    if rm == ro:
                        break
                    # A pair that confirms is merged, so only failed pairs are asked
                    # again: recomputing those beats a memo of every pair.
                    queried.append(other * nc + m)
                    if sets is None or jaccard(sets.get(other), sets.get(m)) >= threshold:
                        verified += 1
                        parent[max(rm, ro)] = min(rm, ro)
                        break
    return (
        np.frombuffer(parent, dtype=np.int64),
        np.frombuffer(queried, dtype=np.int64),
        verified,
    )


def read_summary(cfg: PrepConfig) -> dict:
    """What `cluster` found (its summary, for the report)."""
    return json.loads(version_store(cfg).get(CLUSTER_KEY))


def _roots(parent: np.ndarray) -> np.ndarray:
    """Every element's root by pointer jumping (vectorised; roots are the smallest index
    of their set, since a union always hangs the larger root under the smaller)."""
    p = parent.copy()
    while True:
        pp = p[p]
        if np.array_equal(pp, p):
            return p
        p = pp


def apply_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    return apply_dups(cfg, input_stage, STAGE, shard, STAGE, "near_dup")
