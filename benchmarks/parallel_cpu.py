"""Benchmark: the step time of each parallel configuration at 2 processes on CPU (gloo), for
the record; the figures that matter are GPU ones (tokens/s and MFU per mesh).

    python -m benchmarks.parallel_cpu [--steps 60] [--repeats 2] [--configs one ddp ...]
                                      [--out FILE.json]

The setup is benchmarks/train_cpu.py's (char-level tinyshakespeare, byte tokens, seq_len 64,
4 layers x 128 wide, 4 heads, micro-batch 12, AdamW), trained by `torchrun` for `--steps`
steps per configuration; the pipeline-parallel rows (pp=2 with each schedule, 2 pieces per
micro-batch) and their one-process baseline `one_untied` untie the embeddings. The
configurations run one after another in the order A B C ... C B A (`--repeats` 2), so a load
that drifts over the run weighs on all of them alike.
Reported per configuration: the median ms per optimizer step over every step but the first
10 (warm-up) and the last (the final checkpoint and evaluation), from the run's own train
records (tokens of the step / its tokens/s). Every process runs one thread (torchrun's
default for several; on a shared machine, two spinning OpenMP threads in one process
measured the neighbours more than the model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import RESULTS, ROOT, SHARED, machine, prepared_dataset, write_json

# name: (processes, the `parallel` setting)
CONFIGS: dict[str, tuple[int, Any]] = {
    "one": (1, "ddp"),
    "ddp": (2, "ddp"),
    "fsdp2": (2, "fsdp2"),
    "tp2": (2, {"tp": 2}),
    # Pipeline parallelism needs untied embeddings (the head is on the last stage), so its
    # rows have their own one-process baseline.
    "one_untied": (1, "ddp"),
    "pp2_gpipe": (2, {"pp": 2, "pp_schedule": "gpipe"}),
    "pp2_1f1b": (2, {"pp": 2, "pp_schedule": "1f1b"}),
    "pp2_interleaved": (2, {"pp": 2, "pp_schedule": "interleaved_1f1b"}),
}
# The model's changes from the default setup, by configuration.
MODEL_OVER: dict[str, dict[str, Any]] = {
    n: {"tie_embeddings": False} for n in ("one_untied", "pp2_gpipe", "pp2_1f1b", "pp2_interleaved")
}
WARMUP = 10


def step_ms(metrics: Path) -> list[float]:
    """Per step after the warm-up: its tokens over its tokens/s, in ms."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    out = []
    for prev, r in itertools.pairwise(train):
        if r["step"] <= WARMUP or r is train[-1] or not r["tokens_per_s"]:
            continue
        out.append(1000 * (r["tokens_seen"] - prev["tokens_seen"]) / r["tokens_per_s"])
    return out


def run(name: str, dataset: Path, work: Path, steps: int) -> list[float]:
    nproc, parallel = CONFIGS[name]
    run_dir = work / f"run-{name}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cfg = {
        "dataset": str(dataset),
        "run_dir": str(run_dir),
        "seed": 1337,
        "steps": steps,
        "micro_batch": 12,
        "eval_every": 10**6,
        "eval_batches": 1,
        "parallel": parallel,
        "model": {"d_model": 128, "n_layer": 4, "n_head": 4, **MODEL_OVER.get(name, {})},
        "optim": {"name": "adamw", "lr": 2e-3, "betas": [0.9, 0.99], "weight_decay": 0.1},
        "schedule": {"kind": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1},
        "checkpoint": {"every": 10**6, "keep_last": 1},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "-m", "training.train", "--config", str(path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    return step_ms(run_dir / "metrics.jsonl")


def _model(name: str) -> dict[str, Any]:
    over = MODEL_OVER.get(name)
    return {"model": over} if over else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", default=str(RESULTS / "parallel_cpu.json"))
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-parallel"))
    args = ap.parse_args()
    dataset = prepared_dataset()
    if dataset is None:
        print(f"skip: {SHARED / 'tinyshakespeare.txt'} not found")
        return
    work = Path(args.workdir)

    times: dict[str, list[float]] = {n: [] for n in args.configs}
    order = args.configs
    for i in range(args.repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            ms = run(name, dataset, work, args.steps)
            times[name] += ms
            print(f"{name}: median {statistics.median(ms):.1f} ms/step", flush=True)
    result = {
        "machine": machine(),
        "steps": args.steps,
        "repeats": args.repeats,
        "configs": {
            n: {"processes": CONFIGS[n][0], "parallel": CONFIGS[n][1], **_model(n)} for n in times
        },
        "median_ms_per_step": {n: round(statistics.median(v), 1) for n, v in times.items()},
    }
    print(json.dumps(result, indent=2))
    write_json(args.out, result, end="")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
