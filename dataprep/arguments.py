"""The command-line arguments of a prep run, defined once for `ballast prep`
(cli/commands/prep.py) and `python -m flows.prep`; `--output` also for the commands that
run prep as part of more (`python -m flows.pipeline`, `ballast deploy`). Only argparse is
imported here, so building a parser costs no import of the prep stages."""

from __future__ import annotations

import argparse


class StageNames:
    """The stage graph's names (dataprep/graph.py), for `--until`'s help: read only when help
    is printed (argparse formats `%(stages)s` with the action's attributes), so that no
    other command pays for importing the prep stages."""

    def __str__(self) -> str:
        from dataprep.graph import STAGE_NAMES

        return ", ".join(STAGE_NAMES)


def add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", help="override the prep config's `output:` (local path or s3://bucket/prefix)"
    )


def add_prep_arguments(parser: argparse.ArgumentParser) -> None:
    """The run config and what a run of it may change: where it writes, where it stops,
    where it runs, and whether changed inputs start a new version from scratch."""
    parser.add_argument("config", help="path to the run config (YAML)")
    add_output(parser)
    parser.add_argument("--until", help="stop after this stage (%(stages)s)").stages = StageNames()
    parser.add_argument(
        "--dask",
        metavar="ADDRESS",
        help="run on the Dask cluster whose scheduler is at ADDRESS "
        "(tcp://HOST:8786; default: $DASK_SCHEDULER_ADDRESS if set; "
        "`local`: this machine); inputs and output must then be where "
        "every worker reaches them (s3://)",
    )
    parser.add_argument(
        "--from-scratch",
        action="store_true",
        help="when inputs an earlier version read have changed or gone: "
        "build a new version from all current inputs (default: refuse)",
    )
