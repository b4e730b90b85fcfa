"""`noise_scale`: the gradient noise scale measured during training every `every` steps, and
the batch-size controller it drives (the estimator: training/noise_scale.py).

On a measuring step the first micro-batch's gradient gives |G_small|^2 (read on the device
and brought back with the step's one host transfer); the whole step's clipped-before norm
gives |G_big|^2."""

from __future__ import annotations

from typing import Any

import torch

from training import distributed
from training.components.base import Component
from training.config import TrainConfigError
from training.metrics import MetricsLog
from training.noise_scale import NoiseScale


class NoiseScaleController(Component):
    name = key = "noise_scale"

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        if t.fsdp:
            raise TrainConfigError("noise_scale: not supported with parallel: fsdp2")
        assert t.cfg.noise_scale is not None
        self.cfg = t.cfg.noise_scale
        self.noise = NoiseScale(self.cfg.ema_beta)
        self.on = False
        self.small_sq: torch.Tensor | None = None  # |G_small|^2, on the device

    def state_dict(self) -> Any:
        return self.noise.state_dict()

    def load_state_dict(self, state: Any | None) -> None:
        if state is not None:
            self.noise.load_state_dict(state)
        else:  # a checkpoint from before it was on: start the estimate afresh
            self.noise = NoiseScale(self.noise.beta)

    def accum(self, step: int, accum: int) -> int:
        if self.noise.accum is not None:
            return max(accum, self.noise.accum)  # the batch-size controller's
        return accum

    def step_begin(self, step: int, accum: int) -> None:
        self.on = (step + 1) % self.cfg.every == 0 and accum >= 2
        self.small_sq = None

    def after_backward(self, k: int, accum: int) -> None:
        if self.on and k == 0:
            self.small_sq = self._small_grad_sq(accum)

    @torch.no_grad()
    def _small_grad_sq(self, accum: int) -> torch.Tensor:
        """|G_small|^2 of the first micro-batch, from the gradients it left (scaled by
        1/accum), averaged over ranks (each holds its own, unsynchronised). Device only."""
        t = self.t
        grads = [p.grad for p in t.model.parameters() if p.grad is not None]
        sq = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum() * accum**2
        if t.world.active:
            distributed.all_sum_tensor(sq, t.world)
            sq /= t.world.size
        return sq

    def host_tensors(self) -> list[torch.Tensor]:
        return [self.small_sq.reshape(1)] if self.small_sq is not None else []

    def step_end(self, applied: bool, host: list[float], grad_norm: float, accum: int) -> Any:
        """Fold one estimate into the EMAs; the controller may raise the accumulation of
        the next steps. Returns the "noise_scale" record's fields."""
        if not host or not applied:
            return None
        cfg, noise, micro = self.cfg, self.noise, self.t.cfg.micro_batch
        small_sq, big_sq = host[0], grad_norm**2
        # The small batch, in samples: a rank's share of a micro-batch (the same on every
        # rank, so that every rank's controller decides alike).
        b_small = micro / self.t.world.size
        b_noise = noise.observe(small_sq, big_sq, b_small, micro * accum)
        record: dict[str, Any] = {
            "b_noise": b_noise,
            "g2": noise.g2,
            "s": noise.s,
            "small_sq": small_sq,
            "big_sq": big_sq,
            "accum": accum,
        }
        if cfg.max_accum is not None:
            want = noise.propose(accum, micro, cfg.max_accum, cfg.target)
            if want > accum:
                noise.accum = want
                record["raise_to"] = want
        return record

    def after_step(self, log: MetricsLog, out: Any) -> None:
        noise = out.extras.get(self.name)
        if noise is None:
            return
        step = self.t.state.step
        raise_to = noise.pop("raise_to", None)
        log.write({"kind": "noise_scale", "step": step, **noise})
        if raise_to is not None:
            self.t.record(
                log,
                {
                    "event": "batch_size",
                    "step": step,
                    "accum_from": noise["accum"],
                    "accum_to": raise_to,
                    "b_noise": noise["b_noise"],
                },
            )
