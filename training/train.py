"""The trainer: `python -m training.train --config X` (one process; torchrun comes with
multi-process training). The loop stays short: a series of calls on components that each
own their concern: model, loss, optim, schedule, guards (when a step is bad), checkpoint
and checkpoint_manager (how state is written and read), recovery (rollbacks, the
supervisor's recovery, the DIVERGED marker), faults (hooks tests use to inject faults),
data and metrics.

Exit codes (shared with launchers and Kubernetes): 0 done, 1 bad config or data,
3 diverged beyond the rollback budget.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.protocol import EXIT_CRASHED, EXIT_DIVERGED, EXIT_ERROR, EXIT_OK, format_event
from training import checkpoint as ckpt
from training import distributed
from training.blame import event_documents
from training.checkpoint_manager import open_checkpoints
from training.config import TrainConfig, TrainConfigError, load_train_config
from training.data import DatasetError, Loader, Sampler, TrainData, load_data, validation_batches
from training.faults import Faults, Hooks
from training.flops import device_peak_flops
from training.guards import Decision, StabilityGuard
from training.loss import lm_loss, shift_targets
from training.metrics import MetricsLog, plot_loss, truncate_after
from training.model import GPT
from training.noise_scale import NoiseScale
from training.optim import agc_params, build_optimizer, clip_grad_agc_
from training.recovery import (
    CheckpointChoice,
    Recovery,
    State,
    diverge,
    recover,
    stopped_by_marker,
)
from training.remote import RemoteCheckpointError, RemoteCheckpoints, RemoteOwnershipError
from training.schedule import accum_steps_at, set_lr
from training.stats import LayerStats
from training.warm_start import check_shapes, checkpoint_weights

# A "progress" event (step, loss, tokens/s, ETA) after the first step, then at most this
# often, and at the last step: enough for a live view, few lines in a week-long log.
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class StepResult:
    """What one optimisation step produced (the values are global: the same on every
    rank). `decision` is the guard's verdict, None when an fp16 overflow made the grad
    scaler skip the step (routine, not instability)."""

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
    stats: dict[str, list[float]] | None = None  # on `stats_every` steps only
    noise: dict[str, Any] | None = None  # on noise_scale.every steps only

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
    """model.is_single_segment for a batch still on the host, read through numpy: the
    model need not read its device copy (a sync per micro-batch on CUDA) to pick a mask."""
    seg = segment_ids.numpy()
    return bool((seg == seg[:, :1]).all() and (seg[:, 0] > 0).all())


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.precision.dtype == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


class Trainer:
    def __init__(self, cfg: TrainConfig, hooks: Hooks | None = None,
                 recovery: Recovery | None = None):
        self.cfg, self.hooks, self.recovery = cfg, hooks or Hooks(), recovery
        self.rewind_remote = False  # the next remote upload follows a rollback
        self.device = pick_device(cfg)
        self.world = distributed.init(self.device.type)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=self.device.type == "cuda")
        self.data: TrainData = load_data(cfg.dataset, options=cfg.storage)
        self.model = GPT(cfg.model, self.data.vocab_size, self.data.seq_len).to(self.device)
        # MFU against the peak of the GPU actually present (training/flops.py); None on
        # the CPU or a GPU the table does not know, and then MFU is not logged.
        self.flops_per_token = self.model.flops_per_token(self.data.seq_len)
        self.peak = device_peak_flops(self.device, cfg.precision.dtype)
        if self.device.type == "cuda" and self.peak is None and self.world.is_main:
            print(f"note: no peak FLOP/s known for {torch.cuda.get_device_name(self.device)} "
                  f"at {cfg.precision.dtype} (training/flops.py): MFU is not logged",
                  file=sys.stderr)
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self.fsdp = self.world.active and cfg.parallel == "fsdp2"
        wrapped: torch.nn.Module = self.model
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            # Each block is a unit (its parameters are gathered just before it runs),
            # then the root (embeddings, final norm, head). Before the optimizer exists.
            for block in self.model.blocks:
                fully_shard(block)
            fully_shard(self.model)
        elif self.world.active:
            # Same seed on every rank gives the same init; DDP also broadcasts rank 0's.
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda"
                else None)
            wrapped = self.ddp
        self.forward = torch.compile(wrapped) if cfg.model.compile else wrapped
        if self.fsdp and cfg.init_from:
            raise TrainConfigError("init_from: not supported with parallel: fsdp2")
        if self.fsdp and cfg.stats_every:
            raise TrainConfigError("stats_every: not supported with parallel: fsdp2")
        if self.fsdp and cfg.noise_scale:
            raise TrainConfigError("noise_scale: not supported with parallel: fsdp2")
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.optim_name = cfg.optim.name  # resume_overrides.optimizer may switch it
        # Events found outside the loop's reach (a restore's overrides): written at the
        # next step.
        self.pending_events: list[dict[str, Any]] = []
        self.agc_params = agc_params(self.model) if cfg.optim.agc is not None else []
        self.noise = (NoiseScale(cfg.noise_scale.ema_beta) if cfg.noise_scale is not None
                      else None)
        # The EMA of the weights: one copy per parameter, updated on the device after
        # each applied step (no host read); None when `ema` is off.
        self.ema: list[torch.Tensor] | None = None
        if cfg.ema is not None:
            if self.fsdp:
                raise TrainConfigError("ema: not supported with parallel: fsdp2")
            self.ema = [p.detach().clone() for p in self.model.parameters()]
        # Early stopping on the validation loss: the best so far, the step it was seen at,
        # evaluations since without an improvement, and whether the run has stopped.
        self.early: dict[str, Any] = {"best": None, "best_step": None, "bad": 0,
                                      "stopped": False}
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=cfg.precision.dtype == "fp16")
        # Its skip and rollback events name the documents of their rows (provenance).
        self.guard = StabilityGuard(cfg.guards, describe=event_documents(self.data))
        self.sampler = Sampler(self.data.train.rows, cfg.seed, cfg.shuffle)
        # The next micro-batches load in a background thread while this step computes.
        self.loader = Loader(self.data.train, self.sampler,
                             lambda idx: distributed.rank_slice(idx, self.world),
                             pin_memory=self.device.type == "cuda")
        self.state = State()
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint_dir())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._eval_tokens = 0  # tokens the last evaluate() scored
        c = cfg.checkpoint
        self.ckpts = open_checkpoints(self.ckpt_dir, self.world, self.device, self.model,
                                      self.optimizer, self._after_save, sharded=self.fsdp,
                                      async_save=c.async_save)
        remote_uri = cfg.remote_checkpoint_uri()  # <checkpoint.remote>/<run name>
        self.remote = (RemoteCheckpoints(remote_uri, cfg.storage, c.keep_last, c.keep_every,
                                         c.remote_max_failures,
                                         log=lambda m: print(m, file=sys.stderr))
                       if remote_uri and self.world.is_main else None)
        self.choice = CheckpointChoice(self.ckpt_dir, self.remote)
        self._claim_remote()

    def _claim_remote(self) -> None:
        """Before anything is restored from, uploaded to or pruned in the remote prefix:
        it must be this run's (RUN.json: run name and config fingerprint), or unclaimed.
        Rank 0 checks; every rank raises the same error (exit 1, bad input)."""
        error = None
        if self.remote is not None:
            try:
                self.remote.claim(self.cfg.run_name(), self.cfg.checkpoint_fingerprint())
            except RemoteOwnershipError as e:
                error = str(e)
        if self.cfg.checkpoint.remote:
            error = distributed.broadcast_object(error, self.world, self.device)
        if error is not None:
            if self.remote is not None:
                self.remote.close(drain=False)
            raise RemoteOwnershipError(error)

    # -- checkpoints --------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds besides the model and optimizer."""
        s = self.state
        return {
            "scaler": self.scaler.state_dict(), "rng": ckpt.rng_state(),
            "guard": self.guard.state_dict(), "config": self.cfg.model_dump(mode="json"),
            "trainer": {"step": s.step, "samples_seen": s.samples_seen,
                        "tokens_seen": s.tokens_seen, "lr_scale": s.lr_scale,
                        "rollbacks": s.rollbacks,
                        # Which optimizer's state this is, once a switch is configured.
                        **({"optimizer": self.optim_name} if self._switching() else {})},
            # Only with the options on, so a default run's checkpoints are unchanged.
            **({"ema": [t.clone() for t in self.ema]} if self.ema is not None else {}),
            **({"early_stopping": dict(self.early)} if self.cfg.early_stopping else {}),
            **({"noise_scale": self.noise.state_dict()} if self.noise is not None else {}),
        }

    def _switching(self) -> bool:
        ro = self.cfg.resume_overrides
        return ro is not None and ro.optimizer is not None

    def save(self) -> None:
        self.ckpts.save(self.state.step, self.snapshot())

    def _after_save(self, step: int) -> None:
        c = self.cfg.checkpoint
        # Step 0 is kept: it is the rollback target of last resort.
        ckpt.retain(self.ckpt_dir, c.keep_last, c.keep_every, protect={0})
        if self.remote is not None:  # returns at once; the upload runs in its own thread
            rewind, self.rewind_remote = self.rewind_remote, False
            self.remote.submit(self.ckpt_dir, step, rewind=rewind)
        self.emit({"event": "checkpoint", "step": step})
        self.hooks.after_save(step, self.ckpt_dir)

    def restore(self, step: int, modules_only: bool = False,
                verified: bool = False) -> dict[str, Any]:
        """Load checkpoint `step` (`verified`: rank 0 has just checked its checksums),
        then apply `resume_overrides`."""
        if self._switching():
            saved = self._saved_optimizer(step)
            if saved != self.optim_name:  # it was written before or after a switch
                self._set_optimizer(saved)
        try:
            st = self.ckpts.restore(step, verified=verified)
        except ValueError as e:  # torch: the saved groups do not match this optimizer's
            raise ckpt.CheckpointError(
                f"checkpoint {ckpt.step_name(step)} in {self.ckpt_dir}: its optimizer state "
                f"does not fit this run's optimizer ({e}); optim.name, optim.lr_layer_decay "
                "and optim.param_groups must stay as the run began (resume_overrides can "
                "switch the optimizer)") from None
        self.scaler.load_state_dict(st["scaler"])
        ckpt.set_rng_state(st["rng"])
        if self.ema is not None:
            # A checkpoint from before `ema` was turned on starts the EMA at its weights.
            saved = st.get("ema") or [p.detach() for p in self.model.parameters()]
            torch._foreach_copy_(self.ema, [t.to(self.device) for t in saved])
        es = self.cfg.early_stopping
        if es is not None and "early_stopping" in st:  # rewound on a rollback too
            self.early = dict(st["early_stopping"])
            # Judged by this config's patience: relaunched with more, a stopped run goes on.
            self.early["stopped"] = self.early["bad"] >= es.patience
        if not modules_only:
            self.guard.load_state_dict(st["guard"])
            t = st["trainer"]
            self.state = State(t["step"], t["samples_seen"], t["tokens_seen"], t["lr_scale"],
                               list(t["rollbacks"]))
        if self.noise is not None:
            if "noise_scale" in st:
                self.noise.load_state_dict(st["noise_scale"])
            else:  # a checkpoint from before it was on: start the estimate afresh
                self.noise = NoiseScale(self.noise.beta)
        if self.cfg.resume_overrides is not None:
            self._apply_overrides(int(st["trainer"]["step"]))
        return st

    # -- warm start and resume overrides ------------------------------------------
    def _saved_optimizer(self, step: int) -> str:
        """The optimizer checkpoint `step` holds the state of (read by rank 0; the restore
        that follows checks the checksums and reports a bad checkpoint)."""
        name = None
        if self.world.is_main:
            with contextlib.suppress(ckpt.CheckpointError, KeyError):
                name = ckpt.load(self.ckpt_dir, step, verified=True)["trainer"].get(
                    "optimizer")
        name = distributed.broadcast_object(name, self.world, self.device)
        return name or self.cfg.optim.name

    def _set_optimizer(self, name: str) -> None:
        """A new optimizer `name` over the model, fresh state; the checkpoints follow it."""
        self.optimizer = build_optimizer(self.model,
                                         self.cfg.optim.model_copy(update={"name": name}))
        self.ckpts.optimizer = self.optimizer  # type: ignore[attr-defined]
        self.optim_name = name

    def _apply_overrides(self, step: int) -> None:
        """resume_overrides after a restore: the optimizer switch, then the peak lrs (the
        muP and layer-wise multipliers of each group are kept). Idempotent: a later resume
        finds them applied and records nothing."""
        ro = self.cfg.resume_overrides
        assert ro is not None
        if ro.optimizer is not None and ro.optimizer != self.optim_name:
            self.pending_events.append({"event": "optimizer_switch", "step": step,
                                        "from": self.optim_name, "to": ro.optimizer})
            self._set_optimizer(ro.optimizer)
        changed = False
        for g in self.optimizer.param_groups:
            base = ro.muon_lr if g.get("muon") else ro.lr
            if base is None:
                continue
            new = base * g.get("lr_scale", 1.0) * g.get("lr_mult", 1.0)
            changed = changed or new != g["initial_lr"]
            g["initial_lr"] = new
        if changed:
            self.pending_events.append({"event": "lr_override", "step": step, "lr": ro.lr,
                                        "muon_lr": ro.muon_lr})

    def _flush_events(self, log: MetricsLog) -> None:
        for event in self.pending_events:
            self.record(log, event)
        self.pending_events.clear()

    def _warm_start(self, log: MetricsLog) -> None:
        """init_from: the other checkpoint's weights (shapes checked), at step 0."""
        assert self.cfg.init_from is not None
        where, weights = checkpoint_weights(self.cfg.init_from)
        check_shapes(weights, self.model.state_dict(), where)
        self.model.load_state_dict(weights)
        if self.ema is not None:
            torch._foreach_copy_(self.ema, [p.detach() for p in self.model.parameters()])
        event = {"event": "init_from", "step": 0, "checkpoint": where}
        self.record(log, event)

    def weights_finite(self) -> bool:
        """Every parameter finite, on every rank (FSDP: each rank checks its shards)."""
        local = [getattr(p, "to_local", lambda p=p: p)() for p in self.model.parameters()]
        bad = sum(0 if bool(torch.isfinite(t).all()) else 1 for t in local if t.numel())
        return distributed.all_sum(bad, self.world, self.device) == 0

    def mfu(self, tokens_per_s: float) -> dict[str, float]:
        """{"mfu": model FLOPs utilisation} over every rank's GPU, or {} without a known
        peak. Tokens are the real (non-padding) ones trained, so padding is not counted as
        useful work, and recomputation (activation checkpointing) is not counted either."""
        if self.peak is None:
            return {}
        return {"mfu": tokens_per_s * self.flops_per_token / (self.peak[1] * self.world.size)}

    # -- events -------------------------------------------------------------------
    def progress_event(self, loss: float, took: float, steps: int,
                       tokens: int) -> dict[str, Any]:
        """Where the run is, for whoever watches it (the supervisor logs it and the Prefect
        flow keeps a progress artifact): step, loss, and tokens/s and ETA over the `steps`
        steps (`tokens` tokens, `took` seconds) this attempt has trained so far."""
        s, cfg = self.state, self.cfg
        took = max(took, 1e-9)
        eta = (cfg.steps - s.step) * took / steps if steps > 0 else None
        return {"event": "progress", "step": s.step, "steps": cfg.steps,
                "loss": round(float(loss), 5), "tokens_seen": s.tokens_seen,
                "tokens_per_s": round(tokens / took, 1),
                "eta_s": None if eta is None else round(eta, 1)}

    def emit(self, event: dict[str, Any]) -> None:
        """One machine-readable line on stderr for whoever watches the process (the
        supervisor reads them from the job's logs, whatever the backend)."""
        if self.world.is_main:
            print(format_event(event), file=sys.stderr, flush=True)

    def record(self, log: MetricsLog, event: dict[str, Any]) -> None:
        """An event in the metrics log and on stderr."""
        log.write({"kind": "event", **event})
        self.emit(event)

    # -- one optimisation step ----------------------------------------------------
    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type != "cuda":
            return batch
        # Pinned host memory lets the copy run asynchronously with the previous step.
        return {n: t.pin_memory().to(self.device, non_blocking=True) for n, t in batch.items()}

    def train_step(self) -> StepResult:
        cfg, s, hooks = self.cfg, self.state, self.hooks
        hooks.before_step(s.step, s.rollbacks)
        accum = accum_steps_at(s.step, cfg.schedule, cfg.accum_steps, s.tokens_seen)
        if self.noise is not None and self.noise.accum is not None:
            accum = max(accum, self.noise.accum)  # the batch-size controller's
        ns = cfg.noise_scale
        noise_on = ns is not None and (s.step + 1) % ns.every == 0 and accum >= 2
        small_sq = None  # |G_small|^2: the first micro-batch's gradient, on the device
        # Its batch, in samples: a rank's share of a micro-batch (the same on every rank,
        # so that every rank's controller decides alike).
        b_small = cfg.micro_batch / self.world.size
        lr = set_lr(self.optimizer, s.step, cfg.steps, cfg.schedule,
                    s.lr_scale * hooks.lr_factor(s.step, s.rollbacks))
        idx = self.sampler.take(s.samples_seen, cfg.micro_batch * accum)
        self.model.train()
        # Nothing leaves the device per micro-batch: on CUDA a `.item()` or `int(tensor)`
        # waits for every queued kernel, so the host could not run ahead. The sums stay
        # on the device in float64 (the same arithmetic as Python floats, so the values
        # are bit for bit those of a host-side sum), and one transfer after clipping
        # brings loss, ce, z, grad norm and tokens back for the guard and the log.
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # total, ce, z, tokens
        world = self.world
        # Layer statistics on every `stats_every`-th step (the one logged as a multiple of
        # it): hooks during the first micro-batch's forward only.
        stats = (LayerStats(self.model) if cfg.stats_every is not None
                 and (s.step + 1) % cfg.stats_every == 0 else None)
        for k in range(accum):
            host = self.loader.get(s.samples_seen + k * cfg.micro_batch, cfg.micro_batch)
            b = self.to_device(host)
            targets, valid = shift_targets(b["input_ids"], b["segment_ids"], b["loss_mask"])
            sync = (self.ddp.no_sync() if self.ddp is not None and k < accum - 1
                    else contextlib.nullcontext())
            if self.fsdp:  # reduce-scatter gradients only after the last micro-batch
                self.model.set_requires_gradient_sync(k == accum - 1)
            with sync:
                hooks_on = (stats.forward_hooks() if stats is not None and k == 0
                            else contextlib.nullcontext())
                with autocast(cfg, self.device), hooks_on:
                    logits = self.forward(b["input_ids"], b["position_ids"], b["segment_ids"],
                                          single_segment=single_segment(host["segment_ids"]))
                loss, ce, z = lm_loss(logits.float(), targets, valid, cfg.precision.z_loss,
                                      cfg.label_smoothing)
                if world.active:
                    # Token-weighted across ranks: DDP averages gradients over ranks, so
                    # weight each rank's mean by its share of the micro-batch's tokens.
                    # float32 w, as a Python float multiplying a float32 loss would be.
                    n_local = valid.sum(dtype=torch.float64)
                    n_global = distributed.all_sum_tensor(n_local.clone(), world)
                    w = (world.size * n_local / n_global.clamp(min=1.0)).float()
                    loss, ce, z = loss * w, ce * w, z * w
                loss = hooks.loss(s.step, loss)
                # Mean over micro-batches: each contributes 1/accum of the gradient.
                # Inside `sync`: DDP all-reduces gradients only on the last micro-batch.
                self.scaler.scale(loss / accum).backward()
            if noise_on and k == 0:
                small_sq = self._small_grad_sq(accum)
            sums += torch.stack([loss.detach().double() / accum, ce.detach().double() / accum,
                                 z.detach().double() / accum,
                                 b["loss_mask"].sum(dtype=torch.float64)])
        if world.active:  # the logged values are the global ones, the same on every rank
            distributed.all_sum_tensor(sums, world)
            sums[:3] /= world.size
        self.scaler.unscale_(self.optimizer)
        if stats is not None:
            stats.gradients()  # the raw gradients, before any clipping
        clip = cfg.optim.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        full = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor over the shards
        norm = full() if full is not None else norm
        # After the global norm (the logged one, the guard's input is the raw gradient's):
        # unit-wise AGC, then per-element value clipping. Device ops only.
        if self.agc_params:
            clip_grad_agc_(self.agc_params, cfg.optim.agc, cfg.optim.agc_eps)
        if cfg.optim.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self.model.parameters(), cfg.optim.clip_value)
        # The step's one host transfer (and on CUDA its one synchronisation): the guard
        # decides on the host from these. With fp16, GradScaler.step adds its own `.item()`
        # on the found-inf flag (PyTorch's, once per step).
        extra = [small_sq.reshape(1)] if small_sq is not None else []
        total, ce_sum, z_sum, grad_norm, tokens, *rest = torch.cat(
            [sums[:3], norm.detach().double().reshape(1), sums[3:], *extra]).tolist()
        real_tokens = int(tokens)
        # An fp16 overflow shows in the (scaled) gradients only; a non-finite loss came out
        # of the forward pass (NaN weights, say), which no loss scale explains.
        fp16_overflow = (self.scaler.is_enabled() and math.isfinite(total)
                         and not math.isfinite(grad_norm))
        decision = None
        if fp16_overflow:
            # Dynamic loss scaling: the scaler skips this step and lowers the scale;
            # that is expected behaviour, not instability.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            decision = self.guard.observe(s.step, total, grad_norm, idx.tolist())
            if decision.action == "ok":
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self._update_ema()
            elif self.scaler.is_enabled():
                # No step, but the scaler must close this iteration (unscale_ was called):
                # without update() the next unscale_ raises.
                self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        noise = None
        if rest and decision is not None and decision.action == "ok":
            noise = self._observe_noise(rest[0], grad_norm ** 2, b_small, accum)
        return StepResult(loss=total, ce=ce_sum, z_loss=z_sum, lr=lr, grad_norm=grad_norm,
                          accum=accum, samples=len(idx), real_tokens=real_tokens,
                          decision=decision, fp16_overflow=fp16_overflow,
                          stats=stats.result() if stats is not None else None, noise=noise)

    @torch.no_grad()
    def _small_grad_sq(self, accum: int) -> torch.Tensor:
        """|G_small|^2 of the first micro-batch, from the gradients it left (scaled by
        1/accum), averaged over ranks (each holds its own, unsynchronised). Device only."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sq = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum() * accum ** 2
        if self.world.active:
            distributed.all_sum_tensor(sq, self.world)
            sq /= self.world.size
        return sq

    def _observe_noise(self, small_sq: float, big_sq: float, b_small: float,
                       accum: int) -> dict[str, Any]:
        """Fold one estimate into the EMAs; the batch-size controller may raise the
        accumulation of the next steps. Returns the "noise_scale" record's fields."""
        ns, noise = self.cfg.noise_scale, self.noise
        assert ns is not None and noise is not None
        b_big = self.cfg.micro_batch * accum
        b_noise = noise.observe(small_sq, big_sq, b_small, b_big)
        record: dict[str, Any] = {"b_noise": b_noise, "g2": noise.g2, "s": noise.s,
                                  "small_sq": small_sq, "big_sq": big_sq, "accum": accum}
        if ns.max_accum is not None:
            want = noise.propose(accum, self.cfg.micro_batch, ns.max_accum, ns.target)
            if want > accum:
                noise.accum = want
                record["raise_to"] = want
        return record

    @torch.no_grad()
    def _update_ema(self) -> None:
        if self.ema is not None and self.cfg.ema is not None:
            params = [p.detach() for p in self.model.parameters()]
            torch._foreach_lerp_(self.ema, params, 1.0 - self.cfg.ema.decay)

    @torch.no_grad()
    def evaluate_ema(self) -> float:
        """The validation loss of the EMA weights: swapped into the model for the
        evaluation, and the training weights copied back bit for bit after it."""
        assert self.ema is not None
        params = [p.detach() for p in self.model.parameters()]
        saved = [p.clone() for p in params]
        torch._foreach_copy_(params, self.ema)
        try:
            return self.evaluate()
        finally:
            torch._foreach_copy_(params, saved)

    def _early_stop(self, val: float) -> bool:
        """Count this evaluation for early stopping; True when the run must stop now."""
        es, e = self.cfg.early_stopping, self.early
        if es is None or not math.isfinite(val):
            return False
        if e["best"] is None or val < e["best"] - es.min_delta:
            e.update(best=val, best_step=self.state.step, bad=0)
            return False
        e["bad"] += 1
        e["stopped"] = e["bad"] >= es.patience
        return e["stopped"]

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = 0.0
        count = 0
        batches = validation_batches(self.data.validation, self.cfg.micro_batch,
                                     self.cfg.eval_batches)
        for idx in batches[self.world.rank :: self.world.size]:
            b = self.to_device(self.data.validation.batch(idx))
            targets, valid = shift_targets(b["input_ids"], b["segment_ids"], b["loss_mask"])
            with autocast(self.cfg, self.device):
                logits = self.forward(b["input_ids"], b["position_ids"], b["segment_ids"])
            n = int(valid.sum())
            if n:
                _, ce, _ = lm_loss(logits.float(), targets, valid, 0.0)
                total += ce.item() * n
                count += n
        total = distributed.all_sum(total, self.world, self.device)
        count = int(distributed.all_sum(count, self.world, self.device))
        self._eval_tokens = count
        return total / count if count else float("nan")

    # -- the loop -----------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        except RemoteCheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_CRASHED  # storage trouble is worth a restart; bad input is not
        except ckpt.CheckpointError as e:  # no valid checkpoint left: a restart cannot help
            print(f"error: {e}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            self.loader.close()
            with contextlib.suppress(Exception):  # never leave a save half-way on exit
                self.ckpts.close()
            if self.remote is not None:
                self.remote.close()
            distributed.shutdown()

    def _resume(self, metrics_path: Path) -> int | None:
        """Every rank: restore the checkpoint rank 0 picks (None: a fresh start). Under DDP
        on several nodes the other ranks' local disks hold no checkpoints (only rank 0
        writes them); restore() broadcasts the state."""
        choice: tuple[int | None, str | None] = (None, None)
        if self.world.is_main:
            removed = ckpt.clean_stale_tmp(self.ckpt_dir)
            if removed:
                print(f"checkpoint: removed what an interrupted checkpoint write left in "
                      f"{self.ckpt_dir} (its process is gone): {', '.join(removed)}",
                      file=sys.stderr, flush=True)
            try:
                choice = (self.choice.resume_step(self.state.step), None)
            except ckpt.CheckpointError as e:
                choice = (None, str(e))
                if self.choice.events:  # what was found bad is on record all the same
                    failed = MetricsLog(metrics_path)
                    self.choice.flush(failed)
                    failed.close()
        latest, error = distributed.broadcast_object(choice, self.world, self.device)
        if error is not None:
            raise ckpt.CheckpointError(error)
        if latest is not None:
            self.restore(latest, verified=True)
            if self.world.is_main:
                truncate_after(metrics_path, latest)
            distributed.barrier(self.world)
        return latest

    def _run(self) -> int:
        cfg = self.cfg
        if stopped_by_marker(self.run_dir, self.recovery is not None, self.world):
            return EXIT_DIVERGED
        metrics_path = self.run_dir / "metrics.jsonl"
        latest = self._resume(metrics_path)
        s = self.state
        log = MetricsLog(metrics_path if self.world.is_main else os.devnull)
        tr = cfg.tracking
        if tr is not None and tr.enabled and tr.tensorboard and self.world.is_main:
            from training.tensorboard_log import TensorBoardLog

            log.sinks.append(TensorBoardLog(self.run_dir / "tensorboard", purge_step=latest))
        for ev in self.choice.events:  # found before the log was open: at the resume step
            ev["step"] = s.step
        self.choice.flush(log)
        if latest is None:
            if cfg.init_from:
                self._warm_start(log)
            self.save()  # step 0: the rollback target of last resort
            self.emit({"event": "start", "step": 0})
        else:
            log.write({"kind": "event", "event": "resume", "step": s.step,
                       "checkpoint": ckpt.step_name(latest)})
            self.emit({"event": "resume", "step": s.step, "checkpoint": ckpt.step_name(latest)})
        if self.recovery is not None and latest is not None:
            recover(self, self.recovery, log)
            s = self.state
        t_last, tokens_last = time.perf_counter(), s.tokens_seen
        # For "progress" events: throughput and ETA over this attempt's own steps.
        t_start, step_start, tokens_start = t_last, s.step, s.tokens_seen
        t_progress, progressed = t_last, False
        try:
            while s.step < cfg.steps and not self.early["stopped"]:
                if self.pending_events:
                    self._flush_events(log)
                out = self.train_step()
                d = out.decision
                if d is not None and out.diverged:
                    if diverge(self, d, log, out.samples):
                        return EXIT_DIVERGED
                    s = self.state
                    continue
                if d is not None and out.skipped and d.event:
                    log.write({"kind": "event", **d.event})
                s.step += 1
                s.samples_seen += out.samples
                if not out.skipped:
                    s.tokens_seen += out.real_tokens
                if s.step % cfg.log_every == 0 or s.step == cfg.steps:
                    now = time.perf_counter()
                    tokens_per_s = (s.tokens_seen - tokens_last) / max(now - t_last, 1e-9)
                    log.write({
                        "kind": "train", "step": s.step, "loss": out.loss, "ce": out.ce,
                        "z_loss": out.z_loss, "lr": out.lr, "grad_norm": out.grad_norm,
                        "tokens_per_s": tokens_per_s, **self.mfu(tokens_per_s),
                        "tokens_seen": s.tokens_seen, "accum": out.accum,
                        # The sampler position after the step: `ballast blame` maps steps
                        # to data with it.
                        "samples_seen": s.samples_seen,
                        "skipped": self.guard.skipped_non_finite + self.guard.skipped_spikes,
                        "rollbacks": len(s.rollbacks), "loss_scale": self.scaler.get_scale()
                        if self.scaler.is_enabled() else None,
                    })
                    t_last, tokens_last = now, s.tokens_seen
                    if (s.step == cfg.steps or now - t_progress >= PROGRESS_EVERY_S
                            or not progressed):
                        self.emit(self.progress_event(out.loss, now - t_start,
                                                     s.step - step_start,
                                                     s.tokens_seen - tokens_start))
                        t_progress, progressed = now, True
                if out.stats is not None:
                    self._log_stats(log, out.stats)
                if out.noise is not None:
                    self._log_noise(log, out.noise)
                trouble = self._evaluate_and_save(log)
                if trouble is not None:
                    if self._diverge_now(log, *trouble):
                        return EXIT_DIVERGED
                    s = self.state
                if self.early["stopped"]:
                    break
        finally:
            self._flush_events(log)  # a run resumed at its last step still records them
            log.close()
        self.ckpts.finish()  # the last checkpoint is on disk before final.json points at it
        if self.world.is_main:
            self.finish(metrics_path)
        if self.remote is not None:
            self.remote.wait()  # the final checkpoint is in object storage before exit 0
        done: dict[str, Any] = {"event": "done", "step": s.step, "tokens_seen": s.tokens_seen}
        if self.early["stopped"]:
            done["reason"] = "early_stopping"
        self.emit(done)
        return EXIT_OK

    def _log_noise(self, log: MetricsLog, noise: dict[str, Any]) -> None:
        step = self.state.step
        raise_to = noise.pop("raise_to", None)
        log.write({"kind": "noise_scale", "step": step, **noise})
        if raise_to is not None:
            event = {"event": "batch_size", "step": step, "accum_from": noise["accum"],
                     "accum_to": raise_to, "b_noise": noise["b_noise"]}
            self.record(log, event)

    def _log_stats(self, log: MetricsLog, stats: dict[str, list[float]]) -> None:
        """The "stats" record, and the attention-logit warning when a layer is above
        `max_attn_logit` (a warning only: the step stands)."""
        step, limit = self.state.step, self.cfg.max_attn_logit
        log.write({"kind": "stats", "step": step, **stats})
        logits = stats["attn_logit_max"]
        if limit is None or not any(v > limit for v in logits):
            return
        layer = max(range(len(logits)), key=lambda i: logits[i])
        event = {"event": "attn_logit_warning", "step": step, "layer": layer,
                 "attn_logit_max": logits[layer], "limit": limit}
        self.record(log, event)

    def _evaluate_and_save(self, log: MetricsLog) -> tuple[str, str] | None:
        """The evaluation and the checkpoint due after this step. A non-finite validation
        loss or non-finite weights are a divergence (trigger, description): a NaN model is
        never "done", and never saved (it would become the resume point and rollback
        target)."""
        s, cfg = self.state, self.cfg
        stop = False
        if s.step % cfg.eval_every == 0 or s.step == cfg.steps:
            val = self.evaluate()
            record: dict[str, Any] = {"kind": "eval", "step": s.step, "val_loss": val,
                                      "val_ppl": math.exp(val) if val < 50 else float("inf")}
            if self.ema is not None:
                record["ema_val_loss"] = self.evaluate_ema()
            log.write(record)
            if not math.isfinite(val) and self._eval_tokens > 0:
                return "non_finite_val_loss", f"validation loss {val} at step {s.step}"
            stop = self._early_stop(val)
            if stop:
                event = {"event": "early_stop", "step": s.step, "val_loss": val,
                         **self._early_record()}
                self.record(log, event)
        # The stopping step is checkpointed: final.json names it, and a relaunch of the
        # stopped run resumes there and ends at once.
        if s.step % cfg.checkpoint.every == 0 or s.step == cfg.steps or stop:
            if not self.weights_finite():
                return ("non_finite_weights",
                        f"non-finite weights at step {s.step} (checkpoint not written)")
            self.save()
        return None

    def _early_record(self) -> dict[str, Any]:
        es = self.cfg.early_stopping
        assert es is not None
        return {"reason": "early_stopping", "best_val_loss": self.early["best"],
                "best_step": self.early["best_step"], "patience": es.patience,
                "min_delta": es.min_delta}

    def _diverge_now(self, log: MetricsLog, trigger: str, what: str) -> bool:
        """A divergence the loop found itself, handled as the guard's own are (rollback, or
        exit 3 with the budget spent: True)."""
        d = self.guard.divergence(self.state.step, trigger, what)
        return diverge(self, d, log, 0)

    def finish(self, metrics_path: Path) -> None:
        plot_loss(metrics_path, self.run_dir / "loss.png")
        stopped = {"early_stopping": self._early_record()} if self.early["stopped"] else {}
        (self.run_dir / "final.json").write_text(json.dumps({
            "step": self.state.step, "tokens_seen": self.state.tokens_seen,
            "rollbacks": self.state.rollbacks,
            "skipped_non_finite": self.guard.skipped_non_finite,
            "skipped_spikes": self.guard.skipped_spikes,
            "config": self.cfg.model_dump(mode="json"), "seed": self.cfg.seed,
            "dataset": {"uri": self.cfg.dataset,
                        "config_fingerprint": self.data.manifest.get("config_fingerprint")},
            # world_size: how the samples of a micro-batch were split over ranks (blame).
            "environment": {**environment(), "world_size": self.world.size},
            "checkpoint": str(self.ckpt_dir / ckpt.step_name(self.state.step)),
            **stopped,
        }, indent=2, default=str))


def environment() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.version.cuda,
            "git_commit": commit, "threads": torch.get_num_threads(), "pid": os.getpid()}


def main(argv: list[str] | None = None) -> int:
    from training.entrypoint import record_exit

    code = _main(argv)
    record_exit(code)  # for the pod entrypoint: torchrun hides worker exit codes
    return code


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.train",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--dataset", help="override `dataset:`")
    ap.add_argument("--run-dir", help="override `run_dir:`")
    ap.add_argument("--steps", type=int, help="override `steps:`")
    ap.add_argument("--recover", action="store_true",
                    help="restart after exit 3 (the supervisor passes this): back to a "
                         "checkpoint, skip data, scale the LR, fresh rollback budget")
    ap.add_argument("--rollback-to", type=int, help="with --recover: newest checkpoint <= this")
    ap.add_argument("--skip-to-sample", type=int,
                    help="with --recover: resume the training order at this sample")
    ap.add_argument("--lr-scale", type=float, default=0.5,
                    help="with --recover: multiply the learning rate (default 0.5)")
    ap.add_argument("--fault", action="append", default=[],
                    help="inject a fault (tests): nan@S[,S], spike@S[,S], kill@S, lr_blowup@A-B, "
                         "lr_blowup_persistent@A-B")
    args = ap.parse_args(argv)
    try:
        cfg = load_train_config(args.config, {"dataset": args.dataset, "run_dir": args.run_dir,
                                              "steps": args.steps})
        if not 0 < args.lr_scale <= 1:
            raise ValueError(f"--lr-scale must be in (0, 1], got {args.lr_scale}")
        request = (Recovery(args.rollback_to, args.skip_to_sample, args.lr_scale)
                   if args.recover else None)
        trainer = Trainer(cfg, Faults.parse(args.fault), request)
    except (TrainConfigError, DatasetError, ckpt.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    return trainer.run()


if __name__ == "__main__":
    sys.exit(main())
