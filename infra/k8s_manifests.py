"""Kubernetes objects for a training attempt, rendered from one template: the kubernetes
backend creates exactly these, and k8s/ (for kubectl users) is generated from them.

(skeleton: filled in by the manifests work)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from infra.jobs import JobSpec

# Labels every object and pod of an attempt carries; the backend finds pods by them.
LABEL_APP = "app.kubernetes.io/name"
LABEL_RUN = "ballast.dev/run"
LABEL_ATTEMPT = "ballast.dev/attempt"


@dataclass(frozen=True)
class KubeOptions:
    namespace: str = "ballast"
    image: str = "ghcr.io/ballast-lm/ballast:0.1.0"
    kind: Literal["auto", "job", "jobset"] = "auto"  # auto: Job for 1 node, JobSet beyond
    gpus_per_node: int = 1
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str = "8"
    memory: str = "64Gi"
    shm_size: str = "16Gi"  # memory-backed /dev/shm (NCCL, DataLoader workers)
    node_selector: dict[str, str] = field(
        default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    tolerations: list[dict[str, str]] = field(default_factory=lambda: [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    service_account: str = "ballast-trainer"
    s3_secret: str = "ballast-s3"  # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / endpoint
    config_map: str = "ballast-train-config"  # holds train.yaml, mounted at /etc/ballast
    config_mount: str = "/etc/ballast"
    backoff_limit: int = 3  # crashes other than node loss, exit 1 and exit 3
    jobset_max_restarts: int = 3  # gang restarts of a multi-node JobSet
    run_as_user: int = 1000
    rdzv_port: int = 29500


def render(spec: JobSpec, opts: KubeOptions) -> list[dict[str, Any]]:
    """The API objects (plain dicts, as `kubectl apply` would send them) for one attempt."""
    raise NotImplementedError
