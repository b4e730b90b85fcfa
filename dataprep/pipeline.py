"""`ballast prep` on this machine: the prep driver (dataprep/driver.py) on LocalRunner, a
process pool; PoolRunner is what it shares with dataprep/cluster.py's DaskRunner (skipping
finished items before sending any, a progress bar and the wall time per step). Also what
every worker process runs around a unit: its start-up, the memory handed back after it."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from functools import partial
from typing import Any, Self, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dataprep.config import PrepConfig
from dataprep.driver import Runner, StepWork, run_stages

T = TypeVar("T")
# Test hook: "STEP:N" SIGKILLs this process after the N-th completed item of STEP (e.g.
# "near: signatures:3"), to test that a killed run resumes exactly where it stopped.
FAILPOINT_ENV = "BALLAST_FAILPOINT"
# The note PoolRunner.map adds to an exception raised by a step: "in step: near: buckets".
STEP_NOTE = "in step: "


def _failpoint(desc: str, completed: int) -> None:
    spec = os.environ.get(FAILPOINT_ENV)
    if spec and spec == f"{desc}:{completed}":
        os.kill(os.getpid(), signal.SIGKILL)


class PoolRunner:
    """What the two runners that send units out themselves share (LocalRunner here, a
    process pool; dataprep/cluster.py's DaskRunner, a Dask cluster): finished items are
    skipped before anything is sent (a finished run-once step shows no bar), a progress
    bar per step, the wall time per step for the report, and the driver's bookkeeping in
    this process. `with runner:` closes it on success and aborts it on an error (Ctrl-C
    included), which stops this run's work at once instead of waiting for it."""

    def __init__(self, progress: bool = True, console: Console | None = None):
        self.progress = progress
        self.console = console or Console(stderr=True)
        self.seconds: dict[str, float] = {}  # wall time per step, for the report
        # (start, end) epoch seconds per step: lets a benchmark attribute memory to steps
        self.times: dict[str, tuple[float, float]] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def log(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def record(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def map(self, work: StepWork) -> None:
        todo = work.pending()
        if (work.once or not work.items) and not todo:
            return
        desc = work.desc
        t0, start = time.perf_counter(), time.time()
        try:
            self._map(work.fn, todo, desc, len(work.items) - len(todo))
        except Exception as e:
            e.add_note(f"{STEP_NOTE}{desc}")  # `ballast prep` names the step that failed
            raise
        finally:
            # A repeated step's rounds add up; its window runs from its first round's start.
            self.seconds[desc] = round(self.seconds.get(desc, 0.0) + time.perf_counter() - t0, 3)
            self.times[desc] = (self.times.get(desc, (round(start, 3),))[0], round(time.time(), 3))

    def call(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        start = time.time()
        out = self._call(fn, *args)
        self.times[name] = (round(start, 3), round(time.time(), 3))
        return out

    def timings(self, stage_seconds: dict[str, float]) -> dict[str, Any]:
        return {
            "stage_seconds": {k: round(v, 3) for k, v in stage_seconds.items()},
            "step_seconds": dict(self.seconds),
            "step_epoch_seconds": {k: list(v) for k, v in self.times.items()},
        }

    @contextlib.contextmanager
    def bar(self, desc: str, total: int, done: int) -> Iterator[Callable[[], None]]:
        """A step's progress bar, `done` of `total` items done already; yields the
        function that advances it by one item."""
        with Progress(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.progress,
            transient=False,
        ) as bar:
            yield partial(bar.advance, bar.add_task(desc, total=total, completed=done))

    def _map(self, fn: Callable[[Any], Any], items: list[Any], desc: str, done: int) -> None:
        raise NotImplementedError

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class LocalRunner(PoolRunner):
    """Maps a function over work items in a process pool (one pool per run: workers are
    spawned once, not per stage)."""

    def __init__(self, workers: int, progress: bool = True, console: Console | None = None):
        super().__init__(progress, console)
        self.workers = workers
        self._pool: Executor | None = None

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
        manager = getattr(pool, "_executor_manager_thread", None)
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            with contextlib.suppress(OSError, ValueError):
                p.kill()
        for p in procs:
            with contextlib.suppress(OSError, ValueError, AssertionError):
                p.join(timeout=10)
        # The pool's manager thread closes its wake-up pipe once it sees the workers gone;
        # Python 3.11's exit hook writes to that pipe without a lock, and when the two met
        # the run printed "Exception ignored ... Bad file descriptor" with a traceback
        # after its one-line error. Waiting for the thread here closes that window.
        if manager is not None:
            manager.join(timeout=10)

    def connect(self) -> None:
        """Nothing to reach: the pool is this machine's (DaskRunner connects here)."""

    def start(self, cfg: PrepConfig, run_key: str, inputs: list[str]) -> None:
        """The workers are this machine's processes: they see what this process sees.
        Start them now (they import the prep modules on start), so the start-up overlaps
        the ingest work instead of delaying the first parallel step."""
        if self.workers > 1:
            pool = self._executor()
            with _sigint_blocked():  # submit starts the workers
                for _ in range(self.workers):
                    pool.submit(_noop)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """A run-once piece of work, here in this process."""
        return fn(*args)

    def _executor(self) -> Executor:
        if self._pool is None:
            # spawn, not fork: pyarrow's and numpy's thread pools do not survive a fork.
            deathsig = threading.current_thread() is threading.main_thread()
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=mp.get_context("spawn"),
                initializer=_worker_init,
                initargs=(os.getpid(), deathsig, max(1, (os.cpu_count() or 1) // self.workers)),
            )
        return self._pool

    def _map(self, fn: Callable[[Any], Any], items: list[Any], desc: str, done: int) -> None:
        with self.bar(desc, len(items) + done, done) as advance:
            if self.workers == 1 or len(items) <= 1:
                for k, it in enumerate(items, start=1):
                    call_and_trim(fn, it)
                    advance()
                    _failpoint(desc, done + k)
                return
            with _sigint_blocked():  # a submit may start a worker
                futures = [self._executor().submit(call_and_trim, fn, it) for it in items]
            for k, f in enumerate(as_completed(futures), start=1):
                f.result()  # raise the first failure at once
                advance()
                _failpoint(desc, done + k)


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
            libc.prctl(
                PR_SET_PDEATHSIG,
                ctypes.c_ulong(signal.SIGKILL),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
            )
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)
    # Elsewhere (and as a second line on Linux): a thread that ends the worker when the
    # parent's end of the start-up pipe closes, which happens only when the parent exits.
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(
            target=_exit_with, args=(parent.sentinel,), daemon=True, name="ballast-parent-watch"
        ).start()


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


def run_prep(
    cfg: PrepConfig,
    until: str | None = None,
    runner: Runner | None = None,
    progress: bool = True,
    from_scratch: bool = False,
) -> dict[str, Any]:
    """`ballast prep`: the driver (dataprep/driver.py) on `runner`, by default a process pool
    of cfg.workers on this machine, which it stops when done; returns the report."""
    own = runner is None
    runner = runner or LocalRunner(cfg.workers, progress=progress)  # starts no process
    try:
        return run_stages(cfg, runner, until, from_scratch).report
    except BaseException:  # an error or Ctrl-C: stop the workers now, not after their units
        if own:
            runner.abort()
        raise
    finally:
        if own:
            runner.close()
