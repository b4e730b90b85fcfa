"""Shared test helpers: where the repository, the shared corpora and the test fixtures are,
JSONL files, planted-duplicate makers, the CLI in a subprocess and its one-line errors."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

# The repository; ../shared/data beside it (corpora the tests read, skipped when absent);
# tests/fixtures (recorded data kept with the tests).
ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
FIXTURES = ROOT / "tests" / "fixtures"


def shared_file(name: str) -> Path:
    p = SHARED / name
    if not p.is_file():
        pytest.skip(f"shared corpus {p} is not present")
    return p


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if limit and len(out) >= limit:
                break
    return out


def edit_words(text: str, frac: float, rng: random.Random) -> str:
    """Replace a fraction of the words with random new ones (at least one)."""
    words = text.split()
    k = max(1, round(frac * len(words)))
    for i in rng.sample(range(len(words)), min(k, len(words))):
        words[i] = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(7))
    return " ".join(words)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def watch_latest(
    s3_client: Any, bucket: str, prefix: str, seen: list[str], stop: threading.Event
) -> threading.Thread:
    """A thread that reads `<prefix>/latest` straight from the S3 server every 50 ms and
    records the checkpoint it names, or "PARTIAL ..." when that checkpoint has no
    meta.json (a reader would then see a partial checkpoint)."""

    def watch() -> None:
        while not stop.is_set():
            try:
                name = (
                    s3_client.get_object(Bucket=bucket, Key=f"{prefix}/latest")["Body"]
                    .read()
                    .decode()
                    .strip()
                )
                s3_client.head_object(Bucket=bucket, Key=f"{prefix}/{name}/meta.json")
                seen.append(name)
            except s3_client.exceptions.NoSuchKey:
                pass
            except Exception as e:  # a latest naming a checkpoint without meta.json
                seen.append(f"PARTIAL {e}")
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def cli_env() -> dict[str, str]:
    # No COLUMNS/LINES from the test runner's terminal: the CLI sees what a pipe gives it.
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


def run_cli(
    *args: str, env: dict[str, str] | None = None, **kw: object
) -> subprocess.CompletedProcess[str]:
    """`ballast ARGS` in a subprocess from the repository root, as a user runs it (`env`:
    variables set on top of the test's own)."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**cli_env(), **(env or {})},
        **kw,
    )  # type: ignore[call-overload]


def assert_one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The CLI's contract for bad input: one line on stderr naming the cause, no
    traceback. Returns the line."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]
