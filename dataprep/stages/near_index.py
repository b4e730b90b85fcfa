"""The near stage's bucketing of a version with earlier ones through the dedup index
(dataprep/dedup_index.py): each band's keys of earlier versions are looked up in the
band's index runs rather than read whole from every earlier shard's signatures. Also the
signature and bucket files both paths share, so dataprep/stages/near.py (the stage, and
the whole-read path this one must match) imports from here, never the other way round.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from core.store import Store, open_file
from dataprep import dedup_index
from dataprep.config import PrepConfig
from dataprep.layout import output_store, version_store
from dataprep.stages.exact import versions_of


def sig_key(shard: str) -> str:
    """Band keys of a shard (small; what bucketing reads). Written last: its presence
    means the shard's signatures are done."""
    return f"near/sig/{shard}.npz"


def bucket_key(band: int) -> str:
    return f"near/buckets/band-{band:03d}.npz"


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _band_name(band: int) -> str:
    return f"b{band:03d}"


def _npz_member(store: Store, key: str, name: str) -> np.ndarray:
    """One array of an .npz in the store, read by itself (a zip member is): from disk when
    the store is local, else by ranged reads of the object (bucketing asks each signature
    file for one band at a time, so a whole read per call would fetch it once per band)."""
    with open_file(store, key) as f, np.load(f) as z:
        return z[name]


def band_kind(band: int) -> str:
    """The dedup index's kind for one band's keys (dataprep/dedup_index.py, ALL runs)."""
    return f"band{band:03d}"


def index_key(bands: list[int]) -> str:
    """What one bucketing task read of the index (in the version's store)."""
    return f"near/index/{bands[0]:03d}.json"


def _live(store: Store, shard: str) -> tuple[int, np.ndarray]:
    """A shard's document count and the rows with band keys (a signature not empty)."""
    empty = _npz_member(store, sig_key(shard), "empty")
    return len(empty), np.flatnonzero(~empty)


def _band_keys(
    store: Store, shards: list[str], live: dict[str, np.ndarray], first: dict[str, int], band: int
) -> tuple[np.ndarray, np.ndarray]:
    """One band's keys of the shards' live rows, and their global positions."""
    keys, pos = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
    for s in shards:
        keys.append(_npz_member(store, sig_key(s), _band_name(band))[live[s]])
        pos.append(live[s] + first[s])
    return np.concatenate(keys), np.concatenate(pos)


def bucket_with_index(
    cfg: PrepConfig, prior: list[str], new: list[str], bands: list[int]
) -> int | None:
    """bucket_bands for a version with earlier ones, band by band: the runs of the band's
    index that cover the earlier versions (indexed from their signatures first where a
    version has none, once), compacted; the new documents' distinct keys looked up there
    (every earlier document with the key: a bucket's members); each key's group is its
    earlier members, then its new ones (input order: earlier versions come first), kept
    at two or more, in key order; then the version's own run of the band. None (the
    caller runs the old path) when the shards cannot be placed in versions or the index
    names others."""
    groups_of = versions_of(prior)
    if groups_of is None or any(v >= cfg.version for v, _ in groups_of):
        return None
    store, vstore = output_store(cfg), version_store(cfg)
    stats = dedup_index.Stats()
    by_version = dict(groups_of)
    versions = [v for v, _ in groups_of]
    counts: dict[str, int] = {}
    live: dict[str, np.ndarray] = {}
    for s in new:
        counts[s], live[s] = _live(store, s)
    base = 0
    first: dict[str, int] = {}
    n_groups = 0
    for band in bands:
        kind = band_kind(band)
        runs = dedup_index.list_runs(store, kind, stats)
        chosen = dedup_index.cover(runs, versions)
        dedup_index.drop_replaced(store, runs, chosen)
        for r in chosen:
            names = sorted(s for v in r.versions for s in by_version[v])
            if sorted(s for s, _ in r.shards) != names:
                return None
            counts.update(dict(r.shards))
        if not first:  # positions: the same for every band
            for s in prior:
                if s not in counts:
                    counts[s], live[s] = _live(store, s)
            for s in [*prior, *new]:
                first[s] = base
                base += counts[s]
        if any(r.start != first[r.shards[0][0]] for r in chosen if r.shards):
            return None
        held = {v for r in chosen for v in r.versions}
        for v, names in groups_of:  # earlier versions without a run: from signatures
            if v in held:
                continue
            for s in names:
                if s not in live:
                    live[s] = _live(store, s)[1]
            k, p = _band_keys(store, names, live, first, band)
            stats.bytes_read += k.nbytes + sum(counts[s] for s in names)  # keys, `empty`
            chosen.append(
                dedup_index.write_run(
                    store,
                    kind,
                    [v],
                    [(s, counts[s]) for s in names],
                    first[names[0]],
                    k,
                    None,
                    p,
                    stats,
                    mode=dedup_index.ALL,
                )
            )
            if v not in stats.built_lazily:
                stats.built_lazily.append(v)
        chosen = dedup_index.compact(store, chosen, stats)
        k, p = _band_keys(store, new, live, first, band)
        order = np.lexsort((p, k))
        k, p = k[order], p[order]
        uq, at, n_new = np.unique(k, return_index=True, return_counts=True)
        owner, hist = dedup_index.lookup_all(store, chosen, uq, stats)
        n_hist = np.bincount(owner, minlength=len(uq))
        sizes = n_hist + n_new
        keep = sizes >= 2
        # Each kept key's members: its earlier documents, then its new ones.
        start = np.concatenate([[0], np.cumsum(np.where(keep, sizes, 0))])
        members = np.zeros(int(start[-1]), np.int64)
        h_rank = np.arange(len(owner)) - np.repeat(np.cumsum(n_hist) - n_hist, n_hist)
        hk = keep[owner]
        members[start[owner[hk]] + h_rank[hk]] = hist[hk]
        key_of = np.repeat(np.arange(len(uq)), n_new)
        n_rank = np.arange(len(k)) - np.repeat(at, n_new)
        nk = keep[key_of]
        members[start[key_of[nk]] + n_hist[key_of[nk]] + n_rank[nk]] = p[nk]
        offsets = np.concatenate([[0], np.cumsum(sizes[keep])]).astype(np.int64)
        n_groups += int(keep.sum())
        dedup_index.write_run(
            store,
            kind,
            [cfg.version],
            [(s, counts[s]) for s in new],
            first[new[0]] if new else base,
            k,
            None,
            p,
            stats,
            mode=dedup_index.ALL,
        )
        vstore.put(bucket_key(band), _npz(members=members, offsets=offsets))
    record = {
        **stats.to_json(),
        "bands": list(bands),
        "history_documents": first.get(new[0], base) if new else base,
    }
    record["history_band_bytes"] = record["history_documents"] * 8 * len(bands)
    vstore.put(index_key(bands), json.dumps(record, indent=1).encode())
    return n_groups


def index_record(cfg: PrepConfig) -> dict[str, Any] | None:
    """What the version's bucketing read of the band index, summed over its tasks (None:
    it used none)."""
    vstore = version_store(cfg)
    keys = vstore.list("near/index/")
    if not keys:
        return None
    total: dict[str, Any] = {}
    for key in keys:
        rec = json.loads(vstore.get(key))
        for name, value in rec.items():
            if name == "history_documents":
                total[name] = value
            elif isinstance(value, list):
                total[name] = sorted(set(total.get(name, [])) | set(value))
            elif name == "runs":
                total[name] = max(total.get(name, 0), value)  # per band
            else:
                total[name] = total.get(name, 0) + value
    return total
