"""A decoder-only transformer (GPT) in one readable file, nanoGPT style.

Read top to bottom: norms, rotary embeddings, attention (with document masking), the MLP,
the block, and the model. Every option comes from `training.config.ModelConfig`:

* Pre-LN blocks (LayerNorm or RMSNorm, computed in float32 so mixed precision does not
  hurt them), a final norm before the head, no linear biases unless `bias`.
* Positions: RoPE on the first `rotary_pct` of each head's dims (GPT-NeoX), or learned
  absolute embeddings; both indexed by `position_ids`, which restart at 0 at every document
  of a packed row.
* Sequential blocks, or PaLM's parallel block `x + attn(ln(x)) + mlp(ln(x))`.
* GELU MLP or SwiGLU (LLaMA's 2/3 sizing), optional QK-norm, optional weight tying.
* GPT-2 / Megatron scaled init (or small init, or T-Fixup's) and muP (Yang et al. 2022,
  "Tensor Programs V").
* Dropout on attention probabilities, branch outputs and embeddings; stochastic depth.
* Document masking: tokens of a packed row attend only within their own document.

`GPT.forward` returns float32 logits; the loss lives in `training.loss`. torch.compile is
the trainer's business, not this file's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from training.config import ModelConfig

__all__ = ["GPT", "apply_rotary", "positions_from_segments"]

# What a block receives to mask attention with: None = plain causal (the fast path), a
# boolean (B, 1, T, T) tensor for SDPA (True = may attend), or a flex-attention BlockMask.
AttnMask = Tensor | BlockMask | None
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


# ---------------------------------------------------------------------------------------
# MLP, block
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


class Block(nn.Module):
    """A pre-LN transformer block, sequential or parallel.

    Parallel (GPT-J, PaLM): x + attn(ln(x)) + mlp(ln(x)), with ONE norm shared by both
    branches as in PaLM, so the two input projections can run as one matmul and the block
    has one norm fewer. (GPT-NeoX keeps two norms; PaLM reports no quality loss from one.)
    `drop_path_rate`: stochastic depth of each branch, per sample, in training only.
    """

    def __init__(self, cfg: ModelConfig, mup: bool, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        self.drop_path_rate = drop_path_rate
        self.parallel = cfg.parallel_block
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, mup)
        self.ln_2 = None if self.parallel else make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: Rope, mask: AttnMask) -> Tensor:
        r = self.drop_path_rate
        if r and self.training:
            return self._forward_drop_path(x, rope, mask, r)
        if self.ln_2 is None:
            h = self.ln_1(x)
            return x + self.attn(h, rope, mask) + self.mlp(h)
        x = x + self.attn(self.ln_1(x), rope, mask)
        return x + self.mlp(self.ln_2(x))

    def _forward_drop_path(self, x: Tensor, rope: Rope, mask: AttnMask, r: float) -> Tensor:
        # A separate path so the default forward stays exactly today's.
        if self.ln_2 is None:
            h = self.ln_1(x)
            return (
                x + drop_path(self.attn(h, rope, mask), r, True) + drop_path(self.mlp(h), r, True)
            )
        x = x + drop_path(self.attn(self.ln_1(x), rope, mask), r, True)
        return x + drop_path(self.mlp(self.ln_2(x)), r, True)


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------


def tied_head(x: Tensor, weight: Tensor) -> Tensor:
    """Logits through the token embedding's matrix (tied weights). Under tensor parallelism
    (training/parallel.py) that matrix is a DTensor split by vocabulary rows and x a DTensor
    split by sequence: gather x, multiply each vocabulary shard, gather the logits; DTensor
    does the collectives and their backward."""
    if not isinstance(weight, DTensor):
        return F.linear(x, weight)
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, weight.device_mesh, [Replicate()])
    logits = F.linear(x.redistribute(placements=[Replicate()]), weight)
    return logits.redistribute(placements=[Replicate()]).to_local()


ParamKind = Literal["embedding", "norm", "bias", "hidden", "output"]


class GPT(nn.Module):
    """The language model: token ids (B, T) -> next-token logits (B, T, vocab), float32.

    `attention_backend` picks how document masks are applied: "auto" uses flex attention
    on CUDA (SDPA with a dense mask when attention dropout is active, which flex lacks)
    and SDPA with a dense boolean mask on CPU; "sdpa" / "flex" force one (tests use this).
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.attention_backend: Literal["auto", "sdpa", "flex"] = "auto"
        # muP's width multiplier relative to the width the hyper-parameters were tuned at.
        mup = cfg.mup_base_d_model is not None
        self.width_mult = cfg.d_model / cfg.mup_base_d_model if cfg.mup_base_d_model else 1.0

        self.wte = nn.Embedding(vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.rotary = (
            Rotary(cfg.d_model // cfg.n_head, cfg.rotary_pct, cfg.rope_theta)
            if cfg.position == "rope"
            else None
        )
        self.drop = nn.Dropout(embd_dropout(cfg))
        self.blocks = nn.ModuleList(Block(cfg, mup, rate) for rate in drop_path_rates(cfg))
        self.ln_f = make_norm(cfg)
        # Tied: the head is wte's matrix (Press & Wolf 2017); untied: a matrix of its own.
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, vocab_size, bias=False)
        )
        self._kinds = self._classify_params()
        self.init_weights()

    # -- parameters ----------------------------------------------------------------------

    def _classify_params(self) -> dict[str, ParamKind]:
        kinds: dict[str, ParamKind] = {}
        for mod_name, module in self.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                if isinstance(module, nn.Embedding):
                    kinds[name] = "embedding"
                elif p_name == "bias":
                    kinds[name] = "bias"
                elif isinstance(module, RMSNorm | LayerNorm):
                    kinds[name] = "norm"
                elif module is self.lm_head:
                    kinds[name] = "output"
                elif p.ndim == 2 and mod_name.startswith("blocks."):
                    kinds[name] = "hidden"
                else:  # pragma: no cover - a new parameter must be classified on purpose
                    raise AssertionError(f"unclassified parameter {name}")
        return kinds

    def param_kind(self, name: str) -> ParamKind:
        """What a parameter is, for optimizer groups: "embedding", "norm", "bias", "hidden"
        (2-D weights inside blocks; muP scales their learning rate by 1/width_mult) or
        "output" (the untied head). Accepts names from a torch.compile'd or DDP-wrapped
        model too (`_orig_mod.` / `module.` prefixes are dropped)."""
        parts = name.split(".")
        while parts and parts[0] in ("_orig_mod", "module"):
            parts = parts[1:]
        key = ".".join(parts)
        if key not in self._kinds:
            raise KeyError(f"{name!r} is not a parameter of this model")
        return self._kinds[key]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Zero biases, unit norm gains, and the weights `cfg.init` says (see ModelConfig).

        scaled (the default): normal(0, init_std); residual output projections (W_O,
        w_down) get std / sqrt(2 * n_layer) (GPT-2, Megatron): the residual stream sums
        2 * n_layer of them, so its variance stays O(1) with depth. small: the same
        layout with GPT-NeoX's small_init std sqrt(2 / (5 d)) and wang_init
        2 / (n_layer sqrt(d)) for the residual outputs. Under muP (scaled or small),
        hidden matrices get std / sqrt(width_mult), i.e. variance ~ 1/fan_in relative to
        the base width (d is the base width); embeddings and the head do not (the head's
        width dependence is the 1/width_mult logit multiplier instead). tfixup: see
        `_init_tfixup`.
        """
        cfg = self.cfg
        if cfg.init == "tfixup":
            self._init_tfixup()
            return
        std, resid_std = cfg.init_std, None  # None: std / sqrt(2 * n_layer), as computed
        if cfg.init == "small":
            d = cfg.mup_base_d_model or cfg.d_model
            std, resid_std = math.sqrt(2 / (5 * d)), 2 / (cfg.n_layer * math.sqrt(d))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                s = std
                if name.startswith("blocks."):
                    s /= math.sqrt(self.width_mult)
                    if name.endswith(("attn.w_o", "mlp.w_down")):
                        s = (
                            s / math.sqrt(2 * cfg.n_layer)
                            if resid_std is None
                            else resid_std / math.sqrt(self.width_mult)
                        )
                nn.init.normal_(module.weight, mean=0.0, std=s)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm | LayerNorm):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    @torch.no_grad()
    def _init_tfixup(self) -> None:
        """T-Fixup (Huang et al. 2020), the decoder's rules: Xavier-uniform matrices,
        normal(0, d^-1/2) embeddings, and W_V, W_O, the MLP matrices and the embeddings
        scaled by (9 N)^-1/4 with N = n_layer, which bounds the update of each residual
        branch so the run trains without LR warmup."""
        scale = (9 * self.cfg.n_layer) ** -0.25
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if name.endswith(("attn.w_v", "attn.w_o", "mlp.w_gate", "mlp.w_up", "mlp.w_down")):
                    module.weight.mul_(scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.d_model**-0.5 * scale)
            elif isinstance(module, RMSNorm | LayerNorm):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def num_params(self, exclude_embeddings: bool = True) -> int:
        """Parameter count. With exclude_embeddings, lookup-only tables are left out: the
        position table, and the token table unless tied (then it is also the head's matmul,
        which costs FLOPs like any other matrix). That is nanoGPT's convention and the N
        that `flops_per_token` needs."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
            if self.lm_head is not None:
                n -= self.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward + backward: 6N for the matmuls with weights and
        12 * n_layer * d_model * seq_len for attention's QK^T and AV (PaLM, appendix B).
        Counts full causal attention, as MFU conventionally does."""
        n = self.num_params(exclude_embeddings=True)
        return 6.0 * n + 12.0 * self.cfg.n_layer * self.cfg.d_model * seq_len

    # -- forward -------------------------------------------------------------------------

    @torch.compiler.disable  # data-dependent (host sync); stays eager under torch.compile
    def attention_mask(
        self, segment_ids: Tensor | None, training: bool, single_segment: bool | None = None
    ) -> AttnMask:
        """None (plain causal) when that is exact, else the document mask for the backend.
        `single_segment`: the caller's answer, found on the host (spares the sync)."""
        if is_single_segment(segment_ids) if single_segment is None else single_segment:
            return None
        assert segment_ids is not None
        backend = self.attention_backend
        if backend == "auto":
            dropping = training and attn_dropout(self.cfg) > 0
            backend = "flex" if segment_ids.is_cuda and not dropping else "sdpa"
        if backend == "flex":
            return flex_document_mask(segment_ids)
        return dense_document_mask(segment_ids)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        segment_ids: Tensor | None = None,
        single_segment: bool | None = None,
    ) -> Tensor:
        """Logits (B, T, vocab) in float32.

        position_ids: (B, T), restarting at 0 per document; default: derived from
        segment_ids if given, else 0..T-1. segment_ids: (B, T), 1, 2, ... per document and
        0 on padding (see dataprep/pack.py); None = one document per row. single_segment:
        what is_single_segment(segment_ids) would say, if the caller knows it already.
        """
        B, T = input_ids.shape
        if self.max_seq_len < T:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.max_seq_len}")
        if position_ids is None:
            position_ids = (
                positions_from_segments(segment_ids)
                if segment_ids is not None
                else torch.arange(T, device=input_ids.device).expand(B, T)
            )

        x = self.wte(input_ids)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        x = self.drop(x)
        rope = self.rotary(position_ids) if self.rotary is not None else None
        mask = self.attention_mask(segment_ids, self.training, single_segment)

        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Keep only each block's input; recompute its insides in backward.
                x = checkpoint(block, x, rope, mask, use_reentrant=False)
            else:
                x = block(x, rope, mask)

        x = self.ln_f(x)
        # The head as a module call (not F.linear on its weight), so that tensor
        # parallelism's hooks on it run.
        logits = (
            tied_head(x, self.wte.weight) if self.lm_head is None else self.lm_head(x)
        ).float()
        if self.width_mult != 1.0:
            # muP readout: the head's input grows with width while its learning rate does
            # not shrink, so its output is scaled by 1/width_mult to stay O(1) in training.
            logits = logits * (1.0 / self.width_mult)
        return logits
