"""The transformer's small parts: norms, rotary position embeddings, the MLP and the
dropout / stochastic-depth helpers. Attention is training/attention.py; the block and the
model that put them together are training/model.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.config import ModelConfig

__all__ = [
    "MLP",
    "LayerNorm",
    "RMSNorm",
    "Rope",
    "Rotary",
    "apply_rotary",
    "attn_dropout",
    "drop_path",
    "drop_path_rates",
    "embd_dropout",
    "make_norm",
    "resid_dropout",
    "swiglu_hidden",
]

# RoPE's (cos, sin), each (B, 1, T, rotary_dim), or None for learned positions.
Rope = tuple[Tensor, Tensor] | None


# ---------------------------------------------------------------------------------------
# Norms. Both compute in float32 and cast back: the mean of squares over d_model is where
# bf16/fp16 lose precision, and the norms are cheap, so this costs nothing that matters.
# ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): x / rms(x) * g, no centring."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # torch's fused kernel, in float32 (a no-op cast when x already is).
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al. 2016) whose bias is optional, so `bias=False` means no biases."""

    def __init__(self, dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        b = self.bias.float() if self.bias is not None else None
        y = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), b, self.eps)
        return y.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, cfg.norm_eps, cfg.bias)


# ---------------------------------------------------------------------------------------
# Rotary position embeddings (RoFormer, Su et al. 2021), GPT-NeoX layout: the first
# `rotary_dim` dims of each head are split in two halves that rotate as (x1, x2) pairs;
# the remaining dims carry no position at all.
# ---------------------------------------------------------------------------------------


class Rotary(nn.Module):
    """Turns position ids into the (cos, sin) tables that `apply_rotary` uses.

    The angles are computed per forward from `position_ids` in float32 (a few thousand
    multiplies), rather than kept in a buffer: a buffer would be cast with the model by
    `.to(bfloat16)`, and bf16 angles are wrong by whole radians at long positions.
    """

    def __init__(self, head_dim: int, rotary_pct: float, theta: float) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rotary_pct)  # the config checks it is even, >= 2
        self.theta = theta

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        half = self.rotary_dim // 2
        exponent = torch.arange(half, device=position_ids.device, dtype=torch.float32) / half
        inv_freq = self.theta**-exponent  # theta^(-2i/d), i < d/2
        angles = position_ids.float()[..., None] * inv_freq  # (B, T, half)
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, T, rotary_dim)
        return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] dims of x (B, H, T, head_dim); leave the rest as is."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:  # full rotary: no slicing and re-concatenation
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)
    x_rot, x_pass = x[..., :rot].float(), x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated.to(x.dtype), x_pass], dim=-1)


# ---------------------------------------------------------------------------------------
# MLP, dropout
# ---------------------------------------------------------------------------------------


def swiglu_hidden(cfg: ModelConfig) -> int:
    """LLaMA's SwiGLU width: 2/3 of mlp_ratio * d (three matrices cost what two did),
    rounded up to a multiple of 8 for the matmul kernels."""
    h = int(2 / 3 * cfg.mlp_ratio * cfg.d_model)
    return 8 * math.ceil(h / 8)


class MLP(nn.Module):
    """GELU MLP (GPT-2) or SwiGLU (Shazeer 2020, LLaMA): w_down(silu(w_gate x) * w_up x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.swiglu = cfg.mlp == "swiglu"
        hidden = swiglu_hidden(cfg) if self.swiglu else int(cfg.mlp_ratio * d)
        self.w_gate = nn.Linear(d, hidden, bias=cfg.bias) if self.swiglu else None
        self.w_up = nn.Linear(d, hidden, bias=cfg.bias)
        self.w_down = nn.Linear(hidden, d, bias=cfg.bias)
        self.dropout = nn.Dropout(resid_dropout(cfg))

    def forward(self, x: Tensor) -> Tensor:
        if self.w_gate is not None:
            h = F.silu(self.w_gate(x)) * self.w_up(x)
        else:
            h = F.gelu(self.w_up(x))
        return self.dropout(self.w_down(h))


def attn_dropout(cfg: ModelConfig) -> float:
    return cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout


def resid_dropout(cfg: ModelConfig) -> float:
    return cfg.dropout if cfg.resid_dropout is None else cfg.resid_dropout


def embd_dropout(cfg: ModelConfig) -> float:
    return cfg.dropout if cfg.embd_dropout is None else cfg.embd_dropout


def drop_path_rates(cfg: ModelConfig) -> list[float]:
    """Stochastic depth's rate per block: linear in depth from 0 to `drop_path` (timm's
    torch.linspace(0, drop_path, n_layer))."""
    n = cfg.n_layer
    return [cfg.drop_path * i / (n - 1) if n > 1 else 0.0 for i in range(n)]


def drop_path(x: Tensor, rate: float, training: bool) -> Tensor:
    """Zero the whole branch output of each sample with probability `rate` and scale the
    kept ones by 1 / (1 - rate), so the expectation is unchanged (stochastic depth)."""
    if rate == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - rate)
    return x * keep.div_(1.0 - rate)
