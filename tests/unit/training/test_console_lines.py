"""The console's lines stay whole when two threads speak at once (the async checkpoint
writer reports "checkpoint at step N" while the loop prints progress)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from training.console import Console


def test_lines_from_two_threads_stay_whole(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    console = Console(tmp_path, is_main=True)

    def talk(words: str) -> None:
        for i in range(3000):
            console.say(f"{words} {i}")

    threads = [threading.Thread(target=talk, args=(w,)) for w in ("checkpoint at step", "step")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = capfd.readouterr().err.splitlines()
    # With print's two writes (text, then newline) this saw "checkpoint at step 6step 9"
    # and bare blank lines.
    assert len(lines) == 6000
    assert all(line.count("step") == 1 and line.split(" ")[-1].isdigit() for line in lines)
