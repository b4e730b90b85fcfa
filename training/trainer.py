"""The trainer: assembles a run from its config and runs the loop. The loop is a series of
calls on parts that each own their concern: the step (training/step.py), guards (when a step
is bad), the checkpoint package (how state is written, read and copied to object storage),
recovery (rollbacks, the supervisor's recovery, the DIVERGED marker), faults (hooks tests
use to inject faults), data, metrics, and the recipe options as components
(training/components/: EMA, early stopping, the noise-scale controller, layer statistics,
resume overrides, warm start, progress), which the trainer calls at fixed points.

Steps count from 1, one numbering everywhere: step N is the N-th optimizer step, as the
console ("step N/M"), its train and eval records and the guard's events (skip, rollback,
abort, their windows) number it; checkpoint step-N is the state after step N, so "the
checkpoint before step N" is step-(N-1) or older.

Exit codes (shared with launchers and Kubernetes): 0 done, 1 bad config or data,
3 diverged beyond the rollback budget.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.os_errors import WRITE_ERRNOS, os_error_message
from core.protocol import EXIT_CRASHED, EXIT_DIVERGED, EXIT_ERROR, EXIT_OK
from training import checkpoint as ckpt
from training import components, distributed
from training.blame import event_documents
from training.checkpoint.manager import open_checkpoints
from training.checkpoint.remote import RemoteCheckpointError, RemoteCheckpoints
from training.checkpoint.remote.claim import claim_everywhere
from training.components.base import Component
from training.components.progress import Progress
from training.config import TrainConfig
from training.console import Console, closing_block, write_line
from training.data import Loader, Sampler, TrainData, load_data
from training.faults import Hooks
from training.guards import StabilityGuard
from training.metrics import MetricsLog, open_log, read
from training.model import GPT, compile_model
from training.optim import agc_params, build_optimizer
from training.parallel import parallelize
from training.pipeline import Pipeline, build_pipeline, pipeline_degree
from training.recovery import (
    CheckpointChoice,
    Recovery,
    State,
    diverge,
    recover,
    resume,
    stopped_by_marker,
)
from training.run_record import write_final
from training.step import StepResult, evaluate, pick_device, train_step


class Trainer:
    def __init__(
        self, cfg: TrainConfig, hooks: Hooks | None = None, recovery: Recovery | None = None
    ):
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
        # The world comes back with its data-parallel layout (tensor parallelism: the
        # ranks of a TP group share their data); self.fsdp: the parameters are sharded.
        # Pipeline parallelism (parallel.pp > 1): the model is pruned to this rank's stages,
        # which the schedule runs (training/pipeline.py); checkpoints go through DCP.
        self.pipeline: Pipeline | None = None
        if pipeline_degree(cfg.parallel) > 1:
            self.pipeline, self.world = build_pipeline(
                self.model, self.world, self.device, cfg, self.hooks
            )
            wrapped, self.ddp, self.fsdp = self.model, None, True
        else:
            wrapped, self.ddp, self.fsdp, self.world = parallelize(
                self.model, self.world, self.device, cfg.parallel
            )
        self.forward = compile_model(self.model, wrapped) if cfg.model.compile else wrapped
        self.optimizer = build_optimizer(self.model, cfg.optim)
        # Events found outside the loop's reach (a restore's overrides): written at the
        # next step.
        self.pending_events: list[dict[str, Any]] = []
        self.agc_params = agc_params(self.model) if cfg.optim.agc is not None else []
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision.dtype == "fp16")
        # Its skip and rollback events name the documents of their rows (provenance).
        self.guard = StabilityGuard(cfg.guards, describe=event_documents(self.data))
        self.sampler = Sampler(self.data.train.rows, cfg.seed, cfg.shuffle)
        # The next micro-batches load in a background thread while this step computes.
        self.loader = Loader(
            self.data.train,
            self.sampler,
            lambda idx: distributed.rank_slice(idx, self.world),
            pin_memory=self.device.type == "cuda",
        )
        self.state = State()
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint_dir())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = Console(self.run_dir, self.world.is_main)
        self._eval_tokens = 0  # tokens the last evaluate() scored
        c = cfg.checkpoint
        self.ckpts = open_checkpoints(
            self.ckpt_dir,
            self.world,
            self.device,
            self.model,
            self.optimizer,
            self._after_save,
            sharded=self.fsdp,
            async_save=c.async_save,
        )
        # The recipe options this config turns on (training/components/).
        self.components: list[Component] = []
        self.components = components.build(self)
        self.progress = self.component("progress")
        assert isinstance(self.progress, Progress)
        remote_uri = cfg.remote_checkpoint_uri()  # <checkpoint.remote>/<run name>
        self.remote = (
            RemoteCheckpoints(
                remote_uri,
                cfg.storage,
                c.keep_last,
                c.keep_every,
                c.remote_max_failures,
                log=write_line,
            )
            if remote_uri and self.world.is_main
            else None
        )
        self.choice = CheckpointChoice(self.ckpt_dir, self.remote)
        # Before anything is restored from, uploaded to or pruned in the remote prefix.
        claim_everywhere(
            self.remote,
            bool(cfg.checkpoint.remote),
            cfg.run_name(),
            cfg.checkpoint_fingerprint(),
            self.world,
            self.device,
        )

    def component(self, name: str) -> Component | None:
        """The component called `name`, if this run's config turned it on."""
        return next((c for c in self.components if c.name == name), None)

    # -- checkpoints --------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds besides the model and optimizer."""
        s = self.state
        trainer = {
            "step": s.step,
            "samples_seen": s.samples_seen,
            "tokens_seen": s.tokens_seen,
            "lr_scale": s.lr_scale,
            "rollbacks": s.rollbacks,
        }
        for c in self.components:
            trainer.update(c.trainer_state())
        # Component entries only with the option on, so a default run's checkpoints are
        # unchanged.
        return {
            "scaler": self.scaler.state_dict(),
            "rng": ckpt.rng_state(),
            "guard": self.guard.state_dict(),
            "config": self.cfg.model_dump(mode="json"),
            "trainer": trainer,
            **{c.key: c.state_dict() for c in self.components if c.key is not None},
        }

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

    def restore(
        self, step: int, modules_only: bool = False, verified: bool = False
    ) -> dict[str, Any]:
        """Load checkpoint `step` (`verified`: rank 0 has just checked its checksums),
        every component's state with it; `modules_only` keeps the loop's own position (a
        rollback sets it)."""
        for comp in self.components:
            comp.before_restore(step)
        try:
            if self.pipeline is not None and not ckpt.is_sharded(self.ckpt_dir, step):
                # A plain checkpoint (one process, DDP) holds every stage's tensors.
                st = self.pipeline.load_plain(self.ckpt_dir, step, self, verified)
            else:
                st = self.ckpts.restore(step, verified=verified)
        except ValueError as e:  # torch: the saved groups do not match this optimizer's
            raise ckpt.CheckpointError(
                f"checkpoint {ckpt.step_name(step)} in {self.ckpt_dir}: its optimizer state "
                f"does not fit this run's optimizer ({e}); optim.name, optim.lr_layer_decay "
                "and optim.param_groups must stay as the run began (resume_overrides can "
                "switch the optimizer)"
            ) from None
        self.scaler.load_state_dict(st["scaler"])
        ckpt.set_rng_state(st["rng"])
        if not modules_only:
            self.guard.load_state_dict(st["guard"])
            t = st["trainer"]
            self.state = State(
                t["step"], t["samples_seen"], t["tokens_seen"], t["lr_scale"], list(t["rollbacks"])
            )
        for comp in self.components:
            if comp.key is not None:
                comp.load_state_dict(st.get(comp.key))
        for comp in self.components:
            comp.after_restore(st)
        return st

    def weights_finite(self) -> bool:
        """Every parameter finite, on every rank (FSDP: each rank checks its shards)."""
        local = [getattr(p, "to_local", lambda p=p: p)() for p in self.model.parameters()]
        bad = sum(0 if bool(torch.isfinite(t).all()) else 1 for t in local if t.numel())
        return distributed.all_sum(bad, self.world, self.device) == 0

    # -- events -------------------------------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        """An event: a line for a person, and the machine form for the supervisor
        (training/console.py says where each goes)."""
        self.console.event(event)

    def record(self, log: MetricsLog, event: dict[str, Any]) -> None:
        """An event in the metrics log and on stderr."""
        log.write({"kind": "event", **event})
        self.emit(event)

    def _flush_events(self, log: MetricsLog) -> None:
        for event in self.pending_events:
            self.record(log, event)
        self.pending_events.clear()

    # -- the step and the evaluation (training/step.py) -----------------------------
    def train_step(self) -> StepResult:
        return train_step(self)

    def evaluate(self) -> float:
        val, self._eval_tokens = evaluate(self)
        return val

    def stopped(self) -> bool:
        return any(c.stopped for c in self.components)

    # -- the loop -----------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        except RemoteCheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            if self.remote is not None:  # no draining into a store that is not there
                self.remote.close(drain=False)
            return EXIT_CRASHED  # storage trouble is worth a restart; bad input is not
        except ckpt.CheckpointError as e:  # no valid checkpoint left: a restart cannot help
            print(f"error: {e}", file=sys.stderr)
            return EXIT_ERROR
        except OSError as e:  # a full disk, a quota, a file size limit, a read-only mount
            if e.errno not in WRITE_ERRNOS:
                raise
            print(
                f"error: {os_error_message(e)}; training stopped at step {self.state.step}: "
                "free space, then relaunch to resume from the last checkpoint",
                file=sys.stderr,
            )
            return EXIT_ERROR
        finally:
            self.loader.close()
            with contextlib.suppress(Exception):  # never leave a save half-way on exit
                self.ckpts.close()
            if self.remote is not None:
                self.remote.close()
            # The process group outlives the trainer: training.train tears it down once
            # this object is freed (distributed.shutdown).

    def _run(self) -> int:
        cfg = self.cfg
        if stopped_by_marker(self.run_dir, self.recovery is not None, self.world):
            return EXIT_DIVERGED
        metrics_path = self.run_dir / "metrics.jsonl"
        latest = resume(self, metrics_path)
        s = self.state
        tr = cfg.tracking
        tensorboard = (
            # A directory named after the run: TensorBoard names runs by their directory
            # under --logdir (it showed "." for <run_dir>/tensorboard).
            self.run_dir / "tensorboard" / cfg.run_name()
            if tr is not None and tr.enabled and tr.tensorboard
            else None
        )
        log = open_log(metrics_path, self.world.is_main, tensorboard, latest)
        for ev in self.choice.events:  # found before the log was open: at the resume step
            ev["step"] = s.step
        self.choice.flush(log)
        if latest is None:
            for c in self.components:
                c.on_fresh_start(log)
            self.save()  # step 0: the rollback target of last resort
            self.emit({"event": "start", "step": 0})
        else:
            log.write(
                {
                    "kind": "event",
                    "event": "resume",
                    "step": s.step,
                    "checkpoint": ckpt.step_name(latest),
                }
            )
            self.emit({"event": "resume", "step": s.step, "checkpoint": ckpt.step_name(latest)})
        if self.recovery is not None and latest is not None:
            recover(self, self.recovery, log)
            s = self.state
        if s.step > cfg.steps:  # asked for fewer steps than the run has trained
            log.close()
            print(
                f"error: run dir {self.run_dir} is already at step {s.step}, past steps: "
                f"{cfg.steps}; nothing to train (raise steps, or give this run a run_dir "
                "of its own)",
                file=sys.stderr,
            )
            return EXIT_ERROR
        if latest is not None and s.step == cfg.steps and self.world.is_main:
            print(
                f"note: run dir {self.run_dir} is already at step {s.step} of {cfg.steps}; "
                "nothing to train",
                file=sys.stderr,
            )
        self.progress.begin()
        try:
            while s.step < cfg.steps and not self.stopped():
                self.ckpts.check()  # a failed background save stops the run now
                if self.remote is not None:  # as does a remote gone for too long
                    self.remote.check_behind(cfg.checkpoint.remote_max_lag_minutes * 60)
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
                    log.write(self.progress.train_record(out))
                    self.progress.report(out.loss)
                for c in self.components:
                    c.after_step(log, out)
                # A component's divergence (an eval regression with action rollback) comes
                # before the checkpoint: the step it was found at is not saved.
                trouble = next(
                    (d for c in self.components if (d := c.divergence()) is not None), None
                ) or self._evaluate_and_save(log)
                if trouble is not None:
                    if self._diverge_now(log, *trouble):
                        return EXIT_DIVERGED
                    s = self.state
                if self.stopped():
                    break
        finally:
            self._flush_events(log)  # a run resumed at its last step still records them
            log.close()
        self.ckpts.finish()  # the last checkpoint is on disk before final.json points at it
        if self.world.is_main:
            write_final(self, metrics_path)
        if self.remote is not None:
            self.remote.wait()  # the final checkpoint is in object storage before exit 0
            self.remote.ensure_last_uploaded()
        done: dict[str, Any] = {"event": "done", "step": s.step, "tokens_seen": s.tokens_seen}
        for c in self.components:
            done.update(c.done_fields())
        self.console.event(done, say=False)  # the closing block says it
        if self.world.is_main:
            for line in closing_block(
                json.loads((self.run_dir / "final.json").read_text()),
                [r for r in read(metrics_path) if r.get("kind") == "eval"],
                self.run_dir,
                self.cfg.remote_checkpoint_uri(),
            ):
                self.console.say(line)
        return EXIT_OK

    def _evaluate_and_save(self, log: MetricsLog) -> tuple[str, str, int | None] | None:
        """The evaluation and the checkpoint due after this step. A non-finite validation
        loss or non-finite weights are a divergence (trigger, description): a NaN model is
        never "done", and never saved (it would become the resume point and rollback
        target)."""
        s, cfg = self.state, self.cfg
        stop = False
        if s.step % cfg.eval_every == 0 or s.step == cfg.steps:
            val = self.evaluate()
            record: dict[str, Any] = {
                "kind": "eval",
                "step": s.step,
                "val_loss": val,
                "val_ppl": math.exp(val) if val < 50 else float("inf"),
            }
            for c in self.components:
                record.update(c.eval_fields())
            log.write(record)
            self.console.say(
                f"step {s.step}: validation loss {val:.4f} (perplexity {record['val_ppl']:.4g})"
            )
            if not math.isfinite(val) and self._eval_tokens > 0:
                return "non_finite_val_loss", f"validation loss {val} at step {s.step}", None
            for c in self.components:
                stop = c.after_eval(val, log) or stop
        # The stopping step is checkpointed: final.json names it, and a relaunch of the
        # stopped run resumes there and ends at once.
        if s.step % cfg.checkpoint.every == 0 or s.step == cfg.steps or stop:
            if not self.weights_finite():
                return (
                    "non_finite_weights",
                    f"non-finite weights at step {s.step} (checkpoint not written)",
                    None,
                )
            self.save()
        return None

    def _diverge_now(
        self, log: MetricsLog, trigger: str, what: str, start_step: int | None = None
    ) -> bool:
        """A divergence the loop found itself after step `state.step` (counted, its train
        record written), handled as the guard's own are (rollback, or exit 3 with the budget
        spent: True). `start_step`: the window's first step (default: this step)."""
        d = self.guard.divergence(self.state.step, trigger, what, start_step)
        return diverge(self, d, log, 0)
