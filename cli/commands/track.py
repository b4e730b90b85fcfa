"""`ballast track CONFIG`: a training run logged to MLflow as it is now (its metrics log,
and the prep of its dataset), after a logging failure or for a run trained with tracking
off. `log_to_mlflow` is also how `ballast train` logs the run it trained."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from cli.console import print_error
from core.protocol import EXIT_ERROR, EXIT_OK
from training.arguments import add_train_overrides, train_overrides


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "track",
        help="log a training run (and its dataset's prep) to "
        "MLflow as it is now (`tracking:` in its config, "
        "or defaults)",
    )
    p.add_argument("config", help="the run's training config (YAML)")
    add_train_overrides(p, ("dataset", "run_dir"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from infra.tracking import tracking_on
    from training.config import TrackingConfig, TrainConfigError, load_train_config

    try:
        cfg = load_train_config(args.config, train_overrides(args))
    except TrainConfigError as e:
        print_error(str(e))
        return EXIT_ERROR
    if not tracking_on(cfg):  # asked for explicitly: the defaults, MLflow on
        cfg = cfg.model_copy(update={"tracking": TrackingConfig()})
    if not (Path(cfg.run_dir) / "metrics.jsonl").is_file():
        print_error(f"{cfg.run_dir}: no metrics.jsonl (has this run trained?)")
        return EXIT_ERROR
    done = (Path(cfg.run_dir) / "final.json").is_file()
    return EXIT_OK if log_to_mlflow(cfg, done, "done" if done else "unfinished") else EXIT_ERROR


def log_to_mlflow(cfg: Any, ok: bool, ending: str) -> bool:
    """Log the run of `cfg` (ending as `ending`) to MLflow; False after printing why not."""
    from infra.tracking import TrackingError, log_run

    try:
        r = log_run(cfg, ok, ending)
    except TrackingError as e:
        print_error(f"{e}; log the run again with `ballast track` and the same arguments")
        return False
    Console().print(
        f"mlflow: run {r['run_id']} in experiment {r['experiment']} at {r['uri']}",
        markup=False,
        highlight=False,
    )
    return True
