"""Connected components of near dedup's candidate graph, partitioned: the first half of
near clustering with `max_task_memory` (dataprep/stages/near_parts.py has the rest and
says why components come first).

The graph: a node per document and one per bucket group (id N + band << 40 + index, above
every document's), an edge from each group to each of its members, so two documents are
connected when a chain of shared buckets joins them. Its components are found by the
large-star / small-star rounds of Kiveris et al. 2014 ("Connected Components in MapReduce
and Beyond"): every edge is stored at both its ends' partitions (a node's partition is a
hash of its id), and a round's task holds its nodes' edges only:

    large-star (even rounds)  each node u hangs every neighbour larger than it on
                              m(u) = the smallest of u and its neighbours
    small-star (odd rounds)   each node u hangs itself and its smaller neighbours on the
                              smallest of them

Neither step adds edges beyond those it drops, and alternating them converges in
O(log^2 n) rounds (in practice a handful) to a forest of stars, each centred on its
component's smallest node: its smallest document. A round's task checks that shape on
its own nodes (each either has no smaller neighbour, or exactly one neighbour, smaller);
when every task of a round found it, the round's input is the answer and the driver stops
repeating the step (Step.repeat). Why stars rather than a union-find merged across
partitions: a merge of partition boundaries holds every boundary node in one task, and
near copies are spread over the whole corpus, so almost every node is a boundary node.

Files, in the version's store under near/cc/<tag>/:
    e<round>/<partition>/<producer>.npy   int64 (u, v): the round's input edges at u's
    done/r<round>-<partition>.json        converged, edges, documents, groups
    labels/docs/<shard>/<partition>.npy   (row, component's bin) of each candidate
    labels/groups/band-<band>/<partition>.npy   (group index, component's bin)
    labels/hist/<partition>.npy           candidates per component bin
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from dataprep.config import PrepConfig
from dataprep.layout import version_store
from dataprep.partition import BINS, HIST_BITS
from dataprep.stages.near_index import bucket_key

GROUP_SHIFT = 40  # a group node: N + (band << GROUP_SHIFT) + its index in the band
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each id."""
    z = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def part_of(ids: np.ndarray, parts: int) -> np.ndarray:
    """Each id's partition of `parts`: a hash, so a component's nodes spread evenly."""
    return (((mix(ids) >> np.uint64(32)) * np.uint64(parts)) >> np.uint64(32)).astype(np.int64)


def base(tag: str) -> str:
    return f"near/cc/{tag}"


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def send(
    vstore: Any, tag: str, rnd: int, producer: str, u: np.ndarray, v: np.ndarray, parts: int
) -> None:
    """Edges (u, v) as the input of round `rnd`: each stored at both ends' partitions."""
    a = np.concatenate([u, v])
    b = np.concatenate([v, u])
    dest = part_of(a, parts)
    order = np.argsort(dest, kind="stable")
    a, b, dest = a[order], b[order], dest[order]
    cuts = np.flatnonzero(np.diff(dest)) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(dest)], strict=True):
        if lo == hi:
            continue
        q = int(dest[lo])
        pairs = np.stack([a[lo:hi], b[lo:hi]], axis=1)
        vstore.put(f"{base(tag)}/e{rnd:03d}/{q:05d}/{producer}.npy", _npy(pairs))


def edges_bands(
    cfg: PrepConfig, n_docs: int, tag: str, parts: int, bands: list[int], chunk: int
) -> int:
    """Round 0's input from the bucket groups of `bands`: an edge from each group's node
    to each of its members, sent `chunk` members at a time. Sending costs ~256 bytes a
    member (the edge both ways, its partitions, their sort); a band's members grow with
    the corpus (~790k a band at 10M documents: +133 MB in one task, sent whole), so the
    task holds the band's member array (8 bytes a member) and one chunk's sending."""
    vstore = version_store(cfg)
    n = 0
    for band in bands:
        with np.load(io.BytesIO(vstore.get(bucket_key(band)))) as z:
            members, offsets = z["members"], z["offsets"]
        node0 = n_docs + (band << GROUP_SHIFT)
        for k, lo in enumerate(range(0, len(members), chunk)):
            hi = min(lo + chunk, len(members))
            # The group of each member of [lo, hi): its offsets' interval.
            group = np.searchsorted(offsets, np.arange(lo, hi), side="right") - 1
            send(
                vstore,
                tag,
                0,
                f"b{band:03d}-{k:05d}",
                (node0 + group).astype(np.int64),
                members[lo:hi].astype(np.int64),
                parts,
            )
        n += len(members)
    return n


def read_edges(vstore: Any, tag: str, rnd: int, q: int) -> tuple[np.ndarray, np.ndarray]:
    """Partition q's input edges of round `rnd`, each once, sorted by (u, v)."""
    keys = vstore.list(f"{base(tag)}/e{rnd:03d}/{q:05d}/")
    if not keys:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pairs = np.unique(np.concatenate([np.load(io.BytesIO(vstore.get(k))) for k in keys]), axis=0)
    return pairs[:, 0], pairs[:, 1]


def star_round(
    cfg: PrepConfig, tag: str, parts: int, rnd: int, q: int, n_docs: int
) -> dict[str, Any]:
    """One round's work for partition q (large-star on even rounds, small-star on odd).
    Its marker counts its nodes that are documents (`n_docs` of them in the version)."""
    vstore = version_store(cfg)
    u, v = read_edges(vstore, tag, rnd, q)
    starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]]) if len(u) else np.zeros(0, np.int64)
    nodes = u[starts]
    smallest = np.minimum(nodes, np.minimum.reduceat(v, starts)) if len(u) else nodes
    degree = np.diff(np.r_[starts, len(u)])
    has_smaller = smallest < nodes
    converged = bool(np.all(~has_smaller | (degree == 1)))
    m = np.repeat(smallest, degree)
    if rnd % 2 == 0:  # large-star: neighbours above u go to m(u)
        keep = v > u
        a, b = v[keep], m[keep]
    else:  # small-star: u and its smaller neighbours go to the smallest of them
        keep = v < u
        m_small = np.repeat(np.minimum(nodes, _min_below(u, v, starts)), degree)
        a = np.concatenate([v[keep], nodes])
        b = np.concatenate([m_small[keep], np.minimum(nodes, _min_below(u, v, starts))])
    loops = a != b
    send(vstore, tag, rnd + 1, f"{q:05d}", a[loops], b[loops], parts)
    marker = {
        "converged": converged,
        "edges": len(u),
        "nodes": len(nodes),
        "documents": int((nodes < n_docs).sum()),
    }
    vstore.put(f"{base(tag)}/done/r{rnd:03d}-{q:05d}.json", json.dumps(marker).encode())
    return marker


def _min_below(u: np.ndarray, v: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per node (run of u), the smallest neighbour below it, or the node itself."""
    below = np.where(v < u, v, u)
    return np.minimum.reduceat(below, starts) if len(u) else below


def round_done_key(tag: str, rnd: int, q: int) -> str:
    return f"{base(tag)}/done/r{rnd:03d}-{q:05d}.json"


def state(cfg: PrepConfig, tag: str, parts: int) -> tuple[int, bool]:
    """(the round to run next, whether the components are found): the first round some
    partition has not finished, and whether every partition of the round before it found
    its input a forest of stars."""
    vstore = version_store(cfg)
    rnd = 0
    while all(vstore.exists(round_done_key(tag, rnd, q)) for q in range(parts)):
        rnd += 1
    if rnd == 0:
        return 0, False
    last = [json.loads(vstore.get(round_done_key(tag, rnd - 1, q))) for q in range(parts)]
    return rnd, all(m["converged"] for m in last)


def labels(
    cfg: PrepConfig, tag: str, rnd: int, offsets: np.ndarray, shards: list[str], q: int
) -> dict[str, int]:
    """From a converged round's input: each of partition q's nodes' component (its star's
    centre, its smallest document) as the component's bin (partition.HIST_BITS of a hash
    of the centre), written by the documents' shards and the groups' bands; and how many
    documents fall in each bin, from which the replay partitions are cut (no partition
    then holds more candidates than the bound allows, unless one bin alone does)."""
    vstore = version_store(cfg)
    u, v = read_edges(vstore, tag, rnd, q)
    n_docs = int(offsets[-1])
    starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]]) if len(u) else np.zeros(0, np.int64)
    nodes = u[starts]
    centre = np.minimum(nodes, np.minimum.reduceat(v, starts)) if len(u) else nodes
    r = centre_bin(centre)
    docs = nodes < n_docs
    d, dr = nodes[docs], r[docs]
    shard = np.searchsorted(offsets, d, side="right") - 1
    for si in np.unique(shard).tolist():
        sel = shard == si
        rows = np.stack([d[sel] - offsets[si], dr[sel]], axis=1)
        vstore.put(f"{base(tag)}/labels/docs/{shards[si]}/{q:05d}.npy", _npy(rows))
    g, gr = nodes[~docs] - n_docs, r[~docs]
    band = g >> GROUP_SHIFT
    for b in np.unique(band).tolist():
        sel = band == b
        rows = np.stack([g[sel] & ((1 << GROUP_SHIFT) - 1), gr[sel]], axis=1)
        vstore.put(f"{base(tag)}/labels/groups/band-{b:03d}/{q:05d}.npy", _npy(rows))
    hist = np.bincount(dr, minlength=BINS).astype(np.int64)
    vstore.put(labels_hist_key(tag, q), _npy(hist))
    out = {"documents": int(docs.sum()), "groups": int((~docs).sum())}
    vstore.put(f"{base(tag)}/done/labels-{q:05d}.json", json.dumps(out).encode())
    return out


def centre_bin(centre: np.ndarray) -> np.ndarray:
    """A component's bin: the top partition.HIST_BITS bits of a hash of its centre."""
    return (mix(centre) >> np.uint64(64 - HIST_BITS)).astype(np.int64)


def labels_hist_key(tag: str, q: int) -> str:
    return f"{base(tag)}/labels/hist/{q:05d}.npy"
