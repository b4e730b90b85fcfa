"""Causal self-attention with document masking: the masks that keep a packed row's
documents apart (dense for SDPA, a BlockMask for flex attention) and the attention module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from training.config import ModelConfig
from training.layers import RMSNorm, Rope, apply_rotary, attn_dropout, resid_dropout

__all__ = [
    "AttnMask",
    "CausalSelfAttention",
    "dense_document_mask",
    "flex_document_mask",
    "is_single_segment",
    "positions_from_segments",
]

# What a block receives to mask attention with: None = plain causal (the fast path), a
# boolean (B, 1, T, T) tensor for SDPA (True = may attend), or a flex-attention BlockMask.
AttnMask = Tensor | BlockMask | None


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------


def positions_from_segments(segment_ids: Tensor) -> Tensor:
    """Position ids that restart at 0 wherever the segment id changes (as packing makes)."""
    T = segment_ids.shape[1]
    idx = torch.arange(T, device=segment_ids.device).expand_as(segment_ids)
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    last_start = torch.where(start, idx, 0).cummax(dim=1).values
    return idx - last_start


def is_single_segment(segment_ids: Tensor | None) -> bool:
    """True when plain causal attention is exact: every row is one document, no padding.

    Reads the tensor on the host (one sync on CUDA), once per forward.
    """
    if segment_ids is None:
        return True
    same = segment_ids == segment_ids[:, :1]
    return bool((same.all() & (segment_ids[:, 0] > 0).all()).item())


def dense_document_mask(segment_ids: Tensor) -> Tensor:
    """(B, 1, T, T) boolean, True where query i may attend to key j.

    i attends to j <= i of its own document. Padding (segment 0) attends only to itself:
    every row of the mask keeps its diagonal, so no softmax is over nothing (no NaN), and
    a pad's output depends on nothing else. Real tokens never see padding.
    """
    T = segment_ids.shape[1]
    i = torch.arange(T, device=segment_ids.device)
    causal = i[:, None] >= i[None, :]  # (T, T)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
    real = (segment_ids > 0)[:, :, None]
    eye = i[:, None] == i[None, :]
    return ((causal & same & real) | eye)[:, None]


def flex_document_mask(segment_ids: Tensor) -> BlockMask:
    """The same mask as `dense_document_mask`, as a flex-attention BlockMask.

    Flex attention skips the blocks the mask rules out entirely, so packed rows cost about
    what their documents cost alone, where a dense mask pays for the whole T x T.
    """
    B, T = segment_ids.shape

    def document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        seg_q, seg_kv = segment_ids[b, q], segment_ids[b, kv]
        return (q == kv) | ((q >= kv) & (seg_q == seg_kv) & (seg_q > 0))

    return create_block_mask(
        document_causal, B, None, T, T, device=segment_ids.device, _compile=segment_ids.is_cuda
    )


@functools.cache
def _compiled_flex_attention() -> Callable[..., Any]:
    # Flex attention is only fast compiled (uncompiled it materialises the scores).
    return torch.compile(flex_attention, dynamic=False)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017) with W_Q, W_K, W_V, W_O.

    Separate Q/K/V projections, not one fused matrix, so optimizers that treat each 2-D
    matrix as a unit (muP learning-rate scaling, Muon's orthogonalisation) see the
    paper's matrices.
    """

    def __init__(self, cfg: ModelConfig, mup: bool) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.head_dim = d // cfg.n_head
        self.w_q = nn.Linear(d, d, bias=cfg.bias)
        self.w_k = nn.Linear(d, d, bias=cfg.bias)
        self.w_v = nn.Linear(d, d, bias=cfg.bias)
        self.w_o = nn.Linear(d, d, bias=cfg.bias)
        # QK-norm (Dehghani et al. 2023): RMSNorm per head on q and k, before RoPE, bounds
        # the attention logits and removes a common source of loss spikes.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # muP uses 1/head_dim: once trained, q and k are correlated, so q.k grows like
        # head_dim, not sqrt(head_dim). We use it at every width, base included, so a muP
        # model at width_mult 1 is not the standard model; the hyper-parameters are tuned
        # with muP on, and that is what transfers. (With head_dim fixed and heads added
        # as width grows, the scale does not change with width at all.)
        self.scale = 1.0 / self.head_dim if mup else 1.0 / math.sqrt(self.head_dim)
        self.dropout = attn_dropout(cfg)
        self.resid_dropout = nn.Dropout(resid_dropout(cfg))

    def forward(self, x: Tensor, rope: Rope, mask: AttnMask) -> Tensor:
        B, T, _ = x.shape

        def heads(t: Tensor) -> Tensor:  # (B, T, C) -> (B, H, T, head_dim)
            # -1, not n_head: under tensor parallelism a rank holds n_head / tp heads.
            return t.view(B, T, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.w_q(x)), heads(self.w_k(x)), heads(self.w_v(x))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = self.attend(q, k, v, mask)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.w_o(y))

    @torch.no_grad()
    def max_logit(self, x: Tensor, rope: Rope, mask: AttnMask) -> Tensor:
        """The largest scaled attention logit q.k * scale over the pairs this layer may
        attend (causal, and within documents where `mask` is a boolean tensor; a flex
        BlockMask is read as plain causal), as a 0-d float32 tensor on x's device. For
        statistics: it recomputes q and k and materialises the (B, H, T, T) scores."""
        B, T, _ = x.shape
        q = self.w_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.w_k(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        scores = (q.float() @ k.float().transpose(-2, -1)) * self.scale
        i = torch.arange(T, device=x.device)
        allowed = i[:, None] >= i[None, :]
        if isinstance(mask, Tensor):
            allowed = allowed & mask
        return scores.masked_fill(~allowed, float("-inf")).amax()

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: AttnMask) -> Tensor:
        p = self.dropout if self.training else 0.0
        if mask is None:  # fast path: the fused causal kernels, no mask tensor at all
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=p, scale=self.scale
            )
        if isinstance(mask, Tensor):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, scale=self.scale
            )
        # Inside the trainer's torch.compile, plain flex_attention is what gets compiled.
        flex = (
            flex_attention
            if torch.compiler.is_compiling() or not q.is_cuda
            else _compiled_flex_attention()
        )
        out = flex(q, k, v, block_mask=mask, scale=self.scale)
        assert isinstance(out, Tensor)
        return out
