"""Line dedup on a corpus where no line is common enough: prep completes and keeps every
document (it crashed: `zip() argument 3 is longer` on an empty table of common lines)."""

from __future__ import annotations

import json
from pathlib import Path

from dataprep.config import parse_config
from dataprep.pipeline import run_prep


def test_no_common_line_keeps_everything(tmp_path: Path) -> None:
    corpus = tmp_path / "web.jsonl"
    corpus.write_text(
        "".join(
            json.dumps(
                {
                    "text": f"Document {i} has a line of its own about topic {i * 7}.\n"
                    f"And a second line, number {i}, also seen only here today."
                }
            )
            + "\n"
            for i in range(30)
        )
    )
    out = tmp_path / "out"
    run_prep(
        parse_config(
            {
                "output": str(out),
                "workers": 1,
                "sources": [
                    {
                        "name": "web",
                        "paths": [str(corpus)],
                        "line_dedup": {"max_docs": 10, "min_line_chars": 20},
                    }
                ],
                "dedup": {"exact": False, "near": False},
                "quality": [],
                "pack": {"seq_len": 64},
                "dataset": {"validation_fraction": 0.0},
            }
        ),
        until="lines",
        progress=False,
    )
    version = (
        (out / "dataset" / "latest").read_text().strip()
        if (out / "dataset" / "latest").exists()
        else "v0001"
    )
    report = json.loads((out / version / "report.json").read_text())
    lines = report["stages"]["lines"]["sources"]["web"]
    assert lines["docs_in"] == lines["kept"] == 30 and not lines["dropped"]
