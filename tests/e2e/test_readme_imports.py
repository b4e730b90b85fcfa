"""What the README promises about reading exports in the project's venv (issue 29, item 6):
its StreamingDataset snippet runs as written, in a fresh interpreter (the venv installs
mosaicml-streaming without torchvision, so the package's own `from streaming import
StreamingDataset` is not the way there)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.helpers import ROOT


def test_readme_streaming_import_runs_in_the_venv():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    (snippet,) = [b for b in blocks if "StreamingDataset" in b]
    r = subprocess.run(
        [sys.executable, "-c", snippet + "\nprint(StreamingDataset.__module__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("streaming."), r.stdout
