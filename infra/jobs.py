"""The job-launch contract shared by the supervisor and its backends: a `JobBackend` has
submit, status, logs and cancel. Backends, by name in `BACKENDS` (the one place to add
one): `local` (torchrun as a subprocess; infra/local_backend.py) and `kubernetes` (a
batch/v1 Job or a JobSet; infra/k8s_backend.py). The supervisor (infra/supervisor.py) sees
only the contract; the CLI, the flows and the deployments pick a backend by its name.

Exit codes are the trainer's (training/train.py): 0 done, 1 bad config or data,
3 diverged beyond the rollback budget, anything else crashed or killed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from core.protocol import EXIT_DIVERGED, EXIT_ERROR, EXIT_OK

if TYPE_CHECKING:
    from infra.k8s_manifests import KubeOptions

# How one attempt ended. The supervisor decides what to do from this alone.
Ending = Literal["done", "node_lost", "diverged", "oom", "bad_input", "crashed", "cancelled"]
ENDINGS: tuple[str, ...] = (
    "done",
    "node_lost",
    "diverged",
    "oom",
    "bad_input",
    "crashed",
    "cancelled",
)


# Kubernetes object names are DNS-1123 labels (63 chars; the Job controller adds suffixes
# to pod names, so keep run names shorter).
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$")


def ending_from_exit_code(code: int | None) -> Ending:
    """The ending a bare exit code implies (no node or memory information)."""
    if code == EXIT_OK:
        return "done"
    if code == EXIT_ERROR:
        return "bad_input"
    if code == EXIT_DIVERGED:
        return "diverged"
    return "crashed"


@dataclass(frozen=True)
class JobSpec:
    """One training attempt, backend-neutral.

    `config` is the training config path as the trainer sees it (a local path for the
    local backend; the ConfigMap mount, /etc/ballast/train.yaml, in a pod). `args` are
    extra `training.train` arguments (--dataset, --steps, --recover ...).
    """

    name: str  # the run's name: DNS-1123, <= 42 chars; backends add the attempt number
    config: str
    args: tuple[str, ...] = ()
    attempt: int = 0
    nnodes: int = 1
    nproc_per_node: int = 1
    torchrun_max_restarts: int = 0  # in-place restarts by torchrun before the job fails
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"job name {self.name!r}: lowercase letters, digits and '-', "
                "starting and ending with a letter or digit, at most 42 chars"
            )
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError("nnodes and nproc_per_node must be >= 1")

    @property
    def attempt_name(self) -> str:
        return f"{self.name}-a{self.attempt}"

    def entrypoint_argv(self, torchrun_args: tuple[str, ...] = ()) -> list[str]:
        """The arguments after `python -m training.entrypoint` (pod and local alike)."""
        return [
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.torchrun_max_restarts}",
            *torchrun_args,
            "--",
            "--config",
            self.config,
            *self.args,
        ]


@dataclass(frozen=True)
class JobHandle:
    """What a backend needs to find a submitted job again; JSON-serialisable, so a flow's
    cancellation hook can read it back from disk and cancel the job."""

    backend: str
    name: str
    namespace: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobHandle:
        return cls(d["backend"], d["name"], d.get("namespace"), dict(d.get("data") or {}))


@dataclass(frozen=True)
class JobStatus:
    phase: Literal["pending", "running", "finished"]
    ending: Ending | None = None  # set once finished
    exit_code: int | None = None
    detail: str = ""  # human-readable: which pod, which node, which reason


class JobBackend(Protocol):
    name: str

    def submit(self, spec: JobSpec) -> JobHandle: ...

    def status(self, handle: JobHandle) -> JobStatus: ...

    def logs(self, handle: JobHandle, tail: int | None = None) -> str: ...

    def cancel(self, handle: JobHandle) -> None: ...


# --- the backends, by name ---------------------------------------------------------------


def _local(*, run_dir: Path, **_: Any) -> JobBackend:
    from infra.local_backend import LocalBackend

    return LocalBackend(run_dir / "supervisor" / "jobs")


def _kubernetes(*, kubernetes: KubeOptions | None = None, **_: Any) -> JobBackend:
    from infra.k8s_backend import KubernetesBackend
    from infra.k8s_manifests import KubeOptions

    return KubernetesBackend(kubernetes or KubeOptions())


@dataclass(frozen=True)
class Backend:
    """A backend's factory and where it belongs in Prefect."""

    factory: Callable[..., JobBackend]  # keywords: run_dir, kubernetes (each takes its own)
    pool_type: str  # the Prefect work pool type whose flow runs launch with this backend
    pool: str  # the default name of that work pool (`ballast deploy`, prefect.yaml)
    # The trainer runs beside the flow and reads the config file from its disk; otherwise
    # the config travels inline in the job's environment.
    shares_disk: bool


BACKENDS: dict[str, Backend] = {
    "local": Backend(_local, "process", "ballast-process", shares_disk=True),
    "kubernetes": Backend(_kubernetes, "kubernetes", "ballast-k8s", shares_disk=False),
}
# Work pool type -> its default pool name, and the backend its flow runs launch with.
POOLS: dict[str, str] = {b.pool_type: b.pool for b in BACKENDS.values()}
POOL_BACKENDS: dict[str, str] = {b.pool_type: name for name, b in BACKENDS.items()}


def backend_entry(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}: use {' or '.join(BACKENDS)}") from None


def make_backend(name: str, **opts: Any) -> JobBackend:
    """The backend called `name`, made from the options it takes (`run_dir`: the run's
    directory; `kubernetes`: KubeOptions); the others are ignored."""
    return backend_entry(name).factory(**opts)
