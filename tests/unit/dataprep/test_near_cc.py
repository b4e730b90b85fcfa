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
