"""Tensor parallelism under torchrun on CPU (gloo), beyond parity: checkpoints resumed on
another mesh, degrees that do not fit, the guards and rollback as in one process, fewer
validation batches than ranks, and export (test_tensor_parallel.py has the helpers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.e2e.test_tensor_parallel import MODELS
from tests.support.helpers import ROOT
from tests.support.parity import (
    RTOL,
    assert_close,
    assert_same_weights,
    final_params,
    losses,
    one_process,
    run,
    torchrun,
    write_config,
)
from training import checkpoint as ckpt
from training.config import parse_train_config
from training.metrics import read


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [(2, 1), (1, 2)], ids=["tp2_to_1", "1_to_tp2"])
def test_resumes_on_another_mesh(dataset, tmp_path, first, then):
    """10 steps on one mesh, the next 10 on another: the same losses and final weights as
    an uninterrupted single-process run. tp=2 -> 1 reads a DCP checkpoint in one process;
    1 -> tp=2 splits a plain checkpoint over the TP ranks."""
    # A constant schedule: the stopped run's `steps: 10` must not change its LR.
    model, schedule = MODELS["rope"], {"kind": "constant"}
    ref = one_process(write_config(tmp_path, "ref", dataset, model=model, schedule=schedule))

    def setting(nproc: int) -> dict[str, Any]:
        return {"schedule": schedule, **({"parallel": {"tp": 2}} if nproc == 2 else {})}

    p = write_config(tmp_path, "moved", dataset, model=model, steps=10, **setting(first))
    moved = run(first, p)
    assert ckpt.latest_step(moved / "checkpoints") == 10
    p = write_config(tmp_path, "moved", dataset, model=model, **setting(then))
    run(then, p)
    recs = read(moved / "metrics.jsonl")
    assert any(r.get("event") == "resume" and r["step"] == 10 for r in recs)
    worst = assert_close(losses(ref), losses(moved))
    cfg = yaml.safe_load(p.read_text())
    w = assert_same_weights(final_params(ref, 20, cfg), final_params(moved, 20, cfg))
    print(
        f"\n{first} -> {then} processes: max relative difference: loss {worst:.2e}, weights {w:.2e}"
    )


@pytest.mark.slow
def test_degrees_that_do_not_fit_the_world_size_are_one_line(dataset, tmp_path):
    p = write_config(tmp_path, "bad", dataset, parallel={"dp_shard": 2, "tp": 2}, steps=2)
    r = torchrun(2, p)
    assert r.returncode != 0
    assert "dp_shard 2 x tp 2 x pp 1 = 4 ranks, but the world size (WORLD_SIZE) is 2" in r.stderr


@pytest.mark.slow
def test_guards_act_as_in_one_process(dataset, tmp_path):
    """A NaN loss and a loss spike, planted at the same steps: at tp=2 the guard skips the
    same steps with the same verdicts as in one process (it sees the loss and the grad
    norm of the whole mesh), and the runs go on to the same losses."""
    guards = {"warmup_steps": 5}
    faults = ("--fault", "nan@8", "--fault", "spike@14")
    one = one_process(write_config(tmp_path, "one", dataset, guards=guards), *faults)
    tp = write_config(tmp_path, "tp", dataset, guards=guards, parallel={"tp": 2})
    two = run(2, tp, *faults)
    events = guard_events(one)
    assert {e[1] for e in events} >= {9, 15}, events  # both faults were acted on
    assert guard_events(two) == events
    assert_close(losses(one), losses(two))


def guard_events(run_dir: Path) -> list[tuple[Any, ...]]:
    recs = read(run_dir / "metrics.jsonl")
    return [
        (r["event"], r["step"], r.get("reason"))
        for r in recs
        if r.get("kind") == "event" and r["event"] not in ("resume", "checkpoint")
    ]


@pytest.mark.slow
def test_rollback_as_in_one_process(dataset, tmp_path):
    """A learning-rate blow-up (x1000 for steps 13-15, gone on the replay) rolls the run
    back to its last checkpoint (step 10, DCP at tp=2) and past the data window: the same
    guard events as in one process, and the same losses once it trains on."""
    guards = {"warmup_steps": 5, "spikes_to_rollback": 2, "window": 5}
    over: dict[str, Any] = {"guards": guards}  # checkpoints at 10 and 20
    fault = ("--fault", "lr_blowup@12-15")
    one = one_process(write_config(tmp_path, "one", dataset, **over), *fault)
    two = run(2, write_config(tmp_path, "tp", dataset, parallel={"tp": 2}, **over), *fault)
    events = guard_events(one)
    assert any(e[0] == "rollback" for e in events), events
    assert guard_events(two) == events
    a, b = losses(one)[-5:], losses(two)[-5:]  # steps 16-20, after the replay
    assert all(abs(x - y) < RTOL * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp2", {"tp": 2}])
def test_fewer_validation_batches_than_ranks(dataset, tmp_path, parallel):
    """One validation batch over 2 data-parallel ranks (fsdp2), or over a TP group: the
    rank without a batch still joins the forward's collectives (it used to wait in the
    final sum while the other waited in the forward: a hang until gloo's timeout). The
    loss is the one batch's, as in one process."""
    over: dict[str, Any] = {"steps": 2, "eval_every": 2, "eval_batches": 1}
    one = one_process(write_config(tmp_path, "one", dataset, **over))
    p = write_config(tmp_path, "two", dataset, parallel=parallel, **over)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "training.train", "--config", str(p)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    va = [r["val_loss"] for r in read(one / "metrics.jsonl") if r.get("kind") == "eval"]
    vb = [
        r["val_loss"] for r in read(tmp_path / "two" / "metrics.jsonl") if r.get("kind") == "eval"
    ]
    assert len(va) == len(vb) == 1
    assert abs(va[0] - vb[0]) / va[0] < RTOL


@pytest.mark.slow
def test_exports_from_a_tp_checkpoint(dataset, tmp_path):
    """`ballast export hf` reads a tp=2 checkpoint (DCP gathers it into whole tensors) and
    writes the same weights a one-process read of it gives."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from training.export_hf import export_hf, hf_state_dict

    p = write_config(tmp_path, "tp", dataset, steps=2, parallel={"tp": 2})
    run_dir = run(2, p)
    out, _arch = export_hf(run_dir, tmp_path / "hf")
    exported = load_file(str(out / "model.safetensors"))
    cfg = parse_train_config(yaml.safe_load(p.read_text()))
    want = hf_state_dict(cfg.model, final_params(run_dir, 2, yaml.safe_load(p.read_text())))
    assert want and set(want) <= set(exported) | {"lm_head.weight"}
    for k in set(want) & set(exported):
        assert torch.equal(exported[k], want[k].contiguous()), k
