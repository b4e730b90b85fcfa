"""The trainer end to end on a tiny real dataset: every option trains, the loss falls,
guards act on injected faults, and a run killed with SIGKILL resumes bitwise-exactly."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from core.protocol import EXIT_DIVERGED, EXIT_ERROR
from tests.support.factories import train_config
from tests.support.helpers import ROOT, watch_latest
from tests.support.net import TcpProxy
from training import checkpoint as ckpt
from training.config import parse_train_config
from training.faults import Faults
from training.metrics import read
from training.train import Trainer, main


def train(dataset: str, run_dir: Path, faults: Faults | None = None, **over) -> int:
    return Trainer(
        parse_train_config(train_config(dataset, run_dir, log_every=1, **over)), faults
    ).run()


@pytest.mark.parametrize(
    "over",
    [
        {"optim": {"name": "adamw"}},
        {"optim": {"name": "lion", "lr": 3e-4}},
        {"optim": {"name": "adafactor", "lr": 1e-2}},
        {"optim": {"name": "muon"}},
        {"precision": {"dtype": "bf16", "z_loss": 1e-4}},
        {"precision": {"dtype": "fp16"}},
        {"schedule": {"kind": "wsd"}},
        {"schedule": {"kind": "linear"}},
        {
            "schedule": {
                "kind": "constant",
                "batch_warmup_start_accum": 1,
                "batch_warmup_steps": 4,
            },
            "accum_steps": 3,
        },
        {"model": {"norm": "layernorm", "position": "learned", "mlp": "gelu", "bias": True}},
        {
            "model": {
                "parallel_block": True,
                "qk_norm": True,
                "tie_embeddings": False,
                "rotary_pct": 0.5,
            }
        },
        {"model": {"activation_checkpointing": True, "mup_base_d_model": 16}},
    ],
    ids=lambda o: (
        "-".join(f"{k}" for k in o)
        + "-"
        + "-".join(str(v) for d in o.values() if isinstance(d, dict) for v in d.values())[:40]
    ),
)
def test_every_option_trains(dataset, tmp_path, over):
    assert train(dataset, tmp_path, **over) == 0
    recs = read(tmp_path / "metrics.jsonl")
    losses = [r["loss"] for r in recs if r.get("kind") == "train"]
    assert len(losses) == 6 and all(l == l and l < 20 for l in losses)  # noqa: E741
    assert any(r.get("kind") == "eval" for r in recs)
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["environment"]["torch"] == torch.__version__
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_loss_falls(dataset, tmp_path):
    assert train(dataset, tmp_path, steps=80, optim={"lr": 3e-3}, eval_every=80) == 0
    recs = read(tmp_path / "metrics.jsonl")
    losses = [r["loss"] for r in recs if r.get("kind") == "train"]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0
    first_val = [r["val_loss"] for r in recs if r.get("kind") == "eval"][-1]
    assert first_val < 3.5  # bytes: ln(258) = 5.55 at random init


def skips_counted_at(recs: list[dict]) -> list[int]:
    """The steps whose train record counts one more skipped step than the one before."""
    trains = [r for r in recs if r.get("kind") == "train"]
    return [
        r["step"]
        for p, r in zip([{"skipped": 0}, *trains[:-1]], trains, strict=True)
        if r["skipped"] > p["skipped"]
    ]


def test_nan_batches_are_skipped(dataset, tmp_path):
    # Faults count the steps done before the faulty one (the hooks' position): nan_at 2
    # and 4 hit the 3rd and 5th optimizer steps, steps 3 and 5.
    assert train(dataset, tmp_path, Faults(nan_at={2, 4})) == 0
    recs = read(tmp_path / "metrics.jsonl")
    events = [r for r in recs if r.get("kind") == "event"]
    assert [e["step"] for e in events if e.get("reason") == "non_finite_loss"] == [3, 5]
    # One numbering: a skip event names the step whose own train record counts the skip.
    assert skips_counted_at(recs) == [3, 5]
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["skipped_non_finite"] == 2
    state = ckpt.load(tmp_path / "checkpoints", 6)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_spike_is_skipped_with_sample_ids(dataset, tmp_path):
    code = train(
        dataset,
        tmp_path,
        Faults(spike_at={30}),
        steps=40,
        guards={"warmup_steps": 10},
        checkpoint={"every": 20},
    )
    assert code == 0
    recs = read(tmp_path / "metrics.jsonl")
    events = [r for r in recs if r.get("kind") == "event"]
    spikes = [e for e in events if e.get("reason") in ("loss_spike", "grad_spike")]
    # spike_at 30: after 30 steps, i.e. the 31st step, whose train record counts it.
    assert [e["step"] for e in spikes] == [31] == skips_counted_at(recs)
    assert "step 31: loss spike" in spikes[0]["detail"]
    assert len(spikes[0]["sample_ids"]) == 4  # the micro-batch's rows


def test_lr_blowup_rolls_back_and_completes(dataset, tmp_path):
    code = train(
        dataset,
        tmp_path,
        Faults(lr_blowup=(30, 34)),
        steps=50,
        guards={"warmup_steps": 10, "max_rollbacks": 2, "rollback_lr_scale": 0.5},
        checkpoint={"every": 10},
    )
    assert code == 0
    recs = read(tmp_path / "metrics.jsonl")
    rollbacks = [r for r in recs if r.get("event") == "rollback"]
    assert rollbacks and rollbacks[0]["to_step"] <= 30
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["step"] == 50 and final["rollbacks"]
    train_recs = [r for r in recs if r.get("kind") == "train"]
    before = next(r["loss"] for r in train_recs if r["step"] == 30)  # before the blow-up
    worst = max(r["loss"] for r in train_recs)
    assert train_recs[-1]["loss"] < before < worst - 0.5  # recovered and kept learning


def test_rollback_budget_exhausted_exits_3(dataset, tmp_path):
    code = train(
        dataset,
        tmp_path,
        Faults(lr_blowup=(30, 200), persist=True),
        steps=120,
        guards={"warmup_steps": 10, "max_rollbacks": 1},
        checkpoint={"every": 10},
    )
    assert code == EXIT_DIVERGED


def test_bad_config_and_tampered_dataset_exit_1(dataset, tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({**train_config(dataset, tmp_path, log_every=1), "modle": {}}))
    assert main(["--config", str(p)]) == EXIT_ERROR
    assert "modle: unknown key" in capsys.readouterr().err
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    arrow = sorted((copy / "v0001" / "train").glob("*.arrow"))[0]
    arrow.write_bytes(arrow.read_bytes()[:-10] + b"0123456789")
    p.write_text(yaml.safe_dump(train_config(str(copy), tmp_path, log_every=1)))
    assert main(["--config", str(p)]) == EXIT_ERROR
    assert "does not match its manifest" in capsys.readouterr().err


def _params(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return ckpt.load(run_dir / "checkpoints", step)["model"]


def test_sigkill_resume_is_bitwise_exact(dataset, tmp_path):
    """Killed three times at arbitrary moments, the run ends with the same parameters,
    optimizer state and metrics as a run that never stopped."""
    steps = 60
    c = train_config(
        dataset,
        tmp_path / "ref",
        log_every=1,
        steps=steps,
        eval_every=20,
        checkpoint={"every": 7, "keep_last": 2},
    )
    ref_cfg = tmp_path / "ref.yaml"
    ref_cfg.write_text(yaml.safe_dump(c))
    cmd = [sys.executable, "-m", "training.train", "--config"]
    assert subprocess.run([*cmd, str(ref_cfg)], cwd=ROOT, timeout=300).returncode == 0

    run = tmp_path / "killed"
    kcfg = tmp_path / "killed.yaml"
    kcfg.write_text(yaml.safe_dump({**c, "run_dir": str(run)}))
    rng = random.Random(5)
    kills = 0
    for _ in range(3):
        proc = subprocess.Popen([*cmd, str(kcfg)], cwd=ROOT)
        # Wait for real progress, then kill at a random moment.
        deadline = time.time() + 120
        start = ckpt.latest_step(run / "checkpoints") or 0
        while time.time() < deadline and proc.poll() is None:
            now = ckpt.latest_step(run / "checkpoints") or 0
            if now > start:
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
    assert kills >= 2, "the run finished before it could be killed; make it longer"
    assert subprocess.run([*cmd, str(kcfg)], cwd=ROOT, timeout=300).returncode == 0

    a, b = _params(tmp_path / "ref", steps), _params(run, steps)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    oa = ckpt.load(tmp_path / "ref" / "checkpoints", steps)["optimizer"]["state"]
    ob = ckpt.load(run / "checkpoints", steps)["optimizer"]["state"]
    for k in oa:
        for name, t in oa[k].items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, ob[k][name]), (k, name)
    la = [r for r in read(tmp_path / "ref" / "metrics.jsonl") if r.get("kind") == "train"]
    lb = [r for r in read(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]


def test_fresh_machine_resumes_from_object_storage(
    dataset, tmp_path, s3_bucket, s3_client, moto_endpoint, monkeypatch
):
    """Checkpoints go to S3 in the background; a machine with an empty disk resumes from
    the newest complete one there, and ends where an uninterrupted run ends."""
    import shutil

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    remote = f"s3://{s3_bucket}/runs/{{run}}/checkpoints"  # run "a": runs/a/checkpoints
    # A constant schedule: the first run stops at 6 of what later becomes 12 steps, and a
    # cosine over 6 steps would differ from the uninterrupted run's cosine over 12.
    over = {
        "checkpoint": {"every": 3, "keep_last": 2, "remote": remote},
        "schedule": {"kind": "constant"},
    }
    assert train(dataset, tmp_path / "a", steps=6, **over) == 0
    body = s3_client.get_object(Bucket=s3_bucket, Key="runs/a/checkpoints/latest")["Body"]
    assert body.read().decode().strip() == ckpt.step_name(6)

    shutil.rmtree(tmp_path / "a")  # the machine is gone
    assert train(dataset, tmp_path / "a", steps=12, **over) == 0
    events = [r for r in read(tmp_path / "a" / "metrics.jsonl") if r.get("event") == "resume"]
    assert events and events[0]["step"] == 6

    assert (
        train(
            dataset,
            tmp_path / "ref",
            steps=12,
            checkpoint={"every": 3},
            schedule={"kind": "constant"},
        )
        == 0
    )
    a, b = _params(tmp_path / "a", 12), _params(tmp_path / "ref", 12)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        f.relative_to(root).as_posix(): f.read_bytes()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def test_runs_keep_to_their_own_remote_prefix(dataset, tmp_path):
    """Two runs with the same config and the same checkpoint.remote root, in other run_dirs:
    each gets its own prefix; the second neither resumes from nor prunes the first's."""
    store = tmp_path / "store"
    assert (
        train(
            dataset,
            tmp_path / "first",
            steps=2,
            eval_every=100,
            eval_batches=1,
            checkpoint={"every": 1, "keep_last": 2, "remote": str(store)},
        )
        == 0
    )
    first = store / "first"
    before = _tree(first)
    assert (first / "latest").read_text().strip() == ckpt.step_name(2)
    assert "step-00000002/meta.json" in before
    # More checkpoints, and a retention that would keep only one of them.
    assert (
        train(
            dataset,
            tmp_path / "second",
            steps=4,
            eval_every=100,
            eval_batches=1,
            checkpoint={"every": 1, "keep_last": 1, "remote": str(store)},
        )
        == 0
    )
    assert _tree(first) == before
    events = [r.get("event") for r in read(tmp_path / "second" / "metrics.jsonl")]
    assert "resume" not in events  # started at step 0, not from the first run's step 2
    second = store / "second"
    assert (second / "latest").read_text().strip() == ckpt.step_name(4)
    assert sorted(p.name for p in second.glob("step-*")) == [ckpt.step_name(4)]
    a, b = (json.loads((d / "RUN.json").read_text()) for d in (first, second))
    assert (a["run_name"], b["run_name"]) == ("first", "second")
    assert a["config_fingerprint"] == b["config_fingerprint"]  # the same config


def test_remote_prefix_of_another_config_exits_1(dataset, tmp_path):
    """The run's prefix holds another model's checkpoints (RUN.json with another config
    fingerprint): the trainer exits 1 with one line saying whose they are and what to do,
    restores nothing and leaves the remote untouched."""
    store = tmp_path / "store"
    over = {
        "steps": 1,
        "eval_every": 100,
        "eval_batches": 1,
        "checkpoint": {"every": 1, "remote": str(store)},
    }
    assert train(dataset, tmp_path / "a" / "run", **over) == 0
    prefix = store / "run"
    before = _tree(prefix)
    assert "RUN.json" in before and "latest" in before

    c = train_config(dataset, tmp_path / "b" / "run", log_every=1, model={"d_model": 64}, **over)
    p = tmp_path / "b.yaml"
    p.write_text(yaml.safe_dump(c))
    proc = subprocess.run(
        [sys.executable, "-m", "training.train", "--config", str(p)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == EXIT_ERROR, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    theirs = parse_train_config(train_config(dataset, tmp_path / "a" / "run", log_every=1, **over))
    ours = parse_train_config(c)
    assert theirs.checkpoint_fingerprint() != ours.checkpoint_fingerprint()
    for part in (
        str(prefix.resolve()),
        "'run'",
        theirs.checkpoint_fingerprint(),
        ours.checkpoint_fingerprint(),
        "checkpoint.run_name",
        "delete",
    ):
        assert part in errors[0], part
    assert _tree(prefix) == before
    assert not (tmp_path / "b" / "run" / "checkpoints").exists()


def test_storage_outage_during_training(
    dataset, tmp_path, s3_bucket, s3_client, monkeypatch, moto_endpoint, capfd
):
    """The S3 endpoint goes away for a while mid-run (a proxy that drops every connection):
    training keeps going, uploads are retried and catch up, and `latest` never names a
    partial checkpoint."""
    import threading

    proxy = TcpProxy("127.0.0.1", int(moto_endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    remote = f"s3://{s3_bucket}/runs"  # the root: this run's prefix is runs/outage
    seen: list[str] = []
    stop = threading.Event()

    def outage() -> None:
        time.sleep(1.0)
        proxy.pause()
        time.sleep(3.0)
        proxy.resume()

    watch_latest(s3_client, s3_bucket, "runs/outage", seen, stop)  # moto, not the proxy
    threading.Thread(target=outage, daemon=True).start()
    try:
        code = train(
            dataset,
            tmp_path,
            steps=150,
            eval_every=150,
            storage={"max_attempts": 2},
            checkpoint={
                "every": 10,
                "keep_last": 2,
                "remote": remote,
                "run_name": "outage",
                "remote_max_failures": 100,
            },
        )
    finally:
        stop.set()
        proxy.close()
    assert code == 0
    err = capfd.readouterr().err
    assert "retrying" in err or "FAILED" in err.upper(), "the outage hit no upload"
    assert not [s for s in seen if s.startswith("PARTIAL")], seen
    body = s3_client.get_object(Bucket=s3_bucket, Key="runs/outage/latest")["Body"].read()
    assert body.decode().strip() == ckpt.step_name(150)


def test_dataset_in_object_storage(
    dataset, tmp_path, s3_bucket, s3_client, moto_endpoint, monkeypatch
):
    """A dataset in S3 (what prep writes on a cluster) is fetched into the dataset cache,
    verified, and trained on; a tampered remote copy is refused."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("BALLAST_DATASET_CACHE", str(tmp_path / "cache"))
    for p in Path(dataset).rglob("*"):
        if p.is_file():
            s3_client.upload_file(str(p), s3_bucket, f"ds/{p.relative_to(dataset)}")
    uri = f"s3://{s3_bucket}/ds"
    assert train(uri, tmp_path / "run", steps=2) == 0
    assert len(list((tmp_path / "cache").iterdir())) == 1
    a, b = _params(tmp_path / "run", 2), None
    assert train(dataset, tmp_path / "local", steps=2) == 0
    b = _params(tmp_path / "local", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same data, the same training

    arrow = sorted(p for p in Path(dataset).glob("v0001/train/*.arrow"))[0]
    data = arrow.read_bytes()
    s3_client.put_object(
        Bucket=s3_bucket, Key=f"ds/v0001/train/{arrow.name}", Body=data[:-10] + b"0123456789"
    )
    monkeypatch.setenv("BALLAST_DATASET_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(Exception, match="does not match its manifest"):
        train(uri, tmp_path / "run2", steps=2)


@pytest.mark.parametrize("fused", [False, True])
def test_resume_is_exact_for_both_adamw_kernels(dataset, tmp_path, fused):
    """Stopped at step 3 and resumed to 6 equals 6 steps straight, with the foreach and
    the fused AdamW update alike (a constant schedule: the stop changes no LR)."""
    over = {"optim": {"fused": fused}, "schedule": {"kind": "constant"}}
    assert train(dataset, tmp_path / "a", steps=3, **over) == 0
    assert train(dataset, tmp_path / "a", steps=6, **over) == 0
    assert train(dataset, tmp_path / "b", steps=6, **over) == 0
    a, b = _params(tmp_path / "a", 6), _params(tmp_path / "b", 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if fused:  # and it is a different kernel: not bit-identical to foreach
        assert (
            train(
                dataset,
                tmp_path / "c",
                steps=6,
                optim={"fused": False},
                schedule={"kind": "constant"},
            )
            == 0
        )
        c = _params(tmp_path / "c", 6)
        assert any(not torch.equal(a[k], c[k]) for k in a)
