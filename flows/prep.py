"""The `prep` flow: the prep driver (dataprep/driver.py) on PrefectRunner, which makes every
step of the stage graph (dataprep/graph.py) a Prefect task mapped over the step's items, and
each of the driver's bookkeeping steps a named task; the work lives in dataprep/stages/.

    python -m flows.prep CONFIG [--runner local|dask] [--workers N] [--dask ADDRESS]

The flow's tasks run on its task runner: Prefect's default thread pool, or prefect-dask's
DaskTaskRunner (dask_task_runner) on a Dask cluster, the route onto Dask for flows
(dataprep/cluster.py names both routes). On an existing cluster (the `dask_address`
parameter, else the environment's DASK_SCHEDULER_ADDRESS) the flow runs itself again as a
subflow on DaskTaskRunner(address=...): every step's items are then Dask tasks on the
cluster's workers, which report their states to the Prefect API (they need
PREFECT_API_URL); `--runner dask` starts a temporary local cluster instead.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from prefect import Flow, Task, flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy

from dataprep.arguments import add_prep_arguments
from dataprep.cluster import ClusterError, check_workers, cluster_address, connect, tune_malloc
from dataprep.config import PrepConfig, load_config
from dataprep.driver import StepWork, prepare_output, run_stages, save_report
from dataprep.graph import STAGE_NAMES, STAGES, TEXT_STAGES, Step, item_name, write_dataset
from dataprep.layout import RUN_KEY, output_store
from dataprep.report import build as build_report
from dataprep.versions import Prepared, finish_version
from flows.errors import register
from flows.runs import run_name

T = TypeVar("T")

register()  # a config, input or output error fails the run with its line, no traceback


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
        tune_malloc()  # on a Dask worker (dataprep/cluster.py says why)
        if not step.is_done(cfg, item):
            step.fn(cfg, *args, item)

    name = _task_name(step)
    return task(
        run_step,
        name=name,
        task_run_name=None if step.over is None else partial(_run_name, name),
        cache_policy=INPUTS + TASK_SOURCE + _source_key(step) + RUN_ID,
        persist_result=True,
        **RETRIES,
    )


STEP_TASKS: dict[str, Task] = {s.name: step_task(s) for st in STAGES for s in st.steps}
# A stage's report entry, read once its steps are done (in a task, as the steps read
# the output: the flow itself never opens it).
# Named "<stage>-summary" for its first entry, "<stage>-<key>" for any other.
REPORT_TASKS: dict[Callable[..., Any], Task] = {
    read: task(read, name=f"{st.name}-summary" if i == 0 else f"{st.name}-{key}")
    for st in STAGES
    for i, (key, read) in enumerate(st.reports)
}

# A step's plan (Step.plan), read before its items are drawn: "<step>-plan".
PLAN_TASKS: dict[Callable[..., Any], Task] = {
    s.plan[1]: task(s.plan[1], name=f"{_task_name(s)}-plan")
    for st in STAGES
    for s in st.steps
    if s.plan is not None
}


@task(name="plan-inputs")
def plan_task(cfg: PrepConfig, from_scratch: bool = False) -> Prepared:
    return prepare_output(cfg, get_run_logger().info, from_scratch)


@task(name="report")
def report_task(
    cfg: PrepConfig,
    stages: list[tuple[str, list[str], bool]],
    extra: dict[str, Any],
    all_versions: list[str] | None,
) -> dict[str, Any]:
    return build_report(cfg, stages, extra, all_versions)


@task(name="save-report")
def save_report_task(cfg: PrepConfig, report: dict[str, Any]) -> None:
    """report.json again, now with the dataset's entry (as `ballast prep` writes it)."""
    save_report(cfg, report)


@task(
    name="write-dataset", cache_policy=INPUTS + TASK_SOURCE + RUN_ID, persist_result=True, **RETRIES
)
def dataset_task(
    cfg: PrepConfig,
    extra: dict[str, Any],
    accounting: dict[str, Any],
    all_versions: dict[str, Any] | None,
) -> dict[str, Any]:
    return write_dataset(cfg, extra, accounting, all_versions)


@task(name="finish-version")
def finish_task(prepared: Prepared, shards: list[str], wrote_dataset: bool) -> None:
    finish_version(prepared, shards, wrote_dataset)


def _plan(cfg: PrepConfig, _log: Callable[[str], None], from_scratch: bool) -> Prepared:
    return plan_task(cfg, from_scratch)  # logs to its own task run's log


# The driver's functions (Runner.record and .call) as the tasks the UI shows.
DRIVER_TASKS: dict[Callable[..., Any], Callable[..., Any]] = {
    prepare_output: _plan,
    build_report: report_task,
    write_dataset: dataset_task,
    save_report: save_report_task,
    finish_version: finish_task,
    **REPORT_TASKS,
    **PLAN_TASKS,
}


class PrefectRunner:
    """The driver's runner inside the flow: a step is its task (STEP_TASKS) mapped over
    every item of the step, each item skipping itself when the output has it (so the UI
    shows every item, and a re-run's are cached); a failed item fails the flow once its
    retries are spent. The driver's bookkeeping runs as DRIVER_TASKS. `address`: the Dask
    cluster the flow's task runner is on, whose workers must see the output."""

    def __init__(self, address: str | None = None):
        self.address = address

    def log(self, message: str) -> None:
        get_run_logger().info(message)

    def connect(self) -> None:
        """The flow checked the cluster before it chose its task runner."""

    def start(self, cfg: PrepConfig, run_key: str, inputs: list[str]) -> None:
        if self.address is not None:  # every worker must see the claimed output and inputs
            client = connect(self.address)
            try:
                check_workers(client, cfg, run_key, inputs)
            finally:
                client.close()

    def map(self, work: StepWork) -> None:
        t = STEP_TASKS[work.step.name]
        if work.once:
            t(work.cfg, work.args, work.items[0])
        else:  # .result(): a failed item fails the flow here, after its retries
            t.map(unmapped(work.cfg), unmapped(work.args), work.items).result()

    def call(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        return self.record(fn, *args)

    def record(self, fn: Callable[..., T], *args: Any) -> T:
        return DRIVER_TASKS[fn](*args)

    def timings(self, stage_seconds: dict[str, float]) -> dict[str, Any]:
        return {}  # the UI has every task's timing


def _on_dask() -> bool:
    """Whether this flow run's tasks already go to a Dask cluster (prefect-dask)."""
    from prefect.context import FlowRunContext
    from prefect_dask import DaskTaskRunner

    ctx = FlowRunContext.get()
    return ctx is not None and isinstance(ctx.task_runner, DaskTaskRunner)


def dask_task_runner(address: str | None = None, workers: int = 2) -> Any:
    """The flow's route onto Dask: prefect-dask's DaskTaskRunner on the cluster at
    `address`, or on a temporary local cluster of `workers` single-threaded processes."""
    from prefect_dask import DaskTaskRunner

    if address is not None:
        return DaskTaskRunner(address=address)
    return DaskTaskRunner(
        cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True}
    )


def _stages_doc(fn: Callable[..., T]) -> Callable[..., T]:
    """The flow's docstring (its description in the UI) with the graph's stages."""
    fn.__doc__ = (fn.__doc__ or "").format(
        pipeline=" -> ".join(STAGE_NAMES), stages=", ".join(STAGE_NAMES)
    )
    return fn


@flow(name="prep", log_prints=True, flow_run_name=run_name)
@_stages_doc
def prep(
    config_path: str,
    output: str | None = None,
    until: str | None = None,
    from_scratch: bool = False,
    dask_address: str | None = None,
) -> dict[str, Any]:
    """The prep stages ({pipeline}), then the dataset. Returns the dataset URI and the
    summary; a re-run skips finished shards.

    Args:
        config_path: The prep config (YAML), as the worker sees it: absolute, or relative
            to the worker's working directory.
        output: Where the shards, reports and the dataset go (a directory or s3://...);
            overrides the config's `output`.
        until: Stop after this stage ({stages}); empty runs every enabled stage.
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
    address = cluster_address(dask_address)
    if address is not None and not _on_dask():
        connect(address).close()  # unreachable, or no workers: one clear error, no work
        get_run_logger().info(f"running the steps on the Dask cluster at {address}")
        on_cluster = prep.with_options(task_runner=dask_task_runner(address))
        return on_cluster(config_path, output, until, from_scratch, address)
    done = run_stages(cfg, PrefectRunner(address), until, from_scratch)
    publish_artifacts(done.report, new=not done.prepared.nothing_new)
    return {
        "dataset": done.dataset,
        "output": done.prepared.cfg.output,
        "final_stage": done.final_stage,
        "report": done.report,
    }


def version_md(report: dict[str, Any], new: bool) -> str:
    """What this run added: the version, the inputs it read, documents in / kept /
    dropped by reason, new tokens."""
    v = report.get("version") or {"version": 1, "parent": None, "added": []}
    name = f"v{v['version']:04d}"
    if not new:
        return f"**No new data**: the inputs are as version {name} read them; nothing redone."
    stages = report["stages"]
    first = STAGE_NAMES[0]  # ingest
    docs_in = stages[first]["total"]["docs_in"] if first in stages else 0
    text = [s for s in stages if s in TEXT_STAGES]
    kept = stages[text[-1]]["total"]["kept"] if text else 0
    dropped: dict[str, int] = {}
    for s in text:
        for reason, n in stages[s]["total"]["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    tokens = report.get("tokens") or {}
    parent = f"v{v['parent']:04d}" if v.get("parent") else "none"
    lines = [
        f"## Version {name} (parent: {parent})",
        "",
        f"- documents in: **{docs_in:,}**, kept: **{kept:,}**",
        "- dropped: "
        + (
            ", ".join(f"{r}: {n:,}" for r, n in sorted(dropped.items(), key=lambda kv: -kv[1]))
            or "none"
        ),
        f"- new tokens: {tokens.get('train', 0):,} train, "
        f"{tokens.get('validation', 0):,} validation",
    ]
    added = v.get("added") or []
    if added:
        lines += ["", "| input | added |", "|---|---|"]
        lines += [
            f"| `{a['uri']}` | {a['kind']}"
            + (f" from byte {a['from_byte']:,}" if "from_byte" in a else "")
            + " |"
            for a in added[:50]
        ]
    else:
        lines.append("- inputs: all (the first version)")
    return "\n".join(lines)


def publish_artifacts(report: dict[str, Any], new: bool = True) -> None:
    """Tables in the Prefect UI (Artifacts page): what this run added, accounting,
    mixture, packing; and the accounting as one log line per stage."""
    logger = get_run_logger()
    create_markdown_artifact(
        key="prep-version",
        markdown=version_md(report, new),
        description="What this run added to the dataset",
    )
    for name, st in report["stages"].items():
        t = st["total"]
        reasons = _reasons(t["dropped"])
        top = ", ".join(f"{r}: {n:,}" for r, n in reasons[:4])
        more = f" and {len(reasons) - 4} more" if len(reasons) > 4 else ""
        logger.info(
            f"{name}: {t['docs_in']:,} documents in, {t['kept']:,} kept, "
            f"{sum(t['dropped'].values()):,} dropped" + (f" ({top}{more})" if top else "")
        )
    create_markdown_artifact(
        key="prep-accounting",
        markdown=accounting_md(report),
        description="Documents in, kept and dropped per stage, and the drop reasons",
    )
    mix = report.get("mixture")
    if mix:
        create_table_artifact(
            key="prep-mixture",
            description="Planned vs realised tokens",
            table=[
                {
                    "source": s,
                    "available": f"{m['available_tokens']:,}",
                    "planned": f"{m['planned_tokens']:,}",
                    "realised": f"{m['realised_tokens']:,}",
                    "planned %": f"{100 * m['planned_share']:.2f}",
                    "realised %": f"{100 * m['realised_share']:.2f}",
                    "warning": m["warning"] or "",
                }
                for s, m in mix["sources"].items()
            ],
        )
    pk = report.get("packing")
    if pk:
        md = (
            f"**{pk['strategy']}**, seq_len {pk['seq_len']}\n\n| split | rows | efficiency "
            f"| docs | split docs |\n|---|---:|---:|---:|---:|\n"
        )
        for split in ("train", "validation"):
            s = pk[split]
            md += (
                f"| {split} | {s['rows']:,} | {100 * s['efficiency']:.2f}% | {s['docs']:,} "
                f"| {s['split_docs']:,} |\n"
            )
        create_markdown_artifact(
            key="prep-packing", markdown=md, description="Packing efficiency (non-pad / all tokens)"
        )


def _reasons(dropped: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0]))


def accounting_md(report: dict[str, Any], top: int = 8) -> str:
    """The accounting as `ballast prep` prints it (cli/commands/prep.py): a row per stage,
    then the drop reasons, a row each (the `top` largest per stage, then the rest in one
    row), numbers with thousands separators. Markdown, so a long reason wraps instead of
    being cut at the page's edge."""
    secs = report.get("stage_seconds", {})
    lines = [
        "| stage | docs in | kept | dropped | MB in | MB kept | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, st in report["stages"].items():
        t = st["total"]
        lines.append(
            f"| {name} | {t['docs_in']:,} | {t['kept']:,} | {sum(t['dropped'].values()):,} "
            f"| {t['bytes_in'] / 1e6:,.2f} | {t['bytes_kept'] / 1e6:,.2f} "
            f"| {secs.get(name, 0):.1f} |"
        )
    reasons = [
        (name, _reasons(st["total"]["dropped"]))
        for name, st in report["stages"].items()
        if st["total"]["dropped"]
    ]
    if reasons:
        lines += ["", "**Dropped, by reason**", "", "| stage | reason | docs |", "|---|---|---:|"]
        for name, rs in reasons:
            lines += [f"| {name} | {r} | {n:,} |" for r, n in rs[:top]]
            if len(rs) > top:
                rest = sum(n for _, n in rs[top:])
                lines.append(f"| {name} | ({len(rs) - top} more reasons) | {rest:,} |")
    return "\n".join(lines)


def with_runner(kind: str, workers: int = 2) -> Flow:
    """The prep flow on the default thread-pool task runner, or on a local Dask cluster of
    `workers` processes (prefect-dask); a Dask address can be set in the environment."""
    if kind == "local":
        return prep
    if kind == "dask":
        return prep.with_options(task_runner=dask_task_runner(workers=workers))
    raise ValueError(f"unknown task runner {kind!r}: use local or dask")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_prep_arguments(ap)
    ap.add_argument(
        "--runner",
        default="local",
        choices=["local", "dask"],
        help="the flow's task runner: threads, or a local Dask cluster",
    )
    ap.add_argument(
        "--workers", type=int, default=2, help="processes of the local Dask cluster (--runner dask)"
    )
    args = ap.parse_args()
    try:
        result = with_runner(args.runner, args.workers)(
            args.config,
            args.output,
            args.until,
            from_scratch=args.from_scratch,
            dask_address=args.dask,
        )
    except ClusterError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"dataset: {result['dataset']}")


if __name__ == "__main__":
    main()
