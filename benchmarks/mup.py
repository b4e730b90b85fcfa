"""Benchmark: does the learning rate transfer across width under muP?

    python benchmarks/mup.py [--steps 150] [--out benchmarks/results/mup.json]

Trains 2-layer models of width 64, 128 and 256 (head_dim fixed at 32) for `--steps`
steps (warmup + cosine) on byte-level tinyshakespeare at a grid of learning rates, once
with the standard parametrisation and once with muP (base width 64), and reports the
final validation loss per (width, lr) and the best lr per width. Under muP the best lr
should stay put as the width grows; under the standard parametrisation it drifts down.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WIDTHS = (64, 128, 256)
LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)


def final_loss(dataset: str, work: Path, width: int, lr: float, mup: bool, steps: int,
               seed: int = 0) -> float:
    from training.config import parse_train_config
    from training.metrics import read
    from training.train import Trainer

    run = work / f"{'mup' if mup else 'sp'}-{width}-{lr:g}-s{seed}"
    shutil.rmtree(run, ignore_errors=True)
    model = {"d_model": width, "n_layer": 2, "n_head": width // 32}
    if mup:
        model["mup_base_d_model"] = WIDTHS[0]
    cfg = parse_train_config({
        "dataset": dataset, "run_dir": str(run), "seed": seed, "steps": steps, "micro_batch": 16,
        "eval_every": steps, "eval_batches": 40, "log_every": 1, "model": model,
        "optim": {"lr": lr, "betas": [0.9, 0.95]},
        "schedule": {"kind": "cosine", "warmup_steps": steps // 10, "min_lr_ratio": 0.1},
        "guards": {"enabled": False}, "checkpoint": {"every": steps, "keep_last": 1},
    })
    Trainer(cfg).run()
    # Validation loss after a full warmup + cosine schedule: far less noisy than the
    # training loss at a constant learning rate.
    value = [r["val_loss"] for r in read(run / "metrics.jsonl") if r.get("kind") == "eval"][-1]
    shutil.rmtree(run, ignore_errors=True)
    return value if math.isfinite(value) else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in LRS),
                    help="comma-separated learning rates")
    ap.add_argument("--widths", default=",".join(str(w) for w in WIDTHS))
    ap.add_argument("--seeds", type=int, default=1, help="runs per point; the mean is used")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mup.json"))
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-mup"))
    args = ap.parse_args()
    from train_cpu import prepared_dataset

    dataset = prepared_dataset()
    if dataset is None:
        print("skip: tinyshakespeare.txt not found in the shared data")
        return
    work = Path(args.workdir)
    lrs = [float(x) for x in args.lrs.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    result: dict = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
                    "steps": args.steps, "widths": widths, "lrs": lrs, "seeds": args.seeds,
                    "runs": {}}
    for mode in ("sp", "mup"):
        table = {}
        for w in widths:
            table[w] = {lr: sum(final_loss(str(dataset), work, w, lr, mode == "mup",
                                           args.steps, seed) for seed in range(args.seeds))
                        / args.seeds for lr in lrs}
            best = min(table[w], key=table[w].get)
            print(f"{mode} width {w}: " + "  ".join(f"lr {lr:g}: {v:.3f}"
                                                   for lr, v in table[w].items())
                  + f"   best lr {best:g}")
        result["runs"][mode] = {
            "loss": {str(w): {f"{lr:g}": round(v, 4) for lr, v in t.items()}
                     for w, t in table.items()},
            "best_lr": {str(w): min(t, key=t.get) for w, t in table.items()},
        }
    for mode in ("sp", "mup"):
        best = result["runs"][mode]["best_lr"]
        print(f"{mode}: best lr by width {best}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
