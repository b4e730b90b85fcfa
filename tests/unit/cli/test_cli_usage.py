"""What argparse refuses is an error like any other of `ballast`: one line on stderr
naming the argument and the command's `--help`, exit 1 (argparse's own: the usage and
exit 2, the code a crashed run exits with). `--help` is unchanged."""

from __future__ import annotations

import pytest

from cli.main import main


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`ballast ARGV`'s exit code must be 1 and its stderr one line; returns the line."""
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "usage:" not in captured.err, captured.err
    assert lines[0].startswith("error: ")
    assert captured.out == ""
    return lines[0]


def test_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["prep", "run.yaml", "--no-such-flag"], capsys)
    assert "--no-such-flag" in line and "`ballast --help`" in line


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["preep", "run.yaml"], capsys)
    assert "'preep'" in line and "'prep'" in line


def test_bad_choice(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["deploy", "--pool-type", "slurm"], capsys)
    assert "'slurm'" in line and "'process'" in line and "'kubernetes'" in line
    assert "`ballast deploy --help`" in line


def test_bad_number(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["train", "train.yaml", "--steps", "many"], capsys)
    assert "--steps" in line and "'many'" in line


def test_missing_argument(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["verify"], capsys)
    assert "dataset" in line and "`ballast verify --help`" in line


def test_missing_subcommand_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert "{hf,dataset}" in refused(["export"], capsys)


def test_conflicting_flags(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["blame", "runs/x", "--step", "3", "--event"], capsys)
    assert "--event" in line and "--step" in line


def test_help_is_still_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["export", "dataset", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ballast export dataset") and "--format" in out
