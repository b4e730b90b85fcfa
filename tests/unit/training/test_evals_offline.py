"""How `ballast eval` builds its evals config from the run's section and the command line
(training/evals/offline.py), and its table."""

from __future__ import annotations

import pytest

from training.config.evals import EvalsConfig, EvalTask, EvalText
from training.evals.offline import EvalError, evals_config, table

RUN = EvalsConfig(
    every=50,
    limit=40,
    batch_size=8,
    tasks=["arc_easy", EvalTask(name="mine", path="data/mine.jsonl", metric="acc_per_char")],
    texts=[EvalText(name="owt", path="data/owt.jsonl")],
)


def test_the_runs_section_as_it_is() -> None:
    cfg = evals_config(RUN)
    assert cfg == RUN  # limit and batch size too: the loop's batches, the loop's numbers


def test_tasks_name_what_is_scored_and_keep_the_runs_definitions() -> None:
    cfg = evals_config(RUN, tasks="mine,hellaswag")
    assert [t.name for t in cfg.task_list()] == ["mine", "hellaswag"]
    mine = cfg.task_list()[0]
    assert mine.path == "data/mine.jsonl" and mine.metric == "acc_per_char"
    assert cfg.texts == []  # named tasks only: the run's text sets are not scored


def test_a_path_on_the_command_line_wins() -> None:
    cfg = evals_config(RUN, tasks="mine=other.jsonl", texts="owt,new=new.jsonl")
    assert cfg.task_list()[0].path == "other.jsonl" and cfg.task_list()[0].metric is None
    assert [(t.name, t.path) for t in cfg.texts] == [
        ("owt", "data/owt.jsonl"),
        ("new", "new.jsonl"),
    ]


def test_limit_and_batch_size() -> None:
    assert evals_config(RUN, limit=None).limit is None  # --limit 0: every item
    assert evals_config(RUN, limit=7, batch_size=3).model_dump()["limit"] == 7
    assert evals_config(RUN, batch_size=3).batch_size == 3


def test_without_a_section_the_command_line_says_what() -> None:
    with pytest.raises(EvalError, match="no `evals` section"):
        evals_config(None)
    assert evals_config(None, tasks="arc_easy").limit == 500  # the section's default


@pytest.mark.parametrize(
    ("tasks", "texts", "message"),
    [
        (",", None, "no names"),
        ("a=", None, "NAME=PATH"),
        (None, "unknown", "--texts unknown"),
        ("arc_easy,arc_easy", None, "unique"),
    ],
)
def test_bad_names(tasks: str | None, texts: str | None, message: str) -> None:
    with pytest.raises(EvalError, match=message):
        evals_config(RUN, tasks=tasks, texts=texts)


def test_table_marks_the_primary_metric_and_aligns() -> None:
    lines = table(
        [
            {
                "task": "arc_easy",
                "metric": "acc",
                "value": 0.5,
                "stderr": 0.1,
                "n": 4,
                "primary": True,
            },
            {"task": "owt", "metric": "bpb", "value": 1.25, "stderr": float("nan"), "n": 1},
        ]
    )
    assert lines[1].split() == ["arc_easy", "acc", "*", "0.5000", "±", "0.1000", "4"]
    assert lines[2].split() == ["owt", "bpb", "1.2500", "±", "nan", "1"]
    assert len({len(line) for line in lines}) == 1
