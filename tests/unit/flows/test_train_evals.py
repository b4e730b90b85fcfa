"""How the flows write the in-loop evals (flows/train_evals.py) and read an HPO objective
from a metrics log (flows/tuning/objective.py), on hand-written records."""

from __future__ import annotations

import json
from pathlib import Path

from flows.train_evals import downstream_md, downstream_text, regression_table, regressions_md
from flows.tuning.objective import VALIDATION, Objective

RECORD = {
    "kind": "downstream",
    "step": 500,
    "arc_easy/acc": 0.412,
    "arc_easy/acc_stderr": 0.021,
    "arc_easy/acc_per_char": 0.43,
    "arc_easy/acc_per_char_stderr": 0.022,
    "arc_easy/n": 500.0,
    "owt/bpb": 1.5321,
    "owt/bpb_stderr": 0.011,
    "owt/n": 200.0,
    "seconds": 4.1,
    "weights": "ema",
}


def test_downstream_table_has_a_row_per_set_and_only_the_metrics_logged():
    md = downstream_md(RECORD)
    assert md.splitlines() == [
        "**Downstream evals** at step 500 (EMA weights), value ± standard error:",
        "",
        "| task | n | acc | acc/char | bits/byte |",
        "|---|---:|---:|---:|---:|",
        "| arc_easy | 500 | 0.412 ± 0.021 | 0.43 ± 0.022 |  |",
        "| owt | 200 |  |  | 1.532 ± 0.011 |",
    ]


def test_the_terminal_gets_a_line_per_set():
    assert downstream_text(RECORD, [event()]) == [
        "  downstream evals:  step 500",
        "    arc_easy  acc 0.412 ± 0.021, acc/char 0.43 ± 0.022",
        "    owt       bits/byte 1.532 ± 0.011",
        "  step 600: eval regression: owt bpb 2.31 (best 1.84 at step 400, 9.4 standard "
        "errors worse); since step 400: 71% web-garbage, 29% owt; rollback",
    ]


def test_no_downstream_record_is_no_text():
    assert downstream_md(None) == "" and downstream_md({"kind": "downstream", "step": 3}) == ""
    assert regressions_md([]) == "" and regressions_md(None) == ""
    assert downstream_text(None) == []


def event(**over):
    ev = {
        "kind": "event",
        "event": "eval_regression",
        "step": 600,
        "task": "owt",
        "metric": "bpb",
        "value": 2.31,
        "best": 1.84,
        "best_step": 400,
        "drop": 0.47,
        "stderr": 0.05,
        "k": 3.0,
        "action": "rollback",
        "rows": 12800,
        "rows_looked_up": 4096,
        "sources": [
            {"source": "web-garbage", "tokens": 710, "share": 0.71},
            {"source": "owt", "tokens": 290, "share": 0.29},
        ],
        "documents": [
            {"doc": i, "id": f"g/{i}", "source": "web-garbage", "location": f"g.jsonl:{i}"}
            | {"path": f"/data/g.jsonl:{i}", "tokens": 100 - i}
            for i in range(10)
        ],
        "documents_total": 25,
    }
    return ev | over


def test_a_regression_reads_top_to_bottom():
    rows = [(r["field"], r["value"]) for r in regression_table(event())]
    assert rows[:9] == [
        ("task", "owt"),
        ("metric", "bpb"),
        ("steps (best -> now)", "400 -> 600"),
        ("value (best -> now)", "1.84 -> 2.31"),
        ("drop", "9.4 standard errors (threshold k = 3.0)"),
        ("action", "rollback"),
        ("trained on since the best step", "12,800 rows (4,096 looked up)"),
        ("source", "71% web-garbage (710 tokens)"),
        ("source", "29% owt (290 tokens)"),
    ]
    docs = rows[9:]
    assert docs[0] == ("document 1", "/data/g.jsonl:0 (web-garbage, 100 tokens)")
    assert [f for f, _ in docs] == [f"document {i}" for i in range(1, 9)] + ["documents not shown"]
    assert docs[-1][1] == "17"  # 25 in the window, 8 shown
    json.dumps(rows)  # a table Prefect can store


def test_a_dataset_without_provenance_says_so():
    ev = event(sources=[], documents=[], documents_total=0, rows=0)
    del ev["rows_looked_up"]
    ev["documents_error"] = "no provenance in /data/ds"
    rows = {r["field"]: r["value"] for r in regression_table(ev)}
    assert rows["documents"] == "unknown: no provenance in /data/ds"
    assert "source" not in rows and "document 1" not in rows


def test_objective_values_and_what_a_log_without_them_has(tmp_path: Path):
    log = tmp_path / "metrics.jsonl"
    recs = [
        {"kind": "eval", "step": 3, "val_loss": 4.5},
        {"kind": "downstream", "step": 4, "arc/acc": 0.3, "arc/acc_stderr": 0.1, "arc/n": 9.0},
        {"kind": "downstream", "step": 8, "arc/acc": 0.5, "arc/acc_stderr": 0.1, "arc/n": 9.0},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "downstr')
    acc = Objective("downstream/arc/acc", "downstream", "arc/acc", "maximize")
    assert acc.values(log) == [(4, 0.3), (8, 0.5)]
    assert VALIDATION.values(log) == [(3, 4.5)]
    bpb = Objective("downstream/arc/bpb", "downstream", "arc/bpb", "minimize")
    assert bpb.values(log) == []
    assert bpb.missing(log) == (
        "its downstream records have no arc/bpb (objective downstream/arc/bpb); they have: arc/acc"
    )
    assert acc.missing(tmp_path / "none.jsonl") == (
        "its metrics log has no downstream record (objective downstream/arc/acc)"
    )
