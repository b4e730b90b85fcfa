"""How a run writes and reads its checkpoints: one manager per parallelism, chosen once,
so the trainer never asks which kind it has.

- `LocalCheckpoints` (one process, DDP): every rank holds the same state, rank 0 writes
  it (`checkpoint.save`, optionally in a background thread), the others wait.
- `ShardedCheckpoints` (FSDP2): every rank holds a shard, all of them write (DCP),
  optionally asynchronously in a process group of its own.

Restores go by what is on disk, not by how this run writes: a DCP checkpoint is
resharded on load, so a sharded run can resume at another world size or mesh, one process
included; a plain checkpoint is split on load into a sharded (FSDP2, tensor-parallel)
model. The on-disk formats are those of `training.checkpoint.format`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from training import distributed
from training.checkpoint import format as ckpt
from training.distributed import World

AfterSave = Callable[[int], None]  # rank 0, once checkpoint `step` is in place


class CheckpointManager(Protocol):
    root: Path

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint `step`: the model and optimizer, plus `state` (everything else exact
        resume needs). Called by every rank."""

    def restore(self, step: int, verified: bool = False) -> dict[str, Any]:
        """Load checkpoint `step` into the model and optimizer; returns the rest of its
        state. `verified`: rank 0 has just checked its checksums. Called by every rank."""

    def check(self) -> None:
        """Raise at once the error of a background save that has failed (every step)."""

    def finish(self) -> None:
        """Wait for the checkpoint being written (before anything reads checkpoints)."""

    def close(self) -> None:
        """On the way out, whatever happened: never leave a save half-way."""


class _Checkpoints:
    def __init__(
        self,
        root: Path,
        world: World,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        after_save: AfterSave,
    ):
        self.root, self.world, self.device = root, world, device
        self.model, self.optimizer, self.after_save = model, optimizer, after_save
        # Parameters that are DTensors (FSDP2, tensor parallelism) take a plain
        # checkpoint through torch's distributed state-dict API.
        self.sharded = any(hasattr(p, "device_mesh") for p in model.parameters())

    def _barrier(self) -> None:
        distributed.barrier(self.world)

    def restore(self, step: int, verified: bool = False) -> dict[str, Any]:
        if ckpt.is_sharded(self.root, step):  # DCP: any world size, resharded on load
            return ckpt.load_sharded(
                self.root, step, self.model, self.optimizer, self.device, verified=verified
            )
        st, error = None, None
        if self.world.is_main:
            try:
                st = ckpt.load(self.root, step, map_location=self.device, verified=verified)
            except ckpt.CheckpointError as e:
                error = str(e)
        # The error too: the other ranks must not wait for a state that never comes.
        st, error = distributed.broadcast_object((st, error), self.world, self.device)
        if error is not None:
            raise ckpt.CheckpointError(error)
        if self.sharded:  # a plain checkpoint resumed on a mesh (1 process -> TP, FSDP2)
            ckpt.load_full_into_sharded(self.model, self.optimizer, st)
        else:
            self.model.load_state_dict(st["model"])
            self.optimizer.load_state_dict(st["optimizer"])
        return st


class LocalCheckpoints(_Checkpoints):
    """One process or DDP: rank 0 writes the whole state (`async_save`: in a background
    thread, the loop blocked only while it is copied into staging buffers)."""

    def __init__(
        self,
        root: Path,
        world: World,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        after_save: AfterSave,
        async_save: bool,
    ):
        super().__init__(root, world, device, model, optimizer, after_save)
        self.async_save = async_save
        self.saver = ckpt.AsyncSaver()

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.world.is_main:
            full = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                **state,
            }
            if self.async_save:
                self.saver.save(self.root, step, full, after=lambda: self.after_save(step))
            else:
                ckpt.save(self.root, step, full)
                self.after_save(step)
        self._barrier()

    def check(self) -> None:
        if self.world.is_main:
            self.saver.check()

    def finish(self) -> None:
        if self.world.is_main:
            self.saver.wait()
        self._barrier()  # nobody reads a checkpoint before it exists

    def close(self) -> None:
        self.saver.wait()


class ShardedCheckpoints(_Checkpoints):
    """FSDP2: every rank writes its shards (DCP); rank 0 adds `state` and moves `latest`.
    With `async_save`, DCP writes in a background thread and runs collectives there, so it
    gets a gloo group of its own (never interleaved with training's); the save is completed
    at the next one or at `finish`."""

    def __init__(
        self,
        root: Path,
        world: World,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        after_save: AfterSave,
        async_save: bool,
    ):
        super().__init__(root, world, device, model, optimizer, after_save)
        self._pending: ckpt.PendingSharded | None = None
        self._pg = None
        if async_save:
            import torch.distributed as dist

            self._pg = dist.new_group(backend="gloo")

    def save(self, step: int, state: dict[str, Any]) -> None:
        self._complete()  # the previous async save is complete before the next starts
        self._pending = ckpt.save_sharded(
            self.root,
            step,
            self.model,
            self.optimizer,
            copy.deepcopy(state),
            self.world.is_main,
            self._barrier,
            self._pg,
        )
        if self._pending is None and self.world.is_main:
            self.after_save(step)

    def _complete(self) -> None:
        p, self._pending = self._pending, None
        if p is not None:
            ckpt.finish_sharded(p, self.world.is_main, self._barrier)
            if self.world.is_main:
                self.after_save(p.step)

    def check(self) -> None:
        pass  # DCP's errors surface when the save is completed (the next save, or finish)

    def finish(self) -> None:
        self._complete()
        self._barrier()

    def close(self) -> None:
        pass  # an unfinished DCP save stays unfinished: `latest` names the previous one


def open_checkpoints(
    root: Path,
    world: World,
    device: torch.device,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    after_save: AfterSave,
    *,
    sharded: bool,
    async_save: bool,
) -> CheckpointManager:
    kind = ShardedCheckpoints if sharded else LocalCheckpoints
    return kind(root, world, device, model, optimizer, after_save, async_save)
