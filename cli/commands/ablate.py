"""`ballast ablate CONFIG`: data ablations (the `ablate` flow, flows/ablate.py): the arms'
preps, their proxies, the comparison table."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from cli.console import print_error
from core.protocol import EXIT_ERROR, EXIT_OK


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "ablate",
        help="compare data recipes by the proxy models they train (the `ablate` flow)",
    )
    p.add_argument("config", help="the ablation config (YAML): base, out, arms, proxy, evals")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from core.errors import ConfigError
    from flows.ablate import ablate, summary_text
    from flows.ablation.config import load_ablation_config

    try:
        load_ablation_config(args.config)  # a bad config is one line here, not a failed run
    except ConfigError as e:
        print_error(str(e))
        return EXIT_ERROR
    r = ablate(args.config)  # on $PREFECT_API_URL, else a temporary local Prefect API
    Console().print(summary_text(r), markup=False, highlight=False)
    missing = [a for a, seeds in r["proxies"].items() if not seeds]
    if missing:
        print_error(f"no proxy finished for: {', '.join(missing)}")
        return EXIT_ERROR
    return EXIT_OK
