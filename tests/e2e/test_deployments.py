"""The train flow and the deployments against a real temporary Prefect API: the attempts
table as an artifact, and a deployment run triggered through the API (as the UI does)
that a real `prefect worker` picks up and completes with the local backend."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.factories import TINY, train_config
from tests.support.helpers import ROOT
from tests.support.tiny_run import write_configs


async def _artifact(key: str) -> list[dict]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as client:
        arts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    newest = max(arts, key=lambda a: a.created)
    data = newest.data
    if isinstance(data, str) and not data.startswith("data:"):  # tables come as JSON text
        with contextlib.suppress(ValueError):
            return json.loads(data)
    return data


def test_train_flow_reports_attempts(prefect_api, train_dataset, tmp_path):
    """A divergence beyond the trainer's budget, then a recovery: the flow completes and
    the `train-attempts` artifact has both attempts with what happened."""
    import asyncio

    from flows.train import train

    cfg = tmp_path / "t.yaml"
    cfg.write_text(
        yaml.safe_dump(
            train_config(
                train_dataset,
                tmp_path / "run",
                steps=60,
                eval_every=1000,
                checkpoint={"every": 10},
                schedule={"warmup_steps": 5},
                guards={"warmup_steps": 10, "max_rollbacks": 1},
            )
        )
    )
    state = train(
        str(cfg),
        launch={"poll_s": 0.3},
        extra_args=["--fault", "lr_blowup_persistent@30-200"],
        return_state=True,
    )
    result = state.result()
    assert result["ok"] and result["step"] == 60
    assert Path(result["loss_curve"]).is_file() and Path(result["checkpoint"]).is_dir()
    # One attempts table for the run, updated in place as attempts started and ended.
    (attempts,) = asyncio.run(_run_artifacts(state.state_details.flow_run_id, "train-attempts"))
    rows = json.loads(attempts.data)
    assert [r["ending"] for r in rows] == ["diverged (exit 3)", "done"]
    assert rows[0]["then"].startswith("rollback to ")
    assert rows[1]["resumed from"].startswith("step-") and rows[1]["step"] == 60
    assert all(r["checkpoint"] <= r["step"] for r in rows), rows
    assert "- attempt 0: diverged (exit 3): " in attempts.description
    # The progress bar, one too, says where the run ended.
    (progress,) = asyncio.run(_run_artifacts(state.state_details.flow_run_id, "train-progress"))
    assert progress.data == 100 and progress.description.startswith("**done** at step 60, loss ")
    # The loss curve is markdown: the picture and its legend, no image artifact whose page
    # prints the data URL as text.
    (curve,) = asyncio.run(_run_artifacts(state.state_details.flow_run_id, "train-loss-curve"))
    assert curve.type == "markdown" and curve.data.startswith("![loss curve](data:image/png;")
    caption = curve.data.rsplit("\n", 1)[-1]
    assert caption.startswith("blue: train loss; green: validation loss (1 eval, "), caption
    assert caption.endswith("grey: other events: resume (1), recovered (1)"), caption


def test_train_flow_from_another_directory(prefect_api, train_dataset, tmp_path, monkeypatch):
    """A relative run_dir and dataset are the flow's working directory's, for the job too
    (the local backend starts it in the repository): it trained in the repository's
    runs/... before, and the supervisor, watching its own run dir, never saw it end."""
    from flows.train import train

    shutil.copytree(train_dataset, tmp_path / "data")
    (tmp_path / "t.yaml").write_text(
        yaml.safe_dump(train_config("data", "runs/here", steps=4, eval_every=1000))
    )
    monkeypatch.chdir(tmp_path)
    result = train("t.yaml", launch={"poll_s": 0.3, "max_restarts": 0})
    assert result["ok"] and result["step"] == 4
    assert result["run_dir"] == str(tmp_path / "runs" / "here")
    assert (tmp_path / "runs" / "here" / "final.json").is_file()
    assert not (ROOT / "runs" / "here").exists()


def test_train_flow_fails_on_bad_config(prefect_api, tmp_path):
    from flows.train import train

    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": str(tmp_path), "modle": {}}))
    with pytest.raises(Exception, match="modle: unknown key"):
        train(str(cfg))
    assert not (tmp_path / "runs").exists()


def test_deployment_run_from_the_api_completes(prefect_api, tmp_path):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from flows.deployments import deploy_all

    prep, train = write_configs(tmp_path)
    ids = deploy_all(
        str(prep), str(train), pool_type="process", cron="0 3 * * *", launch={"poll_s": 0.5}
    )
    assert set(ids) == {"pipeline/scheduled", "prep/prep-only", "train/train-only"}

    async def deployment_info() -> tuple[list, str]:
        async with get_client() as client:
            dep = await client.read_deployment(ids["pipeline/scheduled"])
            pool = await client.read_work_pool(dep.work_pool_name)
            return [s.schedule.cron for s in dep.schedules], pool.type

    crons, pool_type = asyncio.run(deployment_info())
    assert crons == ["0 3 * * *"] and pool_type == "process"

    async def form() -> tuple[dict, str | None, int | None]:
        async with get_client() as client:
            dep = await client.read_deployment(ids["pipeline/scheduled"])
            return (
                dep.parameter_openapi_schema["properties"],
                dep.schedules[0].schedule.timezone,
                dep.global_concurrency_limit.limit if dep.global_concurrency_limit else None,
            )

    # The run form explains each parameter (from the flow's docstring), the schedule says
    # its timezone, and one run at a time.
    props, tz, limit = asyncio.run(form())
    described = " ".join(props["prep_config"]["description"].split())
    assert "relative to the worker's working directory" in described
    assert props["run_dir"]["description"].startswith("Where training keeps checkpoints")
    assert " ".join(props["launch"]["description"].split()).startswith(
        "Overrides of the training config's `launch:` section for this run"
    )
    # A scheduled run can put prep on a Dask cluster from the run form (issue Scale II).
    assert "Dask cluster" in " ".join(props["dask_address"]["description"].split())
    assert tz == "UTC" and limit == 1

    # What the UI's "Run" button does: a flow run from the deployment, scheduled now. Twice,
    # as a nightly schedule does: the second run must resume, not fail on the first's jobs,
    # and take in the data that arrived since (rows appended to the corpus), as dataset
    # version 2, then train on it (30 more steps, as a user asks in the run form).
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    states, outputs = [], []
    corpus = tmp_path / "topics.jsonl"
    old_rows = len(corpus.read_text().splitlines())
    for night in range(2):
        if night == 1:
            with open(corpus, "a") as f:
                for i in range(40):
                    f.write(
                        json.dumps({"text": f"news of night two, item {i}: " + "word " * 60}) + "\n"
                    )
        run = run_deployment(
            "pipeline/scheduled", timeout=0, parameters={"steps": 60} if night else None
        )
        worker = subprocess.run(
            [
                sys.executable,
                "-m",
                "prefect",
                "worker",
                "start",
                "--pool",
                "ballast-process",
                "--run-once",
                "--type",
                "process",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        outputs.append(worker.stdout[-3000:] + worker.stderr[-3000:])
        states.append(asyncio.run(_final_state(run.id)))
        assert states[-1] == "COMPLETED", f"night {night}:\n{outputs[-1]}"
        # The second night's form set steps: the name says so (issue 29, item 3).
        assert re.fullmatch(
            rf"pipeline-prep-{'60steps-' if night else ''}"
            r"\d{4}-\d\d-\d\d-\d{4}",
            asyncio.run(_flow_run_name(run.id)),
        )
        rows = asyncio.run(_artifact("train-attempts"))
        assert rows[-1]["ending"] == "done", rows
        if night == 0:
            assert rows[0]["resumed from"] == "fresh", rows
        else:  # the first night's final checkpoint, not a fresh start or a failure
            from training.checkpoint import step_name

            assert rows[0]["resumed from"] == step_name(30), rows
        if night == 0:
            assert "## Version v0001 (parent: none)" in asyncio.run(_artifact("prep-version"))
    final = json.loads((tmp_path / "run" / "final.json").read_text())
    v2 = tmp_path / "prep-out" / "dataset" / "v0002"
    assert final["step"] == 60  # the second night trained on, on version 2
    assert final["dataset"]["uri"] == str(v2)
    manifest = json.loads((v2 / "manifest.json").read_text())
    assert manifest["version"]["parent"] == 1
    assert manifest["accounting"]["ingest"]["total"]["docs_in"] == 40
    assert manifest["version"]["added"][0]["first_line"] == old_rows + 1
    assert (tmp_path / "prep-out" / "dataset" / "latest").read_text() == "v0002\n"
    added = asyncio.run(_artifact("prep-version"))
    assert "## Version v0002 (parent: v0001)" in added and "documents in: **40**" in added
    # Each night submitted jobs of its own.
    jobs = sorted(p.name for p in (tmp_path / "run" / "supervisor" / "jobs").iterdir())
    assert len(jobs) == 2 and jobs[0] != jobs[1] and all(j.endswith("-a0") for j in jobs)

    # What the UI shows: the loss curve as a picture, progress at 100%, a run summary.
    curve = asyncio.run(_artifact("train-loss-curve"))
    assert curve.startswith("![loss curve](data:image/png;base64,")
    png = curve.split(",", 1)[1].split(")", 1)[0]
    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert asyncio.run(_artifact("train-progress")) == 100
    summary = asyncio.run(_artifact("pipeline-summary"))
    assert f"`{v2}`" in summary
    assert "final validation loss: **" in summary and "(step 60)" in summary, summary


async def _run_artifacts(flow_run_id: Any, key: str) -> list[Any]:
    """Every artifact `key` of one flow run (the Artifacts page shows each as a card)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    async with get_client() as client:
        return await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )


async def _flow_run_name(run_id: Any) -> str:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return (await client.read_flow_run(run_id)).name


async def _final_state(run_id: Any) -> str:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        for _ in range(60):
            fr = await client.read_flow_run(run_id)
            if fr.state and fr.state.is_final():
                return fr.state.type.value
            await asyncio.sleep(1)
        return fr.state.type.value if fr.state else "none"


def test_prefect_yaml_matches_the_flows():
    """Every deployment in prefect.yaml names a flow that loads, passes only parameters
    that flow takes (a valid `launch:` override among them), uses one of the pools
    `ballast deploy` creates, and runs its flow-run pods in the trainer image."""
    import inspect

    from prefect.flows import load_flow_from_entrypoint

    from flows.deployments import POOLS
    from infra.k8s_manifests import IMAGE
    from infra.launch import parse_launch

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    template = json.loads((ROOT / "k8s" / "base" / "work-pool-template.json").read_text())
    names = set()
    for d in spec["deployments"]:
        flow_file = d["entrypoint"].split(":")[0]
        assert (ROOT / flow_file).is_file(), d["entrypoint"]
        f = load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
        takes = set(inspect.signature(f.fn).parameters)
        assert set(d["parameters"]) <= takes, (d["name"], set(d["parameters"]) - takes)
        assert d["work_pool"]["name"] in POOLS.values()
        # Job variables exist in the kubernetes pool's template (a typo would be ignored).
        if d["work_pool"]["name"] == POOLS["kubernetes"]:
            assert set(d["work_pool"]["job_variables"]) <= set(
                template["variables"]["properties"]
            ), d["name"]
            assert d["work_pool"]["job_variables"]["image"] == IMAGE, d["name"]
        if "launch" in d["parameters"]:
            backend = parse_launch(None, d["parameters"]["launch"]).backend
            assert backend == (
                "kubernetes" if d["work_pool"]["name"] == POOLS["kubernetes"] else "local"
            ), d["name"]
        names.add(f"{f.name}/{d['name']}")
    assert {"pipeline/scheduled", "prep/prep-only", "train/train-only"} <= names


def test_kubernetes_attempts_carry_the_flows_config(tmp_path, monkeypatch):
    """On Kubernetes the trainer pod gets the config file the flow validated, inline in its
    environment, and the trainer reads the same config from there."""
    from flows.train import CONFIG_ENV, job_spec
    from infra.k8s_manifests import KubeOptions, render
    from training.config import load_train_config

    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": "s3://b/ds", "steps": 7, "model": TINY}))
    spec = job_spec(str(cfg), "kubernetes", "run-1", ["--steps", "5"])
    (job,) = render(spec, KubeOptions(gpus_per_node=0))
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[CONFIG_ENV] == cfg.read_text()
    assert container["args"][-4:] == ["--config", f"env:{CONFIG_ENV}", "--steps", "5"]
    monkeypatch.setenv(CONFIG_ENV, env[CONFIG_ENV])
    assert load_train_config(f"env:{CONFIG_ENV}") == load_train_config(cfg)
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(Exception, match=f"environment variable {CONFIG_ENV} is not set"):
        load_train_config(f"env:{CONFIG_ENV}")
    local = job_spec(str(cfg), "local", "run-1", [])
    assert local.config == str(cfg.resolve()) and not local.env


def test_cancelling_the_flow_run_cancels_the_job(prefect_api, tmp_path):
    """Cancel a running `train` flow run through the API (the UI's Cancel): the worker stops
    the flow-run process, the flow's on_cancellation hook cancels the training job (its own
    process group, which would otherwise outlive the flow), and the run ends Cancelled."""
    import asyncio

    import psutil
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from flows.deployments import deploy_all

    prep, train = write_configs(tmp_path, steps=100_000)
    # A dataset first (the train-only deployment trains on an existing one).
    from dataprep.config import load_config
    from dataprep.pipeline import run_prep

    run_prep(load_config(str(prep)), progress=False)
    deploy_all(
        str(prep),
        str(train),
        pool_type="process",
        pool="ballast-cancel",
        cron=None,
        launch={"poll_s": 0.5},
    )
    run = run_deployment("train/train-only", timeout=0)
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "worker",
            "start",
            "--pool",
            "ballast-cancel",
            "--type",
            "process",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    handle_file = tmp_path / "run" / "supervisor" / "current-job.json"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").is_file():
            time.sleep(0.5)
        assert handle_file.is_file(), "training never started"
        handle = json.loads(handle_file.read_text())["data"]
        job = psutil.Process(int(handle["pid"]))
        assert job.is_running()

        async def cancel_and_wait() -> str:
            async with get_client() as client:
                await client.set_flow_run_state(run.id, Cancelling(), force=True)
                for _ in range(120):
                    fr = await client.read_flow_run(run.id)
                    if fr.state and fr.state.is_final():
                        return fr.state.type.value
                    await asyncio.sleep(1)
                return fr.state.type.value if fr.state else "none"

        state = asyncio.run(cancel_and_wait())
        gone = psutil.wait_procs([job], timeout=60)[0]
    finally:
        worker.terminate()
        try:
            out, _ = worker.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # the worker's own shutdown is not under test
            worker.kill()
            out, _ = worker.communicate(timeout=30)
    assert state == "CANCELLED", out[-3000:]
    assert gone, "the training job outlived its cancelled flow run:\n" + out[-3000:]
    # ... and it was the hook that stopped it (LocalBackend.cancel leaves this marker).
    assert (Path(handle["dir"]) / "cancelled").is_file()
    # The attempts table says so, with the checkpoint the run can resume from.
    rows = asyncio.run(_artifact("train-attempts"))
    assert rows[-1]["ending"] == "cancelled", rows
    from training import checkpoint as ckpt

    last = ckpt.latest_step(tmp_path / "run" / "checkpoints")
    assert rows[-1]["checkpoint"] == last and rows[-1]["step"] >= last, rows
    # The hook updated the run's one attempts table; it made no second one.
    assert len(asyncio.run(_run_artifacts(run.id, "train-attempts"))) == 1
    assert "stopped (cancelled flow run); last checkpoint: step-" in out, out[-3000:]


def test_kubernetes_pool_deployments_register(prefect_api, tmp_path):
    """`ballast deploy --pool-type kubernetes`: the pool gets k8s/'s base job template
    (GPU limit, toleration, memory /dev/shm) and the deployments run the trainer through
    the kubernetes backend, in the trainer image."""
    import asyncio

    from prefect.client.orchestration import get_client

    from flows.deployments import IMAGE, deploy_all

    prep, train = write_configs(tmp_path)
    ids = deploy_all(str(prep), str(train), pool_type="kubernetes", pool="ballast-k8s-test")

    async def read() -> tuple[Any, Any]:
        async with get_client() as client:
            pool = await client.read_work_pool("ballast-k8s-test")
            dep = await client.read_deployment(ids["pipeline/scheduled"])
            return pool, dep

    pool, dep = asyncio.run(read())
    template = json.loads((ROOT / "k8s" / "base" / "work-pool-template.json").read_text())
    assert pool.type == "kubernetes" and pool.base_job_template == template
    assert dep.parameters["launch"] == {"backend": "kubernetes"}
    assert dep.job_variables.get("image") == IMAGE
