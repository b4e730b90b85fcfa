"""Benchmark: tune on a narrow proxy, then scale: does the learning rate the `hpo` flow finds
at width 64 transfer to width 256 under muP?

    python benchmarks/hpo_transfer.py [--steps 300] [--out benchmarks/results/hpo_transfer.json]

On byte-level tinyshakespeare (the train_cpu benchmark's prep), with benchmarks/mup.py's
models (2 layers, head size 32, muP base width 64, warmup + cosine):

1. the `hpo` flow searches the learning rate at width 64 over a grid of factor-2 steps
   (every grid point enqueued, no pruning: the whole grid is measured);
2. the same grid is swept directly at width 256, for the best learning rate there;
3. `ballast hpo transfer --to-width 256` writes the wide config from the study, which is
   trained, against the untuned default (the base config's lr 1e-3) at width 256.

Reported: the lr found at 64, the best lr at 256 and how many grid steps apart they are
(the claim: at most one), and the validation losses of the transferred and default runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GRID = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)


def base_config(dataset: Path, steps: int, width: int, lr: float) -> dict:
    return {
        "dataset": str(dataset), "run_dir": "runs/unused", "seed": 0, "steps": steps,
        "micro_batch": 16, "eval_every": steps, "eval_batches": 40, "log_every": 10,
        "model": {"d_model": width, "n_layer": 2, "n_head": width // 32,
                  "mup_base_d_model": 64},
        "optim": {"lr": lr, "betas": [0.9, 0.95]},
        "schedule": {"kind": "cosine", "warmup_steps": steps // 10, "min_lr_ratio": 0.1},
        "guards": {"enabled": False}, "checkpoint": {"every": steps, "keep_last": 1},
    }


def val_loss(config: Path, run_dir: Path) -> float:
    """Train `config` into `run_dir` (a fresh process, as `ballast train` would) and return
    its final validation loss."""
    from training.metrics import read

    shutil.rmtree(run_dir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "training.train", "--config", str(config),
                    "--run-dir", str(run_dir)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    v = [r["val_loss"] for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "eval"][-1]
    return v if math.isfinite(v) else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-hpo-transfer"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         "hpo_transfer.json"))
    args = ap.parse_args()
    from train_cpu import prepared_dataset

    dataset = prepared_dataset()
    if dataset is None:
        print("skip: tinyshakespeare.txt not found in the shared data")
        return
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    t0 = time.perf_counter()

    # 1. The search at width 64.
    base = work / "base-64.yaml"
    base.write_text(yaml.safe_dump(base_config(dataset, args.steps, 64, 1e-3)))
    search = work / "hpo.yaml"
    search.write_text(yaml.safe_dump({
        "base_config": str(base), "out": str(work / "search"), "n_trials": len(GRID),
        "parallel": 2, "steps": args.steps, "eval_every": args.steps,
        "space": {"optim.lr": {"type": "categorical", "choices": list(GRID)}},
        "enqueue": [{"optim.lr": lr} for lr in GRID], "sampler": {"kind": "random"},
        "pruner": {"kind": "none"}, "poll_s": 0.5}))
    from flows.hpo import hpo, load_hpo_config, open_study, transfer

    r = hpo(str(search))
    found = r["best_params"]["optim.lr"]
    study = open_study(load_hpo_config(search), create=False)
    by_lr = {f"{t.params['optim.lr']:g}": round(t.value, 4) for t in study.trials
             if t.value is not None}

    # 2. The direct sweep at width 256.
    wide: dict[float, float] = {}
    for lr in GRID:
        cfg = work / f"wide-{lr:g}.yaml"
        cfg.write_text(yaml.safe_dump(base_config(dataset, args.steps, 256, lr)))
        wide[lr] = val_loss(cfg, work / f"wide-{lr:g}")
        print(f"width 256, lr {lr:g}: val loss {wide[lr]:.4f}")
    best_wide = min(wide, key=lambda lr: wide[lr])

    # 3. Transfer, against the untuned default at 256.
    transferred = work / "transferred-256.yaml"
    transfer(str(search), 256, transferred)
    t_loss = val_loss(transferred, work / "transferred-256")
    d_loss = wide[1e-3]  # the base config's own lr: what an untuned run at 256 uses
    result = {
        "steps": args.steps, "grid": list(GRID),
        "search_at_64": {"val_loss_by_lr": by_lr, "best_lr": found,
                         "best_val_loss": r["best_value"]},
        "sweep_at_256": {f"{lr:g}": round(v, 4) for lr, v in wide.items()},
        "best_lr_at_256": best_wide,
        "grid_steps_apart": abs(GRID.index(found) - GRID.index(best_wide)),
        "transferred_val_loss_256": round(t_loss, 4),
        "default_val_loss_256": round(d_loss, 4),
        "transferred_beats_default": t_loss < d_loss,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
