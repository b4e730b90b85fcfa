"""Tensor- and pipeline-parallel jobs as the launcher submits them, under torchrun on CPU
(gloo). Remote (S3) checkpoints on a real moto_server: every rank's DCP shards reach the
bucket with the completion marker, and a machine whose local checkpoints are gone resumes
from the bucket and ends where an uninterrupted one-process run ends. The launched mesh
(BALLAST_MESH): a job whose config builds another mesh exits 1 in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.e2e.test_pipeline_parallel import PP_MODEL
from tests.e2e.test_tensor_parallel import MODELS
from tests.support.helpers import ROOT
from tests.support.parity import (
    assert_close,
    assert_same_weights,
    final_params,
    losses,
    one_process,
    run,
    write_config,
)
from training import checkpoint as ckpt
from training.checkpoint.remote.verify import parse_meta
from training.metrics import read

# A constant schedule: the stopped run's `steps: 10` must not change its LR.
SCHEDULE = {"kind": "constant"}
# (processes, model, parallel): one TP group, one two-stage pipeline, and FSDP2 (the
# Kubernetes overlays' mesh), whose DCP checkpoints the same refusal kept out of S3.
MESHES: dict[str, tuple[int, dict[str, Any], str | dict[str, int]]] = {
    "tp2": (2, MODELS["rope"], {"tp": 2}),
    "pp2": (2, PP_MODEL, {"pp": 2}),
    "fsdp2": (2, MODELS["rope"], "fsdp2"),
}


def remote_keys(client: Any, bucket: str, prefix: str) -> dict[str, int]:
    """{key below `prefix`: size} of every object there."""
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) :]] = o["Size"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_resumes_from_object_storage(
    dataset, tmp_path, s3_bucket, s3_client, moto_endpoint, monkeypatch, mesh
):
    """10 steps with checkpoints mirrored to S3; the local checkpoints deleted (a fresh
    machine keeping only its logs); the next 10 steps resume from the bucket's step 10 and
    give the losses and final weights of 20 uninterrupted steps in one process."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # torchrun's ranks inherit it
    nproc, model, parallel = MESHES[mesh]
    over: dict[str, Any] = {
        "model": model,
        "schedule": SCHEDULE,
        "parallel": parallel,
        "checkpoint": {"every": 10, "remote": f"s3://{s3_bucket}/runs"},
    }
    p = write_config(tmp_path, mesh, dataset, steps=10, **over)
    first = run(nproc, p)

    # Step 10 in the bucket: the DCP metadata, one shard file per rank, the trainer state,
    # then meta.json (the completion marker, uploaded last) and `latest` naming it.
    prefix = f"runs/{mesh}/"
    keys = remote_keys(s3_client, s3_bucket, prefix)
    step = ckpt.step_name(10)
    shards = {k for k in keys if k.startswith(f"{step}/") and k.endswith(".distcp")}
    assert shards == {f"{step}/__{rank}_0.distcp" for rank in range(nproc)}
    assert {f"{step}/.metadata", f"{step}/state.pt", f"{step}/meta.json"} <= set(keys)
    meta = json.loads(
        s3_client.get_object(Bucket=s3_bucket, Key=f"{prefix}{step}/meta.json")["Body"].read()
    )
    assert meta["format"] == "dcp"
    # Every file the marker lists is there at the size it records.
    assert {f"{step}/{n}": f["bytes"] for n, f in meta["files"].items()}.items() <= keys.items()
    latest = s3_client.get_object(Bucket=s3_bucket, Key=f"{prefix}latest")["Body"].read()
    assert latest.decode().strip() == step

    shutil.rmtree(first / "checkpoints")  # the machine's disk is gone; its logs are kept
    p = write_config(tmp_path, mesh, dataset, **over)
    resumed = run(nproc, p)
    recs = read(resumed / "metrics.jsonl")
    assert [r["step"] for r in recs if r.get("event") == "resume"] == [10]

    ref = one_process(write_config(tmp_path, "ref", dataset, model=model, schedule=SCHEDULE))
    worst = assert_close(losses(ref), losses(resumed))
    cfg = yaml.safe_load(p.read_text())
    w = assert_same_weights(final_params(ref, 20, cfg), final_params(resumed, 20, cfg))
    print(f"\n{mesh} via S3: max relative difference: loss {worst:.2e}, weights {w:.2e}")


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "state.pt", "model.pt"])
def test_meta_json_may_list_dcp_files(name: str) -> None:
    """DCP's index `.metadata` is a file of every sharded checkpoint: a meta.json listing it
    was refused, so no TP/PP/FSDP2 checkpoint reached the remote."""
    files = {name: {"sha256": "0" * 64, "bytes": 1}}
    assert parse_meta(json.dumps({"files": files}).encode(), "here") == files


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", "meta.json", "latest"])
def test_meta_json_names_stay_in_their_directory(name: str) -> None:
    """A remote meta.json is untrusted: a restore must not write outside the step."""
    files = {name: {"sha256": "0" * 64, "bytes": 1}}
    with pytest.raises(ckpt.CheckpointError, match="invalid file name"):
        parse_meta(json.dumps({"files": files}).encode(), "here")


def test_a_job_launched_for_another_mesh_exits_1_in_one_line(dataset, tmp_path):
    """Submitted as a 2-stage pipeline (the launcher's BALLAST_MESH), run with a config that
    now says tp 2: every rank refuses before building a mesh, and the pod entrypoint passes
    the workers' exit 1 (bad config) on, with no Python traceback from the trainer."""
    p = write_config(tmp_path, "moved", dataset, model=MODELS["rope"], parallel={"tp": 2})
    cmd = [sys.executable, "-m", "training.entrypoint", "--nproc-per-node", "2", "--"]
    cmd += ["--config", str(p)]
    env = {**os.environ, "BALLAST_MESH": "pp2-dp1x1-tp1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    line = (
        "error: BALLAST_MESH is pp2-dp1x1-tp1 (the mesh the launcher resolved), but "
        "parallel: builds pp1-dp1x1-tp2 on 2 ranks here; launch the job again from this "
        "config, or unset BALLAST_MESH"
    )
    lines = r.stderr.splitlines()
    assert lines.count(line) == 2, r.stderr[-3000:]  # once per rank
    # torchrun reports failed workers with one traceback of its own, ending in
    # ChildFailedError; any other would be a worker's.
    assert r.stderr.count("Traceback") == r.stderr.count("errors.ChildFailedError:") == 1
    assert not (tmp_path / "moved" / "checkpoints").exists()
