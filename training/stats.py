"""Layer-wise statistics every `stats_every` steps, an early view of trouble: per block the
RMS of its output activations and of its parameters' gradients, the largest attention
logit of its attention, and the size of the optimizer's update relative to its weights.

Hooks exist only while a statistics step's first micro-batch runs forward: on the other
steps nothing is registered and nothing is computed. Everything stays on the device until
one transfer at the end of the statistics step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from training.model import GPT


class LayerStats:
    """Collects the statistics of one step of `model` (see the module docstring)."""

    def __init__(self, model: GPT) -> None:
        self.model = model
        n = len(model.blocks)
        self.act_rms: list[Tensor | None] = [None] * n
        self.logit_max: list[Tensor | None] = [None] * n
        self.grad_rms: Tensor | None = None
        self.before: list[list[Tensor]] = []

    @contextmanager
    def forward_hooks(self) -> Iterator[None]:
        """Record each block's output RMS and max attention logit during the forward
        passes inside the block; the hooks are removed on exit."""
        handles: list[Any] = []
        for i, block in enumerate(self.model.blocks):
            handles.append(block.register_forward_hook(self._act_hook(i)))
            handles.append(block.attn.register_forward_hook(self._logit_hook(i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _act_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Tensor) -> None:
            self.act_rms[i] = out.detach().float().pow(2).mean().sqrt()

        return hook

    def _logit_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Tensor) -> None:
            x, rope, mask = args
            self.logit_max[i] = module.max_logit(x.detach(), rope, mask)  # type: ignore[operator]

        return hook

    def _block_params(self) -> list[list[Tensor]]:
        return [[p for p in b.parameters() if p.requires_grad] for b in self.model.blocks]

    @torch.no_grad()
    def gradients(self) -> None:
        """Per block: RMS over all its parameters' gradients (call after unscaling, before
        clipping: the raw gradient)."""
        rms = []
        for params in self._block_params():
            grads = [p.grad.float() for p in params if p.grad is not None]
            if not grads:
                rms.append(torch.zeros((), device=params[0].device))
                continue
            sq = torch.stack([g.pow(2).sum() for g in grads]).sum()
            rms.append((sq / sum(g.numel() for g in grads)).sqrt())
        self.grad_rms = torch.stack(rms)
        self.before = [[p.detach().clone() for p in params] for params in self._block_params()]

    @torch.no_grad()
    def result(self) -> dict[str, list[float]]:
        """The step's statistics, read back in one transfer: act_rms, grad_rms,
        attn_logit_max and update_ratio (||W_after - W_before|| / ||W_before|| over each
        block's parameters; 0 for a step the guard skipped)."""
        ratios = []
        for params, before in zip(self._block_params(), self.before, strict=True):
            diff = torch.stack(
                [(p.detach() - b).float().pow(2).sum() for p, b in zip(params, before, strict=True)]
            ).sum()
            norm = torch.stack([b.float().pow(2).sum() for b in before]).sum()
            ratios.append((diff / norm.clamp_min(1e-30)).sqrt())
        n = len(ratios)
        missing = torch.full((), float("nan"), device=ratios[0].device)
        rows = torch.stack(
            [
                torch.stack([a if a is not None else missing for a in self.act_rms]),
                self.grad_rms if self.grad_rms is not None else missing.expand(n),
                torch.stack([m if m is not None else missing for m in self.logit_max]).float(),
                torch.stack(ratios),
            ]
        ).double()
        act, grad, logit, ratio = rows.tolist()  # the statistics step's one extra transfer
        return {"act_rms": act, "grad_rms": grad, "attn_logit_max": logit, "update_ratio": ratio}
