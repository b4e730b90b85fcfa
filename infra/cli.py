"""The `ballast` command line. `ballast prep CONFIG` runs data prep on this machine with
progress bars and a summary table; no Prefect server is needed.

Exit codes follow the architecture: 0 done, 1 a clear error (bad config, bad inputs,
unreachable storage, accounting that does not add up).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

EXIT_OK = 0
EXIT_ERROR = 1


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f}"


def summary_table(report: dict[str, Any]) -> Table:
    t = Table(title="ballast prep: accounting", title_justify="left")
    for col in ("stage", "docs in", "kept", "dropped", "MB in", "MB kept", "seconds"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    secs = report.get("stage_seconds", {})
    for name, st in report["stages"].items():
        tot = st["total"]
        t.add_row(name, f"{tot['docs_in']:,}", f"{tot['kept']:,}",
                  f"{sum(tot['dropped'].values()):,}", _mb(tot["bytes_in"]),
                  _mb(tot["bytes_kept"]), f"{secs.get(name, 0):.1f}")
    return t


def reasons_table(report: dict[str, Any], top: int = 8) -> Table:
    t = Table(title="dropped, by reason", title_justify="left")
    for col in ("stage", "reason", "docs"):
        t.add_column(col, justify="right" if col == "docs" else "left")
    for name, st in report["stages"].items():
        reasons = sorted(st["total"]["dropped"].items(), key=lambda kv: (-kv[1], kv[0]))
        for reason, n in reasons[:top]:
            t.add_row(name, reason, f"{n:,}")
        if len(reasons) > top:
            rest = sum(n for _, n in reasons[top:])
            t.add_row(name, f"({len(reasons) - top} more reasons)", f"{rest:,}")
    return t


def sources_table(report: dict[str, Any]) -> Table:
    stages = report["stages"]
    first, last = next(iter(stages)), report.get("final_stage") or list(stages)[-1]
    t = Table(title=f"per source ({first} -> {last})", title_justify="left")
    for col in ("source", "docs in", "docs kept", "MB in", "MB kept", "kept %"):
        t.add_column(col, justify="left" if col == "source" else "right")
    for src, s in stages[first]["sources"].items():
        k = stages[last]["sources"].get(src, {"kept": 0, "bytes_kept": 0})
        pct = 100 * k["kept"] / s["docs_in"] if s["docs_in"] else 0.0
        t.add_row(src, f"{s['docs_in']:,}", f"{k['kept']:,}", _mb(s["bytes_in"]),
                  _mb(k["bytes_kept"]), f"{pct:.1f}")
    return t


def cmd_prep(args: argparse.Namespace) -> int:
    from infra.storage import StorageError
    from tasks.config import ConfigError, load_config
    from tasks.pipeline import OutputConflict, run_prep
    from tasks.readers import IngestError
    from tasks.report import AccountingError

    err = Console(stderr=True)
    out = Console()
    try:
        cfg = load_config(args.config, {"output": args.output, "workers": args.workers})
        report = run_prep(cfg, until=args.until, progress=not args.no_progress)
    except (ConfigError, IngestError, OutputConflict, StorageError, ValueError) as e:
        err.print(f"[bold red]error:[/] {e}", markup=True, highlight=False)
        return EXIT_ERROR
    except AccountingError as e:
        err.print(f"[bold red]accounting error:[/] {e}", markup=True, highlight=False)
        return EXIT_ERROR
    out.print(summary_table(report))
    out.print(reasons_table(report))
    out.print(sources_table(report))
    near = report.get("near")
    if near:
        out.print(f"near-dedup: {near['bands']} bands x {near['rows']} rows "
                  f"(P[candidate | J={near['threshold']}] = {near['p_candidate_at_threshold']}), "
                  f"{near['candidate_pairs']:,} candidate pairs checked, "
                  f"{near['confirmed_pairs']:,} confirmed, {near['removed']:,} removed",
                  markup=False)
    out.print(f"output: {cfg.output}  (report: {cfg.output.rstrip('/')}/report.json, "
              f"kept documents: docs/{report['final_stage']}/, dropped: dropped/<stage>/)",
              markup=False)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ballast", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prep", help="run data prep from a YAML config (no server needed)")
    prep.add_argument("config", help="path to the run config (YAML)")
    prep.add_argument("--output", help="override `output:` (local path or s3://bucket/prefix)")
    prep.add_argument("--until", help="stop after this stage (ingest, exact, near, quality)")
    prep.add_argument("--workers", type=int, help="override `workers:` (processes)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bars")
    prep.set_defaults(func=cmd_prep)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
