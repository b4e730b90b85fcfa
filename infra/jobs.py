"""The job-launch contract shared by the supervisor and its backends (../shared/ARCHITECTURE.md,
"Launch and supervision"): a `JobBackend` has submit, status, logs and cancel. Backends:
`local` (torchrun as a subprocess; infra/local_backend.py) and `kubernetes` (a batch/v1
Job or a JobSet; infra/k8s_backend.py). The supervisor (infra/supervisor.py) sees only this.

Exit codes are the trainer's (training/train.py): 0 done, 1 bad config or data,
3 diverged beyond the rollback budget, anything else crashed or killed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from core.protocol import EXIT_DIVERGED, EXIT_ERROR, EXIT_OK

# How one attempt ended. The supervisor decides what to do from this alone.
Ending = Literal["done", "node_lost", "diverged", "oom", "bad_input", "crashed", "cancelled"]
ENDINGS: tuple[str, ...] = ("done", "node_lost", "diverged", "oom", "bad_input", "crashed",
                            "cancelled")


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
            raise ValueError(f"job name {self.name!r}: lowercase letters, digits and '-', "
                             "starting and ending with a letter or digit, at most 42 chars")
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError("nnodes and nproc_per_node must be >= 1")

    @property
    def attempt_name(self) -> str:
        return f"{self.name}-a{self.attempt}"

    def entrypoint_argv(self, torchrun_args: tuple[str, ...] = ()) -> list[str]:
        """The arguments after `python -m training.entrypoint` (pod and local alike)."""
        return [f"--nproc-per-node={self.nproc_per_node}",
                f"--max-restarts={self.torchrun_max_restarts}", *torchrun_args,
                "--", "--config", self.config, *self.args]


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
