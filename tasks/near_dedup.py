"""Near deduplication with MinHash LSH, in steps that each run shard by shard or band by
band, exchanging files:

    signatures (per shard)  LSH band keys -> near/sig/<shard>.npz, shingle sets ->
               near/shingles/<shard>.npz
    buckets    (per band group)  documents sharing a band key -> near/buckets/band-XXX.npz
    cluster    (once)  union-find over bucket members, each link confirmed by the exact
               Jaccard of the two shingle sets -> near/dups.parquet
    apply      (per shard)  drop every document that is not its cluster's first one

No step compares all pairs, and none holds the corpus text: buckets hold 16 bytes per
document and band, clustering loads shingle sets of candidate documents shard by shard.
"""

from __future__ import annotations

import io
import json
from collections import OrderedDict

import numpy as np

from tasks import minhash
from tasks.config import NearDedupConfig, PrepConfig
from tasks.exact_dedup import apply_dups, write_dups
from tasks.stage import output_store, read_docs

STAGE = "near"
DUPS_KEY = "near/dups.parquet"
CLUSTER_KEY = "near/cluster.json"
BATCH_DOCS = 1000
# Texts are shingled from their first MAX_CHARS characters: enough to judge
# near-duplication, and one gigantic document cannot blow up a batch.
MAX_CHARS = 1_000_000


def sig_key(shard: str) -> str:
    """Band keys of a shard (small; what bucketing reads). Written last: its presence
    means the shard's signatures are done."""
    return f"near/sig/{shard}.npz"


def shingles_key(shard: str) -> str:
    """Shingle sets of a shard (about the size of its text; only clustering reads them,
    and only for candidate documents)."""
    return f"near/shingles/{shard}.npz"


def bucket_key(band: int) -> str:
    return f"near/buckets/band-{band:03d}.npz"


def bands_rows(near: NearDedupConfig) -> tuple[int, int]:
    if near.bands and near.rows:
        return near.bands, near.rows
    return minhash.choose_bands(near.threshold, near.num_perm, near.recall_at_threshold)


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _load_npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as z:
        return {k: z[k] for k in z.files}


def signature_shard(cfg: PrepConfig, input_stage: str, shard: str) -> int:
    near = cfg.dedup.near
    assert near is not None
    store = output_store(cfg)
    texts = read_docs(store, input_stage, shard).column("text").to_pylist()
    bands, rows = bands_rows(near)
    a, b = minhash.permutations(near.num_perm, cfg.seed)
    sh_parts, off_parts, key_parts = [], [np.zeros(1, dtype=np.int64)], []
    base = 0
    for i in range(0, len(texts), BATCH_DOCS):
        batch = [t[:MAX_CHARS] for t in texts[i : i + BATCH_DOCS]]
        sh, off = minhash.shingle_hashes(batch, near.ngram)
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
    store.put(sig_key(shard), _npz(keys=keys, empty=empty))
    return len(texts)


def band_groups(cfg: PrepConfig, per_task: int = 5) -> list[list[int]]:
    assert cfg.dedup.near is not None
    bands, _ = bands_rows(cfg.dedup.near)
    return [list(range(i, min(i + per_task, bands))) for i in range(0, bands, per_task)]


def bucket_bands(cfg: PrepConfig, shards: list[str], bands: list[int]) -> int:
    """Group documents by band key for the given bands; keep groups of two or more."""
    store = output_store(cfg)
    cols: list[list[np.ndarray]] = [[] for _ in bands]
    idx: list[np.ndarray] = []
    base = 0
    for s in shards:
        z = _load_npz(store.get(sig_key(s)))
        live = np.flatnonzero(~z["empty"])
        idx.append(live + base)
        base += len(z["empty"])
        for k, band in enumerate(bands):
            cols[k].append(z["keys"][live, band])
    doc = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    groups = 0
    for k, band in enumerate(bands):
        key = np.concatenate(cols[k]) if cols[k] else np.zeros(0, np.uint64)
        order = np.lexsort((doc, key))  # by key, then input order inside a bucket
        key, members = key[order], doc[order]
        new = np.ones(len(key), dtype=bool)
        new[1:] = key[1:] != key[:-1]
        starts = np.flatnonzero(new)
        sizes = np.diff(np.append(starts, len(key)))
        multi = sizes >= 2
        keep = np.repeat(multi, sizes)
        members = members[keep]
        offsets = np.concatenate([[0], np.cumsum(sizes[multi])])
        groups += int(multi.sum())
        store.put(bucket_key(band), _npz(members=members, offsets=offsets))
    return groups


class _Shingles:
    """Shingle sets of documents by global index, loaded shard by shard on demand and
    kept in a small LRU, so clustering never holds every shard at once."""

    def __init__(self, cfg: PrepConfig, shards: list[str], offsets: np.ndarray,
                 capacity: int = 64):
        self.store = output_store(cfg)
        self.shards = shards
        self.offsets = offsets
        self.cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.capacity = capacity

    def get(self, doc: int) -> np.ndarray:
        si = int(np.searchsorted(self.offsets, doc, side="right") - 1)
        entry = self.cache.get(si)
        if entry is None:
            z = _load_npz(self.store.get(shingles_key(self.shards[si])))
            entry = (z["shingles"], z["offsets"])
            self.cache[si] = entry
            if len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(si)
        sh, off = entry
        r = doc - int(self.offsets[si])
        return sh[off[r] : off[r + 1]]


def cluster(cfg: PrepConfig, shards: list[str], max_checks: int = 8) -> dict:
    """Union-find over bucket members. Each member is linked to an earlier member of its
    bucket whose exact Jaccard reaches the threshold (the bucket's first member first,
    then up to `max_checks` others), so a chance band collision never merges clusters.
    The document that stays is the cluster's first in input order."""
    near = cfg.dedup.near
    assert near is not None
    store = output_store(cfg)
    counts = []
    for s in shards:
        z = _load_npz(store.get(sig_key(s)))
        counts.append(len(z["empty"]))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    n = int(offsets[-1])
    uf = minhash.UnionFind.of(n)
    sets = _Shingles(cfg, shards, offsets)
    checked: dict[tuple[int, int], bool] = {}
    bands, rows = bands_rows(near)
    candidates = verified = 0
    def confirm(i: int, j: int) -> bool:
        nonlocal candidates, verified
        ok = checked.get((i, j))
        if ok is None:
            candidates += 1
            ok = not near.verify or (
                minhash.jaccard(sets.get(i), sets.get(j)) >= near.threshold)
            checked[(i, j)] = ok
            verified += ok
        return ok

    for band in range(bands):
        z = _load_npz(store.get(bucket_key(band)))
        members, goff = z["members"].tolist(), z["offsets"].tolist()
        for g in range(len(goff) - 1):
            grp = members[goff[g] : goff[g + 1]]
            for i in range(1, len(grp)):
                m = grp[i]
                for other in grp[: min(i, max_checks)]:
                    if uf.find(m) == uf.find(other):
                        break
                    if confirm(other, m):
                        uf.union(other, m)
                        break
    roots = uf.roots()
    dup = np.flatnonzero(roots != np.arange(n))
    kept_of = roots[dup]
    write_dups(store, _input_stage(cfg), shards, offsets, dup, kept_of, DUPS_KEY)
    summary = {
        "bands": bands, "rows": rows, "num_perm": near.num_perm, "threshold": near.threshold,
        "p_candidate_at_threshold": round(
            minhash.candidate_probability(near.threshold, bands, rows), 6),
        "candidate_pairs": candidates, "confirmed_pairs": verified,
        "removed": len(dup), "clusters": len(np.unique(kept_of)),
    }
    # The summary is written after the duplicates: its presence means clustering is done.
    store.put(CLUSTER_KEY, json.dumps(summary, sort_keys=True).encode())
    return summary


def _input_stage(cfg: PrepConfig) -> str:
    return "exact" if cfg.dedup.exact else "ingest"


def apply_shard(cfg: PrepConfig, input_stage: str, shard: str) -> dict:
    return apply_dups(cfg, input_stage, STAGE, shard, DUPS_KEY, "near_dup")
