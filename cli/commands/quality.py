"""`ballast quality train`: a fastText quality classifier (the `classifier` rule's model)
trained on labelled pages, with its threshold and a held-out report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from cli.console import print_error
from core.protocol import EXIT_ERROR, EXIT_OK


def add_parser(subparsers: Any) -> None:
    qu = subparsers.add_parser("quality", help="quality classifier tools")
    sub = qu.add_subparsers(dest="quality_command", required=True)
    t = sub.add_parser(
        "train",
        help="train a fastText quality classifier (the "
        "`classifier` rule's model) on labelled pages",
    )
    t.add_argument(
        "--positive",
        action="append",
        default=[],
        metavar="JSONL",
        help="good pages (JSONL with a text field); repeatable",
    )
    t.add_argument(
        "--negative", action="append", default=[], metavar="JSONL", help="bad pages; repeatable"
    )
    t.add_argument(
        "--labelled",
        action="append",
        default=[],
        metavar="JSONL",
        help="pages with a 1/0 label field; repeatable",
    )
    t.add_argument("--label-field", default="label")
    t.add_argument("--text-field", default="text")
    t.add_argument(
        "--out",
        required=True,
        metavar="MODEL.bin",
        help="the model file; MODEL.report.json is written next to it",
    )
    t.add_argument(
        "--features",
        choices=["text", "text+stats"],
        default="text+stats",
        help="words and bigrams, plus the heuristic statistics as tokens",
    )
    t.add_argument("--epoch", type=int, default=25)
    t.add_argument("--lr", type=float, default=0.5)
    t.add_argument("--word-ngrams", type=int, default=2)
    t.add_argument("--holdout", type=float, default=0.2, help="held-out share for the report")
    t.add_argument(
        "--keep-good",
        type=float,
        default=0.85,
        help="the threshold keeps at least this share of good training pages",
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1, help="more is faster, not reproducible")
    t.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from dataprep.quality.train_classifier import (
        ClassifierTrainConfig,
        TrainError,
        load_calibrated,
        train,
    )

    if not (args.positive or args.negative or args.labelled):
        print_error("give --positive and --negative files, or --labelled")
        return EXIT_ERROR
    try:
        texts, labels, calibrate = load_calibrated(
            args.positive, args.negative, args.labelled, args.label_field, args.text_field
        )
        cfg = ClassifierTrainConfig(
            features=args.features,
            epoch=args.epoch,
            lr=args.lr,
            word_ngrams=args.word_ngrams,
            holdout=args.holdout,
            keep_good=args.keep_good,
            seed=args.seed,
            threads=args.threads,
        )
        r = train(
            texts,
            labels,
            args.out,
            cfg,
            sources={
                "positive": args.positive,
                "negative": args.negative,
                "labelled": args.labelled,
            },
            calibrate=calibrate,
        )
    except TrainError as e:
        print_error(str(e))
        return EXIT_ERROR
    h = r["held_out"]
    Console(soft_wrap=True).print(
        f"{args.out}: threshold {r['threshold']:.4g} ({r['threshold_rule']}); "
        f"held out ({h['good']} good, {h['bad']} bad): good kept "
        f"{h['good_kept']:.1%}, bad kept {h['bad_kept']:.1%}, precision "
        f"{h['precision']:.1%}; report "
        f"{Path(args.out).with_suffix('.report.json')}",
        markup=False,
        highlight=False,
    )
    return EXIT_OK
