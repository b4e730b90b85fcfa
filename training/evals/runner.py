"""An evaluator: the tasks and text sets of an `evals` config, loaded and tokenized once,
scored on any model callable. The trainer's `evals` component and `ballast eval` both use
it, so the numbers in the loop and after training come from the same code."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from training.config.evals import EvalsConfig
from training.evals.score import (
    EncodedTask,
    EncodedText,
    Forward,
    Scores,
    Seq,
    encode_task,
    encode_text,
    logprob_sums,
    task_scores,
    text_scores,
)
from training.evals.tasks import load_task, load_text
from training.evals.tokenizer import EvalTokenizer


@dataclass
class Result:
    scores: list[Scores]
    seconds: float
    sequences: int
    tokens: int

    def record_fields(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.scores:
            out.update(s.record_fields())
        return out


class Evaluator:
    """Raises EvalDataError (one line) when a task or text set cannot be read or encoded."""

    def __init__(self, cfg: EvalsConfig, tok: EvalTokenizer, seq_len: int) -> None:
        self.cfg = cfg
        self.tasks: list[EncodedTask] = [
            encode_task(load_task(spec, cfg.limit), tok, seq_len) for spec in cfg.task_list()
        ]
        self.texts: list[EncodedText] = [
            encode_text(load_text(spec, cfg.limit), tok, seq_len) for spec in cfg.texts
        ]
        # One pass over every sequence of every set: batches fill across sets.
        self.seqs: list[Seq] = [s for e in self.tasks for s in e.seqs] + [
            s for e in self.texts for s in e.seqs
        ]
        self.tokens = sum(len(s.ids) - 1 for s in self.seqs)

    def notes(self) -> list[str]:
        """What a person should know before the numbers: items left out."""
        return [
            f"evals: {e.task.name}: {e.skipped} of {len(e.task.items)} items left out "
            "(a choice longer than the model's seq_len in tokens)"
            for e in self.tasks
            if e.skipped
        ]

    def metrics(self) -> dict[str, str]:
        """Each set's metric that regressions are judged on."""
        return {e.task.name: e.task.metric for e in self.tasks} | {
            e.text.name: "bpb" for e in self.texts
        }

    def run(
        self,
        forward: Forward,
        device: torch.device,
        rank: int = 0,
        size: int = 1,
        group: Any = None,
    ) -> Result:
        """`rank`, `size`, `group`: the data-parallel layout (logprob_sums says more)."""
        t0 = time.perf_counter()
        sums = logprob_sums(forward, self.seqs, self.cfg.batch_size, device, rank, size, group)
        scores: list[Scores] = []
        at = 0
        for et in self.tasks:
            scores.append(task_scores(et, sums[at : at + len(et.seqs)]))
            at += len(et.seqs)
        for ex in self.texts:
            scores.append(text_scores(ex, sums[at : at + len(ex.seqs)]))
            at += len(ex.seqs)
        assert at == len(sums)
        return Result(scores, time.perf_counter() - t0, len(self.seqs), self.tokens)


def summary_line(step: int, result: Result, metrics: dict[str, str]) -> str:
    """`step 500: evals arc_easy acc 0.412 ± 0.021, owt bpb 1.532 ± 0.011 (4.1 s)`."""
    parts = []
    for s in result.scores:
        m = metrics.get(s.name, next(iter(s.values)))
        parts.append(f"{s.name} {m} {s.values[m]:.4g} ± {s.stderrs[m]:.2g}")
    return f"step {step}: evals " + ", ".join(parts) + f" ({result.seconds:.1f} s)"
