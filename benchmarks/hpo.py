"""Benchmark: the demo hyperparameter search (configs/hpo-demo.yaml) from scratch.

    python -m benchmarks.hpo [--n-trials 12] [--parallel 2] [--out benchmarks/results/hpo.json]

Runs the `hpo` flow on a temporary local Prefect API over byte-level tinyshakespeare (the
train_cpu benchmark's prepared dataset, made here if missing), every trial a real training
job on the local backend, and reports trials, pruned trials, wall time, the demo settings'
loss (the first, enqueued trial) and the best loss found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, prepared_dataset, write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "hpo-demo.yaml"))
    ap.add_argument("--n-trials", type=int, help="override `n_trials:`")
    ap.add_argument("--parallel", type=int, help="override `parallel:`")
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-hpo"))
    ap.add_argument("--out", default=str(RESULTS / "hpo.json"))
    args = ap.parse_args()
    dataset = prepared_dataset()
    if dataset is None:
        print("skip: tinyshakespeare.txt not found in the shared data")
        return
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)  # a search from scratch, not a resumed one
    work.mkdir(parents=True)
    # A Prefect home of its own (as `make demo`): no database shared with another server.
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    import yaml

    cfg = yaml.safe_load(Path(args.config).read_text())
    base = Path(cfg["base_config"])
    cfg.update(
        base_config=str(base if base.is_absolute() else ROOT / base),
        dataset=str(dataset),
        out=str(work / "search"),
    )
    for key in ("n_trials", "parallel"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    path = work / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    from flows.hpo import hpo, load_hpo_config, open_study, summary_text

    t0 = time.perf_counter()
    r = hpo(str(path))
    wall = time.perf_counter() - t0
    print(summary_text(r))
    study = open_study(load_hpo_config(path), create=False)
    first = study.trials[0]
    result = {
        "config": str(Path(args.config).relative_to(ROOT)),
        "dataset": "tinyshakespeare, byte tokens, seq_len 64 (benchmarks/train_cpu.py prep)",
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        "n_trials": r["trials"],
        "parallel": cfg["parallel"],
        "steps_per_trial": cfg["steps"],
        "completed": r["completed"],
        "pruned": r["pruned"],
        "failed": r["failed"],
        "wall_s": round(wall, 1),
        "s_per_trial": round(wall / max(r["trials"], 1), 1),
        "demo_settings_loss": first.value,
        "demo_settings_state": first.state.name.lower(),
        "best_loss": r["best_value"],
        "best_trial": r["best_trial"],
        "best_params": r["best_params"],
    }
    write_json(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
