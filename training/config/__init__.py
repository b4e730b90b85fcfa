"""The training config: one YAML file per run, typed with pydantic, errors that name the
key. `training` imports neither Prefect nor `tasks` (see the architecture)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from core.config import Strict, format_validation_error, read_yaml
from core.errors import ConfigError
from core.store import StorageOptions
from training.config.checkpoint import (
    RUN_PLACEHOLDER,
    CheckpointConfig,
    sanitise_run_name,
)
from training.config.evals import EvalsConfig
from training.config.model import _LATER_MODEL_KEYS, _RUNTIME_ONLY_MODEL_KEYS, ModelConfig
from training.config.optim import OptimConfig, ParamGroupRule, PrecisionConfig, ScheduleConfig
from training.config.parallel import (
    ParallelConfig,
    ParallelSetting,
    check_tensor_parallel,
    drop_setting_tag,
)
from training.config.recipe import (
    EarlyStoppingConfig,
    EmaConfig,
    GuardConfig,
    NoiseScaleConfig,
    ResumeOverrides,
)
from training.config.tracking import TRACKING_SCHEMES, TrackingConfig, check_tracking_uri


class TrainConfigError(ConfigError):
    """A training config that cannot be used; the message names every bad key."""


class TrainConfig(Strict):
    dataset: str = Field(
        description=(
            "A prepared dataset (`<prep output>/dataset`, its newest version): a directory "
            "(relative: from the working directory), or s3://... (fetched into "
            "$BALLAST_DATASET_CACHE, ~/.cache/ballast/datasets, and verified)."
        )
    )
    run_dir: str = Field(
        default="runs/train",
        description=(
            "Metrics, loss.png, final.json and (by default) checkpoints go here (relative: "
            "from the working directory)."
        ),
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
    parallel: ParallelSetting = Field(
        default="ddp",
        description=(
            "Under torchrun: ddp (replicated), fsdp2 (fully_shard; checkpoints with DCP), or "
            "the device mesh as a mapping (dp_replicate, dp_shard, tp, pp; their product is "
            "the world size): `ddp` means `{dp_replicate: -1, dp_shard: 1}`, `fsdp2` "
            "`{dp_shard: -1}`."
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
    evals: EvalsConfig | None = Field(
        default=None,
        description=(
            "Downstream benchmarks and held-out text sets scored in the loop, with a "
            "regression check that names the data trained on since the best score; off "
            "unless set."
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
    def _parallel(self) -> TrainConfig:
        check_tensor_parallel(self)
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

    def checkpoint_fingerprint(self) -> Fingerprint:
        """A short sha256 over what makes two runs' checkpoints interchangeable: the model
        (less the keys that only say how it runs) and the optimizer kind (its state is in
        every checkpoint). Steps, data, cadences, paths and the device are left out. The
        vocabulary and sequence length come from the dataset, not from here. The value
        keeps what it hashes (`.hashed`): the remote prefix's ownership record stores it,
        so a refusal names the keys that differ."""
        model = self.model.model_dump(mode="json")
        for key in _RUNTIME_ONLY_MODEL_KEYS:
            model.pop(key, None)
        for key, default in _LATER_MODEL_KEYS.items():
            if model.get(key) == default:
                model.pop(key, None)
        hashed = {"model": model, "optim": {"name": self.optim.name}}
        blob = json.dumps(hashed, sort_keys=True, separators=(",", ":"))
        return Fingerprint(hashlib.sha256(blob.encode()).hexdigest()[:16], hashed)


class Fingerprint(str):
    """A config fingerprint (the hex digest, as a str) that remembers what it hashed."""

    hashed: dict[str, Any] | None

    def __new__(cls, digest: str, hashed: dict[str, Any] | None = None) -> Fingerprint:
        self = super().__new__(cls, digest)
        self.hashed = hashed
        return self


def parse_train_config(data: Any, where: str = "") -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise TrainConfigError(
            format_validation_error(
                e, where, "training config", loc=drop_setting_tag, model=TrainConfig
            )
        ) from None


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


__all__ = [
    "RUN_PLACEHOLDER",
    "TRACKING_SCHEMES",
    "CheckpointConfig",
    "EarlyStoppingConfig",
    "EmaConfig",
    "GuardConfig",
    "ModelConfig",
    "NoiseScaleConfig",
    "OptimConfig",
    "ParallelConfig",
    "ParamGroupRule",
    "PrecisionConfig",
    "ResumeOverrides",
    "ScheduleConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainConfigError",
    "check_tracking_uri",
    "load_train_config",
    "parse_train_config",
    "read_train_doc",
    "sanitise_run_name",
]
