"""The `launch:` section of a training config: how the supervisor runs the trainer. Which
backend (`BACKENDS` in infra/jobs.py), how many nodes and processes, the restart policy
(infra/supervisor.py) and the Kubernetes options (infra/k8s_manifests.py KubeOptions). The
trainer ignores the section; the `train` flow reads it before anything is submitted.

    launch:
      backend: kubernetes
      nnodes: 2
      nproc_per_node: 8
      max_restarts: 3
      kubernetes: {namespace: ballast, image: ghcr.io/ballast-lm/ballast:0.1.0}

Every key is optional; a config without the section launches as the defaults below say.
The train flow checks the config's `parallel` mesh against nnodes x nproc_per_node before it
submits anything (infra/mesh.py fit_launch).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from core.config import Strict, format_validation_error, read_yaml
from core.errors import ConfigError
from infra.jobs import BACKENDS, backend_entry
from infra.k8s_manifests import KubeOptions
from infra.supervisor import RestartPolicy

SECTION = "launch"


class LaunchConfig(Strict):
    backend: str = Field(
        default="local",
        description=(
            "A name in infra/jobs.py BACKENDS: `local` (a subprocess on this machine) or "
            "`kubernetes` (a Job, or a JobSet for several nodes)."
        ),
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        description=(
            "Nodes (pods). nnodes x nproc_per_node processes must be the size of the training "
            "config's `parallel` mesh. With parallel.pp > 1, pipeline stages line up with "
            "nodes when pp divides nnodes or nnodes divides pp; otherwise a stage straddles "
            "nodes (a warning: it runs, its FSDP traffic partly crosses the network)."
        ),
    )
    nproc_per_node: int = Field(
        default=1,
        ge=1,
        description=(
            "Processes (GPUs) per node; a multiple of parallel.tp, so that each tensor-parallel "
            "group sits within one node (its per-layer collectives need NVLink)."
        ),
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description=("Restarts after crashes and out-of-memory endings (with backoff)."),
    )
    max_node_losses: int = Field(
        default=10, ge=0, description=("Restarts after a node was lost or preempted.")
    )
    max_recoveries: int = Field(
        default=1, ge=0, description=("Rollback restarts after a divergence (exit 3).")
    )
    recovery_lr_scale: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description=("The learning rate is multiplied by this on a recovery restart."),
    )
    poll_s: float = Field(default=5.0, gt=0, description=("Seconds between looks at the job."))
    kubernetes: KubeOptions = Field(
        default=KubeOptions(), description=("The kubernetes backend's options.")
    )

    @field_validator("backend")
    @classmethod
    def _known(cls, v: str) -> str:
        backend_entry(v)  # ValueError naming the backends there are
        return v

    def policy(self) -> RestartPolicy:
        return RestartPolicy(
            self.max_restarts,
            self.max_node_losses,
            self.max_recoveries,
            self.recovery_lr_scale,
            poll_s=self.poll_s,
        )


class _Document(Strict):
    # Only so that a validation error names its key as `launch.<key>`.
    launch: LaunchConfig


def parse_launch(
    section: Any, overrides: Mapping[str, Any] | None = None, where: str = ""
) -> LaunchConfig:
    """`section` (the `launch:` mapping, or None) with `overrides` on top, key by key."""
    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(f"invalid launch config {where}: `{SECTION}:` must be a mapping")
    data = {**(section or {}), **(overrides or {})}
    try:
        return _Document.model_validate({SECTION: data}).launch
    except ValidationError as e:
        raise ConfigError(
            format_validation_error(e, where, "launch config", model=_Document)
        ) from None


def load_launch(path: str | Path, overrides: Mapping[str, Any] | None = None) -> LaunchConfig:
    """The `launch:` section of the training config at `path` (a prep config's `train:`
    section counts, as for the trainer), with `overrides` for one run on top."""
    data = read_yaml(path, ConfigError)
    if isinstance(data, dict) and "train" in data and "sources" in data:
        data = data["train"]
    section = data.get(SECTION) if isinstance(data, dict) else None
    return parse_launch(section, overrides, str(path))


def add_launch_arguments(parser: argparse.ArgumentParser, nproc: bool = True) -> None:
    """`--backend` (and `--nproc-per-node`): the launch keys a command line may override,
    for `python -m flows.train` and `python -m flows.pipeline`."""
    parser.add_argument("--backend", choices=list(BACKENDS), help="override `launch.backend`")
    if nproc:
        parser.add_argument("--nproc-per-node", type=int, help="override `launch.nproc_per_node`")


def launch_overrides(args: argparse.Namespace) -> dict[str, Any] | None:
    """The launch overrides `args` gives (None: none), for load_launch."""
    given = {key: getattr(args, key, None) for key in ("backend", "nproc_per_node")}
    return {k: v for k, v in given.items() if v is not None} or None
