"""The `hpo` flow ranking its trials by an in-loop benchmark instead of the validation loss,
against a real temporary Prefect API with real training jobs: a study of two trials told
each one's last downstream value in the direction the config asks; and an objective the
base config cannot give refused in one line naming the key, before any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.evals import evals_section
from tests.support.factories import train_config
from training.metrics import read

STEPS = 12
GOOD, FROZEN = 1e-2, 1e-7  # a learning rate that learns the task in 12 steps, one that cannot


def write_search(tmp: Path, dataset: str, **over) -> Path:
    base = tmp / "base.yaml"
    base.write_text(
        yaml.safe_dump(
            train_config(
                dataset,
                tmp / "unused",
                steps=100,
                eval_every=6,
                eval_batches=2,
                checkpoint={"every": STEPS, "keep_last": 1},
                launch={"poll_s": 0.2, "max_restarts": 0},
                evals=evals_section(tmp / "evals", every=4),
            )
        )
    )
    cfg = {
        "base_config": str(base),
        "out": str(tmp / "hpo"),
        "n_trials": 2,
        "parallel": 1,
        "steps": STEPS,
        "objective": "downstream/shake/acc",
        "direction": "maximize",
        "space": {"optim.lr": {"type": "categorical", "choices": [FROZEN, GOOD]}},
        "enqueue": [{"optim.lr": GOOD}, {"optim.lr": FROZEN}],
        "sampler": {"kind": "random", "seed": 0},
        "pruner": {"kind": "none"},
        "poll_s": 0.2,
        **over,
    }
    path = tmp / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def last_downstream(run_dir: Path, key: str) -> tuple[int, float]:
    recs = [r for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "downstream"]
    return recs[-1]["step"], recs[-1][key]


def test_trials_ranked_by_a_downstream_metric(prefect_api, train_dataset, tmp_path):
    from prefect.artifacts import Artifact

    from flows.hpo import hpo, load_hpo_config, open_study

    path = write_search(tmp_path, train_dataset)
    r = hpo(str(path))
    assert (r["trials"], r["completed"], r["objective"], r["direction"]) == (
        2,
        2,
        "downstream/shake/acc",
        "maximize",
    )
    study = open_study(load_hpo_config(path), create=False)
    values = {}
    for t in study.trials:
        step, acc = last_downstream(Path(t.user_attrs["run_dir"]), "shake/acc")
        assert step == STEPS
        # Each trial's value is its accuracy at the last evaluation, not a loss.
        assert t.value == acc
        # The pruner was told the accuracy at each evaluation (every 4 steps).
        assert sorted(t.intermediate_values) == [4, 8, 12]
        values[t.params["optim.lr"]] = acc
    assert values[GOOD] > values[FROZEN]  # the task is learnable, and was learnt
    # Maximized: the best trial is the one with the higher accuracy.
    assert r["best_params"] == {"optim.lr": GOOD} and r["best_value"] == values[GOOD]
    table = Artifact.get("hpo-trials")
    assert table is not None
    assert "downstream/shake/acc (maximized)" in str(table.description)
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert sorted(row["value"] for row in rows) == sorted(round(v, 5) for v in values.values())
    plot = Artifact.get("hpo-best-loss")
    assert plot is not None and "**best downstream/shake/acc " in str(plot.data)


def test_a_changed_objective_is_refused_for_the_same_study(tmp_path):
    from flows.hpo import HpoError, load_hpo_config, open_study

    first = write_search(tmp_path, str(tmp_path / "no-dataset"))
    open_study(load_hpo_config(first))
    again = write_search(
        tmp_path, str(tmp_path / "no-dataset"), objective="val_loss", direction=None
    )
    again_s = load_hpo_config(again)
    assert again_s.objective.direction == "minimize"
    with pytest.raises(HpoError, match=r"ranks its trials by downstream/shake/acc \(maximize\)"):
        open_study(again_s)


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"objective": "downstream/shake/bleu"}, "shake has no metric 'bleu'"),
        ({"objective": "downstream/garbage/acc"}, "garbage has no metric 'acc' (it has: bpb)"),
        ({"objective": "downstream/arc_easy/acc"}, "scores no 'arc_easy'"),
        ({"objective": "loss"}, "neither val_loss nor downstream/<task>/<metric>"),
        ({"direction": "up"}, "direction"),
    ],
)
def test_a_bad_objective_is_one_line_naming_the_key(tmp_path, over, needle):
    from core.errors import ConfigError
    from flows.hpo import load_hpo_config

    path = write_search(tmp_path, str(tmp_path / "no-dataset"), **over)
    with pytest.raises(ConfigError) as e:
        load_hpo_config(path)
    msg = str(e.value)
    assert "objective" in msg or "direction" in msg
    assert needle in msg and "\n" not in msg, msg


def test_an_objective_without_evals_is_refused(tmp_path):
    from core.errors import ConfigError
    from flows.hpo import load_hpo_config

    path = write_search(tmp_path, str(tmp_path / "no-dataset"))
    base = yaml.safe_load((tmp_path / "base.yaml").read_text())
    del base["evals"]
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError, match="objective: downstream/shake/acc: the base config has"):
        load_hpo_config(path)
