"""`ballast prep CONFIG`: data prep on this machine (or a Dask cluster) with progress bars,
then its accounting as tables: per stage, the drop reasons, per source, the mixture."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cli.console import print_error, stderr_console
from core.os_errors import os_error_message
from core.protocol import EXIT_ERROR, EXIT_OK
from dataprep.arguments import add_prep_arguments


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("prep", help="run data prep from a YAML config (no server needed)")
    add_prep_arguments(p)
    p.add_argument("--workers", type=int, help="override `workers:` (processes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from concurrent.futures.process import BrokenProcessPool

    from core.dataset import shown_path
    from core.store import StorageError
    from dataprep.cluster import ClusterError, DaskRunner, cluster_address
    from dataprep.config import ConfigError, load_config
    from dataprep.driver import OutputConflict, Runner
    from dataprep.graph import TEXT_STAGES
    from dataprep.inputs import InputsChanged
    from dataprep.layout import version_uri
    from dataprep.pipeline import STEP_NOTE, run_prep
    from dataprep.readers import IngestError
    from dataprep.report import AccountingError

    err = stderr_console()
    out = Console()
    output: str | None = args.output
    # --dask ADDRESS, else Dask's own DASK_SCHEDULER_ADDRESS (set in the pods of
    # k8s/overlays/prep-dask); `--dask local` keeps the run on this machine.
    address = cluster_address(args.dask)
    runner: Runner | None = None
    if address is not None:
        runner = DaskRunner(address, progress=not args.no_progress, console=err)
    try:
        cfg = load_config(args.config, {"output": args.output, "workers": args.workers})
        output = cfg.output
        try:
            report = run_prep(
                cfg,
                until=args.until,
                progress=not args.no_progress,
                from_scratch=args.from_scratch,
                runner=runner,
            )
        except BaseException:
            if runner is not None:
                runner.abort()  # this run's tasks leave the cluster
            raise
        if runner is not None:
            runner.close()
    except IngestError as e:
        print_error(str(e) + _sources_against(args.config, str(e)))
        return EXIT_ERROR
    except (
        ConfigError,
        OutputConflict,
        InputsChanged,
        StorageError,
        ClusterError,
        ValueError,
    ) as e:
        print_error(str(e))
        return EXIT_ERROR
    except AccountingError as e:
        print_error(str(e), label="accounting error")
        return EXIT_ERROR
    except OSError as e:
        steps = [
            n[len(STEP_NOTE) :] for n in getattr(e, "__notes__", []) if n.startswith(STEP_NOTE)
        ]
        print_error(os_error_message(e, output, steps[-1] if steps else None))
        return EXIT_ERROR
    except BrokenProcessPool:
        print_error(
            "a worker process died (killed by the system? out of memory?); run again to resume"
        )
        return EXIT_ERROR
    out.print(summary_table(report))
    out.print(reasons_table(report))
    out.print(sources_table(report))
    if report.get("mixture"):
        out.print(mixture_table(report["mixture"]))
        for w in report["mixture"].get("warnings", []):
            err.print(f"warning: {w}", markup=False, highlight=False)
    if report.get("packing"):
        out.print(packing_line(report["packing"]), markup=False)
    near = report.get("near")
    if near:
        out.print(
            f"near-dedup: {near['bands']} bands x {near['rows']} rows "
            f"(P[candidate | J={near['threshold']}] = {near['p_candidate_at_threshold']}), "
            f"{near['candidate_pairs']:,} candidate pairs checked, "
            f"{near['confirmed_pairs']:,} confirmed, {near['removed']:,} removed",
            markup=False,
        )
    substring = report.get("substring")
    if substring:
        out.print(
            substring_line(substring, report["stages"]["substring"]), markup=False, soft_wrap=True
        )
    if report.get("dataset"):
        ds = shown_path(report["dataset"]["uri"])
        out.print(
            f"dataset: {ds}  (load with datasets.load_from_disk; check with `ballast verify {ds}`)",
            markup=False,
            soft_wrap=True,  # a path cut over two lines cannot be copied
        )
    text_stage = [s for s in report["stages"] if s in TEXT_STAGES][-1]
    version = (report.get("version") or {}).get("version", 1)
    vuri = shown_path(version_uri(cfg.model_copy(update={"version": version})))
    note = relative_output_note(args.config, cfg.output, args.output is not None)
    out.print(
        f"output: {shown_path(cfg.output)}  ({note}version {version}; report: "
        f"{vuri.rstrip('/')}/report.json, kept documents: "
        f"docs/{text_stage}/, dropped: dropped/<stage>/)",
        markup=False,
        soft_wrap=True,
    )
    return EXIT_OK


def substring_line(summary: dict[str, Any], stage: dict[str, Any]) -> str:
    """The substring stage in one line: what it cut and what it cost on disk."""
    edits = summary["sources"].values()
    edited = sum(e["edited"] for e in edits)
    removed = sum(e["bytes_removed"] for e in edits)
    spans = sum(e["spans_removed"] for e in edits)
    dropped = stage["total"]["dropped"].get("substring_dup", 0)
    return (
        f"substring-dedup: windows of {summary['min_tokens']} {summary['unit']}, keep "
        f"{summary['keep']}: {edited:,} documents edited ({spans:,} spans, "
        f"{removed / 1e6:,.1f} MB removed), {dropped:,} dropped; {summary['windows']:,} "
        f"windows in {summary['partitions']:,} partitions, "
        f"{summary['hash_disk_bytes'] / 1e6:,.1f} MB of hashes kept"
    )


def relative_output_note(config: str, output: str, from_flag: bool) -> str:
    """Said in the closing line when the config's relative `output` was taken from the
    working directory while the config is elsewhere (its relative source paths are taken
    from its own directory: docs/prep.md, "Relative paths")."""
    if from_flag or "://" in output or Path(output).is_absolute() or config.startswith("env:"):
        return ""
    if Path(config).parent.resolve() == Path.cwd().resolve():
        return ""
    return f"`output: {output}` taken from the working directory, not the config's; "


def _sources_against(config: str, message: str) -> str:
    """What a relative source path in `message` was resolved against, when it was."""
    if config.startswith("env:"):
        return ""
    config_dir = Path(config).parent.resolve()
    if f"{config_dir}{os.sep}" not in message:
        return ""
    return f" (relative source paths are resolved against the config's directory, {config_dir})"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f}"


def summary_table(report: dict[str, Any]) -> Table:
    t = Table(title="ballast prep: accounting", title_justify="left")
    for col in ("stage", "docs in", "kept", "dropped", "MB in", "MB kept", "seconds"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    secs = report.get("stage_seconds", {})
    for name, st in report["stages"].items():
        tot = st["total"]
        t.add_row(
            name,
            f"{tot['docs_in']:,}",
            f"{tot['kept']:,}",
            f"{sum(tot['dropped'].values()):,}",
            _mb(tot["bytes_in"]),
            _mb(tot["bytes_kept"]),
            f"{secs.get(name, 0):.1f}",
        )
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
        t.add_row(
            src,
            f"{s['docs_in']:,}",
            f"{k['kept']:,}",
            _mb(s["bytes_in"]),
            _mb(k["bytes_kept"]),
            f"{pct:.1f}",
        )
    return t


def mixture_table(mix: dict[str, Any]) -> Table:
    t = Table(title="mixture: planned vs realised training tokens", title_justify="left")
    for col in ("source", "available", "planned", "realised", "planned %", "realised %", "epochs"):
        t.add_column(col, justify="left" if col == "source" else "right")
    for src, m in mix["sources"].items():
        avail = m["available_tokens"]
        t.add_row(
            src,
            f"{avail:,}",
            f"{m['planned_tokens']:,}",
            f"{m['realised_tokens']:,}",
            f"{100 * m['planned_share']:.2f}",
            f"{100 * m['realised_share']:.2f}",
            f"{m['realised_tokens'] / avail:.2f}" if avail else "-",
        )
    return t


def packing_line(p: dict[str, Any]) -> str:
    tr, va = p["train"], p["validation"]
    return (
        f"packing ({p['strategy']}, seq_len {p['seq_len']}): train {tr['rows']:,} rows, "
        f"efficiency {100 * tr['efficiency']:.2f}% ({tr['split_docs']:,} of "
        f"{tr['docs']:,} documents split); validation {va['rows']:,} rows, "
        f"{100 * va['efficiency']:.2f}%"
    )
