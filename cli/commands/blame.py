"""`ballast blame RUN_DIR`: the documents a training step trained on (their sources,
input locations and the quality statistics that kept them), every guard event's batches,
or every step that trained on one document."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from cli.console import print_error
from core.protocol import EXIT_ERROR, EXIT_OK
from training.arguments import add_train_overrides


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "blame",
        help="the documents a training step trained on: "
        "sources, input locations, the quality "
        "statistics that kept them",
    )
    p.add_argument("run_dir", help="the training run directory (its metrics.jsonl)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="step N's batch, as the sampler ordered it after any rollback or "
        "skip (step N is the N-th optimizer step, as the trainer's 'step N/M' lines, "
        "the metrics log and the guard events number it: from 1)",
    )
    what.add_argument(
        "--event",
        action="store_true",
        help="every guard event (skipped spike, rollback window) with its batches",
    )
    what.add_argument("--doc", metavar="ID", help="every step that trained on document ID")
    p.add_argument(
        "--config",
        help="the run's training config (default: final.json's, or its newest checkpoint's)",
    )
    add_train_overrides(p, ("dataset",))  # a moved dataset
    p.add_argument(
        "--world-size",
        type=int,
        help="ranks the run trained on, for the rank of each sample (default: the run's own)",
    )
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from training import blame

    try:
        r = blame.open_run(args.run_dir, args.config, args.dataset, args.world_size)
        if args.step is not None:
            d: Any = blame.step_report(r, args.step)
            lines = blame.step_text(d, r.world_size)
        elif args.event:
            d = blame.events_report(r)
            lines = blame.events_text(d, r.world_size)
        else:
            d = r.steps_with(args.doc)
            lines = blame.doc_text(d)
    except blame.BlameError as e:
        print_error(str(e))
        return EXIT_ERROR
    out = Console(soft_wrap=True, highlight=False)
    if args.json:
        out.print(json.dumps(d, indent=1), markup=False)
    else:
        for line in lines:
            out.print(line, markup=False)
    return EXIT_OK
