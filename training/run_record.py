"""What a finished run leaves beside its checkpoints: final.json (where it ended, what it
skipped, its config, data and environment) and loss.png."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from training import checkpoint as ckpt
from training import distributed
from training.metrics import plot_loss

if TYPE_CHECKING:
    from training.trainer import Trainer


def environment() -> dict[str, Any]:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "git_commit": commit,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def write_final(t: Trainer, metrics_path: Path) -> None:
    plot_loss(metrics_path, t.run_dir / "loss.png")
    extra: dict[str, Any] = {}
    for c in t.components:
        extra.update(c.final_fields())
    (t.run_dir / "final.json").write_text(
        json.dumps(
            {
                "step": t.state.step,
                "tokens_seen": t.state.tokens_seen,
                "rollbacks": t.state.rollbacks,
                "skipped_non_finite": t.guard.skipped_non_finite,
                "skipped_spikes": t.guard.skipped_spikes,
                "config": t.cfg.model_dump(mode="json"),
                "seed": t.cfg.seed,
                "dataset": {
                    "uri": t.cfg.dataset,
                    "config_fingerprint": t.data.manifest.get("config_fingerprint"),
                },
                # world_size: into how many shares the samples of a micro-batch were split
                # (blame): the data-parallel size (the ranks of a TP group share theirs).
                "environment": {
                    **environment(),
                    "world_size": distributed.dp_rank_and_size(t.world)[1],
                },
                "checkpoint": str(t.ckpt_dir / ckpt.step_name(t.state.step)),
                **extra,
            },
            indent=2,
            default=str,
        )
    )
