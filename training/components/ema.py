"""`ema`: an exponential moving average of the weights (Polyak averaging), updated after each
applied step, evaluated beside the training weights and checkpointed with them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from training.components.base import Component
from training.config import TrainConfigError


class Ema(Component):
    name = key = "ema"

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        if t.fsdp:
            raise TrainConfigError("ema: not supported with parallel: fsdp2")
        assert t.cfg.ema is not None
        self.decay = t.cfg.ema.decay
        # One copy per parameter, updated on the device (no host read).
        self.shadow = [p.detach().clone() for p in t.model.parameters()]

    def _params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.t.model.parameters()]

    def state_dict(self) -> Any:
        return [t.clone() for t in self.shadow]

    def load_state_dict(self, state: Any | None) -> None:
        # A checkpoint from before `ema` was turned on starts the EMA at its weights.
        saved = state or self._params()
        torch._foreach_copy_(self.shadow, [t.to(self.t.device) for t in saved])

    def on_weights_loaded(self) -> None:
        torch._foreach_copy_(self.shadow, self._params())

    @torch.no_grad()
    def after_update(self) -> None:
        torch._foreach_lerp_(self.shadow, self._params(), 1.0 - self.decay)

    def eval_fields(self) -> dict[str, Any]:
        return {"ema_val_loss": self.evaluate()}

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The EMA weights in the model for the block's duration; the training weights
        are copied back bit for bit after it."""
        with torch.no_grad():
            params = self._params()
            saved = [p.clone() for p in params]
            torch._foreach_copy_(params, self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, saved)

    def evaluate(self) -> float:
        """The validation loss of the EMA weights."""
        with self.swapped():
            return self.t.evaluate()
