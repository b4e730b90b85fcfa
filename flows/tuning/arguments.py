"""The command-line arguments of a search run, defined once for `ballast hpo run`
(cli/commands/hpo.py) and `python -m flows.hpo`. Only argparse is imported here, so
building the CLI's parser costs no import of Prefect or Optuna."""

from __future__ import annotations

import argparse


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the search config (YAML)")
