"""The `hpo` flow: hyperparameter search on small proxy models with Optuna. Each trial is a
training job on the same JobBackend the `train` flow uses (infra/jobs.py: local processes
here, Kubernetes Jobs on a cluster), several at a time; the validation losses the trial
writes to its metrics log (or the in-loop benchmark `objective:` names) are reported to
Optuna's pruner while it runs, and a trial the pruner gives up on is stopped through the
backend. The study lives in an Optuna storage (SQLite under `out:` by default), so a search
run again only runs the trials still missing.

    python -m flows.hpo HPO_CONFIG        (or `ballast hpo run HPO_CONFIG`)

The search config (YAML):

    base_config: configs/train-demo.yaml   # the training config every trial starts from
    out: runs/hpo-demo                     # trials/, study.db, the plot
    n_trials: 12
    parallel: 2                            # trials training at the same time
    steps: 60                              # each trial's budget (not transferred)
    eval_every: 10                         # how often a trial reports its validation loss
    objective: val_loss                    # or downstream/<task>/<metric> (the base config's
    direction: minimize                    #   evals:), e.g. downstream/arc_easy/acc, maximize
    overrides: {model.d_model: 64, model.mup_base_d_model: 64}   # the proxy, every trial
    space:
      optim.lr: {type: float, low: 1.0e-4, high: 3.0e-2, log: true}
      optim.betas.1: {type: categorical, choices: [0.95, 0.99]}
      schedule.warmup_steps: {type: int, low: 0, high: 20}
    sampler: {kind: tpe, seed: 0}          # tpe | random
    pruner: {kind: median}                 # median | asha | hyperband | none

Space and override keys are dotted paths into the training config (training/config.py);
`optim.betas.1` is beta2. `transfer()` (`ballast hpo transfer`) writes the best trial's
hyperparameters into a training config at another width under muP.

The flow is below; its parts are in flows/tuning/:

    config.py    the search config (space, sampler, pruner), validated into a `Search`
    objective.py what ranks the trials: val_loss or an in-loop benchmark, and its direction
    study.py     the Optuna study: storage, sampler, pruner, suggested parameters
    trials.py    each trial a supervised training job; the search loop and the pruner
    report.py    the trials table, the best-value plot, the summary
    transfer.py  muP transfer of the best trial to another width
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from core.errors import ConfigError
from flows.errors import register
from flows.runs import run_name
from flows.train import HANDLE
from flows.tuning.arguments import add_search_arguments
from flows.tuning.config import HpoConfig, HpoError, Search, load_hpo_config
from flows.tuning.report import plot_best, summary, summary_md, summary_text, trial_rows
from flows.tuning.study import open_study
from flows.tuning.transfer import transfer
from flows.tuning.trials import cancel_handle, read_evals, search

register(HpoError)  # "no study", "no finished trial": the line is the cause

__all__ = [
    "PLOT_KEY",
    "TRIALS_KEY",
    "HpoConfig",
    "HpoError",
    "Search",
    "hpo",
    "load_hpo_config",
    "open_study",
    "read_evals",
    "summary_text",
    "transfer",
]

TRIALS_KEY = "hpo-trials"  # the trials table's artifact key
PLOT_KEY = "hpo-best-loss"


def _cancel_trials(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed: the flow's process may be gone; each trial job this
    flow run started and left running is found through its handle file and stopped."""
    try:
        s = load_hpo_config(flow_run.parameters["config_path"])
    except (ConfigError, KeyError):
        return
    for rd in (s.cfg.out_dir() / "trials").glob("trial-*"):
        try:
            owner = json.loads((rd / HANDLE).read_text()).get("flow_run")
        except (OSError, ValueError):
            continue
        if owner == str(flow_run.id):
            cancel_handle(rd, s.launch)


@flow(
    name="hpo",
    flow_run_name=run_name,
    on_cancellation=[_cancel_trials],
    on_crashed=[_cancel_trials],
)
def hpo(config_path: str) -> dict[str, Any]:
    """Search hyperparameters on proxy models: run the trials the study still misses,
    then post the `hpo-trials` table and the `hpo-best-loss` plot (the best value of the
    search's objective against trials).

    Args:
        config_path: The search config (YAML): base training config, space, n_trials,
            parallel, sampler, pruner (see the module's docstring).
    """
    logger = get_run_logger()
    s = load_hpo_config(config_path)
    study = open_study(s)
    search(s, study, logger.info)
    rows = trial_rows(study)
    o = s.objective
    create_table_artifact(
        key=TRIALS_KEY,
        table=rows,
        description=f"Trials of study {s.name}: parameters, {o.label} ({o.direction}d), state",
    )
    r = summary(s, study)
    png = Path(r["plot"])
    plot_best(study, png, o.label)
    create_markdown_artifact(
        key=PLOT_KEY,
        markdown=summary_md(r, png),
        description=f"Best {o.label} against trials, {s.name}",
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_search_arguments(ap)
    a = ap.parse_args()
    print(summary_text(hpo(a.config)))


if __name__ == "__main__":
    main()
