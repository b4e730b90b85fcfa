"""What every flow shares: flow run names that say what ran, and whether another flow run
is still alive."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def run_name() -> str:
    """`<flow>-<config name>[-<run dir>][-<N>steps]-<UTC date and time>`, e.g.
    `pipeline-demo-scheduled-60steps-2026-11-23-0300`, instead of Prefect's random two
    words: the runs list then tells runs apart by what they did and where they trained (the
    run dir and steps only when the run's parameters set them)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    return name_for(
        flow_run.flow_name or "run", params, time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    )


def name_for(flow: str, params: dict[str, Any], stamp: str) -> str:
    config = params.get("config_path") or params.get("prep_config") or "run"
    parts = [flow, Path(str(config)).stem]
    if params.get("run_dir"):
        parts.append(Path(str(params["run_dir"])).name)
    if params.get("steps"):
        parts.append(f"{params['steps']}steps")
    return "-".join([*parts, stamp])


def flow_run_alive(flow_run_id: str) -> bool:
    """Whether flow run `flow_run_id` is another run that is not over yet (on the Prefect
    API this process talks to): the owner of a job or trial found in a run dir."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run_id == flow_run.get_id():
        return False  # this very run, retried: its earlier try is gone
    try:
        with get_client(sync_client=True) as client:
            fr = client.read_flow_run(flow_run_id)
    except Exception:
        return False  # unknown to this API (another server, deleted): not alive here
    return fr.state is not None and not fr.state.is_final()
