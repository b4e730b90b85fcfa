"""Benchmark: does the learning rate transfer across width under muP? Two subcommands:

    python -m benchmarks.mup sweep [--steps 300] [--out benchmarks/results/mup.json]
    python -m benchmarks.mup transfer [--steps 300] [--out benchmarks/results/hpo_transfer.json]

Both train 2-layer models (head_dim fixed at 32, muP base width 64, warmup + cosine) on
byte-level tinyshakespeare (the train_cpu benchmark's prep).

`sweep`: models of width 64, 128 and 256 for `--steps` steps at a grid of learning rates,
once with the standard parametrisation and once with muP, reporting the final validation
loss per (width, lr) and the best lr per width. Under muP the best lr should stay put as
the width grows; under the standard parametrisation it drifts down.

`transfer`: tune on a narrow proxy, then scale: does the learning rate the `hpo` flow finds
at width 64 transfer to width 256 under muP?
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

from benchmarks.common import RESULTS, ROOT, machine, prepared_dataset, write_json

WIDTHS = (64, 128, 256)
LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
GRID = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)  # transfer's: factor-2 steps


def base_config(dataset: Path, steps: int, width: int, lr: float) -> dict:
    """transfer's training config (written to YAML, trained by `training.train`)."""
    return {
        "dataset": str(dataset),
        "run_dir": "runs/unused",
        "seed": 0,
        "steps": steps,
        "micro_batch": 16,
        "eval_every": steps,
        "eval_batches": 40,
        "log_every": 10,
        "model": {"d_model": width, "n_layer": 2, "n_head": width // 32, "mup_base_d_model": 64},
        "optim": {"lr": lr, "betas": [0.9, 0.95]},
        "schedule": {"kind": "cosine", "warmup_steps": steps // 10, "min_lr_ratio": 0.1},
        "guards": {"enabled": False},
        "checkpoint": {"every": steps, "keep_last": 1},
    }


# ---- sweep -----------------------------------------------------------------------------
def final_loss(
    dataset: str, work: Path, width: int, lr: float, mup: bool, steps: int, seed: int = 0
) -> float:
    from training.config import parse_train_config
    from training.metrics import read
    from training.train import Trainer

    run = work / f"{'mup' if mup else 'sp'}-{width}-{lr:g}-s{seed}"
    shutil.rmtree(run, ignore_errors=True)
    model = {"d_model": width, "n_layer": 2, "n_head": width // 32}
    if mup:
        model["mup_base_d_model"] = WIDTHS[0]
    cfg = parse_train_config(
        {
            "dataset": dataset,
            "run_dir": str(run),
            "seed": seed,
            "steps": steps,
            "micro_batch": 16,
            "eval_every": steps,
            "eval_batches": 40,
            "log_every": 1,
            "model": model,
            "optim": {"lr": lr, "betas": [0.9, 0.95]},
            "schedule": {"kind": "cosine", "warmup_steps": steps // 10, "min_lr_ratio": 0.1},
            "guards": {"enabled": False},
            "checkpoint": {"every": steps, "keep_last": 1},
        }
    )
    Trainer(cfg).run()
    # Validation loss after a full warmup + cosine schedule: far less noisy than the
    # training loss at a constant learning rate.
    value = [r["val_loss"] for r in read(run / "metrics.jsonl") if r.get("kind") == "eval"][-1]
    shutil.rmtree(run, ignore_errors=True)
    return value if math.isfinite(value) else float("inf")


def sweep(args: argparse.Namespace) -> None:
    dataset = prepared_dataset()
    if dataset is None:
        print("skip: tinyshakespeare.txt not found in the shared data")
        return
    work = Path(args.workdir)
    lrs = [float(x) for x in args.lrs.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    result: dict = {
        "machine": machine(),
        "steps": args.steps,
        "widths": widths,
        "lrs": lrs,
        "seeds": args.seeds,
        "runs": {},
    }
    for mode in ("sp", "mup"):
        table = {}
        for w in widths:
            table[w] = {
                lr: sum(
                    final_loss(str(dataset), work, w, lr, mode == "mup", args.steps, seed)
                    for seed in range(args.seeds)
                )
                / args.seeds
                for lr in lrs
            }
            best = min(table[w], key=table[w].get)
            print(
                f"{mode} width {w}: "
                + "  ".join(f"lr {lr:g}: {v:.3f}" for lr, v in table[w].items())
                + f"   best lr {best:g}"
            )
        result["runs"][mode] = {
            "loss": {
                str(w): {f"{lr:g}": round(v, 4) for lr, v in t.items()} for w, t in table.items()
            },
            "best_lr": {str(w): min(t, key=t.get) for w, t in table.items()},
        }
    for mode in ("sp", "mup"):
        best = result["runs"][mode]["best_lr"]
        print(f"{mode}: best lr by width {best}")
    write_json(args.out, result, end="")
    print(f"wrote {args.out}")


# ---- transfer --------------------------------------------------------------------------
def val_loss(config: Path, run_dir: Path) -> float:
    """Train `config` into `run_dir` (a fresh process, as `ballast train` would) and return
    its final validation loss."""
    from training.metrics import read

    shutil.rmtree(run_dir, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "training.train",
            "--config",
            str(config),
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    v = [r["val_loss"] for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "eval"][-1]
    return v if math.isfinite(v) else float("inf")


def transfer_bench(args: argparse.Namespace) -> None:
    import yaml

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
    search.write_text(
        yaml.safe_dump(
            {
                "base_config": str(base),
                "out": str(work / "search"),
                "n_trials": len(GRID),
                "parallel": 2,
                "steps": args.steps,
                "eval_every": args.steps,
                "space": {"optim.lr": {"type": "categorical", "choices": list(GRID)}},
                "enqueue": [{"optim.lr": lr} for lr in GRID],
                "sampler": {"kind": "random"},
                "pruner": {"kind": "none"},
                "poll_s": 0.5,
            }
        )
    )
    from flows.hpo import hpo, load_hpo_config, open_study, transfer

    r = hpo(str(search))
    found = r["best_params"]["optim.lr"]
    study = open_study(load_hpo_config(search), create=False)
    by_lr = {
        f"{t.params['optim.lr']:g}": round(t.value, 4) for t in study.trials if t.value is not None
    }

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
        "steps": args.steps,
        "grid": list(GRID),
        "search_at_64": {
            "val_loss_by_lr": by_lr,
            "best_lr": found,
            "best_val_loss": r["best_value"],
        },
        "sweep_at_256": {f"{lr:g}": round(v, 4) for lr, v in wide.items()},
        "best_lr_at_256": best_wide,
        "grid_steps_apart": abs(GRID.index(found) - GRID.index(best_wide)),
        "transferred_val_loss_256": round(t_loss, 4),
        "default_val_loss_256": round(d_loss, 4),
        "transferred_beats_default": t_loss < d_loss,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
    }
    write_json(args.out, result)
    print(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="lr grid per width, standard parametrisation and muP")
    sw.add_argument("--steps", type=int, default=300)
    sw.add_argument(
        "--lrs", default=",".join(f"{x:g}" for x in LRS), help="comma-separated learning rates"
    )
    sw.add_argument("--widths", default=",".join(str(w) for w in WIDTHS))
    sw.add_argument("--seeds", type=int, default=1, help="runs per point; the mean is used")
    sw.add_argument("--out", default=str(RESULTS / "mup.json"))
    sw.add_argument("--workdir", default=str(ROOT / "runs" / "bench-mup"))
    tr = sub.add_parser("transfer", help="the hpo flow at width 64, transferred to 256")
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument("--workdir", default=str(ROOT / "runs" / "bench-hpo-transfer"))
    tr.add_argument("--out", default=str(RESULTS / "hpo_transfer.json"))
    args = ap.parse_args()
    (sweep if args.cmd == "sweep" else transfer_bench)(args)


if __name__ == "__main__":
    main()
