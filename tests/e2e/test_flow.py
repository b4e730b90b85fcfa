"""The `prep` flow against a real temporary Prefect API: same output as the CLI path,
artifacts in the UI, cached re-runs, and the Dask task runner."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.corpus import make_corpus
from tests.support.factories import prep_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    data = tmp_path_factory.mktemp("flow-data")
    return data, make_corpus(data)


def flow_config(data: Path, out: Path) -> dict:
    cfg = prep_config(data, out, shard_docs=60)
    cfg["pack"] = {"seq_len": 512}
    cfg["dataset"] = {"pack_partitions": 2, "train_shards": 2}
    # Substring dedup too: its select step draws its items from a plan the flow reads as
    # a task (Step.plan), and its cuts must be the CLI's.
    cfg["dedup"] = {"substring": {"min_tokens": 30}}
    return cfg


def output_files(root: Path) -> list[Path]:
    """Every file a run writes that must be deterministic (not timings or run ids)."""
    return sorted(
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file() and (p.suffix == ".parquet" or "dataset" in p.parts)
    )


def assert_same_bytes(a: Path, b: Path) -> None:
    files = output_files(a)
    assert files and files == output_files(b)
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_prep_flow_matches_cli_output(prefect_api, corpus, tmp_path: Path):
    from prefect.artifacts import Artifact

    from flows.prep import prep

    data, planted = corpus
    cfg = flow_config(data, tmp_path / "flow-out")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))

    state = prep(str(cfg_path), return_state=True)
    result = state.result()
    out = tmp_path / "flow-out"
    assert result["dataset"] == str(out / "dataset" / "v0001")
    report = result["report"]
    assert report["problems"] == []
    assert report["substring"]["partitions"] >= 1 and "substring" in report["stages"]
    assert report["stages"]["ingest"]["total"]["docs_in"] == (
        planted["n_web_lines"] + planted["n_code"]
    )

    ref = tmp_path / "cli-out"
    run_prep(parse_config({**cfg, "output": str(ref)}), progress=False)
    assert_same_bytes(ref, out)

    for key, needle in (
        ("prep-accounting", "near"),
        ("prep-mixture", "realised"),
        ("prep-packing", "efficiency"),
    ):
        art = Artifact.get(key)
        assert art is not None and needle in str(art.data), key

    # The flow run's log counts documents per stage, as the report does. Logs reach the API
    # from a background worker, so the last lines may land a moment after the flow returns.
    needles = {
        name: f"{name}: {st['total']['docs_in']:,} documents in, {st['total']['kept']:,} "
        f"kept, {sum(st['total']['dropped'].values()):,} dropped"
        for name, st in report["stages"].items()
    }
    deadline = time.monotonic() + 30
    while True:
        logs = "\n".join(m.message for m in asyncio.run(_logs(state.state_details.flow_run_id)))
        if all(n in logs for n in needles.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for name, needle in needles.items():
        assert needle in logs, (name, logs[-2000:])

    # A second run finds every shard done (cached or marked) and rewrites nothing.
    before = {f: (out / f).stat().st_mtime_ns for f in output_files(out)}
    again = prep(str(cfg_path))
    assert again["report"]["stages"] == report["stages"]
    assert {f: (out / f).stat().st_mtime_ns for f in output_files(out)} == before


async def _logs(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        logs: list[Any] = []
        while True:  # every page: the API answers at most its default limit per request
            page = await client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), offset=len(logs)
            )
            logs += page
            if not page:
                return logs


def test_dask_runner_gives_identical_bytes(prefect_api, corpus, tmp_path: Path):
    from flows.prep import with_runner

    data, _ = corpus
    local, dask = tmp_path / "local", tmp_path / "dask"
    for out in (local, dask):
        (tmp_path / f"{out.name}.yaml").write_text(yaml.safe_dump(flow_config(data, out)))
    with_runner("local")(str(tmp_path / "local.yaml"))
    result = with_runner("dask", workers=2)(str(tmp_path / "dask.yaml"))
    assert result["dataset"] == str(dask / "dataset" / "v0001")
    assert_same_bytes(local, dask)


def test_partitioned_flow_matches_cli_single_task(prefect_api, corpus, tmp_path: Path):
    """max_task_memory in the flow: exact select's ranges, near clustering's rounds (a
    step the driver repeats: a task per partition and round) and the mixture plan's
    steps run as the flow's tasks, and the output is the single-task CLI run's."""
    from flows.prep import prep

    data, _planted = corpus
    cfg = {**flow_config(data, tmp_path / "flow-out"), "max_task_memory": "16KB"}
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    report = prep(str(cfg_path))["report"]
    assert report["exact_ranges"]["partitions"] > 1
    assert report["near_parts"]["parts"] > 1 and report["near_round"]["round"] > 1
    ref = tmp_path / "cli-out"
    single = {k: v for k, v in cfg.items() if k != "max_task_memory"}
    run_prep(parse_config({**single, "output": str(ref)}), progress=False)
    out = tmp_path / "flow-out"
    # The duplicates' pieces on their way to exact/dups and near/dups: the partitioned
    # form's own intermediate files.
    files = [f for f in output_files(out) if "ranges" not in f.parts]
    assert files == output_files(ref)
    for f in files:
        assert (ref / f).read_bytes() == (out / f).read_bytes(), f
