"""The model section of the training config: the GPT's shape, norms, position
encoding, MLP, dropout, init and muP, and which keys say only how it runs (left out of the
checkpoint fingerprint)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from core.config import Strict


class ModelConfig(Strict):
    d_model: int = Field(default=128, ge=8, description="Width of the residual stream.")
    n_layer: int = Field(default=4, ge=1, description="Transformer blocks.")
    n_head: int = Field(default=4, ge=1, description=("Attention heads; must divide d_model."))
    mlp_ratio: float = Field(
        default=4.0,
        gt=0,
        description=(
            "MLP hidden size = mlp_ratio * d_model (swiglu: 2/3 of that, rounded to 8, as LLaMA)."
        ),
    )
    norm: Literal["layernorm", "rmsnorm"] = Field(
        default="rmsnorm", description=("Pre-LN normalisation, computed in fp32.")
    )
    norm_eps: float = Field(default=1e-5, description="The norms' epsilon.")
    bias: bool = Field(default=False, description="Biases in the linear layers.")
    position: Literal["rope", "learned"] = Field(
        default="rope", description=("Rotary or learned absolute position embeddings.")
    )
    rotary_pct: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description=(
            "Share of each head's dimensions that RoPE rotates (GPT-NeoX uses 0.25); must give "
            "an even number >= 2."
        ),
    )
    rope_theta: float = Field(default=10_000.0, description="RoPE's base.")
    parallel_block: bool = Field(
        default=False, description=("Attention and MLP in parallel off one norm (GPT-J, GPT-NeoX).")
    )
    mlp: Literal["gelu", "swiglu"] = Field(default="swiglu", description="The MLP.")
    qk_norm: bool = Field(
        default=False, description=("Per-head RMSNorm on the queries and keys, before RoPE.")
    )
    tie_embeddings: bool = Field(
        default=True, description=("The output head shares the token embedding's weights.")
    )
    dropout: float = Field(
        default=0.0, ge=0, lt=1, description=("Dropout at every site unless set per site below.")
    )
    attn_dropout: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description=(
            "Dropout on the attention probabilities (GPT-2's attn_pdrop); unset = `dropout`."
        ),
    )
    resid_dropout: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description=(
            "Dropout on each branch's output before the residual add (resid_pdrop); unset = "
            "`dropout`."
        ),
    )
    embd_dropout: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description=("Dropout on the embedding sum (embd_pdrop); unset = `dropout`."),
    )
    drop_path: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description=(
            'Stochastic depth (Huang et al. 2016, "Deep Networks with Stochastic Depth"), '
            "as DeiT and timm use it: block i drops each residual branch for a whole sample "
            "with probability drop_path * i / (n_layer - 1) (0 for the first block, drop_path "
            "for the last) and scales kept ones by 1 / (1 - rate); training only."
        ),
    )
    init: Literal["scaled", "small", "tfixup"] = Field(
        default="scaled",
        description=(
            "Weight initialisation. `scaled`: normal(0, init_std) everywhere, residual output "
            "projections (W_O, w_down) init_std / sqrt(2 * n_layer) (GPT-2, Megatron-LM, "
            'nanoGPT). `small`: normal(0, sqrt(2 / (5 d))) everywhere ("small init", Nguyen '
            '& Salazar 2019, "Transformers without Tears"; GPT-NeoX\'s small_init), residual '
            "output projections 2 / (n_layer * sqrt(d)) (GPT-NeoX's wang_init, from GPT-J, as "
            "GPT-NeoX-20B pairs them); init_std is unused; with muP, d is mup_base_d_model and "
            "hidden matrices then get muP's 1 / sqrt(width_mult), which gives the same hidden "
            'stds as without muP. `tfixup`: T-Fixup (Huang et al. 2020, "Improving '
            'Transformer Optimization Through Better Initialization"), decoder rules, for '
            "runs without warmup: Xavier-uniform for every matrix, embeddings normal(0, "
            "d^-1/2); W_V, W_O, the MLP matrices and the embeddings then scaled by (9 "
            "n_layer)^-1/4. Only the init: the norms stay (the paper also removes LayerNorm). "
            "init_std is unused; not with muP (Xavier and d^-1/2 already depend on the width, "
            "muP's base-width scaling would count it twice)."
        ),
    )
    init_std: float = Field(default=0.02, description=("Standard deviation of the `scaled` init."))
    mup_base_d_model: int | None = Field(
        default=None,
        ge=8,
        description=(
            "muP: the base width the hyperparameters were tuned at; width_mult = d_model / "
            "mup_base_d_model. Hidden matrices get init std / sqrt(width_mult) and Adam LR / "
            "width_mult, attention scores are scaled by 1/head_dim, the logits by "
            "1/width_mult. Unset = standard parametrisation."
        ),
    )
    activation_checkpointing: bool = Field(
        default=False,
        description=(
            "Recompute each block's activations in the backward pass (less memory, more compute)."
        ),
    )
    compile: bool = Field(default=False, description="torch.compile the model.")

    @model_validator(mode="after")
    def _init_with_mup(self) -> ModelConfig:
        if self.init == "tfixup" and self.mup_base_d_model is not None:
            raise ValueError(
                "init tfixup cannot be combined with mup_base_d_model (T-Fixup's "
                "scales depend on the width itself; use init scaled or small)"
            )
        return self

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        head_dim = self.d_model // self.n_head
        rot = int(head_dim * self.rotary_pct)
        if self.position == "rope" and (rot < 2 or rot % 2):
            raise ValueError(
                f"rotary_pct {self.rotary_pct} of head_dim {head_dim} gives {rot} "
                f"rotary dims; it must be an even number >= 2"
            )
        return self


_RUNTIME_ONLY_MODEL_KEYS = ("compile", "activation_checkpointing")
# ModelConfig keys added after fingerprints were first written, with their defaults: left
# out of the fingerprint while at the default, so a run that began before they existed
# keeps its fingerprint (and its claim on its remote prefix).
_LATER_MODEL_KEYS: dict[str, Any] = {
    "init": "scaled",
    "attn_dropout": None,
    "resid_dropout": None,
    "embd_dropout": None,
    "drop_path": 0.0,
}
