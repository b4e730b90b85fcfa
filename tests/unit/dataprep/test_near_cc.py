"""Near clustering's partitioned connected components (dataprep/stages/near_cc.py):
large-star / small-star rounds over edges stored at both ends' partitions end in stars
centred on each component's smallest node, the components a plain union-find finds, on
graphs that need many rounds (a long path with shuffled ids) and few (random sparse
graphs, bucket-like cliques), for any number of partitions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dataprep.config import parse_config
from dataprep.layout import version_store
from dataprep.stages import near_cc
from tests.support.union_find import UnionFind


def components(
    tmp_path: Path, n: int, u: np.ndarray, v: np.ndarray, parts: int
) -> tuple[np.ndarray, int]:
    """Every node's centre after the rounds, and how many rounds ran."""
    cfg = parse_config(
        {"output": str(tmp_path / "out"), "sources": [{"name": "a", "paths": [str(tmp_path)]}]}
    )
    vstore = version_store(cfg)
    near_cc.send(vstore, "t", 0, "in", u.astype(np.int64), v.astype(np.int64), parts)
    rnd, done = 0, False
    while not done:
        for q in range(parts):
            near_cc.star_round(cfg, "t", parts, rnd, q, n)
        rnd, done = near_cc.state(cfg, "t", parts)
        assert rnd < 200
    centre = np.arange(n)
    for q in range(parts):
        a, b = near_cc.read_edges(vstore, "t", rnd - 1, q)
        assert np.all(near_cc.part_of(a, parts) == q)  # each edge at its end's partition
        np.minimum.at(centre, a, b)
    return centre, rnd


def oracle(n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    uf = UnionFind.of(n)
    for a, b in zip(u.tolist(), v.tolist(), strict=True):
        uf.union(a, b)
    return np.array([uf.find(i) for i in range(n)])


def _graphs() -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    n = 3000
    out = {"sparse": (n, rng.integers(0, n, 2000), rng.integers(0, n, 2000))}
    ids = rng.permutation(600)  # a path 600 long through shuffled ids: many rounds
    out["path"] = (600, ids[:-1], ids[1:])
    members = [rng.choice(n, size=int(rng.integers(2, 9)), replace=False) for _ in range(400)]
    # bucket groups as a group node (>= n) joined to each member, as near: edges writes them
    g = np.concatenate([np.full(len(m), n + i) for i, m in enumerate(members)])
    out["groups"] = (n + len(members), g, np.concatenate(members))
    return out


@pytest.mark.parametrize("name", ["sparse", "path", "groups"])
@pytest.mark.parametrize("parts", [1, 3, 8])
def test_rounds_end_in_the_union_find_components(tmp_path, name, parts):
    n, u, v = _graphs()[name]
    centre, rounds = components(tmp_path, n, u, v, parts)
    want = oracle(n, u, v)
    touched = np.zeros(n, bool)
    touched[u] = touched[v] = True
    # Every node that has an edge ends at its component's smallest node.
    assert np.array_equal(centre[touched], want[touched])
    if name == "path":
        assert rounds > 4  # the path needed the rounds, not one pass


@pytest.mark.parametrize("chunk", [1, 5, 7])
def test_edges_sent_in_chunks_are_the_edges_sent_whole(tmp_path, chunk):
    """near: edges sends a band's members a chunk at a time (its memory bound): each
    partition's round-0 input is the same edges as one send of the whole band, groups
    split across chunks included."""
    from dataprep.stages.near_index import _npz, bucket_key

    n_docs, parts, bands = 500, 4, [0, 2]
    sent, inputs, files = {}, {}, {}
    for c in (chunk, 10**9):
        cfg = parse_config(
            {"output": str(tmp_path / f"out-{c}"), "sources": [{"name": "a", "paths": ["x"]}]}
        )
        vstore = version_store(cfg)
        rng = np.random.default_rng(3)  # the same bucket groups for both
        for band in bands:
            sizes = rng.integers(2, 9, size=40)
            members = rng.integers(0, n_docs, size=int(sizes.sum()))
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            vstore.put(bucket_key(band), _npz(members=members, offsets=offsets))
        sent[c] = near_cc.edges_bands(cfg, n_docs, "t", parts, bands, c)
        inputs[c] = [near_cc.read_edges(vstore, "t", 0, q) for q in range(parts)]
        files[c] = {k.rsplit("/", 1)[-1] for k in vstore.list(f"{near_cc.base('t')}/e000/")}
    assert sent[chunk] == sent[10**9] > 0
    for (a, b), (c, d) in zip(inputs[chunk], inputs[10**9], strict=True):
        assert len(a) > 0 and np.array_equal(a, c) and np.array_equal(b, d)
    assert len(files[chunk]) > len(files[10**9]) == len(bands)  # the split was exercised
