"""The `ballast` command line. `ballast prep CONFIG` runs data prep on this machine with
progress bars and a summary table; no Prefect server is needed. Each command is a module
of cli/commands/ (its parser beside the code that runs it); this module puts them under
one parser and handles what every command shares.

Exit codes follow the architecture: 0 done, 1 a clear error (bad arguments, bad config,
bad inputs, unreachable storage, accounting that does not add up, an operating-system error
such as a full disk), 130 interrupted (Ctrl-C). Errors are one line on stderr, not a
traceback and not argparse's usage.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from cli.commands import ablate, blame, deploy, export, hpo, prep, quality, track, train, verify
from cli.commands import eval as evaluate  # `eval` would hide the builtin
from cli.console import print_error, stderr_console
from core.os_errors import os_error_message
from core.protocol import EXIT_ERROR, EXIT_INTERRUPTED

__all__ = [
    "COMMANDS",
    "Parser",
    "UsageError",
    "build_parser",
    "main",
    "os_error_message",
    "print_error",
    "stderr_console",
]

# In the order `ballast --help` lists them.
COMMANDS = (prep, verify, train, track, blame, evaluate, hpo, ablate, quality, deploy, export)


class UsageError(Exception):
    """An argument argparse refused: an unknown flag or command, a bad choice or value, a
    missing argument."""


class Parser(argparse.ArgumentParser):
    """argparse with its errors as every other error of the CLI: one line, exit 1.
    argparse's own print the usage and exit 2, the code core/protocol.py gives to a
    crashed run (restart and resume). Subcommands' parsers are of this class too
    (add_subparsers makes its parsers of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see `{self.prog} --help`")


def _name_by_choices(parser: argparse.ArgumentParser) -> None:
    """Name every level of subcommands by its choices (`{hf,dataset}`) in errors too, as
    the usage does: argparse names them by their dest ("the following arguments are
    required: format")."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.metavar = action.metavar or "{" + ",".join(action.choices) + "}"
            for sub in action.choices.values():
                _name_by_choices(sub)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="ballast",
        description="Ballast: prepare LLM pre-training data and keep the training run on it alive.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    _name_by_choices(p)
    return p


def main(argv: list[str] | None = None) -> int:
    command = None
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        return int(args.func(args))
    except UsageError as e:
        print_error(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        # `ballast prep` has stopped its workers by now (run_prep); every finished shard
        # is kept, so the same command carries on where this one stopped. (`ballast
        # train` says so itself, with its step and checkpoint, once training has begun.)
        again = "; run the same command again to resume" if command in ("prep", "train") else ""
        stderr_console().print(f"interrupted{again}", markup=False)
        return EXIT_INTERRUPTED
    except OSError as e:  # what a command did not turn into a clearer error itself
        print_error(os_error_message(e))
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
