"""What every flow shares: flow run names that say what ran, and whether another flow run
is still alive."""

from __future__ import annotations

import time
from pathlib import Path


def run_name() -> str:
    """`<flow>-<config name>-<UTC date and time>`, e.g. `train-train-demo-2026-11-23-0300`,
    instead of Prefect's random two words: the runs list then says what each run did."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    config = params.get("config_path") or params.get("prep_config") or "run"
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    return f"{flow_run.flow_name or 'run'}-{Path(str(config)).stem}-{stamp}"


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
