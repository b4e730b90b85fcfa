"""Warm start (`init_from`): another run's checkpointed weights as a new run's step 0.
Only the model's tensors are taken; the optimizer, schedule and data start afresh."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from training import checkpoint as ckpt
from training.export_hf import ExportError, find_checkpoint, load_checkpoint


def checkpoint_weights(path: str | Path) -> tuple[str, dict[str, Tensor]]:
    """(the step directory read, its model state dict on the CPU) for a step-N directory,
    a checkpoint directory (its latest step) or a run directory; local or DCP checkpoints.
    Every file's sha256 is checked. Raises CheckpointError with one line."""
    try:
        root, step = find_checkpoint(path)
        _, weights = load_checkpoint(root, step)
    except ExportError as e:
        raise ckpt.CheckpointError(f"init_from: {e}") from None
    return str(root / ckpt.step_name(step)), weights


def check_shapes(theirs: dict[str, Tensor], ours: dict[str, Tensor], where: str) -> None:
    """Raise CheckpointError naming the first parameter (in this model's order) that is
    missing from `theirs` or has another shape there, or the first one `theirs` has and
    this model has not."""
    for name, t in ours.items():
        if name not in theirs:
            raise ckpt.CheckpointError(f"init_from {where}: it has no parameter {name}")
        if tuple(theirs[name].shape) != tuple(t.shape):
            raise ckpt.CheckpointError(
                f"init_from {where}: parameter {name} has shape {list(theirs[name].shape)} "
                f"there, {list(t.shape)} here"
            )
    extra = next((n for n in theirs if n not in ours), None)
    if extra is not None:
        raise ckpt.CheckpointError(
            f"init_from {where}: its parameter {extra} has no place in this model"
        )
