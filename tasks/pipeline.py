"""Runs the prep stages in order on one machine, shard by shard, skipping every shard a
previous run finished. This is what `ballast prep` runs; flows/prep.py composes the same
steps as Prefect tasks."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from functools import partial
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from infra.storage import Store
from tasks import (
    dataset,
    exact_dedup,
    mixture_stage,
    near_dedup,
    pack_stage,
    quality_filter,
    tokenize_stage,
)
from tasks.config import STAGES, PrepConfig
from tasks.ingest import ingest_unit, plan_units
from tasks.report import build as build_report
from tasks.report import write as write_report
from tasks.stage import is_done, output_store, read_done

T = TypeVar("T")
RUN_KEY = "_run.json"
# The layout of the intermediate files. Bumped when a step's files change shape (2:
# per-shard duplicate lists, band-per-member signatures, byte-range ingest units), so an
# output half-made by an older ballast is refused instead of resumed wrongly.
LAYOUT = 2
# Test hook: "STEP:N" SIGKILLs this process after the N-th completed item of STEP (e.g.
# "near: signatures:3"), to test that a killed run resumes exactly where it stopped.
FAILPOINT_ENV = "BALLAST_FAILPOINT"


def _failpoint(desc: str, completed: int) -> None:
    spec = os.environ.get(FAILPOINT_ENV)
    if spec and spec == f"{desc}:{completed}":
        os.kill(os.getpid(), signal.SIGKILL)


class OutputConflict(RuntimeError):
    """The output already holds a run made with a different config."""


class LocalRunner:
    """Maps a function over work items in a process pool (one pool per run: workers are
    spawned once, not per stage), with a progress bar per step."""

    def __init__(self, workers: int, progress: bool = True, console: Console | None = None):
        self.workers = workers
        self.progress = progress
        self.console = console or Console(stderr=True)
        self._pool: Executor | None = None
        self.seconds: dict[str, float] = {}  # wall time per step, for the report
        # (start, end) epoch seconds per step: lets a benchmark attribute memory to steps
        self.times: dict[str, tuple[float, float]] = {}

    def __enter__(self) -> LocalRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def warm(self) -> None:
        """Start the workers now (they import the prep modules on start), so the start-up
        overlaps the ingest work instead of delaying the first parallel step."""
        if self.workers > 1:
            pool = self._executor()
            for _ in range(self.workers):
                pool.submit(_noop)

    def _executor(self) -> Executor:
        if self._pool is None:
            # spawn, not fork: pyarrow's and numpy's thread pools do not survive a fork.
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"))
        return self._pool

    def map(self, fn: Callable[[Any], T], items: Sequence[Any], desc: str,
            done: int = 0) -> list[T]:
        t0, start = time.perf_counter(), time.time()
        try:
            return self._map(fn, items, desc, done)
        finally:
            self.seconds[desc] = round(time.perf_counter() - t0, 3)
            self.times[desc] = (round(start, 3), round(time.time(), 3))

    def _map(self, fn: Callable[[Any], T], items: Sequence[Any], desc: str,
             done: int) -> list[T]:
        total = len(items) + done
        with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=self.console, disable=not self.progress,
                      transient=False) as bar:
            task = bar.add_task(desc, total=total, completed=done)
            if self.workers == 1 or len(items) <= 1:
                out = []
                for k, it in enumerate(items, start=1):
                    out.append(_call_and_trim(fn, it))
                    bar.advance(task)
                    _failpoint(desc, done + k)
                return out
            futures = [self._executor().submit(_call_and_trim, fn, it) for it in items]
            for k, f in enumerate(as_completed(futures), start=1):
                f.result()  # raise the first failure at once
                bar.advance(task)
                _failpoint(desc, done + k)
            return [f.result() for f in futures]


def _noop() -> None:
    return None


def _call_and_trim(fn: Callable[[Any], T], item: Any) -> T:
    """Run one unit in a worker, then hand the memory it used back to the OS: workers
    live for the whole run, and without this each keeps the high-water mark of every
    unit it ran (glibc's free lists, Arrow's jemalloc pool)."""
    try:
        return fn(item)
    finally:
        release_memory()


def release_memory() -> None:
    import ctypes
    import gc

    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def enabled_stages(cfg: PrepConfig, until: str | None = None) -> list[str]:
    if until is not None and until not in STAGES:
        raise ValueError(f"unknown stage {until!r}; stages are: {', '.join(STAGES)}")
    on = {"ingest": True, "exact": cfg.dedup.exact, "near": cfg.dedup.near is not None,
          "quality": True, "tokenize": True, "mixture": True, "pack": True}
    out = []
    for s in STAGES:
        if on[s]:
            out.append(s)
        if s == until:
            break
    return out


def claim_output(store: Store, cfg: PrepConfig) -> None:
    """Refuse to mix the files of two different configs in one output: resuming is only
    correct when the config that made the existing files is the same."""
    fp = cfg.fingerprint()
    if store.exists(RUN_KEY):
        run = json.loads(store.get(RUN_KEY))
        have = run.get("config_fingerprint")
        if run.get("layout", 1) != LAYOUT:
            raise OutputConflict(
                f"{store.uri} was made by another version of ballast (file layout "
                f"{run.get('layout', 1)}, this version writes {LAYOUT}); choose another "
                "output or delete it")
        if have != fp:
            raise OutputConflict(
                f"{store.uri} holds a run made with a different config (fingerprint {have}, "
                f"this config {fp}); choose another output or delete it")
        return
    # run_id changes whenever the output is made anew: Prefect's cache keys include it,
    # so a deleted output is never mistaken for a finished one.
    store.put(RUN_KEY, json.dumps({"config_fingerprint": fp, "layout": LAYOUT,
                                   "run_id": uuid.uuid4().hex,
                                   "config": cfg.model_dump(mode="json")}, indent=2).encode())


def _todo(store: Store, stage: str, names: list[str]) -> list[str]:
    return [n for n in names if not is_done(store, stage, n)]


def run_prep(cfg: PrepConfig, until: str | None = None, runner: LocalRunner | None = None,
             progress: bool = True) -> dict[str, Any]:
    """Run the enabled stages up to `until`; return the report (also in report.json)."""
    stages = enabled_stages(cfg, until)
    units = plan_units(cfg)  # every input resolved before any work starts
    store = output_store(cfg)
    claim_output(store, cfg)
    own = runner is None
    runner = runner or LocalRunner(cfg.workers, progress=progress)
    runner.warm()
    timings: dict[str, float] = {}
    extra: dict[str, Any] = {"config_fingerprint": cfg.fingerprint(), "seed": cfg.seed}
    try:
        t0 = time.perf_counter()
        todo = [u for u in units if not is_done(store, "ingest", u.name)]
        runner.map(partial(ingest_unit, cfg), todo, "ingest", done=len(units) - len(todo))
        timings["ingest"] = time.perf_counter() - t0
        shards = [s for u in units for s in read_done(store, "ingest", u.name)["shards"]]
        accounted: list[tuple[str, list[str]]] = [("ingest", [u.name for u in units])]
        prev = "ingest"
        for stage in stages[1:]:
            t0 = time.perf_counter()
            if stage == "exact":
                run_exact(cfg, store, runner, prev, shards)
            elif stage == "near":
                extra["near"] = run_near(cfg, store, runner, prev, shards)
            elif stage == "quality":
                todo = _todo(store, stage, shards)
                runner.map(partial(quality_filter.filter_shard, cfg, prev), todo, "quality",
                           done=len(shards) - len(todo))
            elif stage == "tokenize":
                run_tokenize(cfg, store, runner, prev, shards)
            elif stage == "mixture":
                extra["mixture"] = run_mixture(cfg, store, runner, shards)
            elif stage == "pack":
                extra["packing"] = run_pack(cfg, store, runner, shards)
            timings[stage] = time.perf_counter() - t0
            if stage != "pack":  # pack works on rows, not documents: reported apart
                accounted.append((stage, shards))
                prev = stage
        extra["final_stage"] = prev
        extra["shards"] = shards
        # Built (and checked) before the dataset is written: a run whose documents do not
        # add up raises here and never produces a dataset.
        report = build_report(store, accounted, extra)
        if "pack" in stages:
            t0, start = time.perf_counter(), time.time()
            plan = extra["mixture"]
            manifest = dataset.write_dataset(cfg, mixture_stage.train_partitions(cfg, plan), {
                "mixture": extra["mixture"], "packing": extra["packing"],
                "accounting": report["stages"]}, mixture_stage.validation_partitions(plan))
            timings["dataset"] = time.perf_counter() - t0
            runner.times["dataset"] = (round(start, 3), round(time.time(), 3))
            report["dataset"] = {"uri": dataset.dataset_uri(cfg),
                                 "splits": {k: {"rows": v["rows"], "real_tokens": v["real_tokens"]}
                                            for k, v in manifest["splits"].items()}}
        report["stage_seconds"] = {k: round(v, 3) for k, v in timings.items()}
        report["step_seconds"] = dict(runner.seconds)
        report["step_epoch_seconds"] = {k: list(v) for k, v in runner.times.items()}
        write_report(store, report)
        return report
    finally:
        if own:
            runner.__exit__(None, None, None)


def run_exact(cfg: PrepConfig, store: Store, runner: LocalRunner, prev: str,
              shards: list[str]) -> None:
    todo = [s for s in shards if not store.exists(exact_dedup.hashes_key(s))]
    runner.map(partial(exact_dedup.hash_shard, cfg, prev), todo, "exact: hash",
               done=len(shards) - len(todo))
    if not store.exists(exact_dedup.DUPS_KEY):
        runner.map(partial(exact_dedup.select, cfg, prev), [shards], "exact: select")
    todo = _todo(store, "exact", shards)
    runner.map(partial(exact_dedup.apply_shard, cfg, prev), todo, "exact: apply",
               done=len(shards) - len(todo))


def run_near(cfg: PrepConfig, store: Store, runner: LocalRunner, prev: str,
             shards: list[str]) -> dict[str, Any]:
    todo = [s for s in shards if not store.exists(near_dedup.sig_key(s))]
    runner.map(partial(near_dedup.signature_shard, cfg, prev), todo, "near: signatures",
               done=len(shards) - len(todo))
    groups = near_dedup.band_groups(cfg)
    todo_g = [g for g in groups if not all(store.exists(near_dedup.bucket_key(b)) for b in g)]
    runner.map(partial(near_dedup.bucket_bands, cfg, shards), todo_g, "near: buckets",
               done=len(groups) - len(todo_g))
    if not store.exists(near_dedup.CLUSTER_KEY):
        runner.map(partial(near_dedup.cluster, cfg), [shards], "near: cluster")
    summary = json.loads(store.get(near_dedup.CLUSTER_KEY))
    todo = _todo(store, "near", shards)
    runner.map(partial(near_dedup.apply_shard, cfg, prev), todo, "near: apply",
               done=len(shards) - len(todo))
    return summary


def run_tokenize(cfg: PrepConfig, store: Store, runner: LocalRunner, prev: str,
                 shards: list[str]) -> None:
    if not store.exists(tokenize_stage.TOKENIZER_KEY):
        runner.map(partial(tokenize_stage.prepare_tokenizer, cfg, prev), [shards],
                   f"tokenizer: {cfg.tokenizer.kind}")
    todo = _todo(store, "tokenize", shards)
    runner.map(partial(tokenize_stage.tokenize_shard, cfg, prev), todo, "tokenize",
               done=len(shards) - len(todo))


def run_mixture(cfg: PrepConfig, store: Store, runner: LocalRunner,
                shards: list[str]) -> dict[str, Any]:
    if not store.exists(mixture_stage.PLAN_KEY):
        runner.map(partial(mixture_stage.plan, cfg), [shards], "mixture: plan")
    plan = json.loads(store.get(mixture_stage.PLAN_KEY))
    todo = _todo(store, "mixture", shards)
    runner.map(partial(mixture_stage.scatter_shard, cfg), todo, "mixture: order",
               done=len(shards) - len(todo))
    return plan


def run_pack(cfg: PrepConfig, store: Store, runner: LocalRunner,
             shards: list[str]) -> dict[str, Any]:
    plan = mixture_stage.read_plan(cfg)
    train = mixture_stage.train_partitions(cfg, plan)
    val = mixture_stage.validation_partitions(plan)
    parts = [*train, *val]
    todo = [p for p in parts if not store.exists(pack_stage.packed_done_key(p))]
    runner.map(partial(pack_stage.pack_partition, cfg, shards), todo,
               f"pack: {cfg.pack.strategy}", done=len(parts) - len(todo))
    stats = {p: json.loads(store.get(pack_stage.packed_done_key(p))) for p in parts}
    return {"strategy": cfg.pack.strategy, "seq_len": cfg.pack.seq_len,
            "train": pack_stage.packing_summary([stats[p] for p in train]),
            "validation": pack_stage.packing_summary([stats[p] for p in val])}
