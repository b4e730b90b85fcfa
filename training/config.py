"""The training config: one YAML file per run, typed with pydantic, errors that name the
key. `training` imports neither Prefect nor `tasks` (see the architecture)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.config import Strict, format_validation_error, read_yaml
from core.errors import ConfigError
from core.store import StorageOptions


class TrainConfigError(ConfigError):
    """A training config that cannot be used; the message names every bad key."""


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


class GuardConfig(Strict):
    enabled: bool = Field(
        default=True,
        description=(
            "The stability guards (docs/training.md); false keeps only the skips of "
            "non-finite steps (that check is never off)."
        ),
    )
    loss_z: float = Field(
        default=6.0,
        gt=0,
        description=(
            "A loss spike: the loss's z-score against an EMA of its mean and variance above "
            "this skips the batch."
        ),
    )
    grad_z: float = Field(
        default=6.0, gt=0, description=("A grad-norm spike: the same, judged in log space.")
    )
    ema_beta: float = Field(
        default=0.98, gt=0, lt=1, description=("The EMA's decay for the running statistics.")
    )
    warmup_steps: int = Field(
        default=50, ge=0, description=("No spike calls before the statistics settle.")
    )
    spikes_to_rollback: int = Field(
        default=3,
        ge=1,
        description=(
            "Divergence: this many spikes within `window` steps roll back to the last "
            "checkpoint before the trouble."
        ),
    )
    window: int = Field(default=50, ge=1, description="See spikes_to_rollback.")
    divergence_factor: float = Field(
        default=3.0,
        gt=1,
        description=(
            "Divergence: the loss above this factor x its running mean for "
            "`divergence_steps` steps in a row."
        ),
    )
    divergence_steps: int = Field(default=10, ge=1, description=("See divergence_factor."))
    max_rollbacks: int = Field(
        default=3,
        ge=0,
        description=(
            "Past this many rollbacks the trainer exits with code 3, naming the steps and the "
            "data involved."
        ),
    )
    max_nonfinite_steps: int = Field(
        default=5,
        ge=1,
        description=(
            "This many non-finite steps (loss or grad norm) in a row are a divergence, not a "
            "run of skips: the weights are most likely NaN already, so roll back (or give "
            "up)."
        ),
    )
    rollback_lr_scale: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description=("The learning rate is multiplied by this at each rollback."),
    )


class EarlyStoppingConfig(Strict):
    patience: int = Field(
        ge=1,
        description=(
            "Stop after this many evaluations in a row without a validation loss below the "
            "best so far minus `min_delta` (exit 0, an early_stop event, and final.json's "
            "early_stopping)."
        ),
    )
    min_delta: float = Field(default=0.0, ge=0, description="See patience.")


class EmaConfig(Strict):
    decay: float = Field(
        default=0.999,
        gt=0,
        lt=1,
        description=(
            "ema <- decay * ema + (1 - decay) * weights after every applied optimizer step."
        ),
    )


class NoiseScaleConfig(Strict):
    every: int = Field(
        default=10,
        ge=1,
        description=(
            'The gradient noise scale B_noise (McCandlish et al. 2018, the "simple" '
            "estimator from the first micro-batch's and the whole step's gradient norms) every "
            'this many steps, as a "noise_scale" record; needs accum_steps >= 2.'
        ),
    )
    ema_beta: float = Field(
        default=0.9, ge=0, lt=1, description=("Decay of the EMAs of the estimator's |G|^2 and S.")
    )
    max_accum: int | None = Field(
        default=None,
        ge=2,
        description=(
            "The controller: raise grad accumulation towards target * B_noise / micro_batch "
            '(never lower it), at most to this; a "batch_size" event at each change '
            "(checkpointed). None: estimate only."
        ),
    )
    target: float = Field(
        default=1.0,
        gt=0,
        description=("1: the batch B_noise, McCandlish et al.'s critical-batch estimate."),
    )


class ResumeOverrides(Strict):
    # Applied whenever the trainer loads one of the run's checkpoints (a resume, or a
    # rollback), keeping the step count, the data position and the guards' state; a fresh
    # run uses `optim` as it is. Each change is an event in the metrics log.
    lr: float | None = Field(
        default=None,
        gt=0,
        description=("The new peak lr of the `optim.lr` groups (an lr_override event)."),
    )
    muon_lr: float | None = Field(default=None, gt=0, description=("The same for Muon's matrices."))
    optimizer: str | None = Field(
        default=None,
        description=(
            "Switch to this optimizer (a key of training.optim.OPTIMIZERS, e.g. adamw -> "
            "muon: Muon for 2-D hidden matrices, AdamW for the rest); its state starts fresh "
            "(an optimizer_switch event)."
        ),
    )

    @field_validator("optimizer", mode="before")
    @classmethod
    def _registered(cls, v: Any) -> Any:
        return v if v is None else OptimConfig._registered(v)


# MLflow tracking URI schemes the tracking section accepts: a SQLite file (what works
# offline without a server), an MLflow server, Databricks, or a database MLflow's
# SQLAlchemy store speaks (postgresql+psycopg2://... included).
TRACKING_SCHEMES = ("sqlite", "http", "https", "databricks", "postgresql", "mysql", "mssql")


class TrackingConfig(Strict):
    """Experiment tracking, off unless the section is present. The trainer writes
    TensorBoard event files (rank 0, as it trains); the `train` flow and `ballast train`
    log the run to MLflow when training ends (infra/tracking.py)."""

    enabled: bool = Field(
        default=True, description=("false: the section is kept, nothing is tracked.")
    )
    mlflow: bool = Field(
        default=True,
        description=(
            "One MLflow run per train/pipeline flow run or `ballast train`, logged when "
            "training ends."
        ),
    )
    uri: str | None = Field(
        default=None,
        description=(
            "The MLflow tracking URI (sqlite, http(s), databricks, postgresql, mysql, mssql). "
            "None: $MLFLOW_TRACKING_URI, else a SQLite store under the run, "
            "sqlite:///<run_dir>/mlflow/mlflow.db (artifacts in <run_dir>/mlflow/artifacts). "
            "MLflow 3 refuses its old directory store (file:/ or ./mlruns), so that is an "
            "error."
        ),
    )
    experiment: str = Field(
        default="ballast", min_length=1, max_length=500, description=("The MLflow experiment.")
    )
    tensorboard: bool = Field(
        default=True,
        description=(
            "Event files in <run_dir>/tensorboard/<run name>, written by rank 0 as it trains."
        ),
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        if v is not None:
            check_tracking_uri(v)
        return v

    @model_validator(mode="after")
    def _installed(self) -> TrackingConfig:
        import importlib.util

        for key, module in (("mlflow", "mlflow"), ("tensorboard", "tensorboard")):
            if self.enabled and getattr(self, key) and importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"tracking.{key} needs the {module} package, which is not "
                    "installed: pip install 'ballast-lm[track]', or set "
                    f"tracking.{key}: false"
                )
        return self


def check_tracking_uri(uri: str) -> None:
    """ValueError with the reason when `uri` is not an MLflow tracking URI Ballast can use
    (the scheme only: whether a server answers is checked before training starts)."""
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme == "file" or (not scheme and not uri.startswith("databricks")):
        raise ValueError(
            "MLflow 3 refuses the file store (a directory or file:/ URI); use "
            "a SQLite file, sqlite:////absolute/path/mlflow.db, or a server, "
            "http://host:5000"
        )
    if scheme and scheme not in TRACKING_SCHEMES:
        raise ValueError(
            f"unsupported scheme {scheme}:// (use one of "
            f"{', '.join(s + '://' for s in TRACKING_SCHEMES)})"
        )
    if scheme == "sqlite" and not uri.startswith("sqlite:///"):
        raise ValueError(
            "a SQLite URI has three slashes before a relative path and four "
            "before an absolute one: sqlite:////abs/path/mlflow.db"
        )


RUN_PLACEHOLDER = "{run}"
_RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")
# ModelConfig keys that say how the model runs, not what it is: checkpoints made with and
# without them are interchangeable, so they stay out of the config fingerprint.
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


def sanitise_run_name(name: str) -> str:
    """`name` with every run of characters outside [A-Za-z0-9._-] replaced by one '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


class CheckpointConfig(Strict):
    dir: str = Field(
        default="checkpoints", description=("Relative to run_dir unless absolute or s3://.")
    )
    every: int = Field(
        default=100, ge=1, description=("A checkpoint every this many steps (and one at the end).")
    )
    keep_last: int = Field(
        default=3,
        ge=1,
        description=("Retention keeps the last N checkpoints (locally and remotely)."),
    )
    keep_every: int | None = Field(default=None, ge=1, description=("Also keep every K-th step."))
    async_save: bool = Field(
        default=True,
        description=(
            "Write checkpoints in a background thread: the loop only waits for the copy of "
            "the state into staging buffers (benchmarks/checkpoint_stall.py measures both). "
            "With FSDP2, dcp.async_save."
        ),
    )
    remote: str | None = Field(
        default=None,
        description=(
            "Object storage for checkpoints (s3://bucket/prefix or a directory): the ROOT "
            "under which each run gets its own prefix, <remote>/<run name> (or, if `remote` "
            "holds the placeholder {run}, the run name put there: s3://b/exp-{run}/ckpt). "
            "Each local checkpoint is uploaded there in the background; a fresh machine "
            "resumes from there. TrainConfig.remote_checkpoint_uri() gives the run's "
            "effective location."
        ),
    )
    run_name: str | None = Field(
        default=None,
        description=(
            "The run's name under `remote`; None = the last part of `run_dir` (sanitised to "
            "[A-Za-z0-9._-]). Runs never resume from or prune each other's remote "
            "checkpoints."
        ),
    )
    remote_max_failures: int = Field(
        default=3,
        ge=1,
        description=(
            "Upload failures are reported loudly; training stops (exit 2) only after this "
            "many checkpoints in a row failed to upload."
        ),
    )
    remote_max_lag_minutes: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Training stops (exit 2) when a checkpoint has waited this long to reach the remote "
            "(the store gone for good: on Kubernetes the local disk goes with the pod); a "
            "restart resumes and uploads. The final checkpoint must reach the remote before a "
            "run ends done."
        ),
    )

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, v: str | None) -> str | None:
        if v is not None and (not _RUN_NAME.fullmatch(v) or v in (".", "..")):
            raise ValueError(
                "must be a non-empty name of letters, digits, '.', '_' and '-' "
                "(no '/'; it becomes one path component under checkpoint.remote)"
            )
        return v

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: str | None) -> str | None:
        if v is not None:
            if not v.strip():
                raise ValueError("must be s3://bucket/prefix or a directory, not empty")
            if "{" in v.replace(RUN_PLACEHOLDER, "") or "}" in v.replace(RUN_PLACEHOLDER, ""):
                raise ValueError(f"the only placeholder allowed is {RUN_PLACEHOLDER}")
        return v


class TrainConfig(Strict):
    dataset: str = Field(
        description=(
            "A prepared dataset (`<prep output>/dataset`, its newest version): a directory, or "
            "s3://... (fetched into $BALLAST_DATASET_CACHE, ~/.cache/ballast/datasets, and "
            "verified)."
        )
    )
    run_dir: str = Field(
        default="runs/train",
        description=("Metrics, loss.png, final.json and (by default) checkpoints go here."),
    )
    seed: int = Field(
        default=0, description=("Seeds torch and numpy (init, dropout) and the sampler's order.")
    )
    steps: int = Field(default=1000, ge=1, description="Optimizer steps.")
    micro_batch: int = Field(default=12, ge=1, description="Rows per micro-batch.")
    accum_steps: int = Field(
        default=1,
        ge=1,
        description=(
            "Micro-batches per optimizer step; the global batch is micro_batch x accum_steps "
            "whatever the world size."
        ),
    )
    eval_every: int = Field(
        default=200, ge=1, description=("Steps between validation evaluations.")
    )
    eval_batches: int | None = Field(
        default=None,
        ge=1,
        description=("Batches per evaluation; None = the whole validation split."),
    )
    log_every: int = Field(
        default=1,
        ge=1,
        description=("Steps between train records (grad norm, loss, lr) in metrics.jsonl."),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description=("`auto`: CUDA when present.")
    )
    deterministic: bool = Field(
        default=True,
        description=("Deterministic algorithms (exact resume is tested on CPU with this on)."),
    )
    shuffle: bool = Field(
        default=True, description=("false keeps the dataset's order (curriculum runs).")
    )
    parallel: Literal["ddp", "fsdp2"] = Field(
        default="ddp",
        description=(
            "Under torchrun: ddp (replicated) or fsdp2 (fully_shard; checkpoints with DCP)."
        ),
    )
    model: ModelConfig = Field(default=ModelConfig(), description="The model.")
    optim: OptimConfig = Field(
        default=OptimConfig(), description=("The optimizer and gradient clipping.")
    )
    schedule: ScheduleConfig = Field(
        default=ScheduleConfig(), description=("The learning-rate schedule and batch-size warmup.")
    )
    precision: PrecisionConfig = Field(
        default=PrecisionConfig(), description=("Numeric precision and z-loss.")
    )
    guards: GuardConfig = Field(
        default=GuardConfig(),
        description=(
            "The stability guards: skip spikes, roll back divergence, give up with exit 3."
        ),
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description=(
            "Cross-entropy with label smoothing (Szegedy et al. 2016), e.g. 0.1, in the "
            "training loss; the logged `ce` and the validation loss stay the plain "
            "cross-entropy."
        ),
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        default=None, description=("Stop when the validation loss stops improving; off unless set.")
    )
    ema: EmaConfig | None = Field(
        default=None,
        description=(
            "An EMA of the weights, evaluated (ema_val_loss) and checkpointed (DDP or one "
            "process; not with fsdp2); off unless set."
        ),
    )
    init_from: str | None = Field(
        default=None,
        description=(
            "Warm start: a fresh run (no checkpoint of its own yet) starts from the weights "
            "of this checkpoint (a step-N directory, a checkpoint directory or a run "
            "directory; the shapes must match), with a new optimizer, at step 0. Ignored once "
            "the run has a checkpoint of its own."
        ),
    )
    resume_overrides: ResumeOverrides | None = Field(
        default=None,
        description=(
            "Applied whenever the trainer loads one of the run's checkpoints (a resume, or a "
            "rollback), keeping the step count, the data position and the guards' state; a "
            "fresh run uses `optim` as it is. Each change is an event in the metrics log."
        ),
    )
    stats_every: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Every N steps: per block the RMS of activations and gradients, the max attention "
            'logit and the update/weight ratio, as a "stats" record in the metrics log. '
            "Off: no hooks, no work, no host read. Not with model.compile."
        ),
    )
    max_attn_logit: float | None = Field(
        default=None,
        gt=0,
        description=(
            "With stats_every: an attn_logit_warning event when a layer's max attention logit "
            "exceeds this (growing logits are an early sign of divergence; Dehghani et al. "
            "2023)."
        ),
    )
    noise_scale: NoiseScaleConfig | None = Field(
        default=None,
        description=(
            "The gradient noise scale and, optionally, a batch-size controller; off unless "
            "set. Needs accum_steps >= 2; not with fp16."
        ),
    )
    checkpoint: CheckpointConfig = Field(
        default=CheckpointConfig(), description=("Checkpoints, retention and object storage.")
    )
    storage: StorageOptions = Field(
        default=StorageOptions(), description=("For s3:// URIs; unset = the environment.")
    )
    tracking: TrackingConfig | None = Field(
        default=None,
        description=(
            "MLflow and TensorBoard; off unless the section is present. Needs the `[track]` "
            "extra (mlflow-skinny, tensorboard)."
        ),
    )
    launch: dict[str, Any] | None = Field(
        default=None,
        description=(
            "How the `train` flow launches this run (validated by the launcher, "
            "infra/launch.py, which sits above training in the layers: see Launch below); "
            "the trainer itself ignores it."
        ),
    )

    @model_validator(mode="after")
    def _noise_scale(self) -> TrainConfig:
        ns = self.noise_scale
        if ns is None:
            return self
        if self.accum_steps < 2:
            raise ValueError(
                "noise_scale needs accum_steps >= 2 (it compares one "
                "micro-batch's gradient with the whole step's)"
            )
        if ns.max_accum is not None and ns.max_accum < self.accum_steps:
            raise ValueError(
                f"noise_scale.max_accum ({ns.max_accum}) is below accum_steps ({self.accum_steps})"
            )
        if self.precision.dtype == "fp16":
            raise ValueError(
                "noise_scale cannot be combined with precision.dtype fp16 (the "
                "loss-scaled gradients would need a host read per estimate)"
            )
        return self

    @model_validator(mode="after")
    def _stats(self) -> TrainConfig:
        if self.max_attn_logit is not None and self.stats_every is None:
            raise ValueError(
                "max_attn_logit needs stats_every (the logits are measured on statistics steps)"
            )
        if self.stats_every is not None and self.model.compile:
            raise ValueError(
                "stats_every cannot be combined with model.compile (its hooks "
                "would recompile the model)"
            )
        return self

    @model_validator(mode="after")
    def _remote_run_name(self) -> TrainConfig:
        if self.checkpoint.remote and self.checkpoint.run_name is None:
            self.run_name()  # a run_dir that names no run is an error now, not at upload
        return self

    def checkpoint_dir(self) -> str:
        d = self.checkpoint.dir
        if "://" in d or Path(d).is_absolute():
            return d
        return str(Path(self.run_dir) / d)

    def run_name(self) -> str:
        """The run's identity in object storage: `checkpoint.run_name`, or else the last
        part of `run_dir` sanitised to [A-Za-z0-9._-] ("runs/train-demo" -> "train-demo";
        "." or ".." name the directory they resolve to)."""
        if self.checkpoint.run_name is not None:
            return self.checkpoint.run_name
        path = Path(self.run_dir)
        name = path.name
        if name in ("", ".", ".."):
            name = path.resolve().name
        name = sanitise_run_name(name)
        if not name or name in (".", ".."):
            raise ValueError(
                f"run_dir {self.run_dir!r} gives no run name for "
                "checkpoint.remote: set checkpoint.run_name"
            )
        return name

    def remote_checkpoint_uri(self) -> str | None:
        """Where this run's checkpoints go in object storage: `checkpoint.remote` with
        {run} replaced by the run name, or `<checkpoint.remote>/<run name>` without the
        placeholder; None when there is no `checkpoint.remote`."""
        remote = self.checkpoint.remote
        if not remote:
            return None
        if RUN_PLACEHOLDER in remote:
            return remote.replace(RUN_PLACEHOLDER, self.run_name())
        return f"{remote.rstrip('/')}/{self.run_name()}"

    def checkpoint_fingerprint(self) -> str:
        """A short sha256 over what makes two runs' checkpoints interchangeable: the model
        (less the keys that only say how it runs) and the optimizer kind (its state is in
        every checkpoint). Steps, data, cadences, paths and the device are left out. The
        vocabulary and sequence length come from the dataset, not from here."""
        model = self.model.model_dump(mode="json")
        for key in _RUNTIME_ONLY_MODEL_KEYS:
            model.pop(key, None)
        for key, default in _LATER_MODEL_KEYS.items():
            if model.get(key) == default:
                model.pop(key, None)
        blob = json.dumps(
            {"model": model, "optim": {"name": self.optim.name}},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def parse_train_config(data: Any, where: str = "") -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise TrainConfigError(format_validation_error(e, where, "training config")) from None


def read_train_doc(path: str | Path) -> dict[str, Any]:
    """The training config's YAML data, unvalidated: the file itself, or the `train:`
    section of a prep config that has one. TrainConfigError unless it is a mapping."""
    data = read_yaml(path, TrainConfigError)
    if isinstance(data, dict) and "train" in data and "sources" in data:
        data = data["train"]
    if not isinstance(data, dict):
        raise TrainConfigError(f"invalid training config {Path(path)}: expected a mapping")
    return data


def load_train_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML training config. A prep config with a `train:` section is accepted
    too (the section is used), so one file can describe a whole pipeline run."""
    data = read_train_doc(path)
    path = Path(path)
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return parse_train_config(data, str(path))
