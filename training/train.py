"""The trainer: `python -m training.train --config X` (one process; torchrun comes with
multi-process training). The loop stays short; each concern lives in its own module:
model, loss, optim, schedule, guards, checkpoint, data, metrics.

Exit codes (shared with launchers and Kubernetes): 0 done, 1 bad config or data,
3 diverged beyond the rollback budget.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.errors import StorageError
from core.protocol import EXIT_CRASHED, EXIT_DIVERGED, EXIT_ERROR, EXIT_OK, format_event
from training import checkpoint as ckpt
from training import distributed
from training.config import TrainConfig, TrainConfigError, load_train_config
from training.data import DatasetError, Sampler, TrainData, load_data, validation_batches
from training.guards import Decision, StabilityGuard
from training.loss import lm_loss, shift_targets
from training.metrics import MetricsLog, plot_loss, truncate_after
from training.model import GPT
from training.optim import build_optimizer
from training.remote import RemoteCheckpointError, RemoteCheckpoints, RemoteOwnershipError
from training.schedule import accum_steps_at, set_lr


@dataclass
class Faults:
    """Injected faults, for tests of the guards: NaN loss at steps, loss x factor at
    steps (a spike), and the learning rate x factor over a step range (a real blow-up)."""

    nan_at: set[int] = field(default_factory=set)
    spike_at: set[int] = field(default_factory=set)
    spike_factor: float = 50.0
    lr_blowup: tuple[int, int] | None = None
    lr_blowup_factor: float = 1000.0
    persist: bool = False
    kill_at: set[int] = field(default_factory=set)  # SIGKILL itself (a crash, every time)

    @classmethod
    def parse(cls, specs: list[str]) -> Faults:
        f = cls()
        for spec in specs:
            kind, _, at = spec.partition("@")
            if kind == "nan":
                f.nan_at |= {int(s) for s in at.split(",")}
            elif kind == "spike":
                f.spike_at |= {int(s) for s in at.split(",")}
            elif kind == "kill":
                f.kill_at |= {int(s) for s in at.split(",")}
            elif kind in ("lr_blowup", "lr_blowup_persistent"):
                a, b = at.split("-")
                f.lr_blowup = (int(a), int(b))
                f.persist = kind == "lr_blowup_persistent"
            else:
                raise ValueError(f"unknown fault {spec!r} (nan@S, spike@S, kill@S, lr_blowup@A-B, "
                                 "lr_blowup_persistent@A-B)")
        return f


@dataclass(frozen=True)
class Recovery:
    """What the supervisor asks for when it restarts a run that diverged beyond its rollback
    budget (exit 3): go back to the newest checkpoint at or before `rollback_to`, skip the
    training order up to sample `skip_to_sample` (the data that led to the divergence), scale
    the learning rate by `lr_scale`, and start a fresh rollback budget."""

    rollback_to: int | None = None
    skip_to_sample: int | None = None
    lr_scale: float = 1.0




@dataclass
class State:
    """Everything besides module/optimizer state that exact resume needs."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    lr_scale: float = 1.0  # multiplied by rollback_lr_scale at each rollback
    rollbacks: list[dict[str, Any]] = field(default_factory=list)


def pick_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError("device: cuda was asked for, but no CUDA device is available")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


DIVERGED_MARKER = "DIVERGED"
# A "progress" event (step, loss, tokens/s, ETA) after the first step, then at most this
# often, and at the last step: enough for a live view, few lines in a week-long log.
PROGRESS_EVERY_S = 30.0


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.precision.dtype == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


class Trainer:
    def __init__(self, cfg: TrainConfig, faults: Faults | None = None,
                 recovery: Recovery | None = None):
        self.cfg, self.faults, self.recovery = cfg, faults or Faults(), recovery
        self._rewind_next = False  # the next remote upload follows a rollback
        self.device = pick_device(cfg)
        self.world = distributed.init(self.device.type)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=self.device.type == "cuda")
        self.data: TrainData = load_data(cfg.dataset, options=cfg.storage)
        self.model = GPT(cfg.model, self.data.vocab_size, self.data.seq_len).to(self.device)
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
        # FSDP2 async checkpoints: DCP writes in a background thread and runs collectives
        # there, so it gets a gloo group of its own (never interleaved with training's).
        self._pending_dcp: ckpt.PendingSharded | None = None
        self._dcp_pg = None
        if self.fsdp and cfg.checkpoint.async_save:
            import torch.distributed as dist

            self._dcp_pg = dist.new_group(backend="gloo")
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=cfg.precision.dtype == "fp16")
        self.guard = StabilityGuard(cfg.guards)
        self.sampler = Sampler(self.data.train.rows, cfg.seed, cfg.shuffle)
        self.state = State()
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint_dir())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # checkpoint_corrupt events found before the metrics log is open (or in a rollback).
        self._ckpt_events: list[dict[str, Any]] = []
        self._eval_tokens = 0  # tokens the last evaluate() scored
        c = cfg.checkpoint
        self.saver = ckpt.AsyncSaver()
        remote_uri = cfg.remote_checkpoint_uri()  # <checkpoint.remote>/<run name>
        self.remote = (RemoteCheckpoints(remote_uri, cfg.storage, c.keep_last, c.keep_every,
                                         c.remote_max_failures,
                                         log=lambda m: print(m, file=sys.stderr))
                       if remote_uri and self.world.is_main else None)
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
    def snapshot(self, modules: bool = True) -> dict[str, Any]:
        s = self.state
        return {
            **({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
               if modules else {}),
            "scaler": self.scaler.state_dict(), "rng": ckpt.rng_state(),
            "guard": self.guard.state_dict(), "config": self.cfg.model_dump(mode="json"),
            "trainer": {"step": s.step, "samples_seen": s.samples_seen,
                        "tokens_seen": s.tokens_seen, "lr_scale": s.lr_scale,
                        "rollbacks": s.rollbacks},
        }

    def save(self) -> None:
        if self.fsdp:  # every rank holds a shard: all of them write (DCP)
            self._finish_dcp()  # the previous async save is complete before the next starts
            snap = copy.deepcopy(self.snapshot(modules=False))
            self._pending_dcp = ckpt.save_sharded(
                self.ckpt_dir, self.state.step, self.model, self.optimizer, snap,
                self.world.is_main, lambda: distributed.barrier(self.world), self._dcp_pg)
            if self._pending_dcp is None and self.world.is_main:
                self._after_save(self.state.step)
            return
        if self.world.is_main:  # DDP: every rank holds the same state
            step = self.state.step
            if self.cfg.checkpoint.async_save:
                self.saver.save(self.ckpt_dir, step, self.snapshot(),
                                after=lambda: self._after_save(step))
            else:
                ckpt.save(self.ckpt_dir, step, self.snapshot())
                self._after_save(step)
        distributed.barrier(self.world)

    def _after_save(self, step: int) -> None:
        c = self.cfg.checkpoint
        # Step 0 is kept: it is the rollback target of last resort.
        ckpt.retain(self.ckpt_dir, c.keep_last, c.keep_every, protect={0})
        if self.remote is not None:  # returns at once; the upload runs in its own thread
            rewind, self._rewind_next = self._rewind_next, False
            self.remote.submit(self.ckpt_dir, step, rewind=rewind)
        self.emit({"event": "checkpoint", "step": step})

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

    def _finish_dcp(self) -> None:
        p, self._pending_dcp = self._pending_dcp, None
        if p is not None:
            ckpt.finish_sharded(p, self.world.is_main, lambda: distributed.barrier(self.world))
            if self.world.is_main:
                self._after_save(p.step)

    def settle(self) -> None:
        """Wait for the checkpoint being written (before anything reads checkpoints)."""
        if self.world.is_main:
            self.saver.wait()
        self._finish_dcp()
        distributed.barrier(self.world)  # nobody reads a checkpoint before it exists

    def restore(self, step: int, modules_only: bool = False,
                verified: bool = False) -> dict[str, Any]:
        """Load checkpoint `step` (`verified`: rank 0 has just checked its checksums)."""
        if ckpt.is_sharded(self.ckpt_dir, step):  # DCP: any world size, resharded on load
            st = ckpt.load_sharded(self.ckpt_dir, step, self.model, self.optimizer, self.device,
                                   verified=verified)
        else:
            st, error = None, None
            if self.world.is_main:
                try:
                    st = ckpt.load(self.ckpt_dir, step, map_location=self.device,
                                   verified=verified)
                except ckpt.CheckpointError as e:
                    error = str(e)
            # The error too: the other ranks must not wait for a state that never comes.
            st, error = distributed.broadcast_object((st, error), self.world, self.device)
            if error is not None:
                raise ckpt.CheckpointError(error)
            self.model.load_state_dict(st["model"])
            self.optimizer.load_state_dict(st["optimizer"])
        self.scaler.load_state_dict(st["scaler"])
        ckpt.set_rng_state(st["rng"])
        if not modules_only:
            self.guard.load_state_dict(st["guard"])
            t = st["trainer"]
            self.state = State(t["step"], t["samples_seen"], t["tokens_seen"], t["lr_scale"],
                               list(t["rollbacks"]))
        return st

    def _set_aside(self, step: int, error: Exception) -> None:
        """Rank 0: checkpoint `step` failed verification. One warning line, the directory
        renamed aside (kept for a post mortem; retention and restores ignore it), and a
        checkpoint_corrupt event for the metrics log."""
        moved = ckpt.move_aside(self.ckpt_dir, step)
        where = f"moved aside to {moved.name}" if moved is not None else "nothing to move aside"
        print(f"warning: not using checkpoint {ckpt.step_name(step)}: {error}; {where}",
              file=sys.stderr, flush=True)
        self._ckpt_events.append({
            "kind": "event", "event": "checkpoint_corrupt", "step": self.state.step,
            "checkpoint": ckpt.step_name(step), "checkpoint_step": step,
            "moved_to": None if moved is None else str(moved), "error": str(error)})

    def _newest_valid(self, at_most: int | None, also: int | None = None,
                      suspect: bool = False) -> int | None:
        """Rank 0: the newest checkpoint at or before step `at_most` (None: any) that
        verifies, or None. Local ones first, newest first (plus step `also`, which `latest`
        names even if its directory is gone); each bad one is set aside. Object storage is
        asked only when something local was bad (or `suspect`), or nothing local is left:
        a newer complete checkpoint there wins over an older local one."""
        root = self.ckpt_dir
        local = {c for c in ckpt.step_dirs(root) if at_most is None or c <= at_most}
        if also is not None:
            local.add(also)
        best, bad = None, suspect
        for c in sorted(local, reverse=True):
            try:
                ckpt.verify(root, c)
            except ckpt.CheckpointError as e:
                self._set_aside(c, e)
                bad = True
                continue
            best = c
            break
        if self.remote is None or (best is not None and not bad):
            return best
        try:
            newer = [r for r in self.remote.remote_steps()
                     if (at_most is None or r <= at_most) and (best is None or r > best)]
            got = self.remote.restore_at_most(root, max(newer)) if newer else None
        except StorageError as e:
            if best is None:
                raise  # unreachable is not "nothing there": a crash, restarted later
            print(f"warning: object storage {self.remote.uri} cannot be read ({e}); using "
                  f"the local checkpoint {ckpt.step_name(best)}", file=sys.stderr, flush=True)
            return best
        return got if got is not None and (best is None or got > best) else best

    def _resume_step(self) -> int | None:
        """Rank 0: the checkpoint to resume from, None for a fresh start. `latest` names
        it; when that one is corrupt, partial or gone, the newest valid older one (local,
        else object storage) is used and `latest` moved to it. Raises CheckpointError
        when checkpoints were there but none of them is valid."""
        root = self.ckpt_dir
        garbled = False
        try:
            named = ckpt.latest_step(root)
        except ckpt.CheckpointError as e:
            print(f"warning: {e}; looking for the newest valid checkpoint", file=sys.stderr,
                  flush=True)
            named, garbled = None, True
        if named is None and not garbled:
            if self.remote is None:
                return None
            # A fresh machine: the newest complete checkpoint in object storage.
            named = self.remote.restore_latest(root)
            if named is None:
                return None
        best = self._newest_valid(named, also=named, suspect=garbled)
        if best is None:
            where = f"{root}" + (f" or {self.remote.uri}" if self.remote is not None else "")
            what = (f"{root / ckpt.LATEST} names {ckpt.step_name(named)}" if named is not None
                    else f"{root / ckpt.LATEST} is unreadable")
            raise ckpt.CheckpointError(
                f"no valid checkpoint to resume from: {what}, and no complete checkpoint "
                f"at or before it is left in {where} (bad ones were moved aside as "
                f"step-*.corrupt-*); put a good checkpoint back, or delete {root} to start "
                f"from step 0")
        if best != named:
            ckpt.write_latest(root, best)
        return best

    def _flush_checkpoint_events(self, log: MetricsLog) -> None:
        for ev in self._ckpt_events:
            log.write(ev)
        self._ckpt_events.clear()

    def weights_finite(self) -> bool:
        """Every parameter finite, on every rank (FSDP: each rank checks its shards)."""
        local = [getattr(p, "to_local", lambda p=p: p)() for p in self.model.parameters()]
        bad = sum(0 if bool(torch.isfinite(t).all()) else 1 for t in local if t.numel())
        return distributed.all_sum(bad, self.world, self.device) == 0

    # -- one optimisation step ----------------------------------------------------
    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type != "cuda":
            return batch
        # Pinned host memory lets the copy run asynchronously with the previous step.
        return {n: t.pin_memory().to(self.device, non_blocking=True) for n, t in batch.items()}

    def train_step(self) -> dict[str, Any]:
        cfg, s = self.cfg, self.state
        if s.step in self.faults.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        accum = accum_steps_at(s.step, cfg.schedule, cfg.accum_steps)
        scale = s.lr_scale
        blow = self.faults.lr_blowup
        # A transient fault: it hits the first pass over those steps, not the replay
        # after a rollback (unless `persist`, which tests the rollback budget; it lasts
        # until the supervisor's recovery, which tests that).
        persists = self.faults.persist and not any(
            r.get("reason") == "supervisor_recovery" for r in s.rollbacks)
        if blow and blow[0] <= s.step < blow[1] and (persists or not s.rollbacks):
            scale *= self.faults.lr_blowup_factor
        lr = set_lr(self.optimizer, s.step, cfg.steps, cfg.schedule, scale)
        idx = self.sampler.take(s.samples_seen, cfg.micro_batch * accum)
        self.model.train()
        total = ce_sum = z_sum = 0.0
        real_tokens = 0
        world = self.world
        for k in range(accum):
            gidx = idx[k * cfg.micro_batch : (k + 1) * cfg.micro_batch]
            b = self.to_device(self.data.train.batch(distributed.rank_slice(gidx, world)))
            targets, valid = shift_targets(b["input_ids"], b["segment_ids"], b["loss_mask"])
            sync = (self.ddp.no_sync() if self.ddp is not None and k < accum - 1
                    else contextlib.nullcontext())
            if self.fsdp:  # reduce-scatter gradients only after the last micro-batch
                self.model.set_requires_gradient_sync(k == accum - 1)
            with sync:
                with autocast(cfg, self.device):
                    logits = self.forward(b["input_ids"], b["position_ids"], b["segment_ids"])
                loss, ce, z = lm_loss(logits.float(), targets, valid, cfg.precision.z_loss)
                if world.active:
                    # Token-weighted across ranks: DDP averages gradients over ranks, so
                    # weight each rank's mean by its share of the micro-batch's tokens.
                    n_local = int(valid.sum())
                    n_global = distributed.all_sum(n_local, world, self.device)
                    w = world.size * n_local / max(n_global, 1.0)
                    loss, ce, z = loss * w, ce * w, z * w
                if s.step in self.faults.nan_at:
                    loss = loss * float("nan")
                if s.step in self.faults.spike_at:
                    loss = loss * self.faults.spike_factor
                # Mean over micro-batches: each contributes 1/accum of the gradient.
                # Inside `sync`: DDP all-reduces gradients only on the last micro-batch.
                self.scaler.scale(loss / accum).backward()
            total += loss.item() / accum
            ce_sum += ce.item() / accum
            z_sum += z.item() / accum
            real_tokens += int(b["loss_mask"].sum())
        if world.active:  # the logged values are the global ones, the same on every rank
            total, ce_sum, z_sum = (distributed.all_sum(v, world, self.device) / world.size
                                    for v in (total, ce_sum, z_sum))
            real_tokens = int(distributed.all_sum(real_tokens, world, self.device))
        self.scaler.unscale_(self.optimizer)
        clip = cfg.optim.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        full = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor over the shards
        grad_norm = float(full() if full is not None else norm)
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
            elif self.scaler.is_enabled():
                # No step, but the scaler must close this iteration (unscale_ was called):
                # without update() the next unscale_ raises.
                self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return {"lr": lr, "loss": total, "ce": ce_sum, "z_loss": z_sum, "grad_norm": grad_norm,
                "accum": accum, "samples": len(idx), "real_tokens": real_tokens,
                "decision": decision, "fp16_overflow": fp16_overflow}

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
            with contextlib.suppress(Exception):  # never leave a save half-way on exit
                self.saver.wait()
            if self.remote is not None:
                self.remote.close()
            distributed.shutdown()

    def _run(self) -> int:
        cfg, s = self.cfg, self.state
        marker = self.run_dir / DIVERGED_MARKER
        if marker.is_file() and self.recovery is not None:
            distributed.barrier(self.world)  # every rank has seen the marker before it goes
            if self.world.is_main:
                marker.rename(self.run_dir / f"{DIVERGED_MARKER}.recovered-{int(time.time())}")
        elif marker.is_file():
            # torchrun restarts a worker whatever its exit code; a run that diverged
            # beyond its rollback budget must not quietly train on.
            print(f"{marker} exists: this run diverged beyond its rollback budget "
                  f"(delete the file to train anyway):\n{marker.read_text()}", file=sys.stderr)
            return EXIT_DIVERGED
        metrics_path = self.run_dir / "metrics.jsonl"
        # Rank 0's view decides: under DDP on several nodes the other ranks' local disks
        # hold no checkpoints (only rank 0 writes them); restore() broadcasts the state.
        choice: tuple[int | None, str | None] = (None, None)
        if self.world.is_main:
            removed = ckpt.clean_stale_tmp(self.ckpt_dir)
            if removed:
                print(f"checkpoint: removed what an interrupted checkpoint write left in "
                      f"{self.ckpt_dir} (its process is gone): {', '.join(removed)}",
                      file=sys.stderr, flush=True)
            try:
                choice = (self._resume_step(), None)
            except ckpt.CheckpointError as e:
                choice = (None, str(e))
                if self._ckpt_events:  # what was found bad is on record all the same
                    failed = MetricsLog(metrics_path)
                    self._flush_checkpoint_events(failed)
                    failed.close()
        latest, error = distributed.broadcast_object(choice, self.world, self.device)
        if error is not None:
            raise ckpt.CheckpointError(error)
        if latest is not None:
            self.restore(latest, verified=True)
            if self.world.is_main:
                truncate_after(metrics_path, latest)
            distributed.barrier(self.world)
            s = self.state
        log = MetricsLog(metrics_path if self.world.is_main else os.devnull)
        for ev in self._ckpt_events:  # found before the log was open: at the resume step
            ev["step"] = s.step
        self._flush_checkpoint_events(log)
        if latest is None:
            self.save()  # step 0: the rollback target of last resort
            self.emit({"event": "start", "step": 0})
        else:
            log.write({"kind": "event", "event": "resume", "step": s.step,
                       "checkpoint": ckpt.step_name(latest)})
            self.emit({"event": "resume", "step": s.step, "checkpoint": ckpt.step_name(latest)})
        if self.recovery is not None and latest is not None:
            self.recover(self.recovery, log)
            s = self.state
        t_last, tokens_last = time.perf_counter(), s.tokens_seen
        # For "progress" events: throughput and ETA over this attempt's own steps.
        t_start, step_start, tokens_start = t_last, s.step, s.tokens_seen
        t_progress, progressed = t_last, False
        try:
            while s.step < cfg.steps:
                out = self.train_step()
                d = out["decision"]
                if d is not None and d.action in ("rollback", "abort"):
                    if self.diverged(d, log, marker, out["samples"]):
                        return EXIT_DIVERGED
                    s = self.state
                    continue
                if d is not None and d.action != "ok" and d.event:
                    log.write({"kind": "event", **d.event})
                s.step += 1
                s.samples_seen += out["samples"]
                if d is None or d.action == "ok":
                    s.tokens_seen += out["real_tokens"]
                if s.step % cfg.log_every == 0 or s.step == cfg.steps:
                    now = time.perf_counter()
                    log.write({
                        "kind": "train", "step": s.step, "loss": out["loss"], "ce": out["ce"],
                        "z_loss": out["z_loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                        "tokens_per_s": (s.tokens_seen - tokens_last) / max(now - t_last, 1e-9),
                        "tokens_seen": s.tokens_seen, "accum": out["accum"],
                        "skipped": self.guard.skipped_non_finite + self.guard.skipped_spikes,
                        "rollbacks": len(s.rollbacks), "loss_scale": self.scaler.get_scale()
                        if self.scaler.is_enabled() else None,
                    })
                    t_last, tokens_last = now, s.tokens_seen
                    if (s.step == cfg.steps or now - t_progress >= PROGRESS_EVERY_S
                            or not progressed):
                        self.emit(self.progress_event(out["loss"], now - t_start,
                                                     s.step - step_start,
                                                     s.tokens_seen - tokens_start))
                        t_progress, progressed = now, True
                if s.step % cfg.eval_every == 0 or s.step == cfg.steps:
                    val = self.evaluate()
                    log.write({"kind": "eval", "step": s.step, "val_loss": val,
                               "val_ppl": math.exp(val) if val < 50 else float("inf")})
                    if not math.isfinite(val) and self._eval_tokens > 0:
                        # A NaN model is never "done": a divergence like any other.
                        d = self.guard.divergence(
                            s.step, "non_finite_val_loss",
                            f"validation loss {val} at step {s.step}")
                        if self.diverged(d, log, marker, 0):
                            return EXIT_DIVERGED
                        s = self.state
                        continue
                if s.step % cfg.checkpoint.every == 0 or s.step == cfg.steps:
                    if not self.weights_finite():
                        # Never saved: it would become the resume point and rollback target.
                        d = self.guard.divergence(
                            s.step, "non_finite_weights",
                            f"non-finite weights at step {s.step} (checkpoint not written)")
                        if self.diverged(d, log, marker, 0):
                            return EXIT_DIVERGED
                        s = self.state
                        continue
                    self.save()
        finally:
            log.close()
        self.settle()  # the last checkpoint is on disk before final.json points at it
        if self.world.is_main:
            self.finish(metrics_path)
        if self.remote is not None:
            self.remote.wait()  # the final checkpoint is in object storage before exit 0
        self.emit({"event": "done", "step": s.step, "tokens_seen": s.tokens_seen})
        return EXIT_OK

    def diverged(self, d: Decision, log: MetricsLog, marker: Path, samples: int) -> bool:
        """Act on a divergence decision: roll back (False: train on), or, with the budget
        spent, record the abort, leave the DIVERGED marker and return True (exit 3).
        `samples`: those of the current step, not yet counted in the state."""
        s = self.state
        if d.action == "rollback":
            self.rollback(d, log)
            return False
        log.write({"kind": "event", **(d.event or {}), "step": s.step})
        print(d.detail, file=sys.stderr)
        if self.world.is_main:
            marker.write_text(d.detail + "\n")
        ev = d.event or {}
        self.emit({"event": "diverged", "step": s.step, "start_step": ev.get("start_step"),
                   "samples_seen": s.samples_seen + samples, "rollbacks": len(s.rollbacks)})
        return True

    def recover(self, r: Recovery, log: MetricsLog) -> None:
        """The supervisor's restart after a divergence beyond the rollback budget: like a
        rollback, but across processes, with a fresh budget (see Recovery)."""
        s = self.state
        key = {"rollback_to": r.rollback_to, "skip_to_sample": r.skip_to_sample}
        if any(h.get("reason") == "supervisor_recovery" and h.get("request") == key
               for h in s.rollbacks):
            return  # applied before this process restarted (torchrun --max-restarts)
        cap = s.step if r.rollback_to is None else min(r.rollback_to, s.step)
        target = None
        if self.world.is_main:  # rank 0 decides (its disk holds the checkpoints under DDP)
            # The newest valid one at or before `cap` (local, else object storage), else the
            # one this process has just resumed from.
            target = self._newest_valid(cap)
            if target is None:
                target = self._newest_valid(s.step)
        self._flush_checkpoint_events(log)
        target = distributed.broadcast_object(target, self.world, self.device)
        if target is None:
            raise ckpt.CheckpointError(f"no valid checkpoint at or before step {s.step} "
                                       f"left in {self.ckpt_dir} to recover from")
        from_step = s.step
        st = self.restore(target, verified=True)
        t = self.state
        self.state = State(target, max(t.samples_seen, r.skip_to_sample or 0), t.tokens_seen,
                           t.lr_scale * r.lr_scale,
                           [*t.rollbacks, {"from_step": from_step, "to_step": target,
                                           "reason": "supervisor_recovery", "request": key,
                                           "detail": f"lr x {r.lr_scale}"}])
        self.guard.reset_budget()
        if self.world.is_main:  # the abandoned trajectory must never be resumed
            for c in ckpt.steps(self.ckpt_dir):
                if c > target:
                    shutil.rmtree(self.ckpt_dir / ckpt.step_name(c), ignore_errors=True)
        self._rewind_next = True
        self.save()  # overwrites step `target` with the new position and LR scale
        self.settle()
        event = {"event": "recovered", "step": from_step, "to_step": target,
                 "samples_skipped": f"{st['trainer']['samples_seen']}..{self.state.samples_seen}",
                 "lr_scale": self.state.lr_scale}
        log.write({"kind": "event", **event})
        self.emit(event)

    def rollback(self, d: Any, log: MetricsLog) -> None:
        """Back to the newest checkpoint before the trouble began; the data window in
        between is skipped (the sampler position is kept), and the LR optionally scaled."""
        s = self.state
        self.settle()
        start = int((d.event or {}).get("start_step", s.step))
        # The newest valid checkpoint at or before the start (bad ones are set aside).
        target = self._newest_valid(start) if self.world.is_main else None
        self._flush_checkpoint_events(log)
        target = distributed.broadcast_object(target, self.world, self.device)
        if target is None:
            raise ckpt.CheckpointError(f"no valid checkpoint at or before step {start} left "
                                       f"in {self.ckpt_dir} to roll back to")
        samples_seen, tokens_seen = s.samples_seen, s.tokens_seen
        history = [*s.rollbacks, {"from_step": s.step, "to_step": target,
                                  "reason": d.reason, "detail": d.detail}]
        lr_scale = s.lr_scale * self.cfg.guards.rollback_lr_scale
        st = self.restore(target, modules_only=True, verified=True)
        self.state = State(target, samples_seen, tokens_seen, lr_scale, history)
        self._rewind_next = True
        # The guard keeps its counters and history (the budget must run out), but takes the
        # running statistics that match the restored weights.
        self.guard.rolled_back(to_step=target, from_step=s.step, stats_from=st["guard"])
        log.write({"kind": "event", **(d.event or {}), "event": "rollback", "step": s.step,
                   "to_step": target, "lr_scale": lr_scale,
                   "data_skipped": f"samples {st['trainer']['samples_seen']}..{samples_seen} "
                                   f"of the training order are not replayed"})

    def finish(self, metrics_path: Path) -> None:
        plot_loss(metrics_path, self.run_dir / "loss.png")
        (self.run_dir / "final.json").write_text(json.dumps({
            "step": self.state.step, "tokens_seen": self.state.tokens_seen,
            "rollbacks": self.state.rollbacks,
            "skipped_non_finite": self.guard.skipped_non_finite,
            "skipped_spikes": self.guard.skipped_spikes,
            "config": self.cfg.model_dump(mode="json"), "seed": self.cfg.seed,
            "dataset": {"uri": self.cfg.dataset,
                        "config_fingerprint": self.data.manifest.get("config_fingerprint")},
            "environment": environment(),
            "checkpoint": str(self.ckpt_dir / ckpt.step_name(self.state.step)),
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
        recovery = (Recovery(args.rollback_to, args.skip_to_sample, args.lr_scale)
                    if args.recover else None)
        trainer = Trainer(cfg, Faults.parse(args.fault), recovery)
    except (TrainConfigError, DatasetError, ckpt.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    return trainer.run()


if __name__ == "__main__":
    sys.exit(main())
