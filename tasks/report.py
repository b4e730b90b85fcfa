"""The run's accounting: per stage and per source, documents and bytes in, kept, and
dropped by reason, checked so that no document is ever unaccounted for."""

from __future__ import annotations

import json
from typing import Any

from core.store import Store
from tasks.layout import ShardStats, SourceStats, read_done

REPORT_KEY = "report.json"


class AccountingError(RuntimeError):
    """A stage lost or invented documents: the run must not pass as complete."""


def stage_totals(store: Store, stage: str, shards: list[str]) -> dict[str, SourceStats]:
    totals: dict[str, SourceStats] = {}
    for shard in shards:
        stats = ShardStats.from_json(read_done(store, stage, shard)["stats"])
        for src, s in stats.items():
            totals.setdefault(src, SourceStats()).merge(s)
    return totals


def check(stages: list[tuple[str, dict[str, SourceStats]]]) -> list[str]:
    """Every problem with the accounting: docs_in != kept + dropped inside a stage, or a
    stage that received a different number of documents than the previous one kept."""
    problems = []
    prev: dict[str, SourceStats] | None = None
    prev_name = ""
    for name, totals in stages:
        for src, s in sorted(totals.items()):
            if s.docs_in != s.kept + s.n_dropped:
                problems.append(f"{name}/{src}: docs_in {s.docs_in} != kept {s.kept} + "
                                f"dropped {s.n_dropped}")
        if prev is not None:
            for src in sorted(set(prev) | set(totals)):
                got = totals.get(src, SourceStats()).docs_in
                want = prev.get(src, SourceStats()).kept
                if got != want:
                    problems.append(f"{name}/{src}: received {got} documents but {prev_name} "
                                    f"kept {want}")
        prev, prev_name = totals, name
    return problems


def build(store: Store, stages: list[tuple[str, list[str]]], extra: dict[str, Any]) -> dict:
    """Aggregate every stage's shard markers into report.json; raise AccountingError
    (after writing the report, so the numbers can be inspected) if anything is off."""
    per_stage = [(name, stage_totals(store, name, shards)) for name, shards in stages]
    problems = check(per_stage)
    report: dict[str, Any] = {"stages": {}, "problems": problems, **extra}
    for name, totals in per_stage:
        total = SourceStats()
        for s in totals.values():
            total.merge(s)
        report["stages"][name] = {
            "total": total.to_json(),
            "sources": {src: s.to_json() for src, s in sorted(totals.items())},
        }
    write(store, report)
    if problems:
        raise AccountingError("document accounting does not add up:\n  " + "\n  ".join(problems))
    return report


def write(store: Store, report: dict[str, Any]) -> None:
    store.put(REPORT_KEY, json.dumps(report, indent=2, sort_keys=True).encode())
