"""Counting the host reads of the trainer's step (tests of the step's host-device
synchronisations, and of the recipe options that must add none): `count_host_reads`, a
small `trainer` and `reads_per_step`."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from tests.support.factories import TINY
from tests.support.helpers import ROOT
from training.config import parse_train_config
from training.faults import Hooks
from training.trainer import Trainer

# What brings a tensor's value to the host (on CUDA: a synchronisation each).
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu")
# torch's optimizers read their step counters (`state["step"]`), one per parameter; those
# live on the host even when the parameters are on CUDA, so they are counted apart.
OPTIM_DIR = os.path.dirname(torch.optim.__file__)
TORCH_DIR = os.path.dirname(torch.__file__)
# Reads per optimizer step, besides the optimizer's: the trainer's one transfer.
BUDGET = 1


def _place(frame: types.FrameType) -> str:
    """`path:line function` of a frame, the path from torch's parent (site-packages, tried
    first: the venv may lie inside the repository) or the repository root, so that a
    report names the same place on any machine."""
    path = frame.f_code.co_filename
    for base in (os.path.dirname(TORCH_DIR), str(ROOT)):
        if path.startswith(base + os.sep):
            path = os.path.relpath(path, base)
            break
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


def read_site(frame: types.FrameType) -> str:
    """Where a host read comes from: the frame that made it and, when that is torch's own
    code, the first frame outside torch (the call of ours that led there)."""
    site = _place(frame)
    outer: types.FrameType | None = frame
    while outer is not None and outer.f_code.co_filename.startswith(TORCH_DIR + os.sep):
        outer = outer.f_back
    if outer is not None and outer is not frame:
        site += f" <- {_place(outer)}"
    return site


@contextlib.contextmanager
def count_host_reads(
    sites: collections.Counter[str] | None = None,
) -> Iterator[collections.Counter[str]]:
    """Counts, by method, the host reads this thread makes inside the block (the loader's
    prefetch thread is not the step's); those made by torch's optimizer code count under
    "optim.<method>". With `sites`, each read is also counted there under
    "<method> @ <read_site>" (slower: for finding where reads come from). The Tensor
    methods are restored on exit."""
    counts: collections.Counter[str] = collections.Counter()
    me = threading.get_ident()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str, fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if threading.get_ident() == me:
                frame = sys._getframe(1)
                caller = frame.f_code.co_filename
                counts[f"optim.{name}" if caller.startswith(OPTIM_DIR) else name] += 1
                if sites is not None:
                    sites[f"{name} @ {read_site(frame)}"] += 1
            return fn(self, *args, **kwargs)

        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def trainer(dataset: str, run_dir: Path, accum: int, hooks: Hooks | None = None, **over) -> Trainer:
    cfg = {
        "dataset": dataset,
        "run_dir": str(run_dir),
        "steps": 8,
        "micro_batch": 4,
        "accum_steps": accum,
        "eval_every": 1000,
        "model": dict(TINY),
        "checkpoint": {"every": 1000},
        "schedule": {"warmup_steps": 2},
        **over,
    }
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
