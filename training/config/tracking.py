"""The `tracking:` section of the training config: MLflow and TensorBoard."""

from __future__ import annotations

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from core.config import Strict

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
