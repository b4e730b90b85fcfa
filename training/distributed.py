"""Multi-process training under torchrun: process group set-up and the few collective
helpers the trainer needs. One process without torchrun is world size 1, and every
helper is then a no-op, so the trainer has one code path.

The global batch (micro_batch x accum_steps samples) and its order do not depend on the
world size: every micro-batch of the global order is split into contiguous, equal
slices, one per rank. Losses are token-weighted across ranks, so the gradient equals the
single-process gradient up to floating-point summation order.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    # The tensor-parallel degree (training.parallel sets it): the ranks of one TP group are
    # consecutive, so a rank's data-parallel rank is rank // tp.
    tp: int = 1
    # The pipeline-parallel degree: the outermost mesh dimension, so the ranks of one
    # pipeline stage are consecutive (size // pp of them) and hold every data-parallel rank.
    pp: int = 1
    # The data-parallel process group (one rank of every TP group); None = every rank.
    dp_group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1


def init(device_type: str) -> World:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT in the environment); world size 1 without it."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return World()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    world = World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    if device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
    return world


# How long a clean exit waits for the other ranks (they are at most one checkpoint write
# behind: the final checkpoint ends in a barrier of its own).
EXIT_BARRIER_S = 120.0


def exit_barrier(world: World) -> None:
    """Every rank at the end before any tears its process group down: a rank that destroys
    its group while another still talks to it can abort the other at exit (CI saw "terminate
    called without an active exception" from a 2-rank run). Bounded, so a peer that is gone
    delays the exit rather than hangs it; only for a clean exit (a failing rank's peers may
    never arrive, and torchrun stops them)."""
    if not world.active or not dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=EXIT_BARRIER_S)
    with contextlib.suppress(RuntimeError):  # a peer gone: nothing left to wait for
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout)
        else:
            dist.barrier()


def shutdown() -> None:
    """Destroy the process group, after what used it: the trainer's cycles (components
    point back at it) hold DDP's reducer, FSDP's and the pipeline schedule's communication
    objects, which are collected here while the interpreter is whole, not in its
    finalization after the group is gone. The caller drops its own references first."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def dp_rank_and_size(world: World) -> tuple[int, int]:
    """(dp_rank, dp_size): which share of every batch this rank reads, and into how many
    shares a batch is split. Equal to (rank, size) without tensor parallelism; the ranks of
    one TP group get the same dp_rank. Anything that shards data (training batches,
    validation batches, evaluators) shards by this, never by the global rank. The stages
    of one pipeline share their batch too."""
    per_stage = world.size // world.pp
    return (world.rank % per_stage) // world.tp, per_stage // world.tp


def rank_slice(idx: np.ndarray, world: World) -> np.ndarray:
    """This rank's contiguous share of a micro-batch of global sample indices (the same
    for every rank of a TP group)."""
    dp_rank, dp_size = dp_rank_and_size(world)
    if len(idx) % dp_size:
        raise ValueError(
            f"micro_batch {len(idx)} is not divisible by the data-parallel size "
            f"{dp_size}; the global batch must split evenly across ranks"
        )
    n = len(idx) // dp_size
    return idx[dp_rank * n : (dp_rank + 1) * n]


def dp_sum(value: float | int, world: World, device: torch.device) -> float:
    """`value` summed over the data-parallel ranks (TP ranks hold the same value once)."""
    if dp_rank_and_size(world)[1] == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=world.dp_group)
    return float(t.item())


def dp_sum_tensor(t: torch.Tensor, world: World) -> torch.Tensor:
    """`t` summed over the data-parallel ranks, in place, without a host read."""
    if dp_rank_and_size(world)[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=world.dp_group)
    return t


def all_sum(value: float | int, world: World, device: torch.device) -> float:
    if not world.active:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def all_sum_tensor(t: torch.Tensor, world: World) -> torch.Tensor:
    """`t` summed over ranks, in place, and returned. Unlike all_sum it never brings the
    value to the host, so the trainer's step does not wait on the device for it."""
    if world.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(world: World) -> None:
    if world.active:
        dist.barrier()


def broadcast_object(obj: Any, world: World, device: torch.device) -> Any:
    """Rank 0's `obj` on every rank (pickled; tensors come back on `device`). For restores:
    under DDP only rank 0 reads a checkpoint, so nodes with their own local disks (pods
    with an emptyDir) start from the same state."""
    if not world.active:
        return obj
    box = [obj if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]
