"""`ballast export dataset` refuses what it cannot do before it exports anything, in one
line on stderr and exit 1: an output that is a file or lies under one, a directory that
is not empty even when it holds no files (only directories), and a format it does not
know. Before, the first two exported the whole dataset and then failed at the final
rename; a bad format was argparse's usage and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cli
from cli.main import main
from dataprep.export import llmc

ROOT = Path(cli.__file__).resolve().parents[1]


def one_line(err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The splits the llmc writer was asked to write (it still writes them)."""
    calls: list[str] = []
    real = llmc.write_split

    def counted(root, split, *args, **kw):  # type: ignore[no-untyped-def]
        calls.append(split)
        return real(root, split, *args, **kw)

    monkeypatch.setattr(llmc, "write_split", counted)
    return calls


def export(dataset: str, out: Path, *extra: str) -> int:
    return main(
        ["export", "dataset", dataset, str(out), "--format", "llmc", "--no-progress", *extra]
    )


def test_output_that_is_a_file(
    train_dataset: str, tmp_path: Path, writes: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.bin"
    out.write_text("mine")
    assert export(train_dataset, out) == 1
    one_line(capsys.readouterr().err, str(out), "is a file")
    assert writes == []  # refused before exporting anything
    assert out.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]  # no temporary left


def test_output_under_a_file(
    train_dataset: str, tmp_path: Path, writes: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes").write_text("mine")
    out = tmp_path / "notes" / "export"
    assert export(train_dataset, out) == 1
    one_line(capsys.readouterr().err, str(out), f"{tmp_path / 'notes'} is a file")
    assert writes == []


def test_directory_holding_only_directories(
    train_dataset: str, tmp_path: Path, writes: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    (out / "empty").mkdir(parents=True)  # no file anywhere, yet not empty
    assert export(train_dataset, out) == 1
    one_line(capsys.readouterr().err, str(out), "not empty", "empty/")
    assert writes == []
    assert [p.name for p in out.iterdir()] == ["empty"]


def test_empty_directory_is_written(
    train_dataset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert export(train_dataset, out) == 0, capsys.readouterr().err
    assert (out / "ballast_export.json").is_file()


def test_bad_format_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["export", "dataset", str(tmp_path / "ds"), str(tmp_path / "out"), "--format", "parquet"]
    )
    assert code == 1
    one_line(capsys.readouterr().err, "--format", "'parquet'", "megatron", "llmc", "mds")
    assert not (tmp_path / "out").exists()


def test_bad_format_from_the_shell(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "export",
            "dataset",
            str(tmp_path / "ds"),
            str(tmp_path / "out"),
            "--format",
            "bad",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert one_line(r.stderr, "'bad'", "megatron", "llmc", "mds").startswith("error: ")
    assert r.stdout == ""
