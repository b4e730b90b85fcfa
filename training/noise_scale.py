"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A.1, the "simple" estimator) and a batch-size controller driven by it.

With a small batch of B_small samples (one micro-batch) and a big one of B_big samples (the
accumulated step), whose gradient norms are |G_small|^2 and |G_big|^2:

    |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S     = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)
    B_noise = S / |G|^2

Both are unbiased but noisy, so, as the paper advises, each is smoothed with its own EMA and
B_noise is the ratio of the EMAs. B_noise is the batch size (in samples) beyond which a
bigger batch stops paying; the controller raises gradient accumulation towards
target * B_noise / micro_batch, never lowers it, and never passes `max_accum`.

The state is a few floats, checkpointed with the trainer's, so a resumed run goes on with
the same estimate and the same accumulation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class NoiseScale:
    """EMAs of |G|^2 and S (None before the first estimate) and the controller's
    accumulation (None: the controller has not raised it)."""

    beta: float
    g2: float | None = None
    s: float | None = None
    accum: int | None = None

    def observe(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> float | None:
        """Fold in one estimate; returns B_noise (None while |G|^2 is not positive or the
        inputs are not finite, e.g. a skipped or non-finite step)."""
        if not (b_big > b_small > 0 and math.isfinite(small_sq) and math.isfinite(big_sq)):
            return self.b_noise()
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        s = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        self.g2 = g2 if self.g2 is None else self.beta * self.g2 + (1 - self.beta) * g2
        self.s = s if self.s is None else self.beta * self.s + (1 - self.beta) * s
        return self.b_noise()

    def b_noise(self) -> float | None:
        if self.g2 is None or self.s is None or self.g2 <= 0:
            return None
        return self.s / self.g2

    def propose(self, current: int, micro_batch: int, max_accum: int, target: float = 1.0) -> int:
        """The accumulation the controller wants: ceil(target * B_noise / micro_batch), at
        least `current` (it never lowers it) and at most `max_accum`."""
        b = self.b_noise()
        if b is None or not math.isfinite(b) or b <= 0:
            return current
        want = min(max_accum, math.ceil(target * b / micro_batch))
        return max(current, want)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g2, self.s, self.accum = state["g2"], state["s"], state["accum"]
