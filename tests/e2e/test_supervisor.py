"""The supervisor with the local backend, for real: torchrun subprocesses killed with
SIGKILL, a divergence that exhausts the trainer's rollback budget, bad input, cancellation,
and object storage that goes away mid-run."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from infra.jobs import JobHandle, JobSpec
from infra.local_backend import LocalBackend
from infra.supervisor import Outcome, RestartPolicy, parse_events, recovery_args, supervise
from tests.support.factories import merge, train_config
from tests.support.helpers import ROOT, watch_latest
from tests.support.net import TcpProxy
from training import checkpoint as ckpt
from training.metrics import read

FAST = RestartPolicy(max_restarts=5, backoff_s=0.0, poll_s=0.2)


def write_cfg(path: Path, dataset: str, run_dir: Path, **over) -> Path:
    c = train_config(
        dataset,
        run_dir,
        steps=40,
        eval_every=1000,
        log_every=1,
        checkpoint={"every": 10},
        schedule={"warmup_steps": 5},
    )
    path.write_text(yaml.safe_dump(merge(c, **over)))
    return path


def run(
    tmp: Path, cfg: Path, name: str, args: tuple[str, ...] = (), policy: RestartPolicy = FAST, **kw
) -> Outcome:
    backend = LocalBackend(tmp / "jobs", cwd=ROOT, cancel_grace_s=5)
    lines: list[str] = []
    out = supervise(
        backend,
        JobSpec(name, str(cfg), args),
        policy,
        log=lines.append,
        handle_file=tmp / "handle.json",
        **kw,
    )
    (tmp / f"{name}.supervisor.log").write_text("\n".join(lines))
    return out


def last_step(run_dir: Path) -> int:
    p = run_dir / "metrics.jsonl"
    try:
        recs = [r for r in read(p) if r.get("kind") == "train"]
    except (OSError, json.JSONDecodeError):
        return -1
    return recs[-1]["step"] if recs else -1


def worker_pids(handle_file: Path) -> list[int]:
    try:
        pid = int(json.loads(handle_file.read_text())["data"]["pid"])
        procs = psutil.Process(pid).children(recursive=True)
    except (OSError, ValueError, KeyError, psutil.Error):
        return []
    return [p.pid for p in procs if "training.train" in " ".join(p.cmdline())]


def test_parse_events_and_recovery_args():
    text = (
        'noise\n[rank0] BALLAST_EVENT {"event": "resume", "step": 20}\n'
        'BALLAST_EVENT {"event": "diverged", "step": 57, "start_step": 41, '
        '"rollback_to": 40, "samples_seen": 228}\nBALLAST_EVENT {"event": "cut'
    )
    ev = parse_events(text)
    assert [e["event"] for e in ev] == ["resume", "diverged"]
    # Back to the checkpoint before the divergence's first step (41): step-40 or older.
    assert recovery_args(ev[1], 0.5) == [
        "--recover",
        "--lr-scale=0.5",
        "--rollback-to=40",
        "--skip-to-sample=228",
    ]
    # A trainer from before `rollback_to` numbered steps from 0: its start_step was the
    # checkpoint's number.
    old = {"event": "diverged", "step": 56, "start_step": 40, "samples_seen": 228}
    assert "--rollback-to=40" in recovery_args(old, 0.5)
    assert recovery_args(None, 0.25) == ["--recover", "--lr-scale=0.25"]
    with pytest.raises(ValueError, match="recovery_lr_scale"):
        RestartPolicy(recovery_lr_scale=0)


def test_sigkill_three_times_then_same_weights(train_dataset, tmp_path):
    """The training worker is SIGKILLed at three random steps; the supervisor restarts it
    each time and the run ends with the weights of a run that never stopped."""
    steps = 150
    ref = run(
        tmp_path,
        write_cfg(
            tmp_path / "ref.yaml",
            train_dataset,
            tmp_path / "ref",
            steps=steps,
            checkpoint={"every": 13},
        ),
        "ref",
    )
    assert ref.ok and len(ref.attempts) == 1
    assert ref.attempts[0].resumed_from == "fresh" and ref.attempts[0].step_reached == steps

    run_dir = tmp_path / "killed"
    cfg = write_cfg(
        tmp_path / "killed.yaml", train_dataset, run_dir, steps=steps, checkpoint={"every": 13}
    )
    rng = random.Random(7)
    kills: list[tuple[int, int]] = []
    done = threading.Event()

    def killer() -> None:
        at = 0
        for _ in range(3):
            # A random step, some way past the last kill (and past the step the restarted
            # worker resumed from): each kill loses real progress.
            target = at + rng.randint(5, 35)
            killed: set[int] = {p for _, p in kills}
            while not done.is_set():
                # The step first: listing the process tree every poll took a core's worth
                # of CPU from the training it waits for.
                at = last_step(run_dir)
                pids = (
                    []
                    if at < target
                    else [p for p in worker_pids(tmp_path / "handle.json") if p not in killed]
                )
                if pids:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    time.sleep(0.5)  # let the supervisor see the attempt end
                    # The step it was killed at, read after the kill: the worker can go on
                    # (and checkpoint) between the read above and the signal (CI saw a
                    # checkpoint at 52 after a read of 51).
                    kills.append((last_step(run_dir), pids[0]))
                    break
                time.sleep(0.02)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        out = run(tmp_path, cfg, "killed")
    finally:
        done.set()
    assert len(kills) == 3, f"only {kills} kills landed (the run outpaced the killer)"
    assert out.ok, out.message
    endings = [a.ending for a in out.attempts]
    assert endings == ["crashed", "crashed", "crashed", "done"], endings
    # Each restart resumed from a checkpoint at or before the step it was killed at.
    for a, (at, _pid) in zip(out.attempts[1:], kills, strict=True):
        assert a.resumed_from is not None and a.resumed_from.startswith("step-")
        assert int(a.resumed_from.removeprefix("step-")) <= at
    a_w = ckpt.load(tmp_path / "ref" / "checkpoints", steps)["model"]
    b_w = ckpt.load(run_dir / "checkpoints", steps)["model"]
    assert a_w.keys() == b_w.keys()
    for k in a_w:
        assert torch.equal(a_w[k], b_w[k]), k


def test_divergence_is_recovered_with_rollback(train_dataset, tmp_path):
    """A learning-rate blow-up that outlasts the trainer's rollback budget (exit 3): the
    supervisor restarts with rollback settings and the run completes; the attempts say so."""
    run_dir = tmp_path / "run"
    cfg = write_cfg(
        tmp_path / "c.yaml",
        train_dataset,
        run_dir,
        steps=70,
        guards={"warmup_steps": 10, "max_rollbacks": 1},
    )
    out = run(tmp_path, cfg, "div", args=("--fault", "lr_blowup_persistent@30-200"))
    assert out.ok, out.message
    a0, a1 = out.attempts
    assert (a0.ending, a0.exit_code, a1.ending) == ("diverged", 3, "done")
    assert a0.next_action.startswith("restart with rollback")
    assert "--recover" in a1.args
    # The trainer's diverged event: back before the divergence's first step.
    (div,) = [
        e
        for log in (tmp_path / "jobs").glob("*/log.txt")
        for e in parse_events(log.read_text())
        if e["event"] == "diverged"
    ]
    assert div["rollback_to"] == div["start_step"] - 1 and div["start_step"] <= div["step"]
    assert f"--rollback-to={div['rollback_to']}" in a1.args
    assert a1.recovered is not None and a1.recovered["to_step"] <= 30
    assert a1.recovered["lr_scale"] == pytest.approx(0.5)
    final = json.loads((run_dir / "final.json").read_text())
    assert final["step"] == 70
    assert [r["reason"] for r in final["rollbacks"]][-1] == "supervisor_recovery"
    # The abandoned trajectory is gone: no checkpoint from before the recovery is newer
    # than the recovery target unless it was written after it.
    assert not (run_dir / "DIVERGED").exists()


def test_divergence_budget_and_bad_input_stop(train_dataset, tmp_path):
    cfg = write_cfg(
        tmp_path / "c.yaml",
        train_dataset,
        tmp_path / "run",
        steps=70,
        guards={"warmup_steps": 10, "max_rollbacks": 0},
    )
    policy = RestartPolicy(max_recoveries=0, backoff_s=0, poll_s=0.2)
    out = run(tmp_path, cfg, "div0", args=("--fault", "lr_blowup_persistent@30-200"), policy=policy)
    assert not out.ok and out.ending == "diverged" and len(out.attempts) == 1

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"dataset": train_dataset, "modle": {}}))
    out = run(tmp_path, bad, "bad")
    assert (out.ok, out.ending, len(out.attempts)) == (False, "bad_input", 1)
    assert out.attempts[0].exit_code == 1


def test_crash_budget_is_bounded(train_dataset, tmp_path):
    """A worker killed at the same step every time: restarts stop at the budget."""
    cfg = write_cfg(tmp_path / "c.yaml", train_dataset, tmp_path / "run", steps=40)
    policy = RestartPolicy(max_restarts=2, backoff_s=0, poll_s=0.2)
    out = run(tmp_path, cfg, "crash", args=("--fault", "kill@25"), policy=policy)
    assert not out.ok and out.ending == "crashed"
    assert [a.ending for a in out.attempts] == ["crashed"] * 3
    assert out.attempts[0].exit_code == 2  # the entrypoint's "crashed"
    assert out.attempts[-1].next_action == "stop: budget exhausted"


def test_cancel_stops_the_job(train_dataset, tmp_path):
    cfg = write_cfg(tmp_path / "c.yaml", train_dataset, tmp_path / "run", steps=100_000)
    run_dir = tmp_path / "run"
    out = run(tmp_path, cfg, "cancel", should_stop=lambda: last_step(run_dir) >= 5)
    assert (out.ok, out.ending) == (False, "cancelled")
    handle = JobHandle.from_json(json.loads((tmp_path / "handle.json").read_text()))
    pid = int(handle.data["pid"])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert worker_pids(tmp_path / "handle.json") == []


def test_a_job_left_running_is_adopted_or_stopped(train_dataset, tmp_path):
    """A flow run killed mid-training leaves its job running. The next flow run adopts it
    when it runs the same training (watching it to the end instead of starting a second
    trainer in the run dir), and stops it when it runs other settings."""
    from flows.train import HANDLE, _leftover

    run_dir = tmp_path / "run"
    cfg = write_cfg(tmp_path / "c.yaml", train_dataset, run_dir, steps=60)
    backend = LocalBackend(run_dir / "supervisor" / "jobs", cwd=ROOT, cancel_grace_s=5)
    handle_file = run_dir / HANDLE
    lines: list[str] = []

    def leave_running(name: str, args: tuple[str, ...] = ()) -> JobHandle:
        spec = JobSpec(name, str(cfg), args)
        handle = backend.submit(spec)
        handle_file.parent.mkdir(parents=True, exist_ok=True)
        handle_file.write_text(
            json.dumps({**handle.to_json(), "config": spec.config, "args": list(args)})
        )
        return handle

    started: list[JobHandle] = []
    try:
        # Settings differ (another --steps): the old job is stopped, nothing adopted.
        old = leave_running("earlier", ("--steps", "100000"))
        started.append(old)
        spec = JobSpec("tonight", str(cfg), ())
        assert _leftover(backend, run_dir, spec, lines.append) is None
        assert backend.status(old).ending == "cancelled"
        assert any("stopping job earlier-a0" in ln for ln in lines), lines

        # Same settings: adopted, watched to its end, and the run finishes with one trainer.
        old = leave_running("earlier2")
        started.append(old)
        adopt = _leftover(backend, run_dir, spec, lines.append)
        assert adopt is not None and adopt.name == old.name
        out = supervise(backend, spec, FAST, log=lines.append, handle_file=handle_file, adopt=adopt)
        assert out.ok and len(out.attempts) == 1, lines
        a = out.attempts[0]
        assert a.adopted and a.job == "earlier2-a0" and a.step_reached == 60
        assert a.row()["resumed from"].startswith("adopted: ")
        # Progress reached the supervisor's log: step, loss, throughput, ETA.
        assert any(
            re.search(r"step 60/60, loss \d+\.\d{4}, [\d,]+ tokens/s, ETA 0m00s", ln)
            for ln in lines
        ), lines
        assert a.progress is not None and a.progress["step"] == 60
        assert a.row()["last checkpoint"] == "step 60" and a.row()["loss"] == a.progress["loss"]
        assert not (run_dir / "supervisor" / "jobs" / "tonight-a0").exists()
        # Finished now: the next run has nothing to adopt.
        assert _leftover(backend, run_dir, spec, lines.append) is None
    finally:  # a failed check must not leave trainers running
        for h in started:
            backend.cancel(h)


def test_storage_outage_under_supervision(
    train_dataset, tmp_path, s3_bucket, s3_client, moto_endpoint, monkeypatch
):
    """The S3 server is unreachable for a while during a supervised run: training goes on,
    checkpoints catch up, and `latest` never names a partial checkpoint."""
    proxy = TcpProxy("127.0.0.1", int(moto_endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    prefix = "runs/supervised"
    cfg = write_cfg(
        tmp_path / "c.yaml",
        train_dataset,
        tmp_path / "run",
        steps=250,
        storage={"max_attempts": 2},
        checkpoint={
            "every": 10,
            "keep_last": 2,
            "remote": f"s3://{s3_bucket}/runs",
            "run_name": "supervised",
            "remote_max_failures": 100,
        },
    )
    seen: list[str] = []
    stop = threading.Event()

    def outage() -> None:
        while not stop.is_set() and last_step(tmp_path / "run") < 20:
            time.sleep(0.02)
        proxy.pause()
        time.sleep(3.0)
        proxy.resume()

    watch_latest(s3_client, s3_bucket, prefix, seen, stop)  # reads moto, not the proxy
    threading.Thread(target=outage, daemon=True).start()
    try:
        out = run(tmp_path, cfg, "outage")
    finally:
        stop.set()
        proxy.close()
    assert out.ok and len(out.attempts) == 1, out.message
    log = (tmp_path / "jobs" / "outage-a0" / "log.txt").read_text()
    assert "retrying" in log or "FAILED" in log.upper(), "the outage hit no upload"
    assert not [s for s in seen if s.startswith("PARTIAL")], seen
    body = s3_client.get_object(Bucket=s3_bucket, Key=f"{prefix}/latest")["Body"].read()
    assert body.decode().strip() == ckpt.step_name(250)
