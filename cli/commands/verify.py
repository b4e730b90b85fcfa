"""`ballast verify DATASET`: a prepared dataset checked file by file against its
manifest's checksums."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from cli.console import print_error, stderr_console
from core.protocol import EXIT_ERROR, EXIT_OK


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("verify", help="check a prepared dataset against its manifest")
    p.add_argument("dataset", help="dataset directory or s3:// URI (<output>/dataset)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from core.dataset import not_a_dataset, resolve, shown_path, verify
    from core.store import StorageError

    try:
        uri = resolve(args.dataset)  # a dataset root: its newest version
        missing = not_a_dataset(uri)
        if missing is not None:  # one line, with where it looked, not a list of problems
            print_error(missing)
            return EXIT_ERROR
        if uri != args.dataset:
            stderr_console().print(
                f"{shown_path(args.dataset)}: newest version {shown_path(uri)}", markup=False
            )
        problems = verify(uri)
    except StorageError as e:
        print_error(str(e))
        return EXIT_ERROR
    if problems:
        err = stderr_console()
        err.print(f"{shown_path(uri)} does NOT match its manifest:", markup=False)
        for p in problems:
            err.print(f"  - {p}", markup=False, highlight=False)
        return EXIT_ERROR
    Console(soft_wrap=True).print(
        f"{shown_path(uri)}: every file matches its manifest", markup=False
    )
    return EXIT_OK
