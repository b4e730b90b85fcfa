"""The optimizer, learning-rate schedule and numeric precision sections of the training
config."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.config import Strict


class ParamGroupRule(Strict):
    pattern: str = Field(
        description=(
            "A regular expression (re.search) over parameter names as "
            "model.named_parameters() gives them, e.g. `attn\\.w_[qk]` for "
            "`blocks.3.attn.w_q.weight`."
        )
    )
    lr_mult: float = Field(
        default=1.0,
        gt=0,
        description=("The matching parameters' learning rate is multiplied by this."),
    )
    weight_decay: float | None = Field(
        default=None,
        ge=0,
        description=("If set, the matching parameters' weight decay instead of their kind's."),
    )

    @field_validator("pattern")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return v


class OptimConfig(Strict):
    name: str = Field(
        default="adamw",
        description=(
            "The optimizer, a key of training.optim.OPTIMIZERS: `adamw` (no decay on norms, "
            "biases, embeddings), `lion`, `adafactor`, `muon` (Muon for 2-D hidden matrices, "
            "AdamW for the rest)."
        ),
    )
    lr: float = Field(
        default=1e-3, gt=0, description=("Peak learning rate (the schedule scales it).")
    )
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description=("Adam's (beta1, beta2)."))
    eps: float = Field(default=1e-8, description="Adam's epsilon.")
    weight_decay: float = Field(
        default=0.1,
        ge=0,
        description=(
            "Weight decay of hidden and output matrices (0 for norms, biases and embeddings)."
        ),
    )
    muon_lr: float = Field(
        default=0.02,
        gt=0,
        description=(
            "Muon's own learning rate for 2-D hidden matrices (the rest use AdamW at `lr`)."
        ),
    )
    muon_momentum: float = Field(default=0.95, description="Muon's momentum.")
    grad_clip: float | None = Field(
        default=1.0,
        gt=0,
        description=("Global-norm gradient clipping; null: off (the norm is logged either way)."),
    )
    clip_value: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Also clip each gradient element to [-clip_value, clip_value] (clip_grad_value_)."
        ),
    )
    agc: float | None = Field(
        default=None,
        gt=0,
        description=(
            'Adaptive gradient clipping (Brock et al. 2021, "High-Performance Large-Scale '
            "Image Recognition Without Normalization\"), the paper's lambda, e.g. 0.01 .. "
            "0.16: each row of a 2-D hidden matrix keeps ||g_row|| <= agc * max(||w_row||, "
            "agc_eps). Embeddings, head, norms, biases untouched. Order: global norm, AGC, "
            "value; all on the device."
        ),
    )
    agc_eps: float = Field(default=1e-3, gt=0, description="AGC's floor on ||w_row||.")
    fused: bool = Field(
        default=False,
        description=(
            "torch's fused AdamW kernel (CPU and CUDA): one kernel for the whole update "
            "instead of a handful of multi-tensor ops; its rounding differs from the default "
            "foreach path, so switching it in the middle of a run changes the trajectory "
            "(resume stays exact)."
        ),
    )
    lr_layer_decay: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=(
            "Layer-wise learning-rate decay (ELECTRA, Clark et al. 2020; BEiT, Bao et al. "
            "2021), e.g. 0.8: block i's lr is multiplied by lr_layer_decay ** (n_layer - 1 - "
            "i), the embeddings by lr_layer_decay ** n_layer (the lowest; a tied head follows "
            "its embedding), the final norm and an untied head by 1. On top of muP's scales "
            "and the schedule."
        ),
    )
    param_groups: list[ParamGroupRule] | None = Field(
        default=None,
        description=(
            'Per-name rules, e.g. `[{pattern: "attn\\\\.w_[qk]", lr_mult: 0.5, '
            "weight_decay: 0.0}]`; the first rule whose pattern matches a parameter applies "
            "(its lr_mult multiplies the layer decay's). A rule that matches no parameter is "
            "an error. Kept through the schedule, muP and resumes."
        ),
    )

    @field_validator("name", mode="before")
    @classmethod
    def _registered(cls, v: Any) -> Any:
        # The registry lives with the builders (it imports torch), hence the late import;
        # the message is the one a Literal of the same names gives.
        from training.optim import OPTIMIZERS

        if isinstance(v, str) and v in OPTIMIZERS:
            return v
        names = [repr(n) for n in OPTIMIZERS]
        expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise PydanticCustomError(
            "literal_error", "Input should be {expected}", {"expected": expected}
        )


class ScheduleConfig(Strict):
    kind: Literal[
        "cosine", "wsd", "linear", "constant", "step", "exponential", "polynomial", "onecycle"
    ] = Field(
        default="cosine",
        description=(
            "Linear warmup over warmup_steps, then, with p the decay progress and m = "
            "min_lr_ratio: `cosine` to m; `wsd` (warmup-stable-decay) constant, then the last "
            "decay_fraction decays to m; `linear` to m (OPT's 10%); `constant`; `step`: gamma "
            "** ((step - warmup) // step_size) (no floor); `exponential`: m ** p (m > 0); "
            "`polynomial`: m + (1 - m) * (1 - p) ** power; `onecycle`: a cosine warmup from "
            "1/div_factor to 1, then cosine to m (one-cycle's LR half; momentum not cycled)."
        ),
    )
    warmup_steps: int = Field(default=100, ge=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description=(
            "The floor that cosine, linear, wsd, exponential, polynomial and onecycle end at, "
            "as a fraction of the peak."
        ),
    )
    decay_fraction: float = Field(
        default=0.2, gt=0, le=1, description=("wsd: the last fraction of the steps decays.")
    )
    gamma: float = Field(
        default=0.1, gt=0, le=1, description=("step: the lr factor every `step_size` steps.")
    )
    step_size: int = Field(
        default=1000, ge=1, description=("step: steps between drops (after warmup).")
    )
    power: float = Field(
        default=1.0, gt=0, description=("polynomial: the exponent of (1 - progress).")
    )
    div_factor: float = Field(
        default=25.0, ge=1, description=("onecycle: warmup starts at lr / div_factor.")
    )
    batch_warmup_start_accum: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Batch-size warmup: grad accumulation ramps from this to `accum_steps` over "
            "`batch_warmup_steps` steps, or over the first `batch_warmup_tokens` tokens trained "
            "(GPT-3 ramps its batch by tokens, over the first 4-12B)."
        ),
    )
    batch_warmup_steps: int = Field(
        default=0,
        ge=0,
        description=(
            "Batch-size warmup over this many steps (or use batch_warmup_tokens, not both)."
        ),
    )
    batch_warmup_tokens: int = Field(
        default=0,
        ge=0,
        description=(
            "Batch-size warmup over this many tokens (or use batch_warmup_steps, not both)."
        ),
    )

    @model_validator(mode="after")
    def _one_batch_ramp(self) -> ScheduleConfig:
        if self.batch_warmup_steps and self.batch_warmup_tokens:
            raise ValueError(
                "batch_warmup_steps and batch_warmup_tokens are both set: the "
                "batch ramps over steps or over tokens, not both"
            )
        return self

    @field_validator("min_lr_ratio")
    @classmethod
    def _exponential_floor(cls, v: float, info: ValidationInfo) -> float:
        if v == 0 and info.data.get("kind") == "exponential":
            # m ** progress is 0 from the first decay step on: a cliff, not a decay.
            raise ValueError(
                "must be > 0 for kind exponential (it decays geometrically from 1 to min_lr_ratio)"
            )
        return v


class PrecisionConfig(Strict):
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description=("fp32, bf16 autocast, or fp16 with dynamic loss scaling (GradScaler)."),
    )
    z_loss: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Weight of the z-loss on the log-partition function, e.g. 1e-4 (PaLM); logged apart."
        ),
    )
