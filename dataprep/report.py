"""The run's accounting: per stage and per source, documents and bytes in, kept, and
dropped by reason, checked so that no document is ever unaccounted for."""

from __future__ import annotations

import itertools
import json
from typing import Any

from core.store import Store
from dataprep.config import PrepConfig
from dataprep.layout import ShardStats, SourceStats, output_store, read_done, version_store

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


def check(
    stages: list[tuple[str, dict[str, SourceStats]]],
    received: dict[str, dict[str, SourceStats]] | None = None,
) -> list[str]:
    """Every problem with the accounting: docs_in != kept + dropped inside a stage, or a
    stage that received a different number of documents than the previous one kept.
    `received[name]`: what the previous stage kept of the documents stage `name` reads,
    where that is not the previous stage's own total (a stage over every version's
    documents after stages over the new ones)."""
    problems = []
    prev: dict[str, SourceStats] | None = None
    prev_name = ""
    for name, totals in stages:
        if prev is not None and received and name in received:
            prev = received[name]
        for src, s in sorted(totals.items()):
            if s.docs_in != s.kept + s.n_dropped:
                problems.append(
                    f"{name}/{src}: docs_in {s.docs_in} != kept {s.kept} + dropped {s.n_dropped}"
                )
        if prev is not None:
            for src in sorted(set(prev) | set(totals)):
                got = totals.get(src, SourceStats()).docs_in
                want = prev.get(src, SourceStats()).kept
                if got != want:
                    problems.append(
                        f"{name}/{src}: received {got} documents but {prev_name} kept {want}"
                    )
        prev, prev_name = totals, name
    return problems


def _json(per_stage: list[tuple[str, dict[str, SourceStats]]]) -> dict[str, Any]:
    out = {}
    for name, totals in per_stage:
        total = SourceStats()
        for s in totals.values():
            total.merge(s)
        out[name] = {
            "total": total.to_json(),
            "sources": {src: s.to_json() for src, s in sorted(totals.items())},
        }
    return out


def build(
    cfg: PrepConfig,
    stages: list[tuple[str, list[str], bool]],
    extra: dict[str, Any],
    all_versions: dict[str, list[str]] | None = None,
) -> dict:
    """Aggregate every stage's shard markers (name, shards, whether they are in the
    version's store) into the version's report.json; raise AccountingError (after writing
    the report, so the numbers can be inspected) if anything is off.

    `all_versions`: for a version that builds on earlier ones, each stage's names over
    all of them: the report then also holds, under "all_versions", every stage's
    accounting over all of the version's documents."""
    store, vstore = output_store(cfg), version_store(cfg)

    def totals(name: str, shards: list[str], versioned: bool) -> dict[str, SourceStats]:
        return stage_totals(vstore if versioned else store, name, shards)

    per_stage = [(name, totals(name, shards, v)) for name, shards, v in stages]
    received = {}
    for (pname, _ps, pver), (name, shards, ver) in itertools.pairwise(stages):
        if ver and not pver:  # a stage over all the version's documents, after this run's
            received[name] = totals(pname, shards, pver)
    problems = check(per_stage, received)
    report: dict[str, Any] = {"stages": _json(per_stage), "problems": problems, **extra}
    if all_versions is not None:
        report["all_versions"] = _json(
            [(name, totals(name, all_versions[name], v)) for name, _shards, v in stages]
        )
    write(vstore, report)
    if problems:
        raise AccountingError("document accounting does not add up:\n  " + "\n  ".join(problems))
    return report


def write(store: Store, report: dict[str, Any]) -> None:
    store.put(REPORT_KEY, json.dumps(report, indent=2, sort_keys=True).encode())
