"""The retention rule both checkpoint stores use (`training.checkpoint.retention.to_delete`),
and the local store applying it."""

from __future__ import annotations

from pathlib import Path

import torch

from training import checkpoint as ckpt
from training.checkpoint.retention import to_delete


def test_keeps_the_newest_keep_last() -> None:
    assert to_delete(range(1, 8), keep_last=3, keep_every=None) == [1, 2, 3, 4]
    assert to_delete([5, 1, 3], keep_last=3, keep_every=None) == []
    assert to_delete([], keep_last=3, keep_every=4) == []


def test_keep_every_milestones_survive() -> None:
    assert to_delete(range(1, 10), keep_last=2, keep_every=4) == [1, 2, 3, 5, 6, 7]
    # Step 0 is a multiple of every K.
    assert to_delete(range(0, 6), keep_last=1, keep_every=3) == [1, 2, 4]


def test_protected_steps_survive() -> None:
    # `latest` named an older step (after a rollback) and step 0 is the last resort.
    assert to_delete(range(0, 10), keep_last=2, keep_every=None, protect={0, 4}) == [
        1,
        2,
        3,
        5,
        6,
        7,
    ]
    # A protected step that is not a complete checkpoint is never deleted either.
    assert to_delete([1, 2], keep_last=1, keep_every=None, protect={7}, partial=[7]) == [1]


def test_partial_debris_older_than_the_newest_kept_goes() -> None:
    # Remote: partial step dirs older than the newest kept step are failed uploads; a newer
    # one may be another writer's upload in progress.
    assert to_delete([4, 8, 9], keep_last=2, keep_every=None, partial=[0, 5, 99], uploaded=9) == [
        0,
        4,
        5,
    ]
    # The step just uploaded counts as "newest" even if it was not kept.
    assert to_delete(
        [9, 20, 21], keep_last=2, keep_every=None, protect={9}, partial=[30], uploaded=35
    ) == [30]
    # Nothing kept and no upload: no reference point, so no partial dir is called debris.
    assert to_delete([], keep_last=1, keep_every=None, partial=[1, 2]) == []


def test_local_retain_uses_the_rule(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for s in range(0, 7):
        ckpt.save(root, s, {"step": torch.tensor(s)})
    ckpt.write_latest(root, 2)  # a rollback target, older than keep_last
    assert ckpt.retain(root, keep_last=2, keep_every=3, protect={0}) == [1, 4]
    assert ckpt.steps(root) == [0, 2, 3, 5, 6]
