"""Runs the prep stage graph (tasks/graph.py) on one machine, in a process pool, step by
step, skipping every item a previous run finished. This is what `ballast prep` runs;
flows/prep.py runs the same graph as Prefect tasks."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from functools import partial
from typing import Any, Protocol, Self, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from core.store import Store
from tasks.config import PrepConfig
from tasks.graph import Run, Step, all_versions, enabled_stages, write_dataset, writes_dataset
from tasks.inputs import check_overlap
from tasks.layout import output_store, version_store
from tasks.report import build as build_report
from tasks.report import write as write_report
from tasks.stages.ingest import plan_units
from tasks.versions import Prepared, finish_version, prepare_version

T = TypeVar("T")
RUN_KEY = "_run.json"
# The layout of the intermediate files. Bumped when a step's files change shape (2:
# per-shard duplicate lists, band-per-member signatures, byte-range ingest units), so an
# output half-made by an older ballast is refused instead of resumed wrongly. 3: the
# provenance (quality's document tables, the mixture's document index, packed spans).
LAYOUT = 3
# Test hook: "STEP:N" SIGKILLs this process after the N-th completed item of STEP (e.g.
# "near: signatures:3"), to test that a killed run resumes exactly where it stopped.
FAILPOINT_ENV = "BALLAST_FAILPOINT"
# The note LocalRunner.map adds to an exception raised by a step: "in step: near: buckets".
STEP_NOTE = "in step: "


def _failpoint(desc: str, completed: int) -> None:
    spec = os.environ.get(FAILPOINT_ENV)
    if spec and spec == f"{desc}:{completed}":
        os.kill(os.getpid(), signal.SIGKILL)


class OutputConflict(RuntimeError):
    """The output already holds a run made with a different config."""


class RunnerContext:
    """`with runner:` for both runners: close on success; on an error (Ctrl-C included)
    abort, which stops this run's work at once instead of waiting for it."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class LocalRunner(RunnerContext):
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

    def close(self) -> None:
        """Let the workers finish what they run, then stop them."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(cancel_futures=True)

    def abort(self) -> None:
        """Stop the workers now (an error or Ctrl-C ends the run): what they were doing
        is thrown away rather than waited for. Every write is atomic, so the next run
        redoes exactly that work."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # Python 3.11 has no public way to stop a pool's workers (3.14: kill_workers).
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            with contextlib.suppress(OSError, ValueError):
                p.kill()
        for p in procs:
            with contextlib.suppress(OSError, ValueError, AssertionError):
                p.join(timeout=10)

    def connect(self) -> None:
        """Nothing to reach: the pool is this machine's (DaskRunner connects here)."""

    def check_workers(self, cfg: PrepConfig, run_key: str, inputs: list[str]) -> None:
        """The workers are this machine's processes: they see what this process sees."""

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """A run-once piece of work, here in this process."""
        return fn(*args)

    def warm(self) -> None:
        """Start the workers now (they import the prep modules on start), so the start-up
        overlaps the ingest work instead of delaying the first parallel step."""
        if self.workers > 1:
            pool = self._executor()
            with _sigint_blocked():  # submit starts the workers
                for _ in range(self.workers):
                    pool.submit(_noop)

    def _executor(self) -> Executor:
        if self._pool is None:
            # spawn, not fork: pyarrow's and numpy's thread pools do not survive a fork.
            deathsig = threading.current_thread() is threading.main_thread()
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_worker_init,
                                             initargs=(os.getpid(), deathsig,
                                                       max(1, (os.cpu_count() or 1)
                                                           // self.workers)))
        return self._pool

    def map(self, fn: Callable[[Any], T], items: Sequence[Any], desc: str,
            done: int = 0) -> list[T]:
        t0, start = time.perf_counter(), time.time()
        try:
            return self._map(fn, items, desc, done)
        except Exception as e:
            e.add_note(f"{STEP_NOTE}{desc}")  # `ballast prep` names the step that failed
            raise
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
                    out.append(call_and_trim(fn, it))
                    bar.advance(task)
                    _failpoint(desc, done + k)
                return out
            with _sigint_blocked():  # a submit may start a worker
                futures = [self._executor().submit(call_and_trim, fn, it) for it in items]
            for k, f in enumerate(as_completed(futures), start=1):
                f.result()  # raise the first failure at once
                bar.advance(task)
                _failpoint(desc, done + k)
            return [f.result() for f in futures]


def _noop() -> None:
    return None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Workers started inside this block start with SIGINT blocked (a signal mask is
    inherited through fork and exec) until _worker_init ignores it: Ctrl-C in a terminal
    signals the whole process group, and a worker still importing would print a
    traceback. The parent still gets its KeyboardInterrupt (another thread takes the
    signal, or it is delivered when the block ends). multiprocessing starts its resource
    tracker the same way."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _worker_init(parent_pid: int, deathsig: bool, threads: int = 0) -> None:
    """Runs first in every pool worker. Interrupts are the parent's to handle (it stops
    the workers), and a worker never outlives the parent: killed with kill -9, the parent
    runs no clean-up, and its workers would wait forever on a pipe they hold themselves
    (with them multiprocessing's resource tracker, which waits for their end of its
    pipe). `threads`: the cores each worker may use for a model rule (`perplexity`'s
    torch): the workers share the machine, and OpenMP pools sized for every core each
    ran several times slower, spinning for cores the other workers held."""
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if deathsig and sys.platform.startswith("linux"):
        # The kernel SIGKILLs this worker when the thread that started it ends: set only
        # for pools started from the main thread, whose end is the process's end.
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0))
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)
    # Elsewhere (and as a second line on Linux): a thread that ends the worker when the
    # parent's end of the start-up pipe closes, which happens only when the parent exits.
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True,
                         name="ballast-parent-watch").start()


def _exit_with(sentinel: int) -> None:
    from multiprocessing.connection import wait

    wait([sentinel])
    os._exit(1)


def call_and_trim(fn: Callable[[Any], T], item: Any) -> T:
    """Run one unit in a worker, then hand the memory it used back to the OS: workers
    live for the whole run, and without this each keeps the high-water mark of every
    unit it ran (glibc's free lists, Arrow's jemalloc pool)."""
    try:
        return fn(item)
    finally:
        release_memory(only_grown=True)


# Trim only once the process holds this much more than after its last trim. A full
# gc.collect() walks every object of the process, 0.1-0.3 s in one that has imported
# torch and datasets: noise beside a real shard, but 40% of a small run's time (72 units,
# 4 s of 10 s). Growth stays bounded by this figure, however many units a worker runs.
TRIM_ABOVE_BYTES = 64 << 20
_after_trim = 0  # resident bytes after this process's last trim (0: none yet)


def resident_bytes() -> int:
    """This process's resident set size (0 where /proc is missing: then always trim)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_memory(only_grown: bool = False) -> None:
    """Collect cycles and return freed memory to the OS; with `only_grown`, only when the
    process has grown by TRIM_ABOVE_BYTES since its last trim."""
    import ctypes
    import gc

    import pyarrow as pa

    global _after_trim
    if only_grown and _after_trim and resident_bytes() - _after_trim < TRIM_ABOVE_BYTES:
        return
    gc.collect()
    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    _after_trim = resident_bytes()


def claim_output(store: Store, cfg: PrepConfig) -> None:
    """Refuse to mix the files of two different configs in one output: resuming is only
    correct when the config that made the existing files is the same.

    The claim is an atomic create-if-absent of RUN_KEY (Store.put_if_absent), so of two
    runs racing for a fresh output exactly one makes it; the other then finds the claim
    like any existing one (OutputConflict if its config differs, a resume if not)."""
    fp = cfg.fingerprint()
    # run_id changes whenever the output is made anew: Prefect's cache keys include it,
    # so a deleted output is never mistaken for a finished one.
    if not store.exists(RUN_KEY) and store.put_if_absent(RUN_KEY, json.dumps(
            {"config_fingerprint": fp, "layout": LAYOUT, "run_id": uuid.uuid4().hex,
             "config": cfg.model_dump(mode="json")}, indent=2).encode()):
        return
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


def prepare_output(cfg: PrepConfig, log: Callable[[str], None],
                   from_scratch: bool = False) -> Prepared:
    """What every runner does before any work: refuse overlapping inputs and output,
    resolve every input into units, claim the output, and decide which dataset version
    this run builds from what the inputs hold now (tasks/versions.py)."""
    check_overlap(cfg)  # before anything is read or written
    units = plan_units(cfg)  # every input resolved before any work starts
    claim_output(output_store(cfg), cfg)
    return prepare_version(cfg, units, log, from_scratch)


def run_extra(prepared: Prepared) -> dict[str, Any]:
    """The report's entries that say which run this is."""
    cfg = prepared.cfg
    return {"config_fingerprint": cfg.fingerprint(), "seed": cfg.seed,
            "version": {"version": cfg.version, "parent": prepared.parent,
                        "added": prepared.added}}


class Runner(Protocol):
    """What run_prep needs of a runner: LocalRunner (a process pool on this machine) and
    tasks/cluster.py's DaskRunner (an existing Dask cluster)."""

    console: Console
    seconds: dict[str, float]
    times: dict[str, tuple[float, float]]

    def connect(self) -> None: ...
    def check_workers(self, cfg: PrepConfig, run_key: str, inputs: list[str]) -> None: ...
    def warm(self) -> None: ...
    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], desc: str,
            done: int = 0) -> list[Any]: ...
    def call(self, fn: Callable[..., T], *args: Any) -> T: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


def probe_inputs(prepared: Prepared) -> list[str]:
    """One input per source (its first file this run reads), for Runner.check_workers."""
    first: dict[str, str] = {}
    for unit in prepared.units:
        if unit.files:
            first.setdefault(unit.source, unit.files[0].uri)
    return list(first.values())


def run_prep(cfg: PrepConfig, until: str | None = None, runner: Runner | None = None,
             progress: bool = True, from_scratch: bool = False) -> dict[str, Any]:
    """Run the enabled stages up to `until`; return the report (also in report.json, in
    the version's store). On an existing output, only the data that arrived since its last
    version is read, into a new version (tasks/versions.py)."""
    stages = enabled_stages(cfg, until)
    own = runner is None
    runner = runner or LocalRunner(cfg.workers, progress=progress)  # starts no process
    console = runner.console
    runner.connect()  # a cluster that cannot be reached stops the run before anything else
    prepared = prepare_output(cfg, lambda msg: console.print(
        msg, markup=False, highlight=False, soft_wrap=True), from_scratch)
    cfg = prepared.cfg
    store = output_store(cfg)
    runner.check_workers(cfg, RUN_KEY, probe_inputs(prepared))
    runner.warm()
    timings: dict[str, float] = {}
    run = Run(cfg, prepared.units, extra=run_extra(prepared), prior=prepared.prior,
              prior_units=prepared.prior_units)
    try:
        accounted: list[tuple[str, list[str], bool]] = []
        for stage in stages:
            t0 = time.perf_counter()
            for step in stage.steps:
                run_step(runner, store, step, run)
            for key, read in stage.reports:
                run.extra[key] = read(run)
            timings[stage.name] = time.perf_counter() - t0
            if stage.accounting is not None:
                accounted.append((stage.name, stage.accounting(run), stage.versioned))
                run.prev = stage.name
        run.extra["final_stage"] = run.prev
        # Built (and checked) before the dataset is written: a run whose documents do not
        # add up raises here and never produces a dataset.
        report = build_report(cfg, accounted, run.extra,
                              all_versions(run, accounted))
        if writes_dataset(stages):
            t0, start = time.perf_counter(), time.time()
            report["dataset"] = runner.call(write_dataset, cfg, run.extra, report["stages"],
                                            report.get("all_versions"))
            timings["dataset"] = time.perf_counter() - t0
            runner.times["dataset"] = (round(start, 3), round(time.time(), 3))
        report["stage_seconds"] = {k: round(v, 3) for k, v in timings.items()}
        report["step_seconds"] = dict(runner.seconds)
        report["step_epoch_seconds"] = {k: list(v) for k, v in runner.times.items()}
        write_report(version_store(cfg), report)
        if until is None:
            finish_version(prepared, run.shards, writes_dataset(stages))
        return report
    except BaseException:  # an error or Ctrl-C: stop the workers now, not after their units
        if own:
            runner.abort()
        raise
    finally:
        if own:
            runner.close()


def run_step(runner: Runner, store: Store, step: Step, run: Run) -> None:
    """Run a step's unfinished items in the pool; a finished run-once step is skipped
    without a progress bar."""
    items = step.items(run)
    todo = [it for it in items if not step.is_done(run.cfg, it)]
    if step.over is None and not todo:
        return
    runner.map(partial(step.fn, run.cfg, *step.args(run)), todo, step.title(run.cfg),
               done=len(items) - len(todo))
