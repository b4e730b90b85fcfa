"""A small corpus whose big files are split into several ingest units (a big and a small
jsonl file, a parquet file of four row groups), its prep config, and what the tests of
re-runs on an existing output share: the output's mtimes, the CLI and its one-line error."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.helpers import assert_one_line_error, run_cli


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices("abcdefghij", k=rng.randint(2, 8))) for _ in range(n))


def jsonl_rows(path: Path, start: int, n: int, seed: int = 0, mode: str = "w") -> None:
    rng = random.Random(seed * 1000 + start)
    with open(path, mode, encoding="utf-8") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"{path.stem}-{i}", "text": words(rng, 40)}) + "\n")


def make_corpus(root: Path) -> Path:
    """web/: a big jsonl file (split into several parts), a small one; code.parquet: four
    row groups (split too)."""
    (root / "web").mkdir(parents=True)
    jsonl_rows(root / "web" / "big.jsonl", 0, 60)
    jsonl_rows(root / "web" / "small.jsonl", 0, 10, seed=1)
    rng = random.Random(2)
    rows = [
        {"id": f"c{i}", "text": f"def f{i}(x):\n    return x + {i}  # {words(rng, 20)}"}
        for i in range(80)
    ]
    pq.write_table(pa.Table.from_pylist(rows), root / "code.parquet", row_group_size=20)
    return root


def cfg_dict(data: Path, out: Path) -> dict[str, Any]:
    return {
        "output": str(out),
        "workers": 1,
        "seed": 1,
        "sources": [
            {"name": "web", "paths": [str(data / "web")], "id_field": "id"},
            {
                "name": "code",
                "paths": [str(data / "code.parquet")],
                "id_field": "id",
                "quality": [],
            },
        ],
        "ingest": {"shard_docs": 50},
        "quality": ["length"],
        "pack": {"seq_len": 128, "strategy": "bfd", "window": 100},
        "dataset": {"validation_fraction": 0.05, "train_shards": 1, "pack_partitions": 2},
    }


def mtimes(out: Path) -> dict[str, int]:
    """Every file of the output but the report (rewritten by every run), with its mtime."""
    return {
        str(p.relative_to(out)): p.stat().st_mtime_ns
        for p in out.rglob("*")
        if p.is_file() and p.name != "report.json"
    }


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


def one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stderr)
    return assert_one_line_error(r, *needles)


def build(
    factory: pytest.TempPathFactory, name: str, run: Callable[[dict[str, Any]], dict[str, Any]]
) -> tuple[Path, Path, dict[str, Any]]:
    """A corpus and an output made from it by `run`: (data, output, report)."""
    data = make_corpus(factory.mktemp(f"{name}-data"))
    out = factory.mktemp(f"{name}-out") / "run"
    return data, out, run(cfg_dict(data, out))


def copy_output(data: Path, out: Path, at: Path) -> tuple[Path, Path]:
    """A copy of a corpus and the output made from it (at/data, at/out), its records
    naming the copy's inputs as a run of its own would (claim, inventory)."""
    import shutil

    from dataprep.config import parse_config

    d, o = at / "data", at / "out"
    shutil.copytree(data, d)
    shutil.copytree(out, o)
    for rel in ("_inputs.json", "_versions/v0001.json"):
        p = o / rel
        p.write_text(p.read_text().replace(str(data), str(d)))
    claim = json.loads((o / "_run.json").read_text())
    claim["config_fingerprint"] = parse_config(cfg_dict(d, o)).fingerprint()
    (o / "_run.json").write_text(json.dumps(claim))
    return d, o
