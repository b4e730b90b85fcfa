"""What a search reports: the trials table, the best-value plot, the summary record the
flow returns (and its Markdown and text forms), each in terms of the search's objective
(validation loss, or an in-loop benchmark) and its direction."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from flows.tuning.config import Search
from flows.tuning.study import trial_state
from flows.tuning.trials import trial_dir


def trial_rows(study: Any) -> list[dict[str, Any]]:
    keys = sorted({k for t in study.get_trials(deepcopy=False) for k in t.params})
    rows = []
    for t in study.get_trials(deepcopy=False):
        steps = sorted(t.intermediate_values)
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name.lower(),
                "value": None if t.value is None else round(t.value, 5),
                **{k: t.params.get(k) for k in keys},
                "last step": steps[-1] if steps else None,
                "ending": t.user_attrs.get("ending"),
                "minutes": round(t.duration.total_seconds() / 60, 2) if t.duration else None,
            }
        )
    return rows


def plot_best(study: Any, png: Path, label: str = "validation loss") -> None:
    """Each completed trial's value of the objective (`label`), pruned ones at their last
    reported value, and the best so far (lowest or highest, as the study's direction
    says) against the trial number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [
        (t.number, t.value)
        for t in study.get_trials(deepcopy=False)
        if t.state == trial_state("COMPLETE") and t.value is not None
    ]
    pruned = [
        (t.number, t.intermediate_values[max(t.intermediate_values)])
        for t in study.get_trials(deepcopy=False)
        if t.state == trial_state("PRUNED") and t.intermediate_values
    ]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if done:
        better = max if study.direction.name == "MAXIMIZE" else min
        best, line = done[0][1], []
        for n, v in done:
            best = better(best, v)
            line.append((n, best))
        ax.plot(*zip(*done, strict=True), "o", label="completed", ms=4)
        ax.step(*zip(*line, strict=True), where="post", label="best so far", lw=1.5)
    if pruned:
        ax.plot(*zip(*pruned, strict=True), "x", color="gray", label="pruned (last report)")
    ax.set_xlabel("trial")
    ax.set_ylabel(label)
    ax.set_title(f"study {study.study_name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def summary(s: Search, study: Any) -> dict[str, Any]:
    trials = study.get_trials(deepcopy=False)
    by_state = {
        st: sum(1 for t in trials if t.state.name == st) for st in ("COMPLETE", "PRUNED", "FAIL")
    }
    try:  # the lowest or highest value, as the study's direction says
        best = study.best_trial
    except ValueError:  # no completed trial
        best = None
    return {
        "study": s.name,
        "objective": s.objective.name,
        "objective_label": s.objective.label,
        "direction": s.objective.direction,
        "storage": s.cfg.storage_url(),
        "trials": len(trials),
        "completed": by_state["COMPLETE"],
        "pruned": by_state["PRUNED"],
        "failed": by_state["FAIL"],
        "best_trial": best.number if best else None,
        "best_value": best.value if best else None,
        "best_params": best.params if best else None,
        "best_config": str(trial_dir(s, best.number) / "train.yaml") if best else None,
        "plot": str(s.cfg.out_dir() / "best-loss.png"),
    }


def summary_md(r: dict[str, Any], png: Path) -> str:
    lines = [
        f"**study {r['study']}**: {r['trials']} trials ({r['completed']} completed, "
        f"{r['pruned']} pruned, {r['failed']} failed)",
        "",
    ]
    if r["best_trial"] is not None:
        lines += [
            f"**best {r['objective_label']} {r['best_value']:.4f}** ({r['direction']}d; "
            f"trial {r['best_trial']})",
            "",
            *(f"- `{k}`: {v}" for k, v in r["best_params"].items()),
            f"- config: `{r['best_config']}`",
            "",
        ]
    uri = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")
    return "\n".join([*lines, f"![best loss against trials]({uri})"])


def summary_text(r: dict[str, Any]) -> str:
    lines = [
        "",
        f"study {r['study']}: {r['trials']} trials, {r['completed']} completed, "
        f"{r['pruned']} pruned, {r['failed']} failed ({r['storage']})",
    ]
    if r["best_trial"] is not None:
        lines += [
            f"  best {r['objective_label']}: {r['best_value']:.4f} (trial {r['best_trial']}, "
            f"{r['direction']}d)",
            *(
                f"    {k}: {v:.4g}" if isinstance(v, float) else f"    {k}: {v}"
                for k, v in r["best_params"].items()
            ),
            f"  best trial's config: {r['best_config']}",
        ]
    lines.append(f"  plot:                 {r['plot']}")
    return "\n".join(lines)
