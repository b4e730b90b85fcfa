"""The training loader: a prefetching `Loader` serves exactly the micro-batches a
synchronous one does, resume from a saved sampler position is exact, and it shuts down
without leaving a thread behind."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pyarrow as pa
import pytest
import torch

from core.dataset import row_schema
from tests.support.helpers import ROOT
from training.data import Loader, Sampler, Split


def packed_split(rows: int, seq_len: int) -> Split:
    rng = np.random.default_rng(7)
    cols = {}
    for field in row_schema(seq_len):
        dtype = np.int8 if field.name == "loss_mask" else np.int32
        values = rng.integers(0, 100, size=rows * seq_len).astype(dtype)
        cols[field.name] = pa.FixedSizeListArray.from_arrays(pa.array(values), seq_len)
    return Split(pa.table(cols, schema=row_schema(seq_len)), seq_len)


def assert_same_batch(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def step_batches(
    loader: Loader, samples_seen: int, micro: int, accum: int
) -> list[dict[str, torch.Tensor]]:
    """A training step's micro-batches, fetched as the trainer fetches them."""
    return [loader.get(samples_seen + k * micro, micro) for k in range(accum)]


def test_a_micro_batch_is_named_by_its_position() -> None:
    """What the loader's keying rests on: sample j of a step taken at `p` is the sample at
    position p + j, across epoch edges too."""
    sampler = Sampler(10, seed=3)
    for p in (0, 4, 9, 17, 28):
        whole = sampler.take(p, 12)
        for j in range(0, 12, 3):
            assert np.array_equal(whole[j : j + 3], sampler.take(p + j, 3))


@pytest.mark.parametrize("shuffle", [True, False])
def test_prefetching_loader_yields_the_synchronous_batches(shuffle: bool) -> None:
    """The same batches in the same order as loading synchronously, through epoch edges,
    a changing grad accumulation, a rollback (the position moves back) and a data skip
    (forward), with this rank's slice of each micro-batch."""
    split, micro = packed_split(rows=10, seq_len=8), 4
    select = lambda idx: idx[2:]  # noqa: E731 (rank 1 of 2)
    sync = Loader(split, Sampler(split.rows, 5, shuffle), select, depth=0)
    with Loader(split, Sampler(split.rows, 5, shuffle), select, depth=2) as ahead:
        pos, served = 0, 0
        plan = [(1, None), (2, None), (3, None), (1, 8), (2, None), (1, 40), (2, None)]
        for accum, jump_to in plan:
            if jump_to is not None:
                pos = jump_to
            got = step_batches(ahead, pos, micro, accum)
            want = step_batches(sync, pos, micro, accum)
            for a, b in zip(got, want, strict=True):
                assert_same_batch(a, b)
                assert len(a["input_ids"]) == micro // 2
            pos += micro * accum
            served += accum
        assert served == 12
        assert len(ahead._ahead) == 2  # the next two micro-batches are on their way


def test_resume_from_a_saved_position_is_exact() -> None:
    """The loader keeps no state: the position a checkpoint saves is the trainer's
    `samples_seen` after the steps that consumed their batches. A fresh loader started
    there (a restart) serves exactly what the uninterrupted one served next, although the
    first one had already prefetched past that point."""
    split, micro, accum = packed_split(rows=10, seq_len=8), 3, 2
    with Loader(split, Sampler(split.rows, 1), depth=2) as first:
        samples_seen = 0
        for _ in range(3):
            step_batches(first, samples_seen, micro, accum)
            samples_seen += micro * accum
        saved = samples_seen  # what the checkpoint after step 3 records
        assert first._ahead[0][0] == (saved, micro)  # already prefetched beyond the save
        uninterrupted = [
            step_batches(first, saved + i * micro * accum, micro, accum) for i in range(4)
        ]
    with Loader(split, Sampler(split.rows, 1), depth=2) as resumed:
        again = [step_batches(resumed, saved + i * micro * accum, micro, accum) for i in range(4)]
    for a_step, b_step in zip(uninterrupted, again, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            assert_same_batch(a, b)


def test_loader_shuts_down_cleanly() -> None:
    split = packed_split(rows=10, seq_len=8)
    loader = Loader(split, Sampler(split.rows, 0), depth=2)
    loader.get(0, 2)
    assert any(t.name.startswith("prefetch") for t in threading.enumerate())
    loader.close()
    loader.close()  # idempotent
    assert not any(t.name.startswith("prefetch") for t in threading.enumerate())
    # An interpreter exit with batches still queued and no close(): no hanging thread.
    code = (
        "import numpy as np, pyarrow as pa\n"
        f"from {__name__} import packed_split\n"
        "from training.data import Loader, Sampler\n"
        "s = packed_split(1000, 64)\n"
        "loader = Loader(s, Sampler(s.rows, 0), depth=2)\n"
        "loader.get(0, 256)\n"
        "print('exiting')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0 and out.stdout == "exiting\n", out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_pinned_batches_are_the_same_batches() -> None:
    split = packed_split(rows=10, seq_len=8)
    plain = Loader(split, Sampler(split.rows, 0), depth=0)
    with Loader(split, Sampler(split.rows, 0), pin_memory=True, depth=2) as pinned:
        for pos in (0, 4, 8):
            got = pinned.get(pos, 4)
            assert all(t.is_pinned() for t in got.values())
            # The trainer's to_device pins again: a no-op on a pinned tensor, not a copy.
            assert all(t.pin_memory().data_ptr() == t.data_ptr() for t in got.values())
            assert_same_batch({n: t.clone() for n, t in got.items()}, plain.get(pos, 4))
