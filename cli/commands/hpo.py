"""`ballast hpo run CONFIG`: the hyperparameter search (the `hpo` flow, flows/hpo.py) on
proxy models; `ballast hpo transfer`: its best trial as a training config at another
width (muP)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from cli.console import print_error
from core.protocol import EXIT_ERROR, EXIT_OK
from flows.tuning.arguments import add_search_arguments


def add_parser(subparsers: Any) -> None:
    hp = subparsers.add_parser("hpo", help="hyperparameter search on proxy models (Optuna)")
    sub = hp.add_subparsers(dest="hpo_command", required=True)
    r = sub.add_parser(
        "run",
        help="run the search a config describes (the `hpo` flow; "
        "trials a study holds already are kept)",
    )
    add_search_arguments(r)
    r.set_defaults(func=run_search)
    t = sub.add_parser(
        "transfer",
        help="write a training config at another width with the study's best hyperparameters (muP)",
    )
    t.add_argument(
        "--study",
        required=True,
        metavar="HPO_CONFIG",
        help="the search config the study was run with",
    )
    t.add_argument("--to-width", type=int, required=True, metavar="D", help="the target d_model")
    t.add_argument(
        "--out", required=True, metavar="CONFIG", help="where to write the training config (YAML)"
    )
    t.set_defaults(func=run_transfer)


def run_search(args: argparse.Namespace) -> int:
    from core.errors import ConfigError
    from flows.hpo import hpo, load_hpo_config, summary_text

    try:
        load_hpo_config(args.config)  # a bad config is one line here, not a failed flow run
    except ConfigError as e:
        print_error(str(e))
        return EXIT_ERROR
    r = hpo(args.config)  # on $PREFECT_API_URL, else a temporary local Prefect API
    Console().print(summary_text(r), markup=False, highlight=False)
    if r["best_trial"] is None:
        print_error(f"study {r['study']}: no trial completed")
        return EXIT_ERROR
    return EXIT_OK


def run_transfer(args: argparse.Namespace) -> int:
    from core.errors import ConfigError
    from flows.hpo import HpoError, transfer

    try:
        t = transfer(args.study, args.to_width, args.out)
    except (ConfigError, HpoError) as e:
        print_error(str(e))
        return EXIT_ERROR
    Console().print(
        f"{t['out']}: d_model {t['width']} (muP base {t['base_width']}) with the "
        f"hyperparameters of trial {t['trial']} ({t.get('objective', 'validation loss')} "
        f"{t['value']:.4f}): {t['params']}",
        markup=False,
        highlight=False,
    )
    return EXIT_OK
