"""The `parallel` section of the training config: how the ranks of a torchrun job form one
device mesh (data parallel replicated / sharded, tensor parallel, pipeline parallel), its
checks against the model (here) and against the world size (at start, `resolve`).

The two old settings stay valid and mean what they always did: `ddp` is every rank a
replica (`dp_replicate: -1`), `fsdp2` every rank a shard (`dp_shard: -1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from core.config import Strict

if TYPE_CHECKING:
    from training.config import TrainConfig

# -1 in a data-parallel degree: whatever the other degrees leave of the world size.
FILL = -1


class ParallelConfig(Strict):
    dp_replicate: int = Field(
        default=1,
        ge=FILL,
        description=(
            "Data-parallel replicas (DDP when it is the only degree above 1; with dp_shard, "
            "HSDP); -1 = what the other degrees leave of the world size."
        ),
    )
    dp_shard: int = Field(
        default=FILL,
        ge=FILL,
        description=(
            "Data-parallel shards (FSDP2 `fully_shard` over this mesh dimension); -1 (the "
            "default) = what the other degrees leave of the world size."
        ),
    )
    tp: int = Field(
        default=1,
        ge=1,
        description=(
            "Tensor-parallel degree (torch.distributed.tensor.parallel: attention and MLP "
            "column/row parallel, sequence parallel norms). Ranks of one TP group are "
            "consecutive (keep it within a node) and see the same batch. Must divide n_head, "
            "d_model and the MLP's hidden size, and (at start) the sequence length."
        ),
    )
    pp: int = Field(
        default=1,
        ge=1,
        description=(
            "Pipeline-parallel degree (torch.distributed.pipelining): the blocks split evenly "
            "into pp stages (interleaved_1f1b: 2 virtual stages per rank), the first holding "
            "the embeddings, the last the final norm, head and loss. The outermost mesh "
            "dimension (stages map to nodes). pp x 1 (x 2 interleaved) must divide n_layer; "
            "needs untied embeddings, adamw, fp32 or bf16."
        ),
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        default="1f1b",
        description=(
            "The pipeline schedule (with pp > 1): gpipe (all forwards, then all backwards), "
            "1f1b (one forward, one backward: less activation memory), interleaved_1f1b "
            "(1f1b over 2 virtual stages per rank: a smaller bubble)."
        ),
    )
    pp_microbatches: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Pieces the pipeline splits each rank's micro-batch into (it must divide "
            "micro_batch / the data-parallel size; 1f1b and interleaved_1f1b need >= pp); "
            "unset = pp. More pieces, a smaller bubble."
        ),
    )

    @model_validator(mode="after")
    def _degrees(self) -> ParallelConfig:
        for key in ("dp_replicate", "dp_shard"):
            if getattr(self, key) == 0:
                raise ValueError(f"{key} must be >= 1, or -1 for the rest of the world size")
        if self.dp_replicate == FILL and self.dp_shard == FILL:
            raise ValueError("only one of dp_replicate and dp_shard can be -1")
        if self.pp > 1 and self.pp_schedule != "gpipe":
            # torch's 1F1B schedules run a backward as soon as a piece leaves the last
            # stage, so every stage needs a piece in flight.
            m = self.microbatches
            if m < self.pp:
                raise ValueError(
                    f"pp_microbatches {m} is fewer than pp {self.pp}; pp_schedule "
                    f"{self.pp_schedule} needs at least one piece per stage"
                )
            rounds = max(1, m // self.pp)
            if self.pp_schedule == "interleaved_1f1b" and m % rounds:
                raise ValueError(
                    f"pp_microbatches {m} is not a multiple of the schedule's rounds "
                    f"({rounds} = pp_microbatches // pp); use a multiple of pp {self.pp}"
                )
        return self

    @property
    def microbatches(self) -> int:
        """The pieces the pipeline splits a rank's micro-batch into."""
        return self.pp_microbatches or self.pp

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per rank: interleaved 1F1B loops over 2 (torchtitan's default)."""
        return 2 if self.pp_schedule == "interleaved_1f1b" else 1


_TAGS = ("name", "mesh")


def _setting_kind(value: Any) -> str:
    return "name" if isinstance(value, str) else "mesh"


# A string is one of the old names, anything else the mapping: the discriminator keeps a
# mistake in either from being reported against both.
ParallelSetting = Annotated[
    Annotated[Literal["ddp", "fsdp2"], Tag("name")] | Annotated[ParallelConfig, Tag("mesh")],
    Discriminator(_setting_kind),
]


def drop_setting_tag(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """An error location without the union's tag (`parallel.mesh.tp` -> `parallel.tp`)."""
    if len(loc) > 1 and loc[0] == "parallel" and loc[1] in _TAGS:
        return (loc[0], *loc[2:])
    return loc


def parallel_config(setting: str | ParallelConfig) -> ParallelConfig:
    """The mapping form of a `parallel` setting: the old strings as the degrees they mean."""
    if setting == "ddp":
        return ParallelConfig(dp_replicate=FILL, dp_shard=1)
    if setting == "fsdp2":
        return ParallelConfig(dp_shard=FILL)
    assert isinstance(setting, ParallelConfig), setting
    return setting


# The mesh a launcher resolved from the config (MeshShape.name), in a submitted job's
# environment (infra/mesh.py sets it, training/parallel.py checks it).
MESH_ENV = "BALLAST_MESH"


@dataclass(frozen=True)
class MeshShape:
    """A `parallel` setting resolved against the world size: every degree a number >= 1,
    their product the world size. The mesh's dimensions are in this order (outermost
    first), so the ranks of one TP group are consecutive."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def name(self) -> str:
        """`pp2-dp1x2-tp4`: the degrees outermost first, dp as replicate x shard. A valid
        Kubernetes label value (letters, digits, '-'), short enough for one; the launcher
        puts it in a job's MESH_ENV and the trainer compares it with the mesh it builds."""
        return f"pp{self.pp}-dp{self.dp_replicate}x{self.dp_shard}-tp{self.tp}"

    @property
    def mode(self) -> Literal["single", "ddp", "fsdp2", "mesh"]:
        """How parallelize() spreads the model: nothing, the plain DDP or 1-D FSDP2 of old
        (bit for bit what `ddp` / `fsdp2` always did), or a device mesh (TP, HSDP)."""
        if self.world_size == 1:
            return "single"
        if self.tp == 1 and self.pp == 1 and self.dp_shard == 1:
            return "ddp"
        if self.tp == 1 and self.pp == 1 and self.dp_replicate == 1:
            return "fsdp2"
        return "mesh"


class ParallelSizeError(ValueError):
    """The `parallel` degrees do not fit the world size or the data."""


def resolve(setting: str | ParallelConfig, world_size: int) -> MeshShape:
    """The degrees of `setting` at `world_size` (WORLD_SIZE); ParallelSizeError naming the
    keys when they do not multiply to it."""
    cfg = parallel_config(setting)
    fixed = cfg.tp * cfg.pp
    known = fixed * max(cfg.dp_replicate, 1) * max(cfg.dp_shard, 1)
    shown = f"dp_replicate {cfg.dp_replicate} x dp_shard {cfg.dp_shard} x tp {cfg.tp} x pp {cfg.pp}"
    if FILL in (cfg.dp_replicate, cfg.dp_shard):
        if world_size % known:
            raise ParallelSizeError(
                f"parallel: {shown}: the world size {world_size} (WORLD_SIZE) is not a "
                f"multiple of {known}, so the -1 degree has no whole value"
            )
        rest = world_size // known
        rep = rest if cfg.dp_replicate == FILL else cfg.dp_replicate
        shard = rest if cfg.dp_shard == FILL else cfg.dp_shard
    else:
        rep, shard = cfg.dp_replicate, cfg.dp_shard
        if known != world_size:
            raise ParallelSizeError(
                f"parallel: {shown} = {known} ranks, but the world size (WORLD_SIZE) is "
                f"{world_size}; make the product equal it, or set dp_shard: -1"
            )
    return MeshShape(rep, shard, cfg.tp, cfg.pp)


def check_seq_len(shape: MeshShape, seq_len: int) -> None:
    """Sequence parallelism splits each row's tokens evenly over the TP group."""
    if seq_len % shape.tp:
        raise ParallelSizeError(
            f"parallel.tp {shape.tp} does not divide the dataset's seq_len {seq_len} "
            "(sequence parallelism splits every row's tokens evenly over the TP ranks)"
        )


def check_tensor_parallel(cfg: TrainConfig) -> None:
    """The checks a config can have before the world size is known: the model splits
    evenly over `tp` (heads, width) and `pp` (layers), and no option is on that does not
    work on tensor-parallel (DTensor) parameters yet. ValueError naming the keys."""
    if cfg.parallel in ("ddp", "fsdp2"):
        return
    p, m = parallel_config(cfg.parallel), cfg.model
    if p.pp > 1:
        check_pipeline(cfg, p)
    if p.tp == 1:
        return
    # Column-parallel Q/K/V give each TP rank whole heads; row-parallel W_O and w_down
    # split d_model's input side. (The model has no grouped-query attention: the key/value
    # heads are the query heads.)
    for key, value in (("model.n_head", m.n_head), ("model.d_model", m.d_model)):
        if value % p.tp:
            raise ValueError(f"parallel.tp {p.tp} does not divide {key} {value}")
    refused = {
        "ema": cfg.ema is not None,
        "stats_every": cfg.stats_every is not None,
        "noise_scale": cfg.noise_scale is not None,
        "init_from": cfg.init_from is not None,
        "optim.agc": cfg.optim.agc is not None,
        # Every TP rank draws the same random numbers for its own shard of the
        # activations: the masks would be correlated across the shards of one tensor.
        "model.dropout (any site)": any(
            (x or 0.0) > 0 for x in (m.dropout, m.attn_dropout, m.resid_dropout, m.embd_dropout)
        ),
    }
    for key, on in refused.items():
        if on:
            raise ValueError(f"{key} is not supported with parallel.tp > 1 yet")
    if cfg.optim.name != "adamw":
        raise ValueError(
            f"optim.name {cfg.optim.name} is not supported with parallel.tp > 1 yet "
            "(adamw is; Muon and Adafactor need whole matrices)"
        )


def check_pipeline(cfg: TrainConfig, p: ParallelConfig) -> None:
    """What pipeline parallelism needs of the model and the options (pp > 1)."""
    m, stages = cfg.model, p.pp * p.virtual_stages
    if m.n_layer % stages:
        shown = f"parallel.pp {p.pp}"
        if p.virtual_stages > 1:
            shown += f" x {p.virtual_stages} virtual stages (pp_schedule {p.pp_schedule})"
        raise ValueError(f"{shown} does not divide model.n_layer {m.n_layer}")
    if m.tie_embeddings:
        raise ValueError(
            "model.tie_embeddings is not supported with parallel.pp > 1 (the embedding lives "
            "on the first stage, the head on the last); set model.tie_embeddings: false"
        )
    refused = {
        "ema": cfg.ema is not None,
        "stats_every": cfg.stats_every is not None,
        "noise_scale": cfg.noise_scale is not None,
        "init_from": cfg.init_from is not None,
        # In-loop evaluators call the whole model on one rank.
        "evals": cfg.evals is not None,
        "optim.agc": cfg.optim.agc is not None,
        # The schedule runs the forward; a compiled wrapper around the model is never called.
        "model.compile": m.compile,
        # GradScaler scales the loss before a backward the schedule runs itself.
        "precision.dtype fp16": cfg.precision.dtype == "fp16",
    }
    for key, on in refused.items():
        if on:
            raise ValueError(f"{key} is not supported with parallel.pp > 1 yet")
    if cfg.optim.name != "adamw":
        raise ValueError(
            f"optim.name {cfg.optim.name} is not supported with parallel.pp > 1 yet "
            "(adamw is; Muon and Adafactor need whole matrices)"
        )
