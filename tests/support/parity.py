"""Parity of a multi-process run (DDP, FSDP2, TP, PP and their meshes, under torchrun on
CPU with gloo) with the one-process run on the same data and seed: run helpers, the
comparisons, and one-process reference runs shared by every test of a pytest run.

A reference run is deterministic in its config and data, and several meshes compare with the
same one (tp2 and dp2 x tp2 with the same model; pp2 and pp2 x dp2). Each costs a process
start (~6 s of CPU on these 2 cores), so `one_process` runs each once per pytest run, for
every xdist worker, under a file lock in the run's base temporary directory."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from filelock import FileLock

from core.dataset import MANIFEST, resolve
from tests.support.factories import train_config
from tests.support.helpers import ROOT
from training import checkpoint as ckpt
from training.config import parse_train_config
from training.data import load_data
from training.metrics import read
from training.model import GPT

# fp32 on CPU: the meshes change only the summation order (split matmuls, sharded sums).
RTOL = 1e-5


def torchrun(nproc: int, config: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "-m", "training.train", "--config", str(config)]
    cmd += extra
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def run(nproc: int, config: Path, *extra: str) -> Path:
    r = torchrun(nproc, config, *extra)
    assert r.returncode == 0, r.stderr[-4000:]
    return Path(yaml.safe_load(config.read_text())["run_dir"])


def write_config(tmp_path: Path, name: str, dataset: str, **over: Any) -> Path:
    """20 steps, micro_batch 4, accum_steps 2, an eval and a checkpoint every 10, a train
    record every step (`over`: more config) in `tmp_path/<name>.yaml`, run dir
    `tmp_path/<name>`."""
    defaults: dict[str, Any] = {
        "log_every": 1,
        "steps": 20,
        "micro_batch": 4,
        "accum_steps": 2,
        "eval_every": 10,
        "checkpoint": {"every": 10},
    }
    c = train_config(dataset, tmp_path / name, **{**defaults, **over})
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(c))
    return p


def one_process(config: Path, *extra: str) -> Path:
    """The one-process run of `config` (with `extra` arguments), run once per pytest run:
    a later call with the same config (run_dir aside) on the same data gets the first
    call's run directory. The key is the config and the dataset's manifest, not its path:
    each xdist worker prepares its own copy of the same dataset."""
    c = yaml.safe_load(config.read_text())
    manifest = (Path(resolve(c["dataset"])) / MANIFEST).read_bytes()
    key = hashlib.sha256(
        json.dumps(
            [{k: v for k, v in c.items() if k != "run_dir"}, list(extra)], sort_keys=True
        ).encode()
        + manifest
    ).hexdigest()[:16]
    # tmp_path's parent is the base temporary directory of this worker; under xdist its
    # parent is the run's, shared by the workers (and never by another pytest run).
    base = Path(c["run_dir"]).parent.parent
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = shared / "one-process-runs"
    cache.mkdir(exist_ok=True)
    done = cache / key
    with FileLock(str(cache / f"{key}.lock")):
        if not (done / "final.json").is_file():
            shutil.rmtree(done, ignore_errors=True)  # a run that failed part way
            p = cache / f"{key}.yaml"
            p.write_text(yaml.safe_dump({**c, "run_dir": str(done)}))
            run(1, p, *extra)
    return done


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def val_losses(run_dir: Path) -> list[float]:
    return [r["val_loss"] for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]


def final_params(run: Path, step: int, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's whole tensors in checkpoint `step`, plain (torch.save) or DCP (read into
    a one-process model: DCP gathers the shards of any mesh)."""
    import torch.distributed.checkpoint as dcp

    if not ckpt.is_sharded(run / "checkpoints", step):
        return ckpt.load(run / "checkpoints", step)["model"]
    c = parse_train_config(config)
    data = load_data(c.dataset, check=False)
    state = {"model": GPT(c.model, data.vocab_size, data.seq_len).state_dict()}
    dcp.load(state, checkpoint_id=str(run / "checkpoints" / ckpt.step_name(step)))
    return state["model"]


def assert_close(a: list[float], b: list[float]) -> float:
    """The largest relative difference; every step within RTOL (NaN only where both are:
    a step the guard skipped)."""
    assert len(a) == len(b) == 20
    rels = [
        0.0 if math.isnan(x) and math.isnan(y) else abs(x - y) / abs(x)
        for x, y in zip(a, b, strict=True)
    ]
    assert all(r < RTOL for r in rels), (rels, a, b)  # a NaN rel fails here, unlike max()
    return max(rels)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of a tensor, ||b - a|| / ||a||; every one within
    RTOL. Per tensor, not per element: where a gradient is near zero, Adam's update
    m / sqrt(v) turns a difference in the last bits into one of the learning rate's size
    (the embedding row of a token seen once), whatever split the matmuls had."""
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        if k.endswith("attn.w_k.bias"):
            # Its gradient is zero in exact arithmetic (softmax ignores a shift that is the
            # same for every key), so in BOTH runs it is Adam applied to rounding noise.
            continue
        rel = float((b[k].float() - a[k].float()).norm() / a[k].float().norm().clamp(min=1e-12))
        assert rel < RTOL, (k, rel)
        worst = max(worst, rel)
    return worst


def assert_matches_one_process(one: Path, many: Path, config: Path, dp_size: int) -> str:
    """A 20-step mesh run `many` against the one-process run `one` of the same config:
    losses, gradient norms (the clipping and the guards use them: over every shard of the
    mesh), final weights, validation losses (the same batches, sharded or pipelined), the
    recorded world size (what blame splits a micro-batch by: the data-parallel size, not
    the process count) and tokens (counted once per data-parallel rank). Returns the
    differences as a line for the test's output."""
    assert ckpt.is_sharded(many / "checkpoints", 20)  # the mesh path ran (DTensors, DCP)
    worst = assert_close(losses(one), losses(many))
    worst_norm = assert_close(grad_norms(one), grad_norms(many))
    cfg = yaml.safe_load(config.read_text())
    w = assert_same_weights(final_params(one, 20, cfg), final_params(many, 20, cfg))
    va, vb = val_losses(one), val_losses(many)
    assert len(va) == len(vb) == 2
    assert max(abs(x - y) / x for x, y in zip(va, vb, strict=True)) < RTOL
    recorded = json.loads((many / "final.json").read_text())["environment"]["world_size"]
    assert recorded == dp_size
    ta = [r for r in read(one / "metrics.jsonl") if r.get("kind") == "train"][-1]
    tb = [r for r in read(many / "metrics.jsonl") if r.get("kind") == "train"][-1]
    assert ta["tokens_seen"] == tb["tokens_seen"]
    return f"max relative difference: loss {worst:.2e}, grad norm {worst_norm:.2e}, weights {w:.2e}"
