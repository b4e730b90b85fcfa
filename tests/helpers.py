"""Shared test helpers: where the shared corpora are, and planted-duplicate makers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


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
