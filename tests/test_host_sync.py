"""The trainer's step reads values back from the device a fixed number of times per
optimizer step, however many micro-batches it accumulates: on CUDA every such read waits
for all queued kernels, so one per micro-batch would keep the host from running ahead.

On CPU the reads are counted by wrapping the Tensor methods that bring a value to the host
(`.item()`, `.tolist()`, `bool()`, `int()`, `float()`...); on CUDA torch's sync debug mode
counts the synchronisations themselves. `.numpy()` is not counted: it works on host tensors
only (the trainer reads the loader's batch with it), so it can never wait on a device."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from training.config import parse_train_config
from training.faults import Faults, Hooks
from training.trainer import Trainer

TINY = {"d_model": 32, "n_layer": 2, "n_head": 2}
# What brings a tensor's value to the host (on CUDA: a synchronisation each).
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu")
# torch's optimizers read their step counters (`state["step"]`), one per parameter; those
# live on the host even when the parameters are on CUDA, so they are counted apart.
OPTIM_DIR = os.path.dirname(torch.optim.__file__)
# Reads per optimizer step, besides the optimizer's: the trainer's one transfer.
BUDGET = 1


@contextlib.contextmanager
def count_host_reads() -> Iterator[collections.Counter[str]]:
    """Counts, by method, the host reads this thread makes inside the block (the loader's
    prefetch thread is not the step's); those made by torch's optimizer code count under
    "optim.<method>". The Tensor methods are restored on exit."""
    counts: collections.Counter[str] = collections.Counter()
    me = threading.get_ident()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str, fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if threading.get_ident() == me:
                caller = sys._getframe(1).f_code.co_filename
                counts[f"optim.{name}" if caller.startswith(OPTIM_DIR) else name] += 1
            return fn(self, *args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


class ReadsLoss(Hooks):
    """The old step's habit: the loss read back on the host after every micro-batch."""

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        loss.item()
        return loss


def trainer(dataset: str, run_dir: Path, accum: int, hooks: Hooks | None = None,
            **over) -> Trainer:
    cfg = {"dataset": dataset, "run_dir": str(run_dir), "steps": 8, "micro_batch": 4,
           "accum_steps": accum, "eval_every": 1000, "model": dict(TINY),
           "checkpoint": {"every": 1000}, "schedule": {"warmup_steps": 2}, **over}
    return Trainer(parse_train_config(cfg), hooks)


def reads_per_step(t: Trainer, steps: int) -> tuple[list[int], list[int], list[str]]:
    """For each of `steps` train_step() calls: the host reads, those outside torch's
    optimizer, and the guard's verdict."""
    reads, ours, actions = [], [], []
    try:
        for _ in range(steps):
            with count_host_reads() as counts:
                out = t.train_step()
            reads.append(sum(counts.values()))
            ours.append(sum(v for k, v in counts.items() if not k.startswith("optim.")))
            actions.append(out.decision.action if out.decision else "fp16")
            t.state.step += 1
            t.state.samples_seen += out.samples
    finally:
        t.loader.close()
        t.ckpts.close()
    return reads, ours, actions


def test_the_counter_sees_every_kind_of_host_read():
    x = torch.tensor([2.5])
    before = {n: getattr(torch.Tensor, n) for n in HOST_READS}
    with count_host_reads() as counts:
        x.item()
        x.tolist()
        bool(x)
        float(x)
        int(x)
        range(4)[torch.tensor(1)]
        x.cpu()
    assert counts == dict.fromkeys(HOST_READS, 1)
    assert all(getattr(torch.Tensor, n) is before[n] for n in HOST_READS)  # restored


def test_a_read_per_micro_batch_would_show(train_dataset, tmp_path):
    """The count can fail: a step that reads the loss back per micro-batch (as the step
    once did) makes accum - 1 more reads with accum micro-batches."""
    one, _, _ = reads_per_step(trainer(train_dataset, tmp_path / "1", 1, ReadsLoss()), 2)
    four, _, _ = reads_per_step(trainer(train_dataset, tmp_path / "4", 4, ReadsLoss()), 2)
    assert [f - o for f, o in zip(four, one, strict=True)] == [3, 3]


@pytest.mark.parametrize("guards", [{"enabled": False}, {"warmup_steps": 3}],
                         ids=["no-guards", "spike-guard"])
def test_host_reads_per_step_do_not_grow_with_micro_batches(train_dataset, tmp_path, guards):
    """accum 1 and accum 4 (same micro-batch) read the same number of times per optimizer
    step, a few; with the spike guard on, a step it drops costs no extra read either."""
    spike = Faults(spike_at={6}, spike_factor=1000.0)
    one, ours1, acts1 = reads_per_step(trainer(train_dataset, tmp_path / "1", 1, spike,
                                               guards=guards), 8)
    four, ours4, acts4 = reads_per_step(trainer(train_dataset, tmp_path / "4", 4, spike,
                                                guards=guards), 8)
    assert one == four, (one, four)
    assert ours1 == ours4 == [BUDGET] * 8, (ours1, ours4)
    if guards.get("enabled", True):
        assert acts1[6] == acts4[6] == "skip"
        assert acts1[:6] == acts4[:6] == ["ok"] * 6
    else:
        assert acts4 == ["ok"] * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_synchronisations_per_step_do_not_grow_with_micro_batches(train_dataset,
                                                                      tmp_path):
    """torch's sync debug mode warns at each synchronisation with the device."""

    def syncs(accum: int) -> list[int]:
        t = trainer(train_dataset, tmp_path / str(accum), accum, device="cuda")
        counts = []
        try:
            t.train_step()  # the first step sets up (optimizer state, allocator)
            for _ in range(3):
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        t.train_step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                counts.append(sum("synchronizing" in str(w.message) for w in seen))
        finally:
            t.loader.close()
            t.ckpts.close()
        return counts

    one, four = syncs(1), syncs(4)
    assert one == four, (one, four)
    assert max(four) <= 2, four
