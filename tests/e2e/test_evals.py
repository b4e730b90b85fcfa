"""In-loop evaluation end to end: real training runs with the `evals` section on. A resumed
run evaluates and judges regressions exactly as the uninterrupted one; switching the run to
garbage data mid-way is detected on a held-out clean text set and blamed on the garbage
source; with `action: rollback` the run goes back to a checkpoint at or before the best
step."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.support.evals import heldout_evals, heldout_files
from tests.support.factories import train_config
from training.config import parse_train_config
from training.metrics import read
from training.train import Trainer


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return heldout_files(tmp_path_factory.mktemp("evals"))


@pytest.fixture(scope="module")
def garbage_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random lowercase letters and spaces, prepared as the training data is (bytes,
    seq_len 64)."""
    from dataprep.config import parse_config
    from dataprep.pipeline import run_prep

    root = tmp_path_factory.mktemp("garbage")
    rng = random.Random(1)
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    with open(root / "garbage.jsonl", "w") as f:
        for i in range(600):
            n = rng.randint(80, 300)
            f.write(json.dumps({"id": f"g{i}", "text": "".join(rng.choices(alphabet, k=n))}))
            f.write("\n")
    run_prep(
        parse_config(
            {
                "output": str(root / "prep"),
                "workers": 1,
                "sources": [{"name": "garbage", "paths": [str(root / "garbage.jsonl")]}],
                "dedup": {"exact": False, "near": False},
                "quality": [],
                "pack": {"seq_len": 64},
                "dataset": {"validation_fraction": 0.1},
            }
        ),
        progress=False,
    )
    return str(root / "prep" / "dataset")


def _train(dataset: str, run_dir: Path, **over: object) -> int:
    """A constant schedule: a run stopped and relaunched with more steps goes on as the
    uninterrupted one."""
    cfg = train_config(
        dataset,
        run_dir,
        eval_every=10,
        checkpoint={"every": 10, "keep_last": 10},
        optim={"name": "adamw", "lr": 3e-3},
        schedule={"kind": "constant", "warmup_steps": 2},
        **over,
    )
    return Trainer(parse_train_config(cfg)).run()


def _downstream(run_dir: Path) -> list[dict]:
    return [r for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "downstream"]


def test_resumed_run_evaluates_as_the_uninterrupted_one(dataset, eval_files, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert _train(dataset, whole, steps=30, evals=heldout_evals(eval_files)) == 0
    assert _train(dataset, split, steps=20, evals=heldout_evals(eval_files)) == 0
    assert _train(dataset, split, steps=30, evals=heldout_evals(eval_files)) == 0
    a, b = _downstream(whole), _downstream(split)
    assert [r["step"] for r in a] == [10, 20, 30]
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in a]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in b]
    # The best-so-far state in the last checkpoints is the same (restored on resume).
    import torch

    def state(run: Path) -> dict:
        f = run / "checkpoints" / "step-00000030" / "state.pt"
        return torch.load(f, weights_only=False)["evals"]

    assert state(whole) == state(split)
    final = json.loads((whole / "final.json").read_text())
    assert final["downstream"]["heldout/bpb"] == a[-1]["heldout/bpb"]


def test_garbage_data_mid_run_is_detected_and_blamed(
    dataset, garbage_dataset, eval_files, tmp_path
):
    evals = heldout_evals(eval_files, regression={"k": 3.0})
    assert _train(dataset, tmp_path, steps=40, evals=evals) == 0
    clean = _downstream(tmp_path)
    bpbs = [r["heldout/bpb"] for r in clean]
    assert bpbs[-1] < bpbs[0]  # learning the clean data
    assert _train(garbage_dataset, tmp_path, steps=80, evals=evals) == 0
    regs = [
        r
        for r in read(tmp_path / "metrics.jsonl")
        if r.get("kind") == "event" and r.get("event") == "eval_regression"
    ]
    held = [r for r in regs if r["task"] == "heldout"]
    assert len(held) == 1, regs
    ev = held[0]
    before = [r for r in _downstream(tmp_path) if r["step"] < ev["step"]]
    best_step = min(before, key=lambda r: r["heldout/bpb"])["step"]
    assert ev["best_step"] == best_step and ev["metric"] == "bpb"
    assert 40 < ev["step"] <= 80 and ev["value"] > ev["best"]
    assert ev["drop"] > 3.0 * ev["stderr"]
    assert [s["source"] for s in ev["sources"]] == ["garbage"]
    assert ev["documents"] and all(d["source"] == "garbage" for d in ev["documents"])
    assert ev["action"] == "warn"


def test_rollback_action_goes_back_before_the_drop(dataset, garbage_dataset, eval_files, tmp_path):
    evals = heldout_evals(eval_files, regression={"k": 3.0, "action": "rollback"})
    assert _train(dataset, tmp_path, steps=40, evals=evals) == 0
    clean = _downstream(tmp_path)
    best_step = min(clean, key=lambda r: r["heldout/bpb"])["step"]
    code = _train(garbage_dataset, tmp_path, steps=80, evals=evals, guards={"max_rollbacks": 1})
    recs = read(tmp_path / "metrics.jsonl")
    rollbacks = [r for r in recs if r.get("event") == "rollback"]
    assert rollbacks, "no rollback"
    rb = rollbacks[0]
    assert rb["trigger"] == "eval_regression" and rb["to_step"] <= best_step
    # Garbage is all there is to train on, so it regresses again: the budget runs out.
    assert code == 3


def test_ema_runs_are_evaluated_with_the_ema_weights(dataset, eval_files, tmp_path):
    plain, ema = tmp_path / "plain", tmp_path / "ema"
    assert _train(dataset, plain, steps=20, evals=heldout_evals(eval_files)) == 0
    assert _train(dataset, ema, steps=20, evals=heldout_evals(eval_files), ema={"decay": 0.9}) == 0
    train = [
        [r["loss"] for r in read(d / "metrics.jsonl") if r.get("kind") == "train"]
        for d in (plain, ema)
    ]
    # The training weights come back bit for bit after each evaluation: same losses.
    assert train[0] == train[1]
    a, b = _downstream(plain), _downstream(ema)
    assert "weights" not in a[-1] and b[-1]["weights"] == "ema"
    assert a[-1]["heldout/bpb"] != b[-1]["heldout/bpb"]


@pytest.mark.slow
def test_tensor_parallel_evals_equal_one_process(dataset, eval_files, tmp_path):
    """At tp=2 both ranks of the TP group score the same sequences together (one
    data-parallel rank): the numbers are one process's."""
    import yaml

    from tests.e2e.test_distributed import torchrun

    runs = {}
    for name, nproc, over in (("one", 1, {}), ("tp2", 2, {"parallel": {"tp": 2}})):
        c = train_config(
            dataset,
            tmp_path / name,
            steps=10,
            eval_every=10,
            checkpoint={"every": 10},
            evals=heldout_evals(eval_files),
            **over,
        )
        p = tmp_path / f"{name}.yaml"
        p.write_text(yaml.safe_dump(c))
        r = torchrun(nproc, p)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = _downstream(tmp_path / name)
    a, b = runs["one"], runs["tp2"]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [10]
    assert b[0]["heldout/bpb"] == pytest.approx(a[0]["heldout/bpb"], rel=1e-5)
    assert b[0]["next_line/acc"] == a[0]["next_line/acc"]
    assert b[0]["heldout/n"] == a[0]["heldout/n"]
