"""An ablation's results: each proxy's numbers read from its own records (the last
downstream record and the last validation loss in its metrics log, its final.json), the
arms' means with their standard error over seeds, and each arm's difference to the base.

A difference is marked significant when it exceeds two standard errors of the difference
of the two means (each mean's standard error over its seeds, combined): about a 95% level
for normal noise, a conservative call with few seeds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flows.ablation.config import BASE
from training.config.evals import EvalsConfig
from training.evals.regression import LOWER_IS_BETTER
from training.evals.tasks import judged_metric
from training.metrics import read


def compared_keys(evals: EvalsConfig) -> list[str]:
    """What arms are compared on: each task's judged metric and each text set's bpb, the
    same items for every arm. Not the validation loss: each arm's is on its own data."""
    keys = [f"{t.name}/{judged_metric(t)}" for t in evals.task_list()]
    return keys + [f"{t.name}/bpb" for t in evals.texts]


def lower_is_better(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in LOWER_IS_BETTER


def proxy_result(run_dir: Path, keys: list[str]) -> dict[str, Any] | None:
    """A finished proxy's numbers (its last downstream record's), or None when it has no
    final.json yet."""
    final = run_dir / "final.json"
    if not final.is_file():
        return None
    f = json.loads(final.read_text())
    recs = read(run_dir / "metrics.jsonl")
    down = [r for r in recs if r.get("kind") == "downstream"]
    last = down[-1] if down else {}
    values = {k: float(last[k]) for k in keys if k in last}
    return {
        "step": f.get("step"),
        "tokens_seen": f.get("tokens_seen"),
        # Steps whose update the guard dropped (a NaN or a loss spike): their tokens were
        # read but not trained on, so an arm with many skips trained on less than its
        # budget. Said beside the numbers, not corrected for.
        "skipped_steps": int(f.get("skipped_non_finite") or 0) + int(f.get("skipped_spikes") or 0),
        # Rollbacks: the guard went back to the last checkpoint and trained on past the data
        # window, i.e. on other tokens than the other seeds and arms.
        "rollbacks": len(f.get("rollbacks") or []),
        "downstream_step": last.get("step"),
        "values": values,
    }


def _stderr(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


@dataclass
class Cell:
    mean: float
    stderr: float
    n: int
    diff: float | None = None  # arm - base
    diff_stderr: float | None = None
    significant: bool = False
    better: bool | None = None


def aggregate(
    runs: dict[str, dict[int, dict[str, Any]]], keys: list[str]
) -> dict[str, dict[str, Cell]]:
    """arm -> key -> the mean over its seeds, and its difference to the base arm."""
    table: dict[str, dict[str, Cell]] = {}
    for arm, seeds in runs.items():
        table[arm] = {}
        for k in keys:
            xs = np.asarray([r["values"][k] for r in seeds.values() if k in r["values"]])
            if len(xs):
                table[arm][k] = Cell(float(xs.mean()), _stderr(xs), len(xs))
    base = table.get(BASE, {})
    for arm, cells in table.items():
        if arm == BASE:
            continue
        for k, c in cells.items():
            b = base.get(k)
            if b is None:
                continue
            c.diff = c.mean - b.mean
            se = math.sqrt(c.stderr**2 + b.stderr**2)
            c.diff_stderr = se
            c.significant = math.isfinite(se) and se > 0 and abs(c.diff) > 2 * se
            c.better = (c.diff < 0) if lower_is_better(k) else (c.diff > 0)
    return table


def cell_text(c: Cell | None) -> str:
    if c is None:
        return "-"
    s = f"{c.mean:.4g} ± {c.stderr:.2g}" if math.isfinite(c.stderr) else f"{c.mean:.4g}"
    if c.diff is not None:
        mark = " *" if c.significant else ""
        s += f" ({c.diff:+.3g}{mark})"
    return s


def rows(
    table: dict[str, dict[str, Cell]],
    keys: list[str],
    preps: dict[str, dict[str, Any]],
    tokens: dict[str, int],
    runs: dict[str, dict[int, dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """One row per arm: its token budget, the steps each seed's guard skipped and its
    rollbacks, kept
    documents and bytes per source, and each compared value with its difference to the
    base."""
    out = []
    for arm, cells in table.items():
        row: dict[str, Any] = {"arm": arm, "tokens": tokens.get(arm)}
        seeds = (runs or {}).get(arm, {})
        row["skipped"] = "/".join(str(seeds[s].get("skipped_steps", 0)) for s in sorted(seeds))
        row["rollbacks"] = "/".join(str(seeds[s].get("rollbacks", 0)) for s in sorted(seeds))
        kept = preps.get(arm, {}).get("kept", {})
        row["kept"] = ", ".join(
            f"{s}: {v['docs']:,} docs / {v['bytes'] / 1e6:.2f} MB" for s, v in sorted(kept.items())
        )
        for k in keys:
            row[k] = cell_text(cells.get(k))
        out.append(row)
    return out


def kept_by_source(report: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Documents and bytes per source in the dataset (the report's last stage)."""
    stages = report.get("stages") or {}
    last = stages.get(report.get("final_stage", ""), {})
    return {
        s: {"docs": int(v.get("kept", 0)), "bytes": int(v.get("bytes_kept", 0))}
        for s, v in (last.get("sources") or {}).items()
    }


def table_text(rws: list[dict[str, Any]], keys: list[str]) -> list[str]:
    """The table as text lines (the CLI's output)."""
    cols = ["arm", "tokens", "skipped", "rollbacks", *keys]
    cells = [[str(r.get(c) if r.get(c) is not None else "-") for c in cols] for r in rws]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in cells]
    return lines


def plot(table: dict[str, dict[str, Cell]], keys: list[str], path: Path) -> Path:
    """One panel per compared value: each arm's mean with its standard error over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(table)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2), squeeze=False)
    for ax, k in zip(axes[0], keys, strict=True):
        means = [table[a][k].mean if k in table[a] else float("nan") for a in arms]
        errs = [
            table[a][k].stderr if k in table[a] and math.isfinite(table[a][k].stderr) else 0.0
            for a in arms
        ]
        ax.bar(range(len(arms)), means, yerr=errs, capsize=4, color="#4c72b0")
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=8)
        ax.set_title(k + (" (lower is better)" if lower_is_better(k) else ""), fontsize=9)
        finite = [m for m in means if math.isfinite(m)]
        if finite:
            lo, hi = min(finite), max(finite)
            pad = (hi - lo) * 0.5 or abs(hi) * 0.05 or 1.0
            ax.set_ylim(lo - pad, hi + pad)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
