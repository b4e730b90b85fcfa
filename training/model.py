"""A decoder-only transformer (GPT), nanoGPT style, in three files read in this order:
training/layers.py (norms, rotary embeddings, the MLP, dropout), training/attention.py
(attention with document masking), and this one (the block and the model). Every option
comes from `training.config.ModelConfig`:

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
the trainer's business, through `compile_model`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from training.attention import (
    AttnMask,
    CausalSelfAttention,
    dense_document_mask,
    flex_document_mask,
    is_single_segment,
    positions_from_segments,
)
from training.config import ModelConfig
from training.layers import (
    MLP,
    LayerNorm,
    RMSNorm,
    Rope,
    Rotary,
    apply_rotary,
    attn_dropout,
    drop_path,
    drop_path_rates,
    embd_dropout,
    make_norm,
    swiglu_hidden,
)

__all__ = [
    "GPT",
    "Block",
    "LayerNorm",
    "RMSNorm",
    "Rotary",
    "apply_rotary",
    "drop_path",
    "positions_from_segments",
    "swiglu_hidden",
]


# ---------------------------------------------------------------------------------------
# The block
# ---------------------------------------------------------------------------------------


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
    # A DTensor exists only once its module is loaded; not importing it here spares every
    # process that never shards (most of them) 0.5 s of start-up.
    if "torch.distributed.tensor" not in sys.modules:
        return F.linear(x, weight)
    from torch.distributed.tensor import DTensor, Replicate

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


def compile_model(
    model: GPT, wrapped: nn.Module, backend: str | Callable[..., Any] = "inductor"
) -> Callable[..., Any]:
    """torch.compile of `wrapped` (the model, or its DDP/FSDP wrapper), with the model's
    attention mask kept eager: it is data-dependent (a host sync). Applied here rather than
    as a decorator on the method because torch.compiler.disable imports torch._dynamo, half
    a second of every process's start, compiled or not."""
    model.attention_mask = torch.compiler.disable(model.attention_mask)  # type: ignore[method-assign]
    return torch.compile(wrapped, backend=backend)
