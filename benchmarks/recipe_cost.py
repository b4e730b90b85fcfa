"""Benchmark: the per-step cost of recipe options on the CPU benchmark's setup.

    python -m benchmarks.recipe_cost [--rounds 150] [--variants default stats_every_1 ...]
                                     [--out FILE.json]

The setup is benchmarks/train_cpu.py's ballast run (char-level tinyshakespeare, byte
tokens, seq_len 64, 4 layers x 128 wide, 4 heads, batch 12, AdamW). One Trainer per
variant; their `train_step()` calls take turns (round-robin, after 20 warm-up rounds), so
the load of a shared machine drifts over all variants alike. Reported: the median ms per
optimizer step of each variant (accum_steps 2 variants do two micro-batches a step: compare
them with `accum2`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, ROOT, SHARED, prepared_dataset, write_json

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "init_small": {"model": {"init": "small"}},
    "init_tfixup": {"model": {"init": "tfixup"}},
    "dropout_0.1_all": {"model": {"dropout": 0.1}},
    "embd_resid_dropout_0.1": {"model": {"resid_dropout": 0.1, "embd_dropout": 0.1}},
    "attn_dropout_0.1": {"model": {"attn_dropout": 0.1}},
    "drop_path_0.1": {"model": {"drop_path": 0.1}},
    "lr_layer_decay": {"optim": {"lr_layer_decay": 0.8}},
    "param_groups": {"optim": {"param_groups": [{"pattern": "attn", "lr_mult": 0.5}]}},
    "stats_every_10": {"stats_every": 10},
    "stats_every_1": {"stats_every": 1},
    "accum2": {"accum_steps": 2},
    "accum2_noise_10": {"accum_steps": 2, "noise_scale": {"every": 10}},
    "accum2_noise_1": {"accum_steps": 2, "noise_scale": {"every": 1}},
}


def main() -> None:
    from training.config import parse_train_config
    from training.train import Trainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=str(RESULTS / "recipe_cost.json"))
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-recipe"))
    args = ap.parse_args()
    dataset = prepared_dataset()
    if dataset is None:
        print(f"skip: {SHARED / 'tinyshakespeare.txt'} not found")
        return
    work = Path(args.workdir)

    trainers = {}
    for name in args.variants:
        c: dict[str, Any] = {
            "dataset": str(dataset),
            "run_dir": str(work / f"run-{name}"),
            "seed": 1337,
            "steps": 10**6,
            "micro_batch": 12,
            "eval_every": 10**6,
            "model": {"d_model": 128, "n_layer": 4, "n_head": 4},
            "optim": {"name": "adamw", "lr": 2e-3, "betas": [0.9, 0.99], "weight_decay": 0.1},
            "schedule": {"kind": "cosine", "warmup_steps": 100, "min_lr_ratio": 0.1},
            "checkpoint": {"every": 10**6, "keep_last": 1},
        }
        for k, v in VARIANTS[name].items():
            c[k] = {**c[k], **v} if isinstance(c.get(k), dict) else v
        trainers[name] = Trainer(parse_train_config(c))
    times: dict[str, list[float]] = {n: [] for n in trainers}
    try:
        for r in range(args.rounds + 20):
            for name, t in trainers.items():
                t0 = time.perf_counter()
                out = t.train_step()
                ms = 1000 * (time.perf_counter() - t0)
                t.state.step += 1
                t.state.samples_seen += out.samples
                if r >= 20:
                    times[name].append(ms)
    finally:
        for t in trainers.values():
            t.loader.close()
            t.ckpts.close()
    result = {
        "torch_threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "median_ms_per_step": {n: round(statistics.median(v), 2) for n, v in times.items()},
    }
    print(json.dumps(result, indent=2))
    write_json(args.out, result, end="")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
