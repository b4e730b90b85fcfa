"""One optimisation step and one evaluation: the forward/backward over the step's
micro-batches, clipping, the guard's verdict, the optimizer update; and the validation loss.

Nothing leaves the device per micro-batch: on CUDA a `.item()` or `int(tensor)` waits for
every queued kernel, so the host could not run ahead. The sums stay on the device in float64
(the same arithmetic as Python floats, so the values are bit for bit those of a host-side
sum), and one transfer after clipping brings loss, ce, z, grad norm, tokens (and what the
components ask for) back for the guard and the log.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from training import distributed
from training.config import TrainConfig, TrainConfigError
from training.data import validation_batches
from training.guards import Decision
from training.loss import lm_loss, shift_targets
from training.optim import clip_grad_agc_
from training.schedule import accum_steps_at, set_lr

if TYPE_CHECKING:
    from training.trainer import Trainer


@dataclass(frozen=True)
class StepResult:
    """What one optimisation step produced (the values are global: the same on every
    rank). `decision` is the guard's verdict, None when an fp16 overflow made the grad
    scaler skip the step (routine, not instability). `extras`: each component's result of
    the step, by component name (e.g. "layer_stats", "noise_scale"), when it has one."""

    loss: float
    ce: float
    z_loss: float
    lr: float
    grad_norm: float
    accum: int
    samples: int  # of the training order, consumed whatever the verdict
    real_tokens: int
    decision: Decision | None
    fp16_overflow: bool
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.decision is not None and self.decision.action in ("rollback", "abort")

    @property
    def skipped(self) -> bool:
        """Not applied, but no divergence either (a NaN or a spike the guard dropped)."""
        return self.decision is not None and self.decision.action != "ok"


def pick_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError("device: cuda was asked for, but no CUDA device is available")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def single_segment(segment_ids: torch.Tensor) -> bool:
    """attention.is_single_segment for a batch still on the host, read through numpy: the
    model need not read its device copy (a sync per micro-batch on CUDA) to pick a mask."""
    seg = segment_ids.numpy()
    return bool((seg == seg[:, :1]).all() and (seg[:, 0] > 0).all())


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.precision.dtype == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type != "cuda":
        return batch
    # Pinned host memory lets the copy run asynchronously with the previous step.
    return {n: t.pin_memory().to(device, non_blocking=True) for n, t in batch.items()}


def train_step(t: Trainer) -> StepResult:
    """Train step `t.state.step + 1`. Steps count from 1, one numbering throughout: step N
    is the N-th optimizer step (the console's "step N/M", its train record's and the guard
    events' `"step": N`), and checkpoint step-N is the state after it. `t.state.step`, the
    steps done so far, is the position the schedule, the hooks and the components get."""
    cfg, s, hooks, world, comps = t.cfg, t.state, t.hooks, t.world, t.components
    hooks.before_step(s.step, s.rollbacks)
    accum = accum_steps_at(s.step, cfg.schedule, cfg.accum_steps, s.tokens_seen)
    for c in comps:
        accum = c.accum(s.step, accum)
    for c in comps:
        c.step_begin(s.step, accum)
    lr = set_lr(
        t.optimizer,
        s.step,
        cfg.steps,
        cfg.schedule,
        s.lr_scale * hooks.lr_factor(s.step, s.rollbacks),
    )
    idx = t.sampler.take(s.samples_seen, cfg.micro_batch * accum)
    t.model.train()
    sums = torch.zeros(4, dtype=torch.float64, device=t.device)  # total, ce, z, tokens
    # Tensor-parallel ranks share their batch: weights and sums run over data parallelism.
    _, dp_size = distributed.dp_rank_and_size(world)
    pipe = getattr(t, "pipeline", None)
    for k in range(accum):
        host = t.loader.get(s.samples_seen + k * cfg.micro_batch, cfg.micro_batch)
        b = to_device(host, t.device)
        targets, valid = shift_targets(b["input_ids"], b["segment_ids"], b["loss_mask"])
        if pipe is not None:  # the schedule runs forward and backward (training/pipeline.py)
            with autocast(cfg, t.device), contextlib.ExitStack() as around:
                for c in comps:
                    around.enter_context(c.forward_context(k))
                part = pipe.train_micro_batch(
                    b, targets, valid, single_segment(host["segment_ids"]), s.step, accum, world
                )
            for c in comps:
                c.after_backward(k, accum)
            sums += torch.cat([part, b["loss_mask"].sum(dtype=torch.float64).reshape(1)])
            continue
        sync = t.ddp.no_sync() if t.ddp is not None and k < accum - 1 else contextlib.nullcontext()
        if t.fsdp:  # reduce-scatter gradients only after the last micro-batch
            t.model.set_requires_gradient_sync(k == accum - 1)
        with sync:
            with autocast(cfg, t.device), contextlib.ExitStack() as around:
                for c in comps:
                    around.enter_context(c.forward_context(k))
                logits = t.forward(
                    b["input_ids"],
                    b["position_ids"],
                    b["segment_ids"],
                    single_segment=single_segment(host["segment_ids"]),
                )
            loss, ce, z = lm_loss(
                logits.float(), targets, valid, cfg.precision.z_loss, cfg.label_smoothing
            )
            if dp_size > 1:
                # Token-weighted across ranks: DDP / FSDP average gradients over the
                # data-parallel ranks, so weight each rank's mean by its share of the
                # micro-batch's tokens. float32 w, as a Python float multiplying a float32
                # loss would be.
                n_local = valid.sum(dtype=torch.float64)
                n_global = distributed.dp_sum_tensor(n_local.clone(), world)
                w = (dp_size * n_local / n_global.clamp(min=1.0)).float()
                loss, ce, z = loss * w, ce * w, z * w
            loss = hooks.loss(s.step, loss)
            # Mean over micro-batches: each contributes 1/accum of the gradient.
            # Inside `sync`: DDP all-reduces gradients only on the last micro-batch.
            t.scaler.scale(loss / accum).backward()
        for c in comps:
            c.after_backward(k, accum)
        sums += torch.stack(
            [
                loss.detach().double() / accum,
                ce.detach().double() / accum,
                z.detach().double() / accum,
                b["loss_mask"].sum(dtype=torch.float64),
            ]
        )
    if pipe is not None:  # the loss terms live on the last stage
        pipe.all_stages(sums[:3])
    if dp_size > 1:  # the logged values are the global ones, the same on every rank
        distributed.dp_sum_tensor(sums, world)
        sums[:3] /= dp_size
    t.scaler.unscale_(t.optimizer)
    for c in comps:
        c.after_unscale()
    clip = cfg.optim.grad_clip or float("inf")
    if pipe is not None:  # over every stage
        norm = pipe.clip_grad_norm_(list(t.model.parameters()), clip)
    else:
        norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), clip)
    full = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor over the shards
    norm = full() if full is not None else norm
    # After the global norm (the logged one, the guard's input is the raw gradient's):
    # unit-wise AGC, then per-element value clipping. Device ops only.
    if t.agc_params:
        clip_grad_agc_(t.agc_params, cfg.optim.agc, cfg.optim.agc_eps)
    if cfg.optim.clip_value is not None:
        torch.nn.utils.clip_grad_value_(t.model.parameters(), cfg.optim.clip_value)
    # The step's one host transfer (and on CUDA its one synchronisation): the guard
    # decides on the host from these. With fp16, GradScaler.step adds its own `.item()`
    # on the found-inf flag (PyTorch's, once per step).
    extra = [c.host_tensors() for c in comps]
    total, ce_sum, z_sum, grad_norm, tokens, *rest = torch.cat(
        [sums[:3], norm.detach().double().reshape(1), sums[3:], *(x for xs in extra for x in xs)]
    ).tolist()
    # An fp16 overflow shows in the (scaled) gradients only; a non-finite loss came out
    # of the forward pass (NaN weights, say), which no loss scale explains.
    fp16_overflow = t.scaler.is_enabled() and math.isfinite(total) and not math.isfinite(grad_norm)
    decision = None
    if fp16_overflow:
        # Dynamic loss scaling: the scaler skips this step and lowers the scale;
        # that is expected behaviour, not instability.
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        # The step's own number (1-based, as its train record and the console count it):
        # s.step is the count of steps done before this one.
        decision = t.guard.observe(s.step + 1, total, grad_norm, idx.tolist())
        if decision.action == "ok":
            t.scaler.step(t.optimizer)
            t.scaler.update()
            for c in comps:
                c.after_update()
        elif t.scaler.is_enabled():
            # No step, but the scaler must close this iteration (unscale_ was called):
            # without update() the next unscale_ raises.
            t.scaler.update()
    t.optimizer.zero_grad(set_to_none=True)
    applied = decision is not None and decision.action == "ok"
    extras = {}
    for c, xs in zip(comps, extra, strict=True):
        n = sum(x.numel() for x in xs)
        host_values, rest = rest[:n], rest[n:]
        value = c.step_end(applied, host_values, grad_norm, accum)
        if value is not None:
            extras[c.name] = value
    return StepResult(
        loss=total,
        ce=ce_sum,
        z_loss=z_sum,
        lr=lr,
        grad_norm=grad_norm,
        accum=accum,
        samples=len(idx),
        real_tokens=int(tokens),
        decision=decision,
        fp16_overflow=fp16_overflow,
        extras=extras,
    )


@torch.no_grad()
def evaluate(t: Trainer) -> tuple[float, int]:
    """(the mean validation loss over every rank, the tokens it scored)."""
    pipe = getattr(t, "pipeline", None)
    if pipe is not None:
        return pipe.evaluate(t)
    t.model.eval()
    total = 0.0
    count = 0
    batches = validation_batches(t.data.validation, t.cfg.micro_batch, t.cfg.eval_batches)
    # By data-parallel rank: the ranks of a TP group run the same batches together.
    dp_rank, dp_size = distributed.dp_rank_and_size(t.world)
    mine = batches[dp_rank::dp_size]
    # Sharded parameters (FSDP2, TP) are gathered by collectives inside the forward: a
    # rank with fewer batches than another would wait in the final sum while the other
    # waits in its next forward, for ever. So every rank runs as many forwards as the
    # busiest one; the extra ones (on the first batch, again) score nothing.
    rounds = -(-len(batches) // dp_size) if t.fsdp else len(mine)
    for i in range(rounds):
        idx = mine[i] if i < len(mine) else batches[0]
        b = to_device(t.data.validation.batch(idx), t.device)
        targets, valid = shift_targets(b["input_ids"], b["segment_ids"], b["loss_mask"])
        with autocast(t.cfg, t.device):
            logits = t.forward(b["input_ids"], b["position_ids"], b["segment_ids"])
        if i >= len(mine):
            continue
        n = int(valid.sum())
        if n:
            _, ce, _ = lm_loss(logits.float(), targets, valid, 0.0)
            total += ce.item() * n
            count += n
    total = distributed.dp_sum(total, t.world, t.device)
    count = int(distributed.dp_sum(count, t.world, t.device))
    return (total / count if count else float("nan")), count
