"""The `prep` flow: the prep stage graph (tasks/graph.py) as Prefect tasks, one task per
step, generated from the graph and mapped over the step's items; the work lives in
tasks/stages/.

    python -m flows.prep CONFIG [--runner local|dask] [--workers N] [--dask ADDRESS]

On an existing Dask cluster (the `dask_address` parameter, else the environment's
DASK_SCHEDULER_ADDRESS), the flow runs itself again as a subflow on prefect-dask's
DaskTaskRunner(address=...): every step's items are then Dask tasks on the cluster's
workers, which report their states to the Prefect API (they need PREFECT_API_URL).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import uuid
from functools import partial
from typing import Any

from prefect import Flow, Task, flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy

from flows.runs import run_name
from tasks.cluster import (
    ClusterError,
    address_from_env,
    check_workers,
    connect,
    tune_malloc,
)
from tasks.config import PrepConfig, load_config
from tasks.graph import (
    STAGES,
    Run,
    Step,
    all_versions,
    enabled_stages,
    item_name,
    write_dataset,
    writes_dataset,
)
from tasks.layout import output_store, version_store
from tasks.pipeline import RUN_KEY, prepare_output, probe_inputs, run_extra
from tasks.report import build as build_report
from tasks.report import write as write_report
from tasks.stages.dataset import dataset_uri
from tasks.versions import Prepared, finish_version


def _output_run_id(_ctx: Any, inputs: dict[str, Any]) -> str:
    try:
        return json.loads(output_store(inputs["cfg"]).get(RUN_KEY))["run_id"]
    except Exception:  # no claimed output: never reuse a cached result
        return uuid.uuid4().hex


def _source_key(step: Step) -> CachePolicy:
    """The step and its function's source: every step's task runs the same wrapper, so
    TASK_SOURCE alone would neither tell steps apart nor see a step's code change."""
    def key(_ctx: Any, _inputs: dict[str, Any]) -> str:
        try:
            src = inspect.getsource(step.fn)
        except (OSError, TypeError):
            src = f"{step.fn.__module__}.{step.fn.__qualname__}"
        return hashlib.sha256(f"{step.name}\0{src}".encode()).hexdigest()

    return CachePolicy.from_cache_key_fn(key)


# Every step's task gains:
# - retries: writes are atomic and deterministic, so a retried item cannot duplicate
#   output. Transient storage errors (throttling, a dropped connection) are worth a retry;
#   a bad config is not, and fails before these tasks run;
# - a cache policy: inputs + source + the output's run id, with persisted results, so a
#   re-run of the flow does not even schedule finished items. The run id is new whenever
#   the output is made anew, so a deleted output is never taken for a finished one.
#   (Inside each task the step's done check still runs: the output is the truth.)
RETRIES: dict[str, Any] = {"retries": 2, "retry_delay_seconds": [2, 10]}
RUN_ID = CachePolicy.from_cache_key_fn(_output_run_id)


def _task_name(step: Step) -> str:
    return step.name.replace(": ", "-")  # "near: buckets" -> "near-buckets"


def _run_name(name: str, parameters: dict[str, Any]) -> str:
    return f"{name}-{item_name(parameters['item'])}"


def step_task(step: Step) -> Task:
    """The Prefect task of one step: runs `item` unless the output already has it."""
    def run_step(cfg: PrepConfig, args: tuple[Any, ...], item: Any) -> None:
        tune_malloc()  # on a Dask worker (tasks/cluster.py says why)
        if not step.is_done(cfg, item):
            step.fn(cfg, *args, item)

    name = _task_name(step)
    return task(run_step, name=name,
                task_run_name=None if step.over is None else partial(_run_name, name),
                cache_policy=INPUTS + TASK_SOURCE + _source_key(step) + RUN_ID,
                persist_result=True, **RETRIES)


STEP_TASKS: dict[str, Task] = {s.name: step_task(s) for st in STAGES for s in st.steps}
# A stage's report entry, read once its steps are done (in a task, as the steps read
# the output: the flow itself never opens it).
# Named "<stage>-summary" for its first entry, "<stage>-<key>" for any other.
REPORT_TASKS: dict[str, Task] = {
    key: task(read, name=f"{st.name}-summary" if i == 0 else f"{st.name}-{key}")
    for st in STAGES for i, (key, read) in enumerate(st.reports)}


@task(name="plan-inputs")
def plan_task(cfg: PrepConfig, from_scratch: bool = False) -> Prepared:
    return prepare_output(cfg, get_run_logger().info, from_scratch)


@task(name="report")
def report_task(cfg: PrepConfig, stages: list[tuple[str, list[str], bool]],
                extra: dict[str, Any], all_versions: list[str] | None) -> dict[str, Any]:
    return build_report(cfg, stages, extra, all_versions)


@task(name="save-report")
def save_report_task(cfg: PrepConfig, report: dict[str, Any]) -> None:
    """report.json again, now with the dataset's entry (as `ballast prep` writes it)."""
    write_report(version_store(cfg), report)


@task(name="write-dataset", cache_policy=INPUTS + TASK_SOURCE + RUN_ID, persist_result=True,
      **RETRIES)
def dataset_task(cfg: PrepConfig, extra: dict[str, Any], accounting: dict[str, Any],
                 all_versions: dict[str, Any] | None) -> dict[str, Any]:
    return write_dataset(cfg, extra, accounting, all_versions)


@task(name="finish-version")
def finish_task(prepared: Prepared, shards: list[str], wrote_dataset: bool) -> None:
    finish_version(prepared, shards, wrote_dataset)


def _on_dask() -> bool:
    """Whether this flow run's tasks already go to a Dask cluster (prefect-dask)."""
    from prefect.context import FlowRunContext
    from prefect_dask import DaskTaskRunner

    ctx = FlowRunContext.get()
    return ctx is not None and isinstance(ctx.task_runner, DaskTaskRunner)


def _cluster_address(dask_address: str | None) -> str | None:
    address = dask_address or address_from_env()
    return None if address in (None, "", "local") else address


@flow(name="prep", log_prints=True, flow_run_name=run_name)
def prep(config_path: str, output: str | None = None, until: str | None = None,
         from_scratch: bool = False, dask_address: str | None = None) -> dict[str, Any]:
    """Ingest -> exact dedup -> near dedup -> quality -> tokenize -> mixture -> pack ->
    dataset. Returns the dataset URI and the summary; a re-run skips finished shards.

    Args:
        config_path: The prep config (YAML), as the worker sees it: absolute, or relative
            to the worker's working directory.
        output: Where the shards, reports and the dataset go (a directory or s3://...);
            overrides the config's `output`.
        until: Stop after this stage (ingest, exact, near, lines, quality, tokenize, mixture,
            pack); empty runs every enabled stage.
        from_scratch: When inputs an earlier version read have changed or gone, build a
            new version from all current inputs (by default such a run is refused). New
            files and appended rows never need it: they go into a new version by
            themselves.
        dask_address: The scheduler of an existing Dask cluster (tcp://HOST:8786) to run
            every step on; empty: the environment's DASK_SCHEDULER_ADDRESS if set, else
            this flow run's own task runner ("local" forces the latter). Inputs and output
            must then be where every worker reaches them (s3://).
    """
    cfg = load_config(config_path, {"output": output})
    address = _cluster_address(dask_address)
    if address is not None and not _on_dask():
        from prefect_dask import DaskTaskRunner

        connect(address).close()  # unreachable, or no workers: one clear error, no work
        get_run_logger().info(f"running the steps on the Dask cluster at {address}")
        on_cluster = prep.with_options(task_runner=DaskTaskRunner(address=address))
        return on_cluster(config_path, output, until, from_scratch, address)
    stages = enabled_stages(cfg, until)
    prepared = plan_task(cfg, from_scratch)
    cfg = prepared.cfg
    if address is not None:  # every worker must see the claimed output and the inputs
        client = connect(address)
        try:
            check_workers(client, cfg, RUN_KEY, probe_inputs(prepared))
        finally:
            client.close()
    run = Run(cfg, prepared.units, extra=run_extra(prepared), prior=prepared.prior,
              prior_units=prepared.prior_units)
    accounted: list[tuple[str, list[str], bool]] = []
    for stage in stages:
        for step in stage.steps:
            t, args = STEP_TASKS[step.name], step.args(run)
            if step.over is None:
                t(cfg, args, step.items(run)[0])
            else:  # .result(): a failed item fails the flow here, after its retries
                t.map(unmapped(cfg), unmapped(args), step.items(run)).result()
        for key, _read in stage.reports:
            run.extra[key] = REPORT_TASKS[key](run)
        if stage.accounting is not None:
            accounted.append((stage.name, stage.accounting(run), stage.versioned))
            run.prev = stage.name
    run.extra["final_stage"] = run.prev
    report = report_task(cfg, accounted, run.extra, all_versions(run, accounted))
    dataset = None
    if writes_dataset(stages):
        report["dataset"] = dataset_task(cfg, run.extra, report["stages"],
                                         report.get("all_versions"))
        dataset = dataset_uri(cfg)
        save_report_task(cfg, report)
    if until is None:
        finish_task(prepared, run.shards, writes_dataset(stages))
    publish_artifacts(report, new=not prepared.nothing_new)
    return {"dataset": dataset, "output": cfg.output, "final_stage": run.prev,
            "report": report}


def version_md(report: dict[str, Any], new: bool) -> str:
    """What this run added: the version, the inputs it read, documents in / kept /
    dropped by reason, new tokens."""
    v = report.get("version") or {"version": 1, "parent": None, "added": []}
    name = f"v{v['version']:04d}"
    if not new:
        return f"**No new data**: the inputs are as version {name} read them; nothing redone."
    stages = report["stages"]
    docs_in = stages["ingest"]["total"]["docs_in"] if "ingest" in stages else 0
    text = [s for s in stages if s in ("ingest", "exact", "near", "lines", "quality")]
    kept = stages[text[-1]]["total"]["kept"] if text else 0
    dropped: dict[str, int] = {}
    for s in text:
        for reason, n in stages[s]["total"]["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    tokens = report.get("tokens") or {}
    parent = f"v{v['parent']:04d}" if v.get("parent") else "none"
    lines = [f"## Version {name} (parent: {parent})", "",
             f"- documents in: **{docs_in:,}**, kept: **{kept:,}**",
             "- dropped: " + (", ".join(f"{r}: {n:,}" for r, n in sorted(
                 dropped.items(), key=lambda kv: -kv[1])) or "none"),
             f"- new tokens: {tokens.get('train', 0):,} train, "
             f"{tokens.get('validation', 0):,} validation"]
    added = v.get("added") or []
    if added:
        lines += ["", "| input | added |", "|---|---|"]
        lines += [f"| `{a['uri']}` | {a['kind']}"
                  + (f" from byte {a['from_byte']:,}" if "from_byte" in a else "") + " |"
                  for a in added[:50]]
    else:
        lines.append("- inputs: all (the first version)")
    return "\n".join(lines)


def publish_artifacts(report: dict[str, Any], new: bool = True) -> None:
    """Tables in the Prefect UI (Artifacts page): what this run added, accounting,
    mixture, packing; and the accounting as one log line per stage."""
    logger = get_run_logger()
    create_markdown_artifact(key="prep-version", markdown=version_md(report, new),
                             description="What this run added to the dataset")
    rows = []
    for name, st in report["stages"].items():
        t = st["total"]
        top = sorted(t["dropped"].items(), key=lambda kv: -kv[1])[:4]
        rows.append({"stage": name, "docs in": t["docs_in"], "kept": t["kept"],
                     "dropped": sum(t["dropped"].values()),
                     "top reasons": ", ".join(f"{r}: {n}" for r, n in top)})
        r = rows[-1]
        logger.info(f"{name}: {r['docs in']:,} documents in, {r['kept']:,} kept, "
                    f"{r['dropped']:,} dropped" + (f" ({r['top reasons']})" if top else ""))
    create_table_artifact(key="prep-accounting", table=rows,
                          description="Documents in, kept and dropped per stage")
    mix = report.get("mixture")
    if mix:
        create_table_artifact(key="prep-mixture", description="Planned vs realised tokens", table=[
            {"source": s, "available": m["available_tokens"], "planned": m["planned_tokens"],
             "realised": m["realised_tokens"], "planned share": round(m["planned_share"], 4),
             "realised share": round(m["realised_share"], 4), "warning": m["warning"] or ""}
            for s, m in mix["sources"].items()])
    pk = report.get("packing")
    if pk:
        md = (f"**{pk['strategy']}**, seq_len {pk['seq_len']}\n\n| split | rows | efficiency "
              f"| docs | split docs |\n|---|---:|---:|---:|---:|\n")
        for split in ("train", "validation"):
            s = pk[split]
            md += (f"| {split} | {s['rows']:,} | {100 * s['efficiency']:.2f}% | {s['docs']:,} "
                   f"| {s['split_docs']:,} |\n")
        create_markdown_artifact(key="prep-packing", markdown=md,
                                 description="Packing efficiency (non-pad / all tokens)")


def with_runner(kind: str, workers: int = 2) -> Flow:
    """The prep flow on the default thread-pool task runner, or on a local Dask cluster of
    `workers` processes (prefect-dask); a Dask address can be set in the environment."""
    if kind == "local":
        return prep
    if kind == "dask":
        from prefect_dask import DaskTaskRunner

        return prep.with_options(task_runner=DaskTaskRunner(cluster_kwargs={
            "n_workers": workers, "threads_per_worker": 1, "processes": True}))
    raise ValueError(f"unknown task runner {kind!r}: use local or dask")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--output")
    ap.add_argument("--until")
    ap.add_argument("--runner", default="local", choices=["local", "dask"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dask", metavar="ADDRESS", help="an existing Dask cluster's scheduler")
    args = ap.parse_args()
    try:
        result = with_runner(args.runner, args.workers)(args.config, args.output, args.until,
                                                        dask_address=args.dask)
    except ClusterError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"dataset: {result['dataset']}")


if __name__ == "__main__":
    main()
