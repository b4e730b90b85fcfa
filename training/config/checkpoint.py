"""The `checkpoint:` section of the training config: where checkpoints go, how often,
which are kept, the remote copy and the run name that names its prefix."""

from __future__ import annotations

import re

from pydantic import (
    Field,
    field_validator,
)

from core.config import Strict

RUN_PLACEHOLDER = "{run}"
_RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")
# ModelConfig keys that say how the model runs, not what it is: checkpoints made with and
# without them are interchangeable, so they stay out of the config fingerprint.


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
