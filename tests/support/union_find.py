"""Union-find whose root is always the smallest index: the plain clustering the tests of
near dedup compute their expected clusters with (an oracle independent of prep's own
clustering, which lives in dataprep/stages/near.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class UnionFind:
    """Union-find whose root is always the smallest index, so 'the document that stays'
    (the first in input order) is simply find(i)."""

    parent: np.ndarray

    @classmethod
    def of(cls, n: int) -> UnionFind:
        return cls(np.arange(n, dtype=np.int64))

    def find(self, i: int) -> int:
        p = self.parent
        root = i
        while p[root] != root:
            root = p[root]
        while p[i] != root:  # path compression
            p[i], i = root, p[i]
        return int(root)

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            lo, hi = (ri, rj) if ri < rj else (rj, ri)
            self.parent[hi] = lo

    def roots(self) -> np.ndarray:
        for i in range(len(self.parent)):
            self.find(i)
        return self.parent.copy()
