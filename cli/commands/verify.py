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
    from core.dataset import resolve, verify
    from core.store import StorageError

    try:
        uri = resolve(args.dataset)  # a dataset root: its newest version
        if uri != args.dataset:
            stderr_console().print(f"{args.dataset}: newest version {uri}", markup=False)
        problems = verify(uri)
    except StorageError as e:
        print_error(str(e))
        return EXIT_ERROR
    if problems:
        err = stderr_console()
        err.print(f"{args.dataset} does NOT match its manifest:", markup=False)
        for p in problems:
            err.print(f"  - {p}", markup=False, highlight=False)
        return EXIT_ERROR
    Console().print(f"{args.dataset}: every file matches its manifest", markup=False)
    return EXIT_OK
