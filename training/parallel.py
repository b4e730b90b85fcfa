"""How the model is spread over ranks, from the config's `parallel` setting resolved against
the world size (training/config/parallel.py): nothing on one process, DDP (replicated,
gradients all-reduced), FSDP2 (`fully_shard`: parameters, gradients and optimizer state
sharded), or tensor parallelism and/or HSDP composed with FSDP2 on one device mesh
(dp_replicate, dp_shard, tp). Pipeline parallelism (pp > 1) is training/pipeline.py's: its
mesh has pp outermost, and it calls apply_tp and fully_shard on each stage.
Called before the optimizer exists.

Tensor parallelism follows torchtitan's plan for LLaMA (torchtitan/models/llama3/infra/
parallelize.py), with torch's own `torch.distributed.tensor.parallel` and no collective of
our own:

* the residual stream between blocks is split by sequence over the TP ranks (sequence
  parallelism): the embeddings reduce-scatter into it, the norms work on their shard;
* attention and MLP gather the sequence, run column-parallel input projections (W_Q, W_K,
  W_V, w_gate, w_up: each rank holds whole heads / a slice of the hidden units) and
  row-parallel output projections (W_O, w_down), which reduce-scatter back to the sequence
  split;
* QK-norm's per-head norms see the rank's own heads (their weight is replicated and its
  gradient summed over the TP ranks by DTensor);
* the head: a column-parallel `lm_head`, or, tied, the vocabulary-split embedding matrix
  (model.tied_head); both give every TP rank the full logits, so the loss is unchanged.

Every parameter becomes a DTensor on the TP mesh, then FSDP2 shards it over the dp mesh
(HSDP when dp_replicate > 1: replicated over that dimension, sharded over dp_shard): one
mesh, so clip_grad_norm_ returns the norm over the whole mesh, and DCP saves and reshards
everything.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch
from torch import nn

from training.config import TrainConfigError
from training.config.parallel import (
    MESH_ENV,
    MeshShape,
    ParallelConfig,
    ParallelSizeError,
    check_seq_len,
    resolve,
)
from training.distributed import World
from training.model import GPT


def parallelize(
    model: GPT, world: World, device: torch.device, parallel: str | ParallelConfig
) -> tuple[nn.Module, nn.parallel.DistributedDataParallel | None, bool, World]:
    """(the module to call for the forward pass, the DDP wrapper or None, whether the
    parameters are sharded (DTensors: FSDP2 and/or TP; checkpoints go through DCP), the
    world with its data-parallel layout)."""
    try:
        shape = resolve(parallel, world.size)
        check_seq_len(shape, model.max_seq_len)
        check_model(model, shape)
    except ParallelSizeError as e:
        raise TrainConfigError(str(e)) from None
    # The trainer builds pipelines itself (training/pipeline.py: the model is split first).
    assert shape.pp == 1, "parallel.pp > 1 goes through training.pipeline.build_pipeline"
    mode = shape.mode
    if mode == "single":
        return model, None, False, world
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        # Each block is a unit (its parameters are gathered just before it runs), then the
        # root (embeddings, final norm, head).
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, None, True, world
    if mode == "ddp":
        # Same seed on every rank gives the same init; DDP also broadcasts rank 0's.
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        return ddp, ddp, False, world
    return _mesh(model, world, device, shape)


def check_mesh_env(shape: MeshShape, env: Mapping[str, str] = os.environ) -> None:
    """ParallelSizeError when the job's BALLAST_MESH names another mesh than `shape`: the
    config was edited after the launch, or the job runs on another process count than it
    was submitted for. Either way the job's labels, the launch checks (TP within a node,
    stages on node boundaries) and the checkpoints' mesh are not what the launcher saw, so
    refuse before any rank builds a mesh. Unset (or empty): not launched by Ballast, no
    check."""
    launched = env.get(MESH_ENV, "").strip()
    if not launched:
        return
    ours = shape.name
    if launched != ours:
        raise ParallelSizeError(
            f"{MESH_ENV} is {launched} (the mesh the launcher resolved), but parallel: "
            f"builds {ours} on {shape.world_size} ranks here; launch the job again from "
            f"this config, or unset {MESH_ENV}"
        )


def check_model(model: GPT, shape: MeshShape) -> None:
    """What the config could not check: the mesh is the one the job was launched for
    (check_mesh_env), and every matrix that TP splits splits evenly (the MLP's hidden
    size, which SwiGLU rounds). Both the plain meshes (parallelize) and the pipeline
    (training/pipeline.py) call it right after resolving the shape."""
    check_mesh_env(shape)
    if shape.tp == 1:
        return
    hidden = model.blocks[0].mlp.w_up.out_features
    if hidden % shape.tp:
        raise ParallelSizeError(
            f"parallel.tp {shape.tp} does not divide the MLP's hidden size {hidden} "
            "(model.mlp_ratio x d_model; SwiGLU: 2/3 of it rounded up to a multiple of 8)"
        )


def _mesh(
    model: GPT, world: World, device: torch.device, shape: MeshShape
) -> tuple[nn.Module, None, bool, World]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Outermost first: the ranks of one TP group are consecutive (one node's GPUs).
    if shape.dp_replicate == 1:
        mesh = init_device_mesh(
            device.type, (shape.dp_shard, shape.tp), mesh_dim_names=("dp_shard", "tp")
        )
        dp_mesh = mesh["dp_shard"]
        dp_group = dp_mesh.get_group()
    else:
        mesh = init_device_mesh(
            device.type,
            (shape.dp_replicate, shape.dp_shard, shape.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )
        # A 2-D mesh makes fully_shard HSDP: replicated over the first dimension, sharded
        # over the second. Data and sums go over both, one group (torchtitan's "dp").
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        dp_group = dp_mesh._flatten("dp").get_group()
    if shape.tp > 1:
        apply_tp(model, mesh["tp"])
    # FSDP2 on the dp dimension(s), even of size 1: one code path (gradient sync control,
    # DCP state dicts) and every parameter on the same mesh.
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    world = dataclasses.replace(world, tp=shape.tp, dp_group=dp_group)
    return model, None, True, world


def apply_tp(model: GPT, tp_mesh: object) -> None:
    """Tensor (and sequence) parallelism over `tp_mesh`, in place; see the module's
    docstring for the plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # A pipeline stage (training/pipeline.py) holds some of the root's modules (None the
    # others) and some of the blocks (a ModuleDict by layer number).
    root_plan: dict[str, object] = {}
    if model.wte is not None:
        # Vocabulary-split embedding; its output is reduce-scattered to the sequence split.
        root_plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.ln_f is not None:
        # ln_f's output stays a DTensor: the head (module or tied) gathers it itself.
        root_plan["ln_f"] = SequenceParallel(use_local_output=False)
    if model.wpe is not None:  # learned positions: split like the tokens, then added
        root_plan["wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.lm_head is not None:
        root_plan["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)  # type: ignore[arg-type]

    gather = PrepareModuleInput(
        input_layouts=(Shard(1), None, None),
        desired_input_layouts=(Replicate(), None, None),
        use_local_output=True,
    )
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        plan: dict[str, object] = {
            "ln_1": SequenceParallel(use_local_output=False),
            "attn": gather,
            "attn.w_q": ColwiseParallel(),
            "attn.w_k": ColwiseParallel(),
            "attn.w_v": ColwiseParallel(),
            "attn.w_o": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
            "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=Shard(1)),
        }
        if block.ln_2 is not None:  # a sequential block; a parallel one shares ln_1
            plan["ln_2"] = SequenceParallel(use_local_output=False)
        if block.mlp.w_gate is not None:
            plan["mlp.w_gate"] = ColwiseParallel()
        if block.attn.q_norm is not None:
            # q, k are (B, heads, T, head_dim) here, split by heads: dimension 1.
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]
