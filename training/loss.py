"""The language-modelling loss over packed rows: next-token targets that never cross a
document boundary or land on padding, mean cross-entropy over the valid positions, and
PaLM's z-loss (Chowdhery et al. 2022), which keeps log Z = logsumexp(logits) near 0 so the
softmax stays well conditioned in low precision.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "lm_loss", "shift_targets"]

# Target at invalid positions: PyTorch's ignore_index convention, so targets can also go
# straight into F.cross_entropy. `valid` is the authority; lm_loss does not rely on it.
IGNORE_INDEX = -100


def shift_targets(
    input_ids: Tensor, segment_ids: Tensor | None = None, loss_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Targets (B, T): the next token, IGNORE_INDEX where invalid; valid (B, T) bool.

    Position t is valid when token t + 1 exists, is real (loss_mask[t + 1], and segment
    id > 0 when segment ids are given) and is in the same segment as token t, so the last
    token of a document is never asked to predict the first of the next one. With neither
    segment_ids nor loss_mask, every position but the last is valid.
    """
    B, T = input_ids.shape
    valid = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    nxt = torch.ones(B, T - 1, dtype=torch.bool, device=input_ids.device)
    if segment_ids is not None:
        nxt &= (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    if loss_mask is not None:
        nxt &= loss_mask[:, 1:].bool()
    valid[:, :-1] = nxt
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, :-1] = input_ids[:, 1:]
    return targets.masked_fill(~valid, IGNORE_INDEX), valid


def lm_loss(
    logits: Tensor,
    targets: Tensor,
    valid: Tensor,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(total, ce, z), all float32 scalars, means over the valid positions.

    ce = mean(logsumexp(logits) - logits[target]); z = z_loss * mean(logsumexp(logits)^2);
    total = ce + z. The logsumexp is computed once and shared by both terms. With no valid
    position all three are 0 (and still carry a graph, so backward works).

    With label_smoothing e > 0 the target distribution is (1 - e) on the target plus e / V
    on every class (F.cross_entropy's `label_smoothing`), so total = (1 - e) * ce
    + e * mean(logsumexp(logits) - mean_v(logits)) + z; `ce` stays the plain cross-entropy
    (comparable with the validation loss).
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # (B, T)
    safe_targets = targets.clamp(min=0)  # IGNORE_INDEX rows are masked out below
    target_logit = logits.gather(-1, safe_targets[..., None]).squeeze(-1)
    w = valid.to(logits.dtype)
    n = w.sum().clamp(min=1.0)
    ce = ((lse - target_logit) * w).sum() / n
    z = z_loss * (lse.pow(2) * w).sum() / n
    if label_smoothing:
        uniform = ((lse - logits.mean(dim=-1)) * w).sum() / n
        return (1.0 - label_smoothing) * ce + label_smoothing * uniform + z, ce, z
    return ce + z, ce, z
