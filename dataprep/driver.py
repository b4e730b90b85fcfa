"""The prep driver: the one walk over the stage graph (dataprep/graph.py) that every runner
shares. `run_stages(cfg, runner)` claims the output, decides the dataset version, runs each
enabled stage's steps in order, reads the stages' summaries, builds and checks the report,
writes the dataset and records the finished version. It never says WHERE a unit of work
runs; a Runner does:

    dataprep/pipeline.py  LocalRunner   a process pool on this machine (`ballast prep`)
    dataprep/cluster.py   DaskRunner    an existing Dask cluster (`ballast prep --dask ADDRESS`)
    flows/prep.py      PrefectRunner Prefect tasks inside the `prep` flow

A new stage is one entry in STAGES; a new runner is one class with the Runner methods.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from core.config import changed_keys
from core.store import Store
from dataprep.config import UNFINGERPRINTED, PrepConfig
from dataprep.graph import (
    Run,
    Step,
    all_versions,
    enabled_stages,
    write_dataset,
    writes_dataset,
)
from dataprep.inputs import check_overlap
from dataprep.layout import LAYOUT, READABLE_LAYOUTS, RUN_KEY, output_store, version_store
from dataprep.report import build as build_report
from dataprep.report import write as write_report
from dataprep.stages.dataset import dataset_uri
from dataprep.stages.ingest import Splits, plan_units
from dataprep.versions import Prepared, finish_version, prepare_version

T = TypeVar("T")
# A repeated step (Step.repeat) that has not ended after this many rounds is a bug, not a
# large input: large-star / small-star converges in O(log^2 n) rounds.
MAX_ROUNDS = 400


class OutputConflict(RuntimeError):
    """The output already holds a run made with a different config."""


@dataclass(frozen=True)
class StepWork:
    """One step's units of work, as the driver hands them to a runner: `fn(item)` runs one
    item; `items` is every item of the step, finished ones included (a runner skips those:
    the pool runners before sending anything out, the flow's tasks each by itself)."""

    step: Step
    cfg: PrepConfig
    args: tuple[Any, ...]  # the step's inputs drawn from the run (Step.inputs)
    items: list[Any]

    @property
    def desc(self) -> str:
        """The step's name in progress bars, timings, notes and failpoints."""
        return self.step.title(self.cfg)

    @property
    def once(self) -> bool:
        """A run-once step: one item, every shard."""
        return self.step.over is None

    @property
    def fn(self) -> Callable[[Any], Any]:
        """One item's work: module-level functions and the config, so that a process pool
        or a Dask worker gets it by name."""
        return partial(self.step.fn, self.cfg, *self.args)

    def pending(self) -> list[Any]:
        """The items the output does not yet hold."""
        return [it for it in self.items if not self.step.is_done(self.cfg, it)]


class Runner(Protocol):
    """Where the driver's work runs. `map` and `call` are the work; `record` is the
    driver's own bookkeeping (planning the version, reading a stage's summary, the report,
    recording the version), which a pool runner does in this process and the flow as
    named Prefect tasks; the rest are the hooks around them."""

    def log(self, message: str) -> None:
        """A line for whoever watches the run (the console, the flow run's log)."""

    def connect(self) -> None:
        """Before anything is read or written: reach the workers (an error if not)."""

    def start(self, cfg: PrepConfig, run_key: str, inputs: list[str]) -> None:
        """The output is claimed: check that the workers see it and `inputs` (one input
        per source); start them."""

    def map(self, work: StepWork) -> None:
        """Run the step's unfinished items; results stay in the output."""

    def call(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        """Run-once work with a small result (`name`: "dataset"), where the units run."""
        ...

    def record(self, fn: Callable[..., T], *args: Any) -> T:
        """One of the driver's bookkeeping functions (those of this module's walk)."""
        ...

    def timings(self, stage_seconds: dict[str, float]) -> dict[str, Any]:
        """The report's entries on where the time went, given the driver's seconds per
        stage; {} for a runner that keeps its own record (the Prefect UI)."""
        ...


@dataclass
class PrepResult:
    """What a run made: its report, the version it built (prepared.cfg.version) and the
    last stage whose documents it accounted for."""

    report: dict[str, Any]
    prepared: Prepared
    final_stage: str

    @property
    def dataset(self) -> str | None:
        """The URI of the dataset it wrote (None: it stopped before packing)."""
        return dataset_uri(self.prepared.cfg) if "dataset" in self.report else None


def run_stages(
    cfg: PrepConfig, runner: Runner, until: str | None = None, from_scratch: bool = False
) -> PrepResult:
    """Run the enabled stages up to `until` on `runner`; the report is also in
    report.json, in the version's store. On an existing output, only the data that arrived
    since its last version is read, into a new version (dataprep/versions.py)."""
    stages = enabled_stages(cfg, until)
    runner.connect()  # a cluster that cannot be reached stops the run before anything else
    prepared = runner.record(prepare_output, cfg, runner.log, from_scratch)
    cfg = prepared.cfg
    runner.start(cfg, RUN_KEY, probe_inputs(prepared))
    run = Run(
        cfg,
        prepared.units,
        extra=run_extra(prepared),
        prior=prepared.prior,
        prior_units=prepared.prior_units,
    )
    seconds: dict[str, float] = {}
    accounted: list[tuple[str, list[str], bool]] = []
    for stage in stages:
        t0 = time.perf_counter()
        for step in stage.steps:
            if not step.when(cfg):
                continue
            for _round in range(MAX_ROUNDS):
                if step.plan is not None:
                    key, read = step.plan
                    run.extra[key] = runner.record(read, run)
                work = StepWork(step, cfg, step.args(run), step.items(run))
                if step.repeat and not work.items:
                    break
                runner.map(work)
                if not step.repeat:
                    break
            else:
                raise RuntimeError(f"{step.name}: no end after {MAX_ROUNDS} rounds")
        for key, read in stage.reports:
            run.extra[key] = runner.record(read, run)
        seconds[stage.name] = time.perf_counter() - t0
        if stage.accounting is not None:
            accounted.append((stage.name, stage.accounting(run), stage.versioned))
            run.prev = stage.name
    run.extra["final_stage"] = run.prev
    # Built (and checked, and written) before the dataset is written: a run whose
    # documents do not add up raises here and never produces a dataset.
    report = runner.record(build_report, cfg, accounted, run.extra, all_versions(run, accounted))
    packed = writes_dataset(stages)
    if packed:
        t0 = time.perf_counter()
        report["dataset"] = runner.call(
            "dataset", write_dataset, cfg, run.extra, report["stages"], report.get("all_versions")
        )
        seconds["dataset"] = time.perf_counter() - t0
    timings = runner.timings(seconds)
    if packed or timings:  # report.json again, with what the report gained since
        report.update(timings)
        runner.record(save_report, cfg, report)
    if until is None:
        runner.record(finish_version, prepared, run.shards, packed)
    return PrepResult(report, prepared, run.prev)


def save_report(cfg: PrepConfig, report: dict[str, Any]) -> None:
    write_report(version_store(cfg), report)


def claim_output(store: Store, cfg: PrepConfig) -> None:
    """Refuse to mix the files of two different configs in one output: resuming is only
    correct when the config that made the existing files is the same.

    The claim is an atomic create-if-absent of RUN_KEY (Store.put_if_absent), so of two
    runs racing for a fresh output exactly one makes it; the other then finds the claim
    like any existing one (OutputConflict if its config differs, a resume if not)."""
    fp = cfg.fingerprint()
    # run_id changes whenever the output is made anew: Prefect's cache keys include it,
    # so a deleted output is never mistaken for a finished one.
    if not store.exists(RUN_KEY) and store.put_if_absent(
        RUN_KEY,
        json.dumps(
            {
                "config_fingerprint": fp,
                "layout": LAYOUT,
                "run_id": uuid.uuid4().hex,
                "config": cfg.model_dump(mode="json"),
            },
            indent=2,
        ).encode(),
    ):
        return
    run = json.loads(store.get(RUN_KEY))
    have = run.get("config_fingerprint")
    if run.get("layout", 1) not in READABLE_LAYOUTS:
        raise OutputConflict(
            f"{store.uri} was made by another version of ballast (file layout "
            f"{run.get('layout', 1)}, this version writes {LAYOUT}); choose another "
            "output or delete it"
        )
    if have != fp:
        # What differs, when the claim holds the config that made it (it does since
        # layout 2): the keys, not only two hashes.
        old = run.get("config")
        changed = (
            changed_keys(_fingerprinted(old), _fingerprinted(cfg.model_dump(mode="json")))
            if isinstance(old, dict)
            else ""
        )
        raise OutputConflict(
            f"{store.uri} holds a run made with a different config (fingerprint {have}, "
            f"this config {fp}"
            + (f"; changed: {changed}" if changed else "")
            + "); choose another output or delete it"
        )


def _fingerprinted(dump: dict[str, Any]) -> dict[str, Any]:
    """The part of a config dump that PrepConfig.fingerprint hashes."""
    return {k: v for k, v in dump.items() if k not in UNFINGERPRINTED}


def prepare_output(
    cfg: PrepConfig, log: Callable[[str], None], from_scratch: bool = False
) -> Prepared:
    """What every run does before any work: refuse overlapping inputs and output, resolve
    every input into units, claim the output, and decide which dataset version this run
    builds from what the inputs hold now (dataprep/versions.py)."""
    check_overlap(cfg)  # before anything is read or written
    store = output_store(cfg)
    # A cache only: read before the claim, written once the run goes ahead (a refused run
    # writes nothing).
    splits = Splits.load(store)
    units = plan_units(cfg, splits=splits)  # every input resolved before any work starts
    claim_output(store, cfg)
    prepared = prepare_version(cfg, units, log, from_scratch)
    splits.save(store)
    return prepared


def run_extra(prepared: Prepared) -> dict[str, Any]:
    """The report's entries that say which run this is."""
    cfg = prepared.cfg
    return {
        "config_fingerprint": cfg.fingerprint(),
        "seed": cfg.seed,
        "version": {"version": cfg.version, "parent": prepared.parent, "added": prepared.added},
    }


def probe_inputs(prepared: Prepared) -> list[str]:
    """One input per source (its first file this run reads), for Runner.start."""
    first: dict[str, str] = {}
    for unit in prepared.units:
        if unit.files:
            first.setdefault(unit.source, unit.files[0].uri)
    return list(first.values())
