"""Experiment tracking, read back through the tools' own readers: a real pipeline run (tiny
prep, a few training steps) logged to MLflow (MlflowClient: params, metric histories with
steps, artifacts) and TensorBoard (EventAccumulator), compared with what the prep wrote
(report.json, manifest.json) and the trainer's metrics log; guard events; bad stores
refused before training; MFU's peak FLOP/s chosen by device name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support.moto import free_port
from tests.support.tiny_run import write_configs
from training.components.progress import mfu
from training.flops import device_peak_flops, matmul_dtype, peak_flops
from training.metrics import read, scalars

pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")


def add_tracking(train_cfg: Path, **tracking: Any) -> dict[str, Any]:
    data = yaml.safe_load(train_cfg.read_text())
    data["tracking"] = tracking
    train_cfg.write_text(yaml.safe_dump(data))
    return data


def history(client: Any, run_id: str, name: str) -> list[tuple[int, float]]:
    """A metric's history in the order it was logged (the timestamps keep the order)."""
    ms = sorted(client.get_metric_history(run_id, name), key=lambda m: (m.timestamp, m.step))
    return [(m.step, m.value) for m in ms]


def expected_histories(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for rec in records:
        for name, value in scalars(rec):
            out.setdefault(name, []).append((rec["step"], value))
    return out


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_pipeline_run_is_one_mlflow_run_with_prep_and_training(prefect_api, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import pipeline
    from infra.tracking import metric_key

    prep_cfg, train_cfg = write_configs(tmp_path, steps=8, eval_every=4, checkpoint_every=4)
    add_tracking(train_cfg)  # the defaults: a SQLite store under the run dir
    result = pipeline(str(prep_cfg), str(train_cfg), launch={"poll_s": 0.3})
    run_dir = tmp_path / "run"
    tracked = result["train"]["mlflow"]
    assert tracked["uri"] == f"sqlite:///{run_dir.resolve()}/mlflow/mlflow.db"

    client = MlflowClient(tracking_uri=tracked["uri"])
    exp = client.get_experiment_by_name("ballast")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [tracked["run_id"]]
    run = client.get_run(tracked["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["ballast.run_dir"] == str(run_dir.resolve())
    assert run.data.tags["prefect.flow_run_id"]

    # The configs of both halves, as parameters.
    params = run.data.params
    train_doc = yaml.safe_load(train_cfg.read_text())
    assert params["train.steps"] == "8" and params["train.model.d_model"] == "32"
    assert params["train.tracking.experiment"] == "ballast"
    prep_doc = yaml.safe_load(prep_cfg.read_text())
    assert params["prep.pack.seq_len"] == str(prep_doc["pack"]["seq_len"])
    assert json.loads(params["prep.sources"])[0]["name"] == "pydoc"
    assert params["dataset.uri"] == str(Path(train_doc["dataset"]) / "v0001")  # the version

    # The prep's accounting per stage, per rule and per source, and the mixture planned
    # vs realised: the numbers report.json holds.
    report = json.loads((tmp_path / "prep-out" / "v0001" / "report.json").read_text())
    metrics = run.data.metrics
    checked = 0
    for stage, st in report["stages"].items():
        for src, s in st["sources"].items():
            for field in ("docs_in", "kept", "bytes_in", "bytes_kept"):
                assert metrics[metric_key("prep", stage, "source", src, field)] == s[field]
                checked += 1
            for reason, n in s["dropped"].items():
                assert metrics[metric_key("prep", stage, "source", src, "dropped", reason)] == n
                checked += 1
        for reason, n in st["total"]["dropped"].items():
            assert metrics[metric_key("prep", stage, "dropped", reason)] == n
    assert report["stages"]["exact"]["total"]["dropped"]  # a rule dropped something
    assert checked > 20
    for src, m in report["mixture"]["sources"].items():
        assert metrics[f"mixture/{src}/planned_tokens"] == m["planned_tokens"]
        assert metrics[f"mixture/{src}/realised_tokens"] == m["realised_tokens"]

    # Every training metric, with its steps, as the metrics log has it.
    records = read(run_dir / "metrics.jsonl")
    want = expected_histories(records)
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/val_loss"} <= set(want)
    assert "train/mfu" not in want  # on the CPU there is no peak to divide by
    assert [s for s, _ in want["train/loss"]] == list(range(1, 9))
    for name, points in want.items():
        assert history(client, run.info.run_id, name) == points, name

    # Artifacts: the loss plot, the metrics log, the manifest, the prep's report.
    listed = {
        a.path for d in ("training", "prep") for a in client.list_artifacts(run.info.run_id, d)
    }
    assert {
        "training/loss.png",
        "training/metrics.jsonl",
        "training/final.json",
        "prep/manifest.json",
        "prep/report.json",
        "prep/config.json",
    } <= listed
    got = Path(client.download_artifacts(run.info.run_id, "prep/manifest.json", str(tmp_path)))
    v1 = tmp_path / "prep-out" / "dataset" / "v0001"
    manifest = json.loads((v1 / "manifest.json").read_text())
    assert json.loads(got.read_text()) == manifest

    # TensorBoard: the same numbers at the same steps (stored as float32).
    tb = tensorboard_scalars(run_dir / "tensorboard" / run_dir.name)  # a dir per run
    assert set(tb) == set(want)
    for name, points in want.items():
        assert [s for s, _ in tb[name]] == [s for s, _ in points], name
        assert [v for _, v in tb[name]] == pytest.approx([v for _, v in points], rel=1e-6)


def test_guard_events_reach_both_writers(tmp_path, capsys):
    """A spike the guard skips is an event in MLflow (a metric at its step, and the event
    itself in training/events.json) and in TensorBoard; `ballast track` logs a run dir."""
    from mlflow.tracking import MlflowClient

    from cli.main import main as cli
    from dataprep.config import load_config
    from dataprep.pipeline import run_prep
    from training.train import main as train_main

    prep_cfg, train_cfg = write_configs(tmp_path, steps=8, eval_every=1000, checkpoint_every=4)
    run_prep(load_config(prep_cfg), progress=False)
    data = add_tracking(train_cfg, mlflow=False)  # TensorBoard only while training
    data["guards"] = {"warmup_steps": 3}
    train_cfg.write_text(yaml.safe_dump(data))
    assert train_main(["--config", str(train_cfg), "--fault", "spike@6"]) == 0
    run_dir = tmp_path / "run"
    assert not (run_dir / "mlflow").exists()
    events = [r for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "event"]
    skips = [e for e in events if e["event"] == "skip"]
    # spike@6: after 6 steps, i.e. step 7, as its train record numbers it.
    assert [e["step"] for e in skips] == [7], events

    tb = tensorboard_scalars(run_dir / "tensorboard" / run_dir.name)  # a dir per run
    assert tb["events/skip"] == [(7, 1.0)]

    capsys.readouterr()
    assert cli(["track", str(train_cfg)]) == 0  # tracking.mlflow off: `track` turns it on
    out = capsys.readouterr().out
    run_id = out.split("mlflow: run ", 1)[1].split()[0]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve()}/mlflow/mlflow.db")
    assert history(client, run_id, "events/skip") == [(7, 1.0)]
    got = Path(client.download_artifacts(run_id, "training/events.json", str(tmp_path)))
    assert json.loads(got.read_text()) == events
    assert client.get_run(run_id).info.status == "FINISHED"


def test_unusable_store_is_one_line_before_training(tmp_path, capsys):
    from cli.main import main as cli

    _, train_cfg = write_configs(tmp_path, steps=2)
    url = f"http://127.0.0.1:{free_port()}"
    add_tracking(train_cfg, uri=url)
    assert cli(["train", str(train_cfg)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: tracking.uri: no MLflow server answers at {url}"), err
    assert not (tmp_path / "run").exists()  # refused before anything was trained

    add_tracking(train_cfg, uri=str(tmp_path / "mlruns"))  # MLflow 3's refused file store
    assert cli(["train", str(train_cfg)]) == 1
    err = capsys.readouterr().err
    assert "tracking.uri: Value error, MLflow 3 refuses the file store" in err, err

    add_tracking(train_cfg, experimant="x")
    assert cli(["train", str(train_cfg)]) == 1
    assert "tracking.experimant: unknown key" in capsys.readouterr().err


def test_tracking_switched_off_writes_nothing(tmp_path):
    from dataprep.config import load_config
    from dataprep.pipeline import run_prep
    from training.train import main as train_main

    prep_cfg, train_cfg = write_configs(tmp_path, steps=2, checkpoint_every=2)
    run_prep(load_config(prep_cfg), progress=False)
    add_tracking(train_cfg, enabled=False)
    assert train_main(["--config", str(train_cfg)]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert not (tmp_path / "run" / "mlflow").exists()


@pytest.mark.parametrize(
    ("name", "dtype", "label", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", "H100 SXM", 989.5),  # what torch calls the SXM part
        ("NVIDIA H100 80GB HBM3", "fp32", "H100 SXM", 67),
        ("NVIDIA H100 80GB HBM3", "tf32", "H100 SXM", 494.5),
        ("NVIDIA H100 PCIe", "bf16", "H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", "fp16", "H100 NVL", 835.5),
        ("NVIDIA H200", "bf16", "H200 SXM", 989.5),
        ("NVIDIA H200 NVL", "bf16", "H200 NVL", 835.5),
        ("NVIDIA GH200 480GB", "bf16", "H100 SXM", 989.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", "A100", 312),
        ("NVIDIA A100-PCIE-40GB", "fp16", "A100", 312),
        ("NVIDIA A100 80GB PCIe", "fp32", "A100", 19.5),
        ("NVIDIA L4", "bf16", "L4", 121),
        ("NVIDIA L40S", "bf16", "L40S", 362.05),
        ("NVIDIA L40", "bf16", "L40", 181.05),
        ("NVIDIA A10", "bf16", "A10", 125),
        ("Tesla V100-SXM2-16GB", "fp16", "V100 SXM2", 125),
        ("Tesla V100-PCIE-32GB", "fp16", "V100 PCIe", 112),
        ("Tesla T4", "fp16", "T4", 65),
    ],
)
def test_peak_flops_by_device_name(name, dtype, label, tflops):
    assert peak_flops(name, dtype) == (label, pytest.approx(tflops * 1e12))


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("Tesla V100-SXM2-16GB", "bf16"),  # no bf16 tensor cores: no honest peak
        ("Tesla T4", "bf16"),
        ("NVIDIA A10G", "bf16"),  # not in NVIDIA's datasheets (an AWS part)
        ("NVIDIA GeForce RTX 4090", "bf16"),
    ],
)
def test_unknown_peak_is_none(name, dtype):
    assert peak_flops(name, dtype) is None


def test_mfu_uses_the_device_peak_and_every_rank():
    assert device_peak_flops(torch.device("cpu"), "bf16") is None
    assert matmul_dtype("bf16") == "bf16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_dtype("fp32") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert matmul_dtype("fp32") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    # 2 ranks at 1e4 tokens/s each of 6e8 FLOPs, against 989.5 TFLOP/s per GPU.
    assert mfu(2e4, 6e8, ("H100 SXM", 989.5e12), 2) == {
        "mfu": pytest.approx(2e4 * 6e8 / (2 * 989.5e12))
    }
    assert mfu(2e4, 6e8, None, 2) == {}
