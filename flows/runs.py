"""What every flow shares: flow run names that say what ran."""

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
