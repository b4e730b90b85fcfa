"""`ballast train CONFIG`: the trainer (training/train.py) in this process, and the run
logged to MLflow when its config turns tracking on."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.commands.track import log_to_mlflow
from cli.console import print_error
from core.protocol import EXIT_DIVERGED, EXIT_ERROR, EXIT_OK
from training.arguments import OVERRIDES, add_train_overrides, train_overrides

ENDINGS = {EXIT_OK: "done", EXIT_ERROR: "error", EXIT_DIVERGED: "diverged"}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train on a prepared dataset on this machine "
        "(exit 0 done, 1 bad config/data, 3 diverged)",
    )
    p.add_argument("config", help="training config (YAML), or a run config with `train:`")
    add_train_overrides(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from training.train import main as train_main

    argv = ["--config", args.config]
    for key, value in train_overrides(args).items():
        if value is not None:
            argv += [OVERRIDES[key][0], str(value)]
    cfg = _tracked_config(args)
    if cfg is False:
        return EXIT_ERROR
    code = train_main(argv)
    # The run as the metrics log has it, whatever the exit code: a failed run is logged
    # as FAILED, not lost. A logging failure turns a done run's 0 into 1.
    if (
        cfg is not None
        and (Path(cfg.run_dir) / "metrics.jsonl").is_file()
        and not log_to_mlflow(cfg, code == EXIT_OK, ENDINGS.get(code, f"exit {code}"))
    ):
        code = code or EXIT_ERROR
    return code


def _tracked_config(args: argparse.Namespace) -> Any:
    """The training config when it turns MLflow tracking on (its store checked before any
    training: False after printing why it cannot be used), else None (a bad config is
    left to the trainer, which names the key)."""
    from infra.tracking import TrackingError, check_tracking, tracking_on
    from training.config import TrainConfigError, load_train_config

    try:
        cfg = load_train_config(args.config, train_overrides(args))
    except TrainConfigError:
        return None
    if not tracking_on(cfg):
        return None
    try:
        check_tracking(cfg)
    except TrackingError as e:
        print_error(str(e))
        return False
    return cfg
