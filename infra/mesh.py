"""Does the training config's device mesh (`parallel:`) fit the launch (`launch:` nodes x
processes per node)? The `train` flow asks before anything is submitted, so a mesh that
cannot start fails at once with the keys to change, not minutes later in a pod.

The mesh's dimensions are (pp, dp_replicate, dp_shard, tp), outermost first, and torchrun
gives the processes of one node consecutive ranks. So a TP group (tp consecutive ranks) is
within one node exactly when tp divides nproc_per_node, and a pipeline stage (the
world / pp consecutive ranks of one dp x tp block) is whole nodes or within one node
exactly when pp divides nnodes or nnodes divides pp.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError
from training.config.parallel import (
    FILL,
    MeshShape,
    ParallelConfig,
    ParallelSizeError,
    parallel_config,
    resolve,
)
from training.config.parallel import (
    MESH_ENV as MESH_ENV,  # where the launcher's callers find it
)


# The mesh as the flow resolved it (mesh_name), in the job's environment (MESH_ENV): the
# pod's labels (infra/k8s_manifests.py), a person reading `kubectl describe` and the
# trainer's check (training/parallel.py check_mesh_env) see the same value.
def mesh_name(shape: MeshShape) -> str:
    """`pp2-dp1x2-tp4` (MeshShape.name): the job's MESH_ENV and its mesh label."""
    return shape.name


@dataclass(frozen=True)
class MeshFit:
    """A mesh that fits the launch, and what about it is allowed but slow."""

    shape: MeshShape
    warnings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return mesh_name(self.shape)


def check_tp(tp: int, nproc_per_node: int) -> None:
    """Refused, not warned: a TP group's collectives (all-gather and reduce-scatter of the
    activations, in every layer, forward and backward) are on the critical path. Across
    the network instead of NVLink they cost more than TP saves."""
    if nproc_per_node % tp:
        raise ConfigError(
            f"launch.nproc_per_node {nproc_per_node} is not a multiple of parallel.tp {tp} "
            "(a TP group must sit within one node: its collectives run in every layer and "
            "need NVLink)"
        )


def pp_warnings(shape: MeshShape, nnodes: int, nproc_per_node: int) -> tuple[str, ...]:
    """Warned, not refused, when a pipeline stage's dp x tp block straddles a node boundary
    (pp divides neither nnodes nor is divided by it). It trains correctly and TP groups stay
    within nodes (check_tp); what is lost is bandwidth: the straddling stage's FSDP
    collectives mix NVLink and network links and one node carries two stages' traffic.
    Those collectives overlap with compute and FSDP across nodes is the multi-node norm,
    so the cost is a fraction, and the node count or the layer count sometimes leaves no
    better pp: a refusal with nothing to turn it off would stop such a run for no gain."""
    if shape.pp == 1 or nnodes == 1 or nnodes % shape.pp == 0 or shape.pp % nnodes == 0:
        return ()
    stage = shape.world_size // shape.pp
    return (
        f"parallel.pp {shape.pp} and launch.nnodes {nnodes} divide neither way, so a pipeline "
        f"stage's {stage} processes (dp x tp) straddle the {nproc_per_node}-GPU nodes and "
        "their FSDP collectives cross the network where they could stay within a node; "
        "choose nnodes a multiple or a divisor of pp for stages that line up with nodes",
    )


def check_fit(shape: MeshShape, nnodes: int, nproc_per_node: int) -> tuple[str, ...]:
    """ConfigError naming the keys when `shape` cannot run on nnodes x nproc_per_node
    processes; else the warnings (pp_warnings). Works on any MeshShape, pp included."""
    world = nnodes * nproc_per_node
    check_tp(shape.tp, nproc_per_node)
    if shape.world_size != world:
        raise ConfigError(
            f"parallel: pp {shape.pp} x dp_replicate {shape.dp_replicate} x dp_shard "
            f"{shape.dp_shard} x tp {shape.tp} = {shape.world_size} processes, but "
            f"launch.nnodes {nnodes} x launch.nproc_per_node {nproc_per_node} = {world}"
        )
    return pp_warnings(shape, nnodes, nproc_per_node)


def fit_launch(parallel: str | ParallelConfig, nnodes: int, nproc_per_node: int) -> MeshFit:
    """The training config's `parallel` setting resolved at nnodes x nproc_per_node (the
    `launch:` section), checked against it: ConfigError on one line naming the keys."""
    cfg = parallel_config(parallel)
    check_tp(cfg.tp, nproc_per_node)  # first: it is the advice that helps when both fail
    world = nnodes * nproc_per_node
    try:
        shape = resolve(cfg, world)
    except ParallelSizeError:
        raise ConfigError(_size_message(cfg, nnodes, nproc_per_node)) from None
    return MeshFit(shape, check_fit(shape, nnodes, nproc_per_node))


def _size_message(cfg: ParallelConfig, nnodes: int, nproc_per_node: int) -> str:
    world = nnodes * nproc_per_node
    launch = f"launch.nnodes {nnodes} x launch.nproc_per_node {nproc_per_node} = {world}"
    fixed = [("pp", cfg.pp), ("tp", cfg.tp)] + [
        (key, getattr(cfg, key))
        for key in ("dp_replicate", "dp_shard")
        if getattr(cfg, key) != FILL
    ]
    product = 1
    for _, degree in fixed:
        product *= degree
    shown = " x ".join(f"parallel.{key} {degree}" for key, degree in fixed)
    filled = [key for key in ("dp_replicate", "dp_shard") if getattr(cfg, key) == FILL]
    if filled:
        return (
            f"{launch} processes is not a multiple of {shown} = {product}, so "
            f"parallel.{filled[0]} -1 has no whole value"
        )
    return (
        f"{shown} = {product} processes, but {launch}; make them equal, or set "
        "parallel.dp_shard: -1"
    )
