"""The `hpo` flow against a real temporary Prefect API, with real training jobs on the local
backend: clearly bad trials pruned while they run, a repeated search that runs nothing, a
bad search space refused in one line, and the muP transfer of the best trial."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.factories import train_config
from tests.support.helpers import assert_one_line_error, run_cli

STEPS = 60  # long enough that a pruned trial is stopped well before its end
GOOD = [{"optim.lr": 3e-3, "model.init_std": 0.02}, {"optim.lr": 1e-3, "model.init_std": 0.02}]
# Logits ~100x too large and a learning rate that cannot fix them in a few steps: the
# validation loss at the first report is many times the good trials'.
BAD = [{"optim.lr": 1e-6, "model.init_std": 3.0}, {"optim.lr": 1e-6, "model.init_std": 1.0}]


def write_search(tmp: Path, dataset: str, **over) -> Path:
    base = tmp / "base.yaml"
    base.write_text(
        yaml.safe_dump(
            train_config(
                dataset,
                tmp / "unused",
                steps=100,
                eval_every=50,
                eval_batches=2,
                checkpoint={"every": STEPS, "keep_last": 1},
                launch={"poll_s": 0.2, "max_restarts": 0},
            )
        )
    )
    cfg = {
        "base_config": str(base),
        "out": str(tmp / "hpo"),
        "n_trials": 4,
        "parallel": 2,
        "steps": STEPS,
        "eval_every": 3,
        "overrides": {"model.mup_base_d_model": 32},
        "space": {
            "optim.lr": {"type": "categorical", "choices": [1e-6, 1e-3, 3e-3]},
            "model.init_std": {"type": "categorical", "choices": [0.02, 1.0, 3.0]},
        },
        # Two good trials run (and finish) first, then two bad ones meet the pruner.
        "enqueue": GOOD + BAD,
        "sampler": {"kind": "random", "seed": 0},
        "pruner": {"kind": "median", "n_startup_trials": 2},
        "poll_s": 0.2,
        **over,
    }
    path = tmp / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def searched(prefect_api, train_dataset, tmp_path_factory):
    from flows.hpo import hpo

    tmp = tmp_path_factory.mktemp("hpo")
    path = write_search(tmp, train_dataset)
    return path, tmp / "hpo", hpo(str(path))


def last_train_step(run_dir: Path) -> int:
    from flows.hpo import read_evals
    from training.metrics import read

    assert read_evals(run_dir / "metrics.jsonl"), run_dir
    return max(r["step"] for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "train")


def test_bad_trials_are_pruned_while_they_run(searched):
    from prefect.artifacts import Artifact

    _, out, r = searched
    assert (r["trials"], r["completed"], r["pruned"], r["failed"]) == (4, 2, 2, 0)
    assert r["best_params"] in GOOD
    trials = sorted((out / "trials").iterdir())
    assert [last_train_step(d) for d in trials[:2]] == [STEPS, STEPS]
    # The pruned jobs were stopped well before the end: no final checkpoint, no final.json.
    for d in trials[2:]:
        assert last_train_step(d) < STEPS and not (d / "final.json").exists(), d
    table = Artifact.get("hpo-trials")
    assert table is not None and str(table.data).count("pruned") >= 2
    plot = Artifact.get("hpo-best-loss")
    assert plot is not None and "data:image/png;base64," in str(plot.data)


def test_a_repeated_search_runs_no_trial_again(searched):
    from flows.hpo import hpo

    path, out, first = searched
    jobs = sorted(p for p in (out / "trials").glob("*/supervisor/jobs/*"))
    before = {p: p.stat().st_mtime_ns for p in jobs}
    again = hpo(str(path))
    assert again["trials"] == first["trials"] == 4
    assert again["best_value"] == first["best_value"]
    assert {p: p.stat().st_mtime_ns for p in (out / "trials").glob("*/supervisor/jobs/*")} == before


def test_transfer_writes_the_target_width_config(searched, tmp_path):
    from training.config import load_train_config

    path, _, r = searched
    out = tmp_path / "wide.yaml"
    res = run_cli("hpo", "transfer", "--study", str(path), "--to-width", "128", "--out", str(out))
    assert res.returncode == 0, res.stderr
    # The study's objective names the value (rich wraps the line at the terminal width).
    assert "(validation loss " in " ".join(res.stdout.split())
    cfg = load_train_config(out)
    assert (cfg.model.d_model, cfg.model.n_head, cfg.model.mup_base_d_model) == (128, 8, 32)
    assert cfg.optim.lr == r["best_params"]["optim.lr"]
    assert cfg.model.init_std == r["best_params"]["model.init_std"]
    assert cfg.steps == 100  # the trial budget stays with the trials


def test_a_bad_space_is_one_line_naming_the_key(tmp_path):
    space = {"optim.lrr": {"type": "float", "low": 1e-4, "high": 1e-2}}
    path = write_search(tmp_path, str(tmp_path / "no-dataset"), space=space, enqueue=[])
    r = run_cli("hpo", "run", str(path))
    assert r.returncode == 1
    assert_one_line_error(r, "space.optim.lrr", "no key 'lrr' in optim")


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"space": {"optim.lr": {"type": "float", "low": 0.0, "high": 1e-2}}}, "space.optim.lr"),
        ({"space": {"optim.lr": {"type": "float", "low": 0.1, "high": 0.01}}}, "space.optim.lr"),
        (
            {"space": {"optim.lr": {"type": "float", "low": 0, "high": 1, "log": True}}},
            "space.optim.lr",
        ),
        ({"space": {"model.n_head": {"type": "int", "low": 2, "high": 3}}}, "space.model.n_head"),
        ({"space": {"optim": {"type": "float", "low": 0, "high": 1}}}, "space.optim"),
        (
            {"space": {"optim.betas.2": {"type": "float", "low": 0.9, "high": 0.99}}},
            "space.optim.betas.2",
        ),
        ({"space": {"run_dir": {"type": "categorical", "choices": ["a"]}}}, "space.run_dir"),
        ({"overrides": {"model.width": 64}}, "overrides.model.width"),
        ({"enqueue": [{"optim.eps": 1e-8}]}, "enqueue[0].optim.eps"),
        ({"pruner": {"kind": "asha", "reduction_factor": 1}}, "pruner.reduction_factor"),
        # the trials' mesh against their launch (one process here)
        ({"overrides": {"parallel": {"tp": 2}}}, "launch.nproc_per_node 1"),
    ],
)
def test_config_errors_name_the_key(tmp_path, over, needle):
    from core.errors import ConfigError
    from flows.hpo import load_hpo_config

    path = write_search(tmp_path, str(tmp_path / "no-dataset"), **{"enqueue": [], **over})
    with pytest.raises(ConfigError) as e:
        load_hpo_config(path)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_transfer_needs_mup_proxies(tmp_path):
    from flows.hpo import HpoError, transfer

    path = write_search(tmp_path, str(tmp_path / "no-dataset"), overrides={})
    with pytest.raises(HpoError, match="mup_base_d_model"):
        transfer(str(path), 128, tmp_path / "out.yaml")
