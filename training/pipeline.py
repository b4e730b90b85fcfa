"""Pipeline parallelism (`parallel.pp > 1`) with torch's own `torch.distributed.pipelining`,
after torchtitan (torchtitan/distributed/pipeline_parallel.py: `pipeline_module_split`,
`build_pipeline_schedule`): each rank keeps only its stages' part of the model, the
schedule (GPipe, 1F1B, interleaved 1F1B) sends activations between the stages and runs the
backward, and the loss lives on the last stage.

The device mesh is (pp, dp_replicate, dp_shard, tp), outermost first: one pipeline stage
is a block of consecutive ranks (a node, say) holding every data-parallel and TP rank, and
the pipeline's stages are its ranks with the same (dp, tp) coordinates.

What the trainer's guarantees need here:

* the model's names stay the one-process model's (`blocks.3.attn.w_q.weight`): each rank
  prunes its GPT in place (the blocks a ModuleDict by layer number, the embeddings only on
  the first stage, the final norm and head only on the last), so DCP checkpoints reshard
  between any pp and one process, and `ballast export hf` reads them;
* the gradient is the one-process gradient: the schedule splits a rank's micro-batch into
  `pp_microbatches` pieces, and each piece's loss is its token-weighted share of the
  micro-batch's (sum over pieces = the micro-batch's mean), with `scale_grads=False`;
* every rank sees the same loss and gradient norm: the loss terms are summed over the
  pipeline's ranks (zero off the last stage), the squared gradient norm too, so the guards
  decide the same everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from training import checkpoint as ckpt
from training import distributed
from training.config import TrainConfig, TrainConfigError
from training.config.parallel import (
    ParallelSizeError,
    check_seq_len,
    parallel_config,
    resolve,
)
from training.data import validation_batches
from training.distributed import World
from training.faults import Hooks
from training.loss import IGNORE_INDEX, lm_loss, shift_targets
from training.model import GPT
from training.optim import param_groups
from training.parallel import apply_tp, check_model

if TYPE_CHECKING:
    from training.trainer import Trainer


def pipeline_degree(setting: Any) -> int:
    """`parallel.pp` of a `parallel` setting (1 for the old names)."""
    return parallel_config(setting).pp


def stage_layers(n_layer: int, n_stages: int) -> list[list[int]]:
    """The blocks of each stage: an even split in order (the config checks it divides)."""
    per = n_layer // n_stages
    return [list(range(s * per, (s + 1) * per)) for s in range(n_stages)]


def rank_stages(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages a pipeline rank runs: looped, as interleaved 1F1B expects (rank r holds
    r, r + pp, ...)."""
    return [pp_rank + k * pp for k in range(virtual)]


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: the same modules (shared with the pruned GPT, so its
    names are the model's) and GPT.forward's arithmetic for its part. The first stage
    takes token ids, the others the residual stream; the last returns float32 logits."""

    def __init__(self, model: GPT, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.wte = model.wte if first else None
        self.wpe = model.wpe if first else None
        self.drop = model.drop if first else None
        self.rotary = model.rotary  # no parameters: every stage computes its own angles
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
        self.ln_f = model.ln_f if last else None
        self.lm_head = model.lm_head if last else None
        self.width_mult = model.width_mult
        self.activation_checkpointing = model.cfg.activation_checkpointing
        # A bound method, not a submodule: the GPT must not become a child of its stage.
        self._attention_mask: Callable[..., Any] = model.attention_mask

    def forward(
        self, h: Tensor, position_ids: Tensor, segment_ids: Tensor, single_segment: bool
    ) -> Tensor:
        if self.wte is not None:
            x = self.wte(h)
            if self.wpe is not None:
                x = x + self.wpe(position_ids)
            assert self.drop is not None
            x = self.drop(x)
        else:
            x = h
        rope = self.rotary(position_ids) if self.rotary is not None else None
        mask = self._attention_mask(segment_ids, self.training, single_segment)
        for block in self.blocks.values():
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, mask, use_reentrant=False)
            else:
                x = block(x, rope, mask)
        if self.ln_f is None:
            return x
        assert self.lm_head is not None
        logits = self.lm_head(self.ln_f(x)).float()
        if self.width_mult != 1.0:  # muP readout, as GPT.forward
            logits = logits * (1.0 / self.width_mult)
        return logits


@dataclasses.dataclass
class _LossContext:
    """What the loss function needs to know about the call it is in (the schedule calls
    it with (output, target) only)."""

    evaluating: bool = False
    step: int = 0
    accum: int = 1
    # dp_size / the micro-batch's valid tokens over the data-parallel ranks: a piece's
    # weight is its valid tokens times this (float64, on the device).
    weight: Tensor | None = None


class Pipeline:
    """This rank's stages, their schedule and the loss the last stage computes."""

    def __init__(
        self,
        cfg: TrainConfig,
        hooks: Hooks,
        modules: list[GPTStage],
        stages: list[Any],
        pp_group: Any,
        holds_last: bool,
    ) -> None:
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        p = parallel_config(cfg.parallel)
        self.cfg, self.hooks, self.modules, self.stages = cfg, hooks, modules, stages
        self.pp_group, self.holds_last = pp_group, holds_last
        self.microbatches = p.microbatches
        self.ctx = _LossContext()
        self.records: list[Tensor] = []  # the last stage's per-piece loss terms
        # scale_grads=False: the loss is already each piece's share of the mean.
        if p.pp_schedule == "interleaved_1f1b":
            self.schedule: Any = ScheduleInterleaved1F1B(
                stages, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False
            )
        else:
            kind = ScheduleGPipe if p.pp_schedule == "gpipe" else Schedule1F1B
            self.schedule = kind(
                stages[0], n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False
            )

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        valid = targets != IGNORE_INDEX  # shift_targets sets every invalid target to it
        c, n = self.ctx, valid.sum(dtype=torch.float64)
        if c.evaluating:
            _, ce, _ = lm_loss(logits.float(), targets, valid, 0.0)
            self.records.append(torch.stack([ce.detach().double() * n, n]))
            return ce
        total, ce, z = lm_loss(
            logits.float(), targets, valid, self.cfg.precision.z_loss, self.cfg.label_smoothing
        )
        assert c.weight is not None
        # float32 weights, as the one-process step's data-parallel weight is.
        w = (c.weight * n).float()
        loss = self.hooks.loss(c.step, total * w)
        self.records.append(
            torch.stack(
                [loss.detach().double(), (ce * w).detach().double(), (z * w).detach().double()]
            )
        )
        return loss / c.accum

    def _run(
        self, fn: Callable[..., Any], b: dict[str, Tensor], targets: Tensor, single: bool
    ) -> list[Tensor]:
        """One schedule call (`step` or `eval`) on a whole micro-batch; the last stage's
        loss terms of its pieces."""
        self.records.clear()
        fn(
            b["input_ids"],
            target=targets,
            position_ids=b["position_ids"],
            segment_ids=b["segment_ids"],
            single_segment=single,
        )
        # The schedule may call the loss once more on its first use (torch infers the
        # stages' shapes with a real forward and backward): the step's are the last ones.
        return self.records[-self.microbatches :] if self.holds_last else []

    def train_micro_batch(
        self,
        b: dict[str, Tensor],
        targets: Tensor,
        valid: Tensor,
        single: bool,
        step: int,
        accum: int,
        world: World,
    ) -> Tensor:
        """Forward and backward of one micro-batch through the pipeline; its (loss, ce, z)
        divided by accum (as the one-process step sums them), zeros off the last stage."""
        for m in self.modules:
            m.train()
        _, dp_size = distributed.dp_rank_and_size(world)
        n_global = distributed.dp_sum_tensor(valid.sum(dtype=torch.float64), world)
        self.ctx = _LossContext(False, step, accum, dp_size / n_global.clamp(min=1.0))
        records = self._run(self.schedule.step, b, targets, single)
        if not records:
            return torch.zeros(3, dtype=torch.float64, device=targets.device)
        return torch.stack(records).sum(dim=0) / accum

    def all_stages(self, t: Tensor) -> Tensor:
        """`t` summed over the pipeline's stages, in place (the last stage's values where
        the others hold zeros)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pp_group)
        return t

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """torch's clip_grad_norm_ over the whole pipeline: each stage's norm (a DTensor's
        is over its dp and tp shards), squared and summed over the stages."""
        params = [p for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)  # type: ignore[misc]
        full = getattr(norm, "full_tensor", None)
        norm = full() if full is not None else norm
        norm = self.all_stages(norm.pow(2)).sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def load_plain(self, root: Path, step: int, t: Trainer, verified: bool) -> dict[str, Any]:
        """Plain checkpoint `step` (whole tensors, the optimizer's state by parameter index:
        one process or DDP) into this rank's stages; the trainer state, as the checkpoint
        manager's restore returns it."""
        st, error = None, None
        if t.world.is_main:  # as the manager does: one reader, the state broadcast
            try:
                st = ckpt.load(root, step, map_location=t.device, verified=verified)
            except ckpt.CheckpointError as e:
                error = str(e)
        st, error = distributed.broadcast_object((st, error), t.world, t.device)
        if error is not None:
            raise ckpt.CheckpointError(error)
        load_whole_into_stages(t.model, t.optimizer, st, t.cfg, t.data.vocab_size)
        return st

    @torch.no_grad()
    def evaluate(self, t: Trainer) -> tuple[float, int]:
        """step.evaluate through the pipeline (forward only). Every batch is padded to
        micro_batch rows (the stages' shapes are fixed), the padding scoring nothing."""
        from training.step import autocast, single_segment, to_device

        for m in self.modules:
            m.eval()
        self.ctx = _LossContext(evaluating=True)
        batches = validation_batches(t.data.validation, t.cfg.micro_batch, t.cfg.eval_batches)
        dp_rank, dp_size = distributed.dp_rank_and_size(t.world)
        mine = batches[dp_rank::dp_size]
        acc = torch.zeros(2, dtype=torch.float64, device=t.device)
        # As step.evaluate with sharded parameters: every rank runs as many rounds as the
        # busiest, the extra ones scoring nothing.
        for i in range(-(-len(batches) // dp_size)):
            idx = mine[i] if i < len(mine) else batches[0]
            host = t.data.validation.batch(idx)
            single = single_segment(host["segment_ids"])
            rows = len(idx)
            pad = t.cfg.micro_batch - rows
            if pad:
                host = {k: torch.cat([v, v[:1].expand(pad, *v.shape[1:])]) for k, v in host.items()}
            b = to_device(host, t.device)
            targets, _ = shift_targets(b["input_ids"], b["segment_ids"], b["loss_mask"])
            targets[rows:] = IGNORE_INDEX
            if i >= len(mine):
                targets.fill_(IGNORE_INDEX)
            with autocast(t.cfg, t.device):
                records = self._run(self.schedule.eval, b, targets, single)
            for r in records:
                acc += r
        distributed.dp_sum_tensor(self.all_stages(acc), t.world)
        total, count = acc.tolist()
        return (total / count if count else float("nan")), int(count)


def build_pipeline(
    model: GPT, world: World, device: torch.device, cfg: TrainConfig, hooks: Hooks
) -> tuple[Pipeline, World]:
    """Split `model` (built whole, the same on every rank, so the initial weights are the
    one-process run's) into this rank's stages, in place; TP and FSDP2 on each stage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    p = parallel_config(cfg.parallel)
    try:
        shape = resolve(cfg.parallel, world.size)
        check_seq_len(shape, model.max_seq_len)
        check_model(model, shape)
    except ParallelSizeError as e:
        raise TrainConfigError(str(e)) from None
    rows = cfg.micro_batch // shape.dp
    if cfg.micro_batch % shape.dp or rows % p.microbatches:
        raise TrainConfigError(
            f"parallel.pp_microbatches {p.microbatches} does not divide the rows each "
            f"pipeline gets per micro-batch (micro_batch {cfg.micro_batch} / data-parallel "
            f"size {shape.dp})"
        )
    mesh = init_device_mesh(
        device.type,
        (shape.pp, shape.dp_replicate, shape.dp_shard, shape.tp),
        mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
    )
    if shape.dp_replicate == 1:
        dp_mesh = mesh["dp_shard"]
        dp_group = dp_mesh.get_group()
    else:  # HSDP, as training/parallel.py
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        dp_group = dp_mesh._flatten("dp").get_group()
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()

    n_stages = shape.pp * p.virtual_stages
    mine = rank_stages(pp_rank, shape.pp, p.virtual_stages)
    layers = stage_layers(model.cfg.n_layer, n_stages)
    first, last = 0 in mine, n_stages - 1 in mine
    # MFU (flops_per_token) counts the whole model's parameters, not this rank's part.
    whole = {True: model.num_params(), False: model.num_params(exclude_embeddings=False)}
    model.num_params = lambda exclude_embeddings=True: whole[exclude_embeddings]  # type: ignore[method-assign]
    # Prune in place: names stay the model's, so checkpoints are the one-process model's.
    model.blocks = nn.ModuleDict(  # type: ignore[assignment]
        {str(i): model.blocks[i] for s in mine for i in layers[s]}
    )
    if not first:
        model.wte = None  # type: ignore[assignment]
        model.wpe = None
    if not last:
        model.ln_f = None  # type: ignore[assignment]
        model.lm_head = None
    # Its checkpoints key the optimizer's groups by parameter (training/checkpoint/format.py).
    model.pipelined = True
    if shape.tp > 1:
        apply_tp(model, mesh["tp"])
    modules = [GPTStage(model, layers[s], s == 0, s == n_stages - 1) for s in mine]
    # FSDP2 on the dp dimension(s), even of size 1 (one code path, DCP checkpoints), each
    # block a unit, then each stage. No resharding after forward: the schedule runs each
    # stage once per piece, and gathering the parameters again for each is waste.
    for m in modules:
        for block in m.blocks.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(m, mesh=dp_mesh, reshard_after_forward=False)
    stages = [
        PipelineStage(m, s, n_stages, device, group=pp_mesh.get_group())
        for m, s in zip(modules, mine, strict=True)
    ]
    world = dataclasses.replace(world, tp=shape.tp, pp=shape.pp, dp_group=dp_group)
    pipe = Pipeline(cfg, hooks, modules, stages, pp_mesh.get_group(), last)
    return pipe, world


def load_whole_into_stages(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    cfg: TrainConfig,
    vocab_size: int,
) -> None:
    """A whole model's plain state (model and optimizer) into a pruned one: this rank's
    tensors, split as its parameters are (torch's distributed state-dict API). The saved
    optimizer numbers the one-process model's parameters in the order of its groups, which
    an optimizer built over that model on the meta device names; groups match by name
    (a stage holds only some of the kinds)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    keys = set(model.state_dict())
    set_model_state_dict(
        model, {k: v for k, v in state["model"].items() if k in keys}, options=full
    )
    saved = state["optimizer"]
    with torch.device("meta"):
        whole = GPT(cfg.model, vocab_size, model.max_seq_len)
    whole_name = {id(p): n for n, p in whole.named_parameters()}
    index_to_name: dict[int, str] = {}
    for old, g in zip(saved["param_groups"], param_groups(whole, cfg.optim), strict=True):
        names = [whole_name[id(p)] for p in g["params"]]
        index_to_name.update(zip(old["params"], names, strict=True))
    by_group = {g["name"]: g for g in saved["param_groups"]}
    name = {id(p): n for n, p in model.named_parameters()}
    groups = [
        {**by_group[live["name"]], "params": [name[id(p)] for p in live["params"]]}
        for live in optimizer.param_groups
    ]
    mine = {n for g in groups for n in g["params"]}
    by_name = {index_to_name[i]: s for i, s in saved["state"].items() if index_to_name[i] in mine}
    set_optimizer_state_dict(
        model, optimizer, {"state": by_name, "param_groups": groups}, options=full
    )
