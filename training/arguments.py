"""The command-line overrides of a training config's keys (`--dataset`, `--run-dir`,
`--steps`), defined once for every command that takes them: `ballast train`, `track`,
`blame` and `deploy`, `python -m training.train`, `python -m flows.train` and
`python -m flows.pipeline`. Only argparse is imported here, so building a parser costs no
import of the trainer."""

from __future__ import annotations

import argparse
from typing import Any

# key of the training config -> (flag, type)
OVERRIDES: dict[str, tuple[str, type]] = {
    "dataset": ("--dataset", str),
    "run_dir": ("--run-dir", str),
    "steps": ("--steps", int),
}


def add_train_overrides(
    parser: argparse.ArgumentParser, keys: tuple[str, ...] = tuple(OVERRIDES)
) -> None:
    for key in keys:
        flag, kind = OVERRIDES[key]
        parser.add_argument(flag, type=kind, help=f"override the training config's `{key}:`")


def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The overrides `args` has, by config key (None: not given), for load_train_config."""
    return {key: getattr(args, key) for key in OVERRIDES if hasattr(args, key)}
