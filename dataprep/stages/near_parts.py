"""Near clustering partitioned (`max_task_memory` set), in place of near.cluster's one task.

Why not connected components over the confirmed pairs: near.cluster's loop is
order-dependent. It links a bucket member to the first earlier member that confirms (exact
Jaccard) and stops at the first one it is already joined with, so which pairs are tried,
and so the clusters, depend on the union-find's state; components over every confirming
pair would merge more than it does and change the output. What does split exactly is the
candidate graph (every bucket group joins its members, nothing verified): the loop's
decisions for a member depend only on the state of its own component of that graph, which
only that component's groups ever change. So:

    edges       (per band group)  group -> member edges (dataprep/stages/near_cc.py)
    components  (per partition, repeated)  large-star / small-star rounds until stars
    labels      (per partition)  each candidate's and group's component as a bin (a hash
                of its smallest document), and the candidates per bin; the bins are cut
                into replay partitions of at most max_task_memory's candidates
    route       (per band; per shard)  each replay partition's groups, band by band, and
                its candidates' shingle sets
    replay      (per replay partition)  near.cluster's own loop over its groups in band
                order: the same decisions, the same pairs tried and confirmed
    keepers, dups  (per shard)  the duplicates' lists (dataprep/stages/dup_shuffle.py)
    summary     (once)  the partitions' counts summed: near/cluster.json

A replay partition holds its components; a single component larger than the bound (a
cluster of millions of near copies) is one task whatever the bound, since the loop's order
inside it cannot be split.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np

from core.store import Store
from dataprep import minhash, partition
from dataprep.config import PrepConfig
from dataprep.layout import output_store, version_store
from dataprep.stages import dup_shuffle, near_cc
from dataprep.stages.near import (
    CLUSTER_KEY,
    MAX_CHECKS,
    STAGE,
    _links,
    _roots,
    _ShingleScratch,
    bands_rows,
    first_occurrences,
    shard_sets,
)
from dataprep.stages.near_index import _npz, _npz_member, bucket_key, sig_key

# Bytes a components round holds per input edge (the pairs, their sort and the edges it
# sends on), and a replay task per candidate document (its groups in every band, the pairs
# it tries, the union-find, one shard's shingle sets at a time), at the task's peak:
# measured with tracemalloc over every task of a partitioned run of the scale corpus
# (`python -m benchmarks.near_item_bytes`, benchmarks/results/near_item_bytes.json; the
# largest tasks under a 16MB bound): a round 109-122 bytes an edge at 100k and 1M
# documents; a replay 1,203-1,259 bytes a candidate at 100k and 297-443 at 1M. The
# difference is the corpus's: a candidate costs per group it is in (up to one a band) and
# per pair it tries, which the replay plan does not count; the constant is the larger
# figure, so the bound held on both corpora, and a corpus whose candidates sit in more
# groups can still exceed it.
EDGE_BYTES = 128
CANDIDATE_BYTES = 1280
PLAN_KEY = "near_parts"  # run.extra: the components' plan
ROUND_KEY = "near_round"  # run.extra: the round to run next
REPLAY_KEY = "near_replay"  # run.extra: the replay partitions


def enabled(cfg: PrepConfig) -> bool:
    return cfg.dedup.near is not None and cfg.max_task_memory is not None


def single(cfg: PrepConfig) -> bool:
    return cfg.dedup.near is not None and cfg.max_task_memory is None


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _json(vstore: Any, key: str, obj: Any) -> None:
    vstore.put(key, json.dumps(obj, sort_keys=True).encode())


# ---- plans (read by the driver before a step's items are drawn) ------------------------
def plan(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    """The components' partitions, from the bucket groups' total membership (each member
    is an edge, stored at both ends); each shard's first global document index."""
    assert cfg.max_task_memory is not None and cfg.dedup.near is not None
    store, vstore = output_store(cfg), version_store(cfg)
    counts = [len(_npz_member(store, sig_key(s), "empty")) for s in shards]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    bands, _ = bands_rows(cfg.dedup.near)
    members = sum(int(_npz_member(vstore, bucket_key(b), "offsets")[-1]) for b in range(bands))
    parts = max(1, -(-2 * members * EDGE_BYTES // cfg.max_task_memory))
    tag = f"p{parts:05d}"
    planned = {"tag": tag, "parts": parts, "documents": int(offsets[-1]), "edges": members}
    # Read by the tasks (the same bytes however often the plan is read again).
    vstore.put(f"{near_cc.base(tag)}/offsets.npy", _npy(offsets))
    _json(vstore, f"{near_cc.base(tag)}/plan.json", planned)
    return planned


def _offsets(cfg: PrepConfig, tag: str) -> np.ndarray:
    return np.load(io.BytesIO(version_store(cfg).get(f"{near_cc.base(tag)}/offsets.npy")))


def round_state(cfg: PrepConfig, planned: dict[str, Any]) -> dict[str, Any]:
    rnd, done = near_cc.state(cfg, planned["tag"], planned["parts"])
    return {"round": rnd, "done": done}


def replay_plan(cfg: PrepConfig, planned: dict[str, Any], rnd: dict[str, Any]) -> dict[str, Any]:
    """The replay partitions: the labels' per-bin candidate counts summed and cut into
    contiguous bin ranges, none over max_task_memory / CANDIDATE_BYTES candidates unless
    one bin alone is (a component that large). Each bin's partition is written for the
    route tasks."""
    assert cfg.max_task_memory is not None
    cc, parts = planned["tag"], planned["parts"]
    vstore = version_store(cfg)
    counts = np.zeros(partition.BINS, np.int64)
    for q in range(parts):
        counts += np.load(io.BytesIO(vstore.get(near_cc.labels_hist_key(cc, q))))
    cap = partition.item_cap(cfg.max_task_memory, CANDIDATE_BYTES)
    ranges = partition.cut(counts, cap)
    rt = "x" + partition.plan_tag(ranges)
    of_bin = np.zeros(partition.BINS, np.int64)
    for i, (lo, hi) in enumerate(ranges):
        of_bin[lo:hi] = i
    vstore.put(f"{_replay_base(cc, rt)}/bins.npy", _npy(of_bin))
    return {
        "tag": shuffle_tag(cc, rt),
        "cc": cc,
        "route": rt,
        "replay": len(ranges),
        "final": rnd["round"] - 1,
        "candidates": int(counts.sum()),
        "cap_candidates": cap,
        "max_candidates": max(int(counts[lo:hi].sum()) for lo, hi in ranges),
    }


def shuffle_tag(cc: str, rt: str) -> str:
    """The duplicates' shuffle's name for this plan (dup_shuffle's files)."""
    return f"{cc}-{rt}"


def _replay_base(cc: str, rt: str) -> str:
    return f"{near_cc.base(cc)}/route-{rt}"


def _of_bin(cfg: PrepConfig, cc: str, rt: str) -> np.ndarray:
    return np.load(io.BytesIO(version_store(cfg).get(f"{_replay_base(cc, rt)}/bins.npy")))


# ---- steps --------------------------------------------------------------------------
def edges(cfg: PrepConfig, item: str) -> int:
    tag, _, bands = item.partition(".")
    planned = json.loads(version_store(cfg).get(f"{near_cc.base(tag)}/plan.json"))
    band_list = [int(b) for b in bands.split(",")]
    assert cfg.max_task_memory is not None
    chunk = max(1, cfg.max_task_memory // (2 * EDGE_BYTES))  # as the rounds are sized
    n = near_cc.edges_bands(cfg, planned["documents"], tag, planned["parts"], band_list, chunk)
    _json(version_store(cfg), edges_done_key(item), {"edges": n})
    return n


def edges_done_key(item: str) -> str:
    tag, _, bands = item.partition(".")
    return f"{near_cc.base(tag)}/done/edges-{bands.split(',')[0]}.json"


def components(cfg: PrepConfig, item: str) -> dict[str, Any]:
    tag, rnd, q = item.split(".")
    planned = json.loads(version_store(cfg).get(f"{near_cc.base(tag)}/plan.json"))
    return near_cc.star_round(
        cfg, tag, planned["parts"], int(rnd[1:]), int(q[1:]), planned["documents"]
    )


def components_done_key(item: str) -> str:
    tag, rnd, q = item.split(".")
    return near_cc.round_done_key(tag, int(rnd[1:]), int(q[1:]))


def labels(cfg: PrepConfig, prior: list[str], new: list[str], item: str) -> dict[str, int]:
    cc, final, q = item.split(".")
    return near_cc.labels(cfg, cc, int(final[1:]), _offsets(cfg, cc), [*prior, *new], int(q[1:]))


def labels_done_key(item: str) -> str:
    cc, _final, q = item.split(".")
    return f"{near_cc.base(cc)}/done/labels-{int(q[1:]):05d}.json"


def route_groups(cfg: PrepConfig, item: str) -> int:
    """A band's groups split by replay partition, each kept in its band order."""
    cc, rt, band_s = item.split(".")
    band = int(band_s[1:])
    vstore = version_store(cfg)
    of_bin = _of_bin(cfg, cc, rt)
    with np.load(io.BytesIO(vstore.get(bucket_key(band)))) as z:
        members, offsets = z["members"], z["offsets"]
    sizes = np.diff(offsets)
    part = np.full(len(sizes), -1, np.int64)
    for key in vstore.list(f"{near_cc.base(cc)}/labels/groups/band-{band:03d}/"):
        rows = np.load(io.BytesIO(vstore.get(key)))
        part[rows[:, 0]] = of_bin[rows[:, 1]]
    assert (part >= 0).all(), f"band {band}: a group without a component"
    base = _replay_base(cc, rt)
    for r in np.unique(part).tolist():
        sel = part == r
        vstore.put(
            f"{base}/R{r:05d}/band-{band:03d}.npz",
            _npz(
                members=members[np.repeat(sel, sizes)],
                offsets=np.concatenate([[0], np.cumsum(sizes[sel])]).astype(np.int64),
            ),
        )
    _json(vstore, route_groups_done_key(item), {"groups": len(sizes)})
    return len(sizes)


def route_groups_done_key(item: str) -> str:
    cc, rt, band_s = item.split(".")
    return f"{_replay_base(cc, rt)}/done/band-{int(band_s[1:]):03d}.json"


def route_sets(cfg: PrepConfig, item: str) -> int:
    """A shard's candidates' shingle sets split by replay partition."""
    cc, rt, shard = item.split(".", 2)
    vstore = version_store(cfg)
    keys = vstore.list(f"{near_cc.base(cc)}/labels/docs/{shard}/")
    n = 0
    if keys:
        rows = np.concatenate([np.load(io.BytesIO(vstore.get(k))) for k in keys])
        rows[:, 1] = _of_bin(cfg, cc, rt)[rows[:, 1]]
        rows = rows[np.lexsort((rows[:, 0], rows[:, 1]))]  # by partition, then row
        n = len(rows)
        store = output_store(cfg)
        base = _replay_base(cc, rt)
        for a, b in dup_shuffle.runs(rows[:, 1]):
            sh, lens = shard_sets(store, [shard], 0, rows[a:b, 0])
            vstore.put(
                f"{base}/R{int(rows[a, 1]):05d}/sets/{shard}.npz",
                _npz(rows=rows[a:b, 0], lens=lens, shingles=sh),
            )
    _json(vstore, route_sets_done_key(item), {"candidates": n})
    return n


def route_sets_done_key(item: str) -> str:
    cc, rt, shard = item.split(".", 2)
    return f"{_replay_base(cc, rt)}/done/sets-{shard}.json"


def _routed_sets(
    vstore: Any, base: str, shards: list[str], si: int, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    with np.load(io.BytesIO(vstore.get(f"{base}/sets/{shards[si]}.npz"))) as z:
        assert np.array_equal(z["rows"], rows), "a partition's sets are not its candidates"
        return z["shingles"], z["lens"]


def replay(
    cfg: PrepConfig, input_stage: str, prior: list[str], new: list[str], item: str
) -> dict[str, int]:
    """near.cluster's loop over one replay partition's groups, in band order."""
    near = cfg.dedup.near
    assert near is not None
    cc, rt, r_s = item.split(".")
    r = int(r_s[1:])
    vstore = version_store(cfg)
    base = f"{_replay_base(cc, rt)}/R{r:05d}"
    shards = [*prior, *new]
    offsets = _offsets(cfg, cc)
    bands, _ = bands_rows(near)
    # The groups in band order, each at its first occurrence only (as near.cluster: the
    # same group always falls in one partition, so the same ones are skipped).
    groups, docs = first_occurrences(_replay_bands(vstore, base, bands))
    ranked = [(np.searchsorted(docs, m), o) for m, o in groups]
    with tempfile.TemporaryDirectory(prefix="ballast-near-") as tmp:
        sets = (
            _ShingleScratch(
                output_store(cfg),
                shards,
                offsets,
                docs,
                os.path.join(tmp, "shingles"),
                sets=partial(_routed_sets, vstore, base, shards),
            )
            if near.verify
            else None
        )
        try:
            parent, queried, verified = _links(ranked, len(docs), MAX_CHECKS, near.threshold, sets)
        finally:
            if sets is not None:
                sets.close()
    roots = _roots(parent)
    counts = {"candidates": len(np.unique(queried)), "confirmed": verified}
    is_dup = roots != np.arange(len(docs))
    dup, kept_of = docs[is_dup], docs[roots[is_dup]]
    fresh = dup >= offsets[len(prior)]  # earlier versions' documents stay as they are
    dup, kept_of = dup[fresh], kept_of[fresh]
    dup_shuffle.write_pairs(
        vstore, STAGE, shuffle_tag(cc, rt), f"{r:05d}", shards, offsets, dup, kept_of
    )
    counts.update(removed=len(dup), clusters=len(np.unique(kept_of)), held=len(docs))
    _json(vstore, replay_done_key(item), counts)
    return counts


def _replay_bands(vstore: Store, base: str, bands: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A replay partition's groups per band, (members, offsets), in band order; a band
    that routed none of its groups here has no file."""
    for band in range(bands):
        key = f"{base}/band-{band:03d}.npz"
        if vstore.exists(key):
            with np.load(io.BytesIO(vstore.get(key))) as z:
                yield z["members"], z["offsets"]


def replay_done_key(item: str) -> str:
    cc, rt, r_s = item.split(".")
    return f"{_replay_base(cc, rt)}/done/replay-{int(r_s[1:]):05d}.json"


def keepers(cfg: PrepConfig, input_stage: str, prior: list[str], new: list[str], item: str) -> int:
    return dup_shuffle.keepers(cfg, STAGE, input_stage, prior, new, item)


def keepers_done_key(item: str) -> str:
    return dup_shuffle.keepers_done_key(STAGE, item)


def dups(cfg: PrepConfig, item: str) -> int:
    return dup_shuffle.gather(cfg, STAGE, item)


def dups_done_key(item: str) -> str:
    return dup_shuffle.dups_done_key(STAGE, item)


def summary(cfg: PrepConfig, item: str) -> dict[str, Any]:
    """The replay partitions' counts summed into near.cluster's summary (`item`:
    "CC.ROUTE.nN": the plan and its N replay partitions)."""
    near = cfg.dedup.near
    assert near is not None
    vstore = version_store(cfg)
    total = {"candidates": 0, "confirmed": 0, "removed": 0, "clusters": 0}
    cc, rt, n_s = item.split(".")
    for r in range(int(n_s[1:])):
        m = json.loads(vstore.get(replay_done_key(f"{cc}.{rt}.r{r:05d}")))
        for k in total:
            total[k] += m[k]
    bands, rows = bands_rows(near)
    out = {
        "bands": bands,
        "rows": rows,
        "num_perm": near.num_perm,
        "threshold": near.threshold,
        "p_candidate_at_threshold": round(
            minhash.candidate_probability(near.threshold, bands, rows), 6
        ),
        "candidate_pairs": total["candidates"],
        "confirmed_pairs": total["confirmed"],
        "removed": total["removed"],
        "clusters": total["clusters"],
    }
    vstore.put(CLUSTER_KEY, json.dumps(out, sort_keys=True).encode())
    return out
