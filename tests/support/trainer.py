"""The trainer in-process on `factories.train_config`'s tiny run (`train`), and the one-line
message of a config the trainer refuses (`config_error`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.factories import train_config
from training.config import TrainConfigError, parse_train_config
from training.trainer import Trainer


def train(dataset: str, run_dir: Path, **over: Any) -> int:
    """Train `train_config(dataset, run_dir, **over)`; returns the run's exit code."""
    return Trainer(parse_train_config(train_config(dataset, run_dir, **over))).run()


def config_error(**over: Any) -> str:
    """The error of parsing {"dataset": "ds", **over}, which must fail."""
    with pytest.raises(TrainConfigError) as e:
        parse_train_config({"dataset": "ds", **over}, "t.yaml")
    return str(e.value)
