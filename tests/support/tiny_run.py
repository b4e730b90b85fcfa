"""A small whole run that needs no shared data, for tests and benchmarks/ui_check.py: a prep
config over pydoc's topic pages (they ship with Python), byte tokens packed to 64, and a
tiny training config on its output."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dataprep.stdlib_corpus import topics
from tests.support.factories import train_config


def write_configs(
    tmp: Path,
    steps: int = 30,
    *,
    train_name: str = "train.yaml",
    eval_every: int = 1000,
    checkpoint_every: int = 10,
) -> tuple[Path, Path]:
    """Write the corpus and both configs under `tmp`; returns (prep config, train config).
    Prep writes to `tmp/prep-out`, training to `tmp/run`."""
    corpus = tmp / "topics.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in topics()))
    prep = tmp / "prep.yaml"
    prep.write_text(
        yaml.safe_dump(
            {
                "output": str(tmp / "prep-out"),
                "workers": 1,
                "sources": [{"name": "pydoc", "paths": [str(corpus)]}],
                "dedup": {"exact": True, "near": False},
                "quality": [],
                "pack": {"seq_len": 64},
                "dataset": {"validation_fraction": 0.05},
            }
        )
    )
    train = tmp / train_name
    train.write_text(
        yaml.safe_dump(
            train_config(
                str(tmp / "prep-out" / "dataset"),
                tmp / "run",
                steps=steps,
                eval_every=eval_every,
                eval_batches=2,
                checkpoint={"every": checkpoint_every},
                schedule={"warmup_steps": 3},
            )
        )
    )
    return prep, train
