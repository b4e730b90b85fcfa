"""Prefect deployments: `pipeline` (prep then train) on a cron schedule, `prep` only, and
`train` only, on a work pool: `process` for one machine (a `prefect worker` runs flows as
local processes) or `kubernetes` for a cluster (the worker starts each flow run as a pod,
and the train flow launches the trainer as its own Job or JobSet).

    ballast deploy --prep-config configs/demo.yaml --train-config configs/train-demo.yaml
    prefect worker start --pool ballast-process

prefect.yaml at the repository root describes the same deployments for `prefect deploy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

from infra.jobs import POOL_BACKENDS, POOLS
from infra.k8s_manifests import IMAGE

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CRON = "0 3 * * *"  # nightly at 03:00 (the deployment's timezone: UTC)
K8S_TEMPLATE = ROOT / "k8s" / "base" / "work-pool-template.json"


async def _ensure_pool(name: str, pool_type: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    template: dict[str, Any] = {}
    if pool_type == "kubernetes" and K8S_TEMPLATE.is_file():
        # GPU limits, the nvidia toleration and a memory-backed /dev/shm for flow-run pods.
        template = json.loads(K8S_TEMPLATE.read_text())
    async with get_client() as client:
        with contextlib.suppress(ObjectAlreadyExists):
            await client.create_work_pool(
                WorkPoolCreate(name=name, type=pool_type, base_job_template=template)
            )


def deploy_all(
    prep_config: str,
    train_config: str,
    *,
    pool_type: Literal["process", "kubernetes"] = "process",
    pool: str | None = None,
    cron: str | None = DEFAULT_CRON,
    output: str | None = None,
    run_dir: str | None = None,
    steps: int | None = None,
    image: str = IMAGE,
    source: str | Path = ROOT,
    launch: dict[str, Any] | None = None,
    dask_address: str | None = None,
) -> dict[str, UUID]:
    """Create the work pool if needed and register the three deployments; returns their
    ids by name ("pipeline/scheduled", "prep/prep-only", "train/train-only"). Config paths
    are as the worker will see them (relative to `source`, or absolute). The training
    runs launch with the pool's backend (`local` on a process pool, `kubernetes` on a
    kubernetes pool) and the rest of the training config's `launch:` section, `launch`
    overriding keys of it. `dask_address`: prep runs on that Dask cluster."""
    from prefect import Flow

    pool = pool or POOLS[pool_type]
    asyncio.run(_ensure_pool(pool, pool_type))
    overrides = {"backend": POOL_BACKENDS[pool_type], **(launch or {})}
    # ignore_warnings: Prefect's hint to `.serve` instead is for local experiments; these
    # deployments are meant for a worker.
    common: dict[str, Any] = {
        "work_pool_name": pool,
        "build": False,
        "push": False,
        "print_next_steps": False,
        "tags": ["ballast"],
        "ignore_warnings": True,
    }
    if pool_type == "kubernetes":
        common["image"] = image
    src = str(source)

    def load(entry: str) -> Any:
        return Flow.from_source(source=src, entrypoint=entry)

    ids = {}
    params = {
        "prep_config": prep_config,
        "train_config": train_config,
        "output": output,
        "run_dir": run_dir,
        "steps": steps,
        "launch": overrides,
        "dask_address": dask_address,
    }
    from prefect.schedules import Cron

    # One run at a time per deployment: a night whose run outlasts 24 hours must not start
    # a second trainer in the same run dir; the next run waits for a slot.
    ids["pipeline/scheduled"] = load("flows/pipeline.py:pipeline").deploy(
        name="scheduled",
        schedule=Cron(cron, timezone="UTC") if cron else None,
        parameters={k: v for k, v in params.items() if v is not None},
        concurrency_limit=1,
        description=f"Data prep, then training on the new dataset"
        f"{f' (cron {cron!r}, UTC)' if cron else ''}",
        **common,
    )
    ids["prep/prep-only"] = load("flows/prep.py:prep").deploy(
        name="prep-only",
        parameters={
            k: v
            for k, v in {
                "config_path": prep_config,
                "output": output,
                "dask_address": dask_address,
            }.items()
            if v is not None
        },
        description="Data prep only (what `ballast prep` runs)",
        **common,
    )
    ids["train/train-only"] = load("flows/train.py:train").deploy(
        name="train-only",
        parameters={
            k: v
            for k, v in {
                "config_path": train_config,
                "run_dir": run_dir,
                "steps": steps,
                "launch": overrides,
            }.items()
            if v is not None
        },
        concurrency_limit=1,
        description="Training under the supervisor, on an existing dataset",
        **common,
    )
    return ids
