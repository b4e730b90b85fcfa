"""How the model is spread over ranks: nothing on one process, DDP (replicated, gradients
all-reduced), or FSDP2 (`fully_shard`: parameters, gradients and optimizer state sharded).
Called before the optimizer exists. Where tensor and pipeline parallelism will compose."""

from __future__ import annotations

import torch

from training.distributed import World
from training.model import GPT


def parallelize(
    model: GPT, world: World, device: torch.device, parallel: str
) -> tuple[torch.nn.Module, torch.nn.parallel.DistributedDataParallel | None, bool]:
    """(the module to call for the forward pass, the DDP wrapper or None, whether FSDP2
    shards the model)."""
    if not world.active:
        return model, None, False
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        # Each block is a unit (its parameters are gathered just before it runs), then the
        # root (embeddings, final norm, head).
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, None, True
    # Same seed on every rank gives the same init; DDP also broadcasts rank 0's.
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    return ddp, ddp, False
