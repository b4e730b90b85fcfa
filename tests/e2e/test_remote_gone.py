"""Object storage gone for good mid-run (issue 27, defect 2), on a real moto server that is
stopped and never comes back: training stops with one line naming the endpoint and the last
remote step once a checkpoint has waited longer than checkpoint.remote_max_lag_minutes, and
a run is never "done" while its final checkpoint is only on local disk."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import boto3
import pytest

from core.protocol import EXIT_CRASHED
from tests.support.factories import TINY, train_config
from tests.support.helpers import ROOT
from tests.support.moto import FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, start_moto, stop
from training import checkpoint as ckpt
from training.checkpoint.remote import RemoteCheckpointError, RemoteCheckpoints
from training.config import parse_train_config
from training.faults import Hooks
from training.trainer import Trainer


@pytest.fixture
def own_moto(tmp_path: Path, aws_env: None) -> Any:
    """A moto server of this test's own (the shared one must outlive it), with a bucket."""
    proc, endpoint = start_moto(tmp_path / "moto.log")
    boto3.session.Session(
        aws_access_key_id=FAKE_ACCESS_KEY_ID,
        aws_secret_access_key=FAKE_SECRET_ACCESS_KEY,
        region_name="us-east-1",
    ).client("s3", endpoint_url=endpoint).create_bucket(Bucket="ckpts")
    try:
        yield proc, endpoint
    finally:
        stop(proc)


class StopStorageAt(Hooks):
    """Stops the object store for good once checkpoint `step` is saved locally."""

    def __init__(self, step: int, proc: Any) -> None:
        self.step, self.proc = step, proc

    def after_save(self, step: int, root: Path) -> None:
        if step == self.step:
            stop(self.proc)


def test_a_store_gone_for_good_stops_training_in_one_line(train_dataset, tmp_path, own_moto, capfd):
    proc, endpoint = own_moto
    cfg = parse_train_config(
        train_config(
            train_dataset,
            tmp_path / "run",
            steps=100_000,
            eval_every=100_000,
            eval_batches=1,
            checkpoint={"every": 5, "remote": "s3://ckpts/runs", "remote_max_lag_minutes": 0.05},
            storage={"endpoint_url": endpoint, "max_attempts": 1},
        )
    )
    t0 = time.monotonic()
    code = Trainer(cfg, StopStorageAt(10, proc)).run()
    took = time.monotonic() - t0
    assert code == EXIT_CRASHED
    errors = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, errors
    # The newest remote step: whichever upload finished before the store went (none, 0, 5
    # or 10, as fast as this machine uploads), named as where a fresh machine would resume.
    named = re.search(
        rf"\(endpoint {re.escape(endpoint)}; the newest there is "
        r"(step-(\d+)|none from this run);",
        errors[0],
    )
    assert named is not None, errors[0]
    newest = int(named.group(2)) if named.group(2) else -1
    assert newest in (-1, 0, 5, 10)
    assert "remote_max_lag_minutes is 0.05" in errors[0]
    assert took < 120  # stopped by the bound, not after 100,000 steps or every retry
    # Local checkpoints are intact: the resume point is newer than anything remote.
    assert max(ckpt.steps(tmp_path / "run" / "checkpoints")) > max(newest, 10)


def test_the_final_checkpoint_must_reach_the_store(tmp_path, own_moto):
    proc, endpoint = own_moto
    from core.store import StorageOptions

    local = tmp_path / "ckpt"
    for step in (5, 10):
        ckpt.save(local, step, {"w": step})
    remote = RemoteCheckpoints(
        "s3://ckpts/run",
        StorageOptions(endpoint_url=endpoint, max_attempts=1),
        retries=0,
        log=lambda m: None,
    )
    try:
        remote.submit(local, 5)
        remote.wait()
        remote.ensure_last_uploaded()  # step 5 is there
        stop(proc)
        remote.submit(local, 10)
        remote.wait()
        with pytest.raises(RemoteCheckpointError) as e:
            remote.ensure_last_uploaded()
        assert str(e.value).startswith(
            f"the final checkpoint step-00000010 did not reach s3://ckpts/run (endpoint "
            f"{endpoint}; the newest there is step-00000005; last error: "
        )
    finally:
        remote.close(drain=False)


def test_a_checkpoint_bucket_that_does_not_exist_is_one_line_exit_1(
    train_dataset, tmp_path, moto_endpoint, aws_env
):
    import subprocess
    import sys

    import yaml

    config = tmp_path / "t.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "dataset": train_dataset,
                "run_dir": str(tmp_path / "run"),
                "steps": 2,
                "micro_batch": 4,
                "model": TINY,
                "checkpoint": {"remote": "s3://no-such-bucket-ballast/runs"},
                "storage": {"endpoint_url": moto_endpoint},
            }
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "training.train", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "error: bucket 'no-such-bucket-ballast' does not exist at "
    ), lines


def test_a_lost_ownership_record_is_written_again(tmp_path, moto_endpoint, s3_bucket, s3_client):
    """Issue 27, defect 7: after the store lost RUN.json, the next upload writes it again."""
    import json

    from core.store import StorageOptions

    local = tmp_path / "ckpt"
    for step in (5, 10):
        ckpt.save(local, step, {"w": step})
    logs: list[str] = []
    remote = RemoteCheckpoints(
        f"s3://{s3_bucket}/run",
        StorageOptions(endpoint_url=moto_endpoint),
        retries=0,
        log=logs.append,
    )
    try:
        remote.claim("run", "0123456789abcdef")
        remote.submit(local, 5)
        remote.wait()
        s3_client.delete_object(Bucket=s3_bucket, Key="run/RUN.json")
        remote.submit(local, 10)
        remote.wait()
        remote.ensure_last_uploaded()
    finally:
        remote.close()
    record = json.loads(s3_client.get_object(Bucket=s3_bucket, Key="run/RUN.json")["Body"].read())
    assert (record["run_name"], record["config_fingerprint"]) == ("run", "0123456789abcdef")
    assert any("RUN.json is gone (the store lost data?)" in m for m in logs), logs
