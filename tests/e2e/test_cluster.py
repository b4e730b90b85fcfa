"""Prep on a real Dask cluster (issue Scale II): a `dask scheduler` and `dask worker`
processes started here over TCP on 127.0.0.1, each worker with its own scratch directory,
inputs and output on a real S3 server (moto_server). The cluster's output is byte for byte
the local process pool's; a worker SIGKILLed in the middle of near dedup costs nothing; an
unreachable scheduler, or workers that cannot read the run's data, stop the run with one
line before any work."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from dataprep.cluster import WORKER_FAILPOINT_ENV
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.corpus import make_corpus
from tests.support.factories import prep_config
from tests.support.moto import FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, free_port

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 90.0
# Keys whose content differs between two runs by design: the run's identity (run id and
# output URI in the claim), when it finished, and timings.
VOLATILE = ("_run.json", "v0001/report.json", "_versions/v0001.json")


@dataclass
class Cluster:
    scheduler_file: Path
    scheduler: subprocess.Popen[bytes]
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    address: str = ""

    def stop(self) -> None:
        for p in [*self.workers, self.scheduler]:
            if p.poll() is None:
                p.terminate()
        for p in [*self.workers, self.scheduler]:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def start_cluster(
    root: Path,
    env: dict[str, str],
    n_workers: int = 2,
    worker_env: dict[int, dict[str, str]] | None = None,
) -> Cluster:
    """A scheduler and `n_workers` single-threaded worker processes (no nanny, so a killed
    worker stays dead), each with scratch of its own (TMPDIR and Dask's local directory);
    `worker_env[i]` adds to (or, with "" values, removes from) worker i's environment."""
    from distributed import Client

    root.mkdir(parents=True, exist_ok=True)
    sched_file = root / "scheduler.json"
    log = (root / "scheduler.log").open("wb")
    cluster = Cluster(
        sched_file,
        subprocess.Popen(
            [
                str(BIN / "dask"),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                str(sched_file),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        ),
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not cluster.address:
            assert cluster.scheduler.poll() is None, (root / "scheduler.log").read_text()
            assert time.monotonic() < deadline, "the scheduler did not start"
            with contextlib.suppress(OSError, ValueError):  # not yet (fully) written
                cluster.address = str(json.loads(sched_file.read_text())["address"])
            time.sleep(0.1)
        for i in range(n_workers):
            scratch = root / f"worker{i}"
            scratch.mkdir()
            wenv = {**env, "TMPDIR": str(scratch)}
            for k, v in (worker_env or {}).get(i, {}).items():
                if v:
                    wenv[k] = v
                else:
                    wenv.pop(k, None)
            cluster.workers.append(
                subprocess.Popen(
                    [
                        str(BIN / "dask"),
                        "worker",
                        "--scheduler-file",
                        str(sched_file),
                        "--host",
                        "127.0.0.1",
                        "--nthreads",
                        "1",
                        "--no-nanny",
                        "--no-dashboard",
                        "--name",
                        f"worker{i}",
                        "--local-directory",
                        str(scratch),
                    ],
                    env=wenv,
                    cwd=scratch,
                    stdout=(root / f"worker{i}.log").open("wb"),
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        with Client(cluster.address, timeout="30s", set_as_default=False) as client:
            client.wait_for_workers(n_workers, timeout=START_TIMEOUT_S)
        return cluster
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="module")
def s3_world(
    moto_endpoint: str, s3_client: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """A bucket holding the test corpus under in/, the environment that reaches it, and a
    reference run of the local process pool on it (output s3://BUCKET/local)."""
    bucket = f"cluster-{os.getpid()}"
    s3_client.create_bucket(Bucket=bucket)
    data = tmp_path_factory.mktemp("cluster-data")
    planted = make_corpus(data)
    for f in sorted(p for p in data.rglob("*") if p.is_file()):
        s3_client.upload_file(str(f), bucket, f"in/{f.relative_to(data).as_posix()}")
    env = {
        "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_ACCESS_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
        "BALLAST_DASK_CONNECT_TIMEOUT": "3",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "DASK_SCHEDULER_ADDRESS"):
            mp.delenv(k, raising=False)
        world = {"bucket": bucket, "planted": planted, "env": {**os.environ}, "client": s3_client}
        run_prep(parse_config(s3_config(bucket, "local")), progress=False)
        yield world


def s3_config(bucket: str, out: str) -> dict[str, Any]:
    cfg = prep_config(Path("unused"), Path("unused"), shard_docs=40)
    cfg["output"] = f"s3://{bucket}/{out}"
    cfg["sources"][0]["paths"] = [f"s3://{bucket}/in/web/*.jsonl.gz"]
    cfg["sources"][1]["paths"] = [f"s3://{bucket}/in/code/"]
    cfg["pack"] = {"seq_len": 256}
    cfg["dataset"] = {"pack_partitions": 2, "train_shards": 2}
    return cfg


def objects(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/"
    ):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) + 1 :]] = client.get_object(Bucket=bucket, Key=o["Key"])[
                "Body"
            ].read()
    return out


# What only a run with max_task_memory writes (exact select's and the mixture plan's
# partitioned files), or only one without (the single select's marker): left out where
# the two are compared.
ONE_FORM_ONLY = (
    "v0001/exact/ranges/",
    "exact/split/",
    "v0001/near/cc/",
    "v0001/near/ranges/",
    "v0001/exact/dups.json",
    *(
        f"v0001/mixture/{k}"
        for k in ("keys/", "hist/", "boundary/", "cut.json", "taken.npy", "resolved.json")
    ),
)


def assert_same_output(world: dict[str, Any], out: str, partitioned: bool = False) -> None:
    """Every object of the cluster run equals the reference run's, byte for byte; the
    three records of the run itself agree apart from ids, times and the output's name.
    `partitioned`: the run split exact select by hash range (the reference did not)."""
    ref = objects(world["client"], world["bucket"], "local")
    got = objects(world["client"], world["bucket"], out)
    if partitioned:
        assert any(k.startswith(ONE_FORM_ONLY[0]) for k in got)
        assert "v0001/mixture/cut.json" in got
        ref, got = (
            {k: v for k, v in d.items() if not k.startswith(ONE_FORM_ONLY)} for d in (ref, got)
        )
    assert sorted(got) == sorted(ref)
    assert any(k.startswith("dataset/") for k in got) and any("near" in k for k in got)
    for key in ref:
        if key not in VOLATILE:
            assert got[key] == ref[key], key
    rep, ref_rep = json.loads(got["v0001/report.json"]), json.loads(ref["v0001/report.json"])
    for r in (rep, ref_rep):
        for k in ("stage_seconds", "step_seconds", "step_epoch_seconds"):
            r.pop(k, None)
        r["dataset"].pop("uri")
    if partitioned:
        assert rep.pop("exact_ranges")["partitions"] > 1
        assert rep.pop("near_parts")["parts"] > 1  # components over several partitions
        for k in ("near_replay", "near_round"):
            rep.pop(k)
    assert rep == ref_rep
    assert rep["problems"] == []
    planted = world["planted"]
    assert rep["stages"]["ingest"]["total"]["docs_in"] == (
        planted["n_web_lines"] + planted["n_code"]
    )


def ballast_prep(
    world: dict[str, Any],
    tmp_path: Path,
    out: str,
    address: str,
    timeout: float = 300,
    extra: dict[str, Any] | None = None,
) -> subprocess.CompletedProcess[str]:
    cfg_path = tmp_path / f"{out}.yaml"
    cfg_path.write_text(yaml.safe_dump({**s3_config(world["bucket"], out), **(extra or {})}))
    return subprocess.run(
        [str(BIN / "ballast"), "prep", str(cfg_path), "--dask", address, "--no-progress"],
        env=world["env"],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def test_cluster_output_is_byte_identical_to_the_local_pool(s3_world, tmp_path):
    cluster = start_cluster(tmp_path / "cluster", s3_world["env"])
    try:
        r = ballast_prep(s3_world, tmp_path, "cluster", cluster.address)
    finally:
        cluster.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"prep on the Dask cluster at {cluster.address} (2 workers)" in r.stderr
    assert_same_output(s3_world, "cluster")
    # Scratch is the workers' own; nothing of the run was left on their local disks.
    for i in range(2):
        left = [
            p
            for p in (tmp_path / "cluster" / f"worker{i}").rglob("*")
            if p.is_file() and "ballast" in p.name
        ]
        assert left == []


def test_partitioned_exact_select_on_the_cluster_writes_the_local_bytes(s3_world, tmp_path):
    """max_task_memory small enough for several hash ranges: exact select's ranges, the
    kept ids and the per-shard lists, and the mixture plan's steps, run as cluster tasks,
    and the output is the local pool's single-task run's, byte for byte."""
    cluster = start_cluster(tmp_path / "cluster", s3_world["env"])
    try:
        r = ballast_prep(
            s3_world, tmp_path, "parted", cluster.address, extra={"max_task_memory": "4KB"}
        )
    finally:
        cluster.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_output(s3_world, "parted", partitioned=True)


def test_a_worker_killed_in_near_dedup_costs_nothing(s3_world, tmp_path):
    """Worker 0 SIGKILLs itself as it starts a near-dedup bucketing task; the scheduler
    reruns its task on worker 1, and the output is still the reference's."""
    cluster = start_cluster(
        tmp_path / "cluster",
        s3_world["env"],
        worker_env={0: {WORKER_FAILPOINT_ENV: "near: buckets"}},
    )
    try:
        r = ballast_prep(s3_world, tmp_path, "killed", cluster.address)
        killed = cluster.workers[0].poll()
        alive = cluster.workers[1].poll()
    finally:
        cluster.stop()
    assert killed == -signal.SIGKILL, "worker 0 should have died in near: buckets"
    assert alive is None
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_output(s3_world, "killed")


def test_workers_dying_in_a_run_once_step_is_one_line_naming_it(s3_world, tmp_path):
    """Workers that die in exact select (as one killed at its memory limit does), on a
    scheduler that allows no failure: Dask gives up on the task (KilledWorker) and the run
    stops with one line that names the step and says what splits it, exit 1."""
    env = {**s3_world["env"], "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
    dies = {WORKER_FAILPOINT_ENV: "exact: select"}  # on both: the task may go to either
    cluster = start_cluster(tmp_path / "cluster", env, worker_env={0: dies, 1: dies})
    try:
        r = ballast_prep(s3_world, tmp_path, "dying", cluster.address)
    finally:
        cluster.stop()
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("error: Dask workers died running step 'exact: select'")
    assert "set max_task_memory" in errors[0]


def test_unreachable_scheduler_is_one_line_before_any_work(s3_world, tmp_path):
    port = free_port()  # nothing listens there
    r = ballast_prep(s3_world, tmp_path, "unreached", f"tcp://127.0.0.1:{port}", timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: cannot reach the Dask scheduler at tcp://127.0.0.1:{port}")
    assert "Traceback" not in r.stderr
    assert objects(s3_world["client"], s3_world["bucket"], "unreached") == {}


def test_workers_that_cannot_read_the_data_stop_the_run(s3_world, tmp_path):
    """A worker without the S3 credentials the submitting machine has: the run stops
    after claiming the output, naming the worker and what it cannot read."""
    cluster = start_cluster(
        tmp_path / "cluster",
        s3_world["env"],
        n_workers=1,
        worker_env={
            0: {
                "AWS_ACCESS_KEY_ID": "",
                "AWS_SECRET_ACCESS_KEY": "",
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                "AWS_CONFIG_FILE": str(tmp_path / "none"),
            }
        },
    )
    try:
        r = ballast_prep(s3_world, tmp_path, "blind", cluster.address, timeout=120)
    finally:
        cluster.stop()
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: Dask worker tcp://127.0.0.1:")
    assert f"cannot read s3://{s3_world['bucket']}/blind (StorageError: " in err
    assert "credentials" in err and "(and 2 more); 1 of 1 workers" in err
    # Nothing but the claim: no shard was written.
    assert set(objects(s3_world["client"], s3_world["bucket"], "blind")) <= {
        "_run.json",
        "_inputs.json",
        "_versions/v0001.plan.json",
    }


def test_prep_flow_on_the_cluster(s3_world, prefect_api, tmp_path):
    """The prep flow's `dask_address` parameter (what a deployment run from the UI sets):
    its steps run as tasks on the cluster's workers, and the output is the reference's."""
    from prefect.client.orchestration import get_client

    from flows.prep import prep

    env = {
        **s3_world["env"],
        "PREFECT_API_URL": prefect_api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    cluster = start_cluster(
        tmp_path / "cluster",
        env,
        worker_env={
            i: {"PREFECT_HOME": str(tmp_path / "cluster" / f"worker{i}" / "prefect")}
            for i in range(2)
        },
    )
    cfg_path = tmp_path / "flow.yaml"
    cfg_path.write_text(yaml.safe_dump(s3_config(s3_world["bucket"], "flow")))
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in s3_world["env"].items():
                if k.startswith(("AWS_", "BALLAST_")):
                    mp.setenv(k, v)
            state = prep(str(cfg_path), dask_address=cluster.address, return_state=True)
        result = state.result()
    finally:
        cluster.stop()
    assert result["report"]["problems"] == []
    assert_same_output(s3_world, "flow")

    parent = state.state_details.flow_run_id

    async def subflow_tasks() -> tuple[list[Any], list[str]]:
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterId,
            FlowRunFilterParentFlowRunId,
        )

        async with get_client() as client:
            subs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])
                )
            )
            tasks = (
                await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[s.id for s in subs]))
                )
                if subs
                else []
            )
            return subs, [t.name for t in tasks]

    subs, names = asyncio.run(subflow_tasks())
    assert [s.state_type.value for s in subs] == ["COMPLETED"]
    assert any(n.startswith("near-buckets") for n in names), names
