"""The `ballast` command line. `ballast prep CONFIG` runs data prep on this machine with
progress bars and a summary table; no Prefect server is needed.

Exit codes follow the architecture: 0 done, 1 a clear error (bad config, bad inputs,
unreachable storage, accounting that does not add up, an operating-system error such as
a full disk), 130 interrupted (Ctrl-C). Errors are one line on stderr, not a traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.protocol import EXIT_DIVERGED, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK

# Errors of a write that has no file name (a write(2) on an open file): the output's.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_ERRNO_IN_TEXT = re.compile(r"\[errno (\d+)\]", re.IGNORECASE)  # pyarrow's OSErrors


def stderr_console() -> Console:
    # soft_wrap: when stderr is not a terminal rich wraps at 80 columns, and one error
    # would become several lines in a log.
    return Console(stderr=True, soft_wrap=True, highlight=False)


def print_error(message: str, label: str = "error") -> None:
    stderr_console().print(Text.assemble((f"{label}:", "bold red"), " ", message))


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _existing(path: Path) -> Path | None:
    """`path` or its nearest ancestor that exists."""
    for p in (path, *path.parents):
        try:
            p.stat()
            return p
        except OSError:
            continue
    return None


def os_error_message(e: OSError, output: str | None = None, step: str | None = None) -> str:
    """One line for an operating-system error: the path, the cause, and what helps to
    act on it (the free space left on a full disk, the file in the way of a directory,
    the file size limit)."""
    code = e.errno if isinstance(e.errno, int) else None
    if code is None:  # pyarrow's OSErrors carry it in the text only
        m = _ERRNO_IN_TEXT.search(str(e))
        code = int(m.group(1)) if m else None
    cause = e.strerror or str(e) or type(e).__name__
    path: str | None = None
    if e.filename is not None:
        path = os.fsdecode(e.filename)
        where = path if e.filename2 is None else f"{path} -> {os.fsdecode(e.filename2)}"
        msg = f"{where}: {cause}"
    elif code in _WRITE_ERRNOS and output and "://" not in output:
        path = output
        msg = f"cannot write to {output}: {cause}"
    else:
        msg = cause
    extra = [f"in step {step}"] if step else []
    if path is not None and code in (errno.EEXIST, errno.ENOTDIR):
        blocker = _existing(Path(path))
        if blocker is not None and not blocker.is_dir():
            extra.append("it is a file, not a directory" if str(blocker) == path
                         else f"{blocker} is a file, not a directory")
    if code in (errno.ENOSPC, errno.EDQUOT) and (path or output):
        at = _existing(Path(path or output or "."))
        if at is not None:
            du = shutil.disk_usage(at)
            extra.append(f"{_size(du.free)} free of {_size(du.total)} on that filesystem")
    if code == errno.EFBIG:
        try:
            import resource

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY:
                extra.append(f"the file size limit (ulimit -f) is {limit} bytes")
        except (ImportError, OSError, ValueError):
            pass
    return msg + (f" ({'; '.join(extra)})" if extra else "")


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


def mixture_table(mix: dict[str, Any]) -> Table:
    t = Table(title="mixture: planned vs realised training tokens", title_justify="left")
    for col in ("source", "available", "planned", "realised", "planned %", "realised %",
                "epochs"):
        t.add_column(col, justify="left" if col == "source" else "right")
    for src, m in mix["sources"].items():
        avail = m["available_tokens"]
        t.add_row(src, f"{avail:,}", f"{m['planned_tokens']:,}", f"{m['realised_tokens']:,}",
                  f"{100 * m['planned_share']:.2f}", f"{100 * m['realised_share']:.2f}",
                  f"{m['realised_tokens'] / avail:.2f}" if avail else "-")
    return t


def packing_line(p: dict[str, Any]) -> str:
    tr, va = p["train"], p["validation"]
    return (f"packing ({p['strategy']}, seq_len {p['seq_len']}): train {tr['rows']:,} rows, "
            f"efficiency {100 * tr['efficiency']:.2f}% ({tr['split_docs']:,} of "
            f"{tr['docs']:,} documents split); validation {va['rows']:,} rows, "
            f"{100 * va['efficiency']:.2f}%")


def cmd_prep(args: argparse.Namespace) -> int:
    from concurrent.futures.process import BrokenProcessPool

    from core.store import StorageError
    from prep.cluster import ClusterError, DaskRunner, cluster_address
    from prep.config import ConfigError, load_config
    from prep.driver import OutputConflict, Runner
    from prep.graph import TEXT_STAGES
    from prep.inputs import InputsChanged
    from prep.layout import version_uri
    from prep.pipeline import STEP_NOTE, run_prep
    from prep.readers import IngestError
    from prep.report import AccountingError

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
            report = run_prep(cfg, until=args.until, progress=not args.no_progress,
                              from_scratch=args.from_scratch, runner=runner)
        except BaseException:
            if runner is not None:
                runner.abort()  # this run's tasks leave the cluster
            raise
        if runner is not None:
            runner.close()
    except (ConfigError, IngestError, OutputConflict, InputsChanged, StorageError,
            ClusterError, ValueError) as e:
        print_error(str(e))
        return EXIT_ERROR
    except AccountingError as e:
        print_error(str(e), label="accounting error")
        return EXIT_ERROR
    except OSError as e:
        steps = [n[len(STEP_NOTE):] for n in getattr(e, "__notes__", [])
                 if n.startswith(STEP_NOTE)]
        print_error(os_error_message(e, output, steps[-1] if steps else None))
        return EXIT_ERROR
    except BrokenProcessPool:
        print_error("a worker process died (killed by the system? out of memory?); run "
                    "again to resume")
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
        out.print(f"near-dedup: {near['bands']} bands x {near['rows']} rows "
                  f"(P[candidate | J={near['threshold']}] = {near['p_candidate_at_threshold']}), "
                  f"{near['candidate_pairs']:,} candidate pairs checked, "
                  f"{near['confirmed_pairs']:,} confirmed, {near['removed']:,} removed",
                  markup=False)
    if report.get("dataset"):
        out.print(f"dataset: {report['dataset']['uri']}  (load with datasets.load_from_disk; "
                  f"check with `ballast verify {report['dataset']['uri']}`)", markup=False)
    text_stage = [s for s in report["stages"] if s in TEXT_STAGES][-1]
    version = (report.get("version") or {}).get("version", 1)
    vuri = version_uri(cfg.model_copy(update={"version": version}))
    out.print(f"output: {cfg.output}  (version {version}; report: "
              f"{vuri.rstrip('/')}/report.json, kept documents: "
              f"docs/{text_stage}/, dropped: dropped/<stage>/)", markup=False)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from core.dataset import resolve, verify
    from core.store import StorageError

    try:
        uri = resolve(args.dataset)  # a dataset root: its newest version
        if uri != args.dataset:
            stderr_console().print(f"{args.dataset}: newest version {uri}", markup=False)
        problems = verify(uri)
    except StorageError as e:
        print_error(str(e))
        return EXIT_ERROR
    if problems:
        err = stderr_console()
        err.print(f"{args.dataset} does NOT match its manifest:", markup=False)
        for p in problems:
            err.print(f"  - {p}", markup=False, highlight=False)
        return EXIT_ERROR
    Console().print(f"{args.dataset}: every file matches its manifest", markup=False)
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    from training.train import main as train_main

    argv = ["--config", args.config]
    for flag, value in (("--dataset", args.dataset), ("--run-dir", args.run_dir),
                        ("--steps", args.steps)):
        if value is not None:
            argv += [flag, str(value)]
    cfg = _tracked_config(args)
    if cfg is False:
        return EXIT_ERROR
    code = train_main(argv)
    # The run as the metrics log has it, whatever the exit code: a failed run is logged
    # as FAILED, not lost. A logging failure turns a done run's 0 into 1.
    if (cfg is not None and (Path(cfg.run_dir) / "metrics.jsonl").is_file()
            and not _log_tracking(cfg, code == EXIT_OK, ENDINGS.get(code, f"exit {code}"))):
        code = code or EXIT_ERROR
    return code


ENDINGS = {EXIT_OK: "done", EXIT_ERROR: "error", EXIT_DIVERGED: "diverged"}


def _tracked_config(args: argparse.Namespace) -> Any:
    """The training config when it turns MLflow tracking on (its store checked before any
    training: False after printing why it cannot be used), else None (a bad config is
    left to the trainer, which names the key)."""
    from infra.tracking import TrackingError, check_tracking, tracking_on
    from training.config import TrainConfigError, load_train_config

    try:
        cfg = load_train_config(args.config, {"dataset": args.dataset,
                                              "run_dir": args.run_dir, "steps": args.steps})
    except TrainConfigError:
        return None
    if not tracking_on(cfg):
        return None
    try:
        check_tracking(cfg)
    except TrackingError as e:
        print_error(str(e))
        return False
    return cfg


def _log_tracking(cfg: Any, ok: bool, ending: str) -> bool:
    from infra.tracking import TrackingError, log_run

    try:
        r = log_run(cfg, ok, ending)
    except TrackingError as e:
        print_error(f"{e}; log the run again with `ballast track` and the same arguments")
        return False
    Console().print(f"mlflow: run {r['run_id']} in experiment {r['experiment']} at {r['uri']}",
                    markup=False, highlight=False)
    return True


def cmd_track(args: argparse.Namespace) -> int:
    """Log a run dir as it is now (its metrics log, and the prep of its dataset) as a new
    MLflow run: after a logging failure, or for a run trained with tracking off."""
    from infra.tracking import tracking_on
    from training.config import TrackingConfig, TrainConfigError, load_train_config

    try:
        cfg = load_train_config(args.config, {"dataset": args.dataset,
                                              "run_dir": args.run_dir})
    except TrainConfigError as e:
        print_error(str(e))
        return EXIT_ERROR
    if not tracking_on(cfg):  # asked for explicitly: the defaults, MLflow on
        cfg = cfg.model_copy(update={"tracking": TrackingConfig()})
    if not (Path(cfg.run_dir) / "metrics.jsonl").is_file():
        print_error(f"{cfg.run_dir}: no metrics.jsonl (has this run trained?)")
        return EXIT_ERROR
    done = (Path(cfg.run_dir) / "final.json").is_file()
    return EXIT_OK if _log_tracking(cfg, done, "done" if done else "unfinished") else EXIT_ERROR


def cmd_export_hf(args: argparse.Namespace) -> int:
    from training.export_hf import ExportError, export_hf

    try:
        out, arch = export_hf(args.checkpoint, args.out_dir, dataset=args.dataset,
                              dtype=args.dtype, max_shard_size=args.max_shard_size)
    except ExportError as e:
        print_error(str(e))
        return EXIT_ERROR
    Console().print(f"{out}: {arch} (load with AutoModelForCausalLM.from_pretrained)",
                    markup=False)
    return EXIT_OK


def cmd_export_dataset(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from core.store import StorageError
    from prep.export import ExportError, check, export_dataset

    splits = tuple(args.splits.split(","))
    try:
        manifest = check(args.dataset, args.format, args.out, splits,
                         shard_tokens=args.shard_tokens)[3]
    except (ExportError, StorageError) as e:
        print_error(str(e))
        return EXIT_ERROR
    with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                  console=stderr_console(), disable=args.no_progress) as bars:
        tasks = {s: bars.add_task(f"export {s} rows", total=int(
            manifest.get("splits", {}).get(s, {}).get("rows", 0))) for s in splits}

        def advance(split: str, rows: int) -> None:
            bars.advance(tasks[split], rows)

        try:
            rec = export_dataset(args.dataset, args.format, args.out, splits,
                                 shard_tokens=args.shard_tokens, progress=advance)
        except (ExportError, StorageError) as e:
            print_error(str(e))
            return EXIT_ERROR
    out = Console(soft_wrap=True)
    for name, s in rec["splits"].items():
        count = s.get("documents", s.get("samples"))
        unit = "documents" if "documents" in s else "rows"
        cut = f" ({s['cut_pieces']} of them pieces of cut documents)" if s.get("cut_pieces") \
            else ""
        out.print(f"{name}: {count} {unit}{cut}, {len(s['files'])} files", markup=False)
    out.print(f"{args.out}: {args.format} export of {rec['dataset']} (checksums and the "
              f"dataset's accounting in ballast_export.json)", markup=False)
    return EXIT_OK


def cmd_blame(args: argparse.Namespace) -> int:
    import json

    from training import blame

    try:
        run = blame.open_run(args.run_dir, args.config, args.dataset, args.world_size)
        if args.step is not None:
            d: Any = blame.step_report(run, args.step)
            lines = blame.step_text(d, run.world_size)
        elif args.event:
            d = blame.events_report(run)
            lines = blame.events_text(d, run.world_size)
        else:
            d = run.steps_with(args.doc)
            lines = blame.doc_text(d)
    except blame.BlameError as e:
        print_error(str(e))
        return EXIT_ERROR
    out = Console(soft_wrap=True, highlight=False)
    if args.json:
        out.print(json.dumps(d, indent=1), markup=False)
    else:
        for line in lines:
            out.print(line, markup=False)
    return EXIT_OK


def cmd_hpo_run(args: argparse.Namespace) -> int:
    from core.errors import ConfigError
    from flows.hpo import hpo, load_hpo_config, summary_text

    try:
        load_hpo_config(args.config)  # a bad config is one line here, not a failed flow run
    except ConfigError as e:
        print_error(str(e))
        return EXIT_ERROR
    r = hpo(args.config)  # on $PREFECT_API_URL, else a temporary local Prefect API
    Console().print(summary_text(r), markup=False, highlight=False)
    if r["best_trial"] is None:
        print_error(f"study {r['study']}: no trial completed")
        return EXIT_ERROR
    return EXIT_OK


def cmd_hpo_transfer(args: argparse.Namespace) -> int:
    from core.errors import ConfigError
    from flows.hpo import HpoError, transfer

    try:
        t = transfer(args.study, args.to_width, args.out)
    except (ConfigError, HpoError) as e:
        print_error(str(e))
        return EXIT_ERROR
    Console().print(f"{t['out']}: d_model {t['width']} (muP base {t['base_width']}) with the "
                    f"hyperparameters of trial {t['trial']} (validation loss "
                    f"{t['value']:.4f}): {t['params']}", markup=False, highlight=False)
    return EXIT_OK


def cmd_quality_train(args: argparse.Namespace) -> int:
    from prep.quality.train_classifier import TrainConfig, TrainError, load_calibrated, train

    if not (args.positive or args.negative or args.labelled):
        print_error("give --positive and --negative files, or --labelled")
        return EXIT_ERROR
    try:
        texts, labels, calibrate = load_calibrated(args.positive, args.negative,
                                                   args.labelled, args.label_field,
                                                   args.text_field)
        cfg = TrainConfig(features=args.features, epoch=args.epoch, lr=args.lr,
                          word_ngrams=args.word_ngrams, holdout=args.holdout,
                          keep_good=args.keep_good, seed=args.seed, threads=args.threads)
        r = train(texts, labels, args.out, cfg, sources={
            "positive": args.positive, "negative": args.negative, "labelled": args.labelled},
            calibrate=calibrate)
    except TrainError as e:
        print_error(str(e))
        return EXIT_ERROR
    h = r["held_out"]
    Console(soft_wrap=True).print(
                    f"{args.out}: threshold {r['threshold']:.4g} ({r['threshold_rule']}); "
                    f"held out ({h['good']} good, {h['bad']} bad): good kept "
                    f"{h['good_kept']:.1%}, bad kept {h['bad_kept']:.1%}, precision "
                    f"{h['precision']:.1%}; report "
                    f"{Path(args.out).with_suffix('.report.json')}",
                    markup=False, highlight=False)
    return EXIT_OK


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.deployments import deploy_all
    from infra.jobs import POOLS

    ids = deploy_all(args.prep_config, args.train_config, pool_type=args.pool_type,
                     pool=args.pool, cron=args.cron or None, output=args.output,
                     run_dir=args.run_dir, steps=args.steps, image=args.image,
                     dask_address=args.dask)
    out = Console()
    for name, dep_id in ids.items():
        out.print(f"deployment {name}: {dep_id}", markup=False)
    pool = args.pool or POOLS[args.pool_type]
    out.print(f"start a worker: prefect worker start --pool {pool}", markup=False)
    return EXIT_OK


class StageNames:
    """The stage graph's names (prep/graph.py), for `--until`'s help: read only when help
    is printed (argparse formats `%(stages)s` with the action's attributes), so that no
    other command pays for importing the prep stages."""

    def __str__(self) -> str:
        from prep.graph import STAGE_NAMES

        return ", ".join(STAGE_NAMES)


def build_parser() -> argparse.ArgumentParser:
    from infra.jobs import POOLS
    from infra.k8s_manifests import IMAGE

    p = argparse.ArgumentParser(prog="ballast", description="Ballast: prepare LLM pre-training "
                                "data and keep the training run on it alive.")
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prep", help="run data prep from a YAML config (no server needed)")
    prep.add_argument("config", help="path to the run config (YAML)")
    prep.add_argument("--output", help="override `output:` (local path or s3://bucket/prefix)")
    prep.add_argument("--until", help="stop after this stage (%(stages)s)").stages = StageNames()
    prep.add_argument("--workers", type=int, help="override `workers:` (processes)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bars")
    prep.add_argument("--dask", metavar="ADDRESS",
                      help="run on the Dask cluster whose scheduler is at ADDRESS "
                           "(tcp://HOST:8786; default: $DASK_SCHEDULER_ADDRESS if set; "
                           "`local`: this machine's process pool); inputs and output must "
                           "then be where every worker reaches them (s3://)")
    prep.add_argument("--from-scratch", action="store_true",
                      help="when inputs an earlier version read have changed or gone: build "
                           "a new version from all current inputs (default: refuse)")
    prep.set_defaults(func=cmd_prep)
    ver = sub.add_parser("verify", help="check a prepared dataset against its manifest")
    ver.add_argument("dataset", help="dataset directory or s3:// URI (<output>/dataset)")
    ver.set_defaults(func=cmd_verify)
    tr = sub.add_parser("train", help="train on a prepared dataset on this machine "
                                      "(exit 0 done, 1 bad config/data, 3 diverged)")
    tr.add_argument("config", help="training config (YAML), or a run config with `train:`")
    tr.add_argument("--dataset", help="override `dataset:`")
    tr.add_argument("--run-dir", help="override `run_dir:`")
    tr.add_argument("--steps", type=int, help="override `steps:`")
    tr.set_defaults(func=cmd_train)
    tk = sub.add_parser("track", help="log a training run (and its dataset's prep) to MLflow "
                                      "as it is now (`tracking:` in its config, or defaults)")
    tk.add_argument("config", help="the run's training config (YAML)")
    tk.add_argument("--dataset", help="override `dataset:`")
    tk.add_argument("--run-dir", help="override `run_dir:`")
    tk.set_defaults(func=cmd_track)
    bl = sub.add_parser("blame", help="the documents a training step trained on: sources, "
                                      "input locations, the quality statistics that kept them")
    bl.add_argument("run_dir", help="the training run directory (its metrics.jsonl)")
    what = bl.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, metavar="N",
                      help="step N's batch, as the sampler ordered it after any rollback or "
                           "skip (steps as guard events number them: from 0)")
    what.add_argument("--event", action="store_true",
                      help="every guard event (skipped spike, rollback window) with its batches")
    what.add_argument("--doc", metavar="ID", help="every step that trained on document ID")
    bl.add_argument("--config", help="the run's training config (default: final.json's, or "
                                     "its newest checkpoint's)")
    bl.add_argument("--dataset", help="override the config's `dataset:` (a moved dataset)")
    bl.add_argument("--world-size", type=int, help="ranks the run trained on, for the rank "
                                                   "of each sample (default: the run's own)")
    bl.add_argument("--json", action="store_true", help="JSON instead of text")
    bl.set_defaults(func=cmd_blame)
    hp = sub.add_parser("hpo", help="hyperparameter search on proxy models (Optuna)")
    hp_sub = hp.add_subparsers(dest="hpo_command", required=True)
    hp_run = hp_sub.add_parser("run", help="run the search a config describes (the `hpo` "
                                           "flow; trials a study holds already are kept)")
    hp_run.add_argument("config", help="the search config (YAML)")
    hp_run.set_defaults(func=cmd_hpo_run)
    hp_tr = hp_sub.add_parser("transfer", help="write a training config at another width "
                                               "with the study's best hyperparameters (muP)")
    hp_tr.add_argument("--study", required=True, metavar="HPO_CONFIG",
                       help="the search config the study was run with")
    hp_tr.add_argument("--to-width", type=int, required=True, metavar="D",
                       help="the target d_model")
    hp_tr.add_argument("--out", required=True, metavar="CONFIG",
                       help="where to write the training config (YAML)")
    hp_tr.set_defaults(func=cmd_hpo_transfer)
    qu = sub.add_parser("quality", help="quality classifier tools")
    qu_sub = qu.add_subparsers(dest="quality_command", required=True)
    qt = qu_sub.add_parser("train", help="train a fastText quality classifier (the "
                                         "`classifier` rule's model) on labelled pages")
    qt.add_argument("--positive", action="append", default=[], metavar="JSONL",
                    help="good pages (JSONL with a text field); repeatable")
    qt.add_argument("--negative", action="append", default=[], metavar="JSONL",
                    help="bad pages; repeatable")
    qt.add_argument("--labelled", action="append", default=[], metavar="JSONL",
                    help="pages with a 1/0 label field; repeatable")
    qt.add_argument("--label-field", default="label")
    qt.add_argument("--text-field", default="text")
    qt.add_argument("--out", required=True, metavar="MODEL.bin",
                    help="the model file; MODEL.report.json is written next to it")
    qt.add_argument("--features", choices=["text", "text+stats"], default="text+stats",
                    help="words and bigrams, plus the heuristic statistics as tokens")
    qt.add_argument("--epoch", type=int, default=25)
    qt.add_argument("--lr", type=float, default=0.5)
    qt.add_argument("--word-ngrams", type=int, default=2)
    qt.add_argument("--holdout", type=float, default=0.2, help="held-out share for the report")
    qt.add_argument("--keep-good", type=float, default=0.85,
                    help="the threshold keeps at least this share of good training pages")
    qt.add_argument("--seed", type=int, default=0)
    qt.add_argument("--threads", type=int, default=1, help="more is faster, not reproducible")
    qt.set_defaults(func=cmd_quality_train)
    dep = sub.add_parser("deploy", help="register the Prefect deployments (pipeline on a "
                                        "schedule, prep only, train only) on a work pool")
    dep.add_argument("--prep-config", default="configs/demo.yaml")
    dep.add_argument("--train-config", default="configs/train-demo.yaml")
    dep.add_argument("--pool-type", choices=list(POOLS), default="process")
    dep.add_argument("--pool", help=f"work pool name (default {' / '.join(POOLS.values())})")
    dep.add_argument("--cron", default="0 3 * * *", help="pipeline schedule ('' for none)")
    dep.add_argument("--output", help="prep output override")
    dep.add_argument("--run-dir", help="training run dir override")
    dep.add_argument("--steps", type=int, help="training steps override")
    dep.add_argument("--image", default=IMAGE, help="image for the kubernetes pool")
    dep.add_argument("--dask", metavar="ADDRESS",
                     help="prep (prep-only and the pipeline) runs on this Dask cluster")
    dep.set_defaults(func=cmd_deploy)
    exp = sub.add_parser("export", help="export a checkpoint or a dataset for other tools")
    exp_sub = exp.add_subparsers(dest="format", required=True)
    hf = exp_sub.add_parser("hf", help="as a Hugging Face transformers model directory")
    hf.add_argument("checkpoint", help="a step-N checkpoint, a checkpoint directory or a run "
                                       "directory (its latest checkpoint)")
    hf.add_argument("out_dir", help="directory to write config.json, model.safetensors, ...")
    hf.add_argument("--dataset", help="the dataset whose tokenizer to export (default: the "
                                      "run's `dataset:`)")
    hf.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    hf.add_argument("--max-shard-size", default="5GB",
                    help="split model.safetensors above this size (with an index)")
    hf.set_defaults(func=cmd_export_hf)
    ed = exp_sub.add_parser("dataset", help="a prepared dataset in another trainer's format")
    ed.add_argument("dataset", help="dataset directory or s3:// URI (its newest version)")
    ed.add_argument("out", help="an empty or new directory (or s3:// prefix) to write to")
    ed.add_argument("--format", required=True, choices=["megatron", "llmc", "mds"],
                    help="megatron: indexed .bin/.idx (documents); llmc: llm.c/nanoGPT "
                         ".bin shards; mds: MosaicML streaming shards (packed rows)")
    ed.add_argument("--splits", default="train,validation",
                    help="comma-separated splits to export")
    ed.add_argument("--shard-tokens", type=int, default=10**8,
                    help="llmc: tokens per shard (llm.c's fineweb.py: 10^8)")
    ed.add_argument("--no-progress", action="store_true", help="no progress bars")
    ed.set_defaults(func=cmd_export_dataset)
    return p


def main(argv: list[str] | None = None) -> int:
    command = None
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        return int(args.func(args))
    except KeyboardInterrupt:
        # `ballast prep` has stopped its workers by now (run_prep); every finished shard
        # is kept, so the same command carries on where this one stopped.
        again = "; run the same command again to resume" if command == "prep" else ""
        stderr_console().print(f"interrupted{again}", markup=False)
        return EXIT_INTERRUPTED
    except OSError as e:  # what a command did not turn into a clearer error itself
        print_error(os_error_message(e))
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
