"""Prep on an existing Dask cluster. There are two routes onto one, both choosing the
cluster the same way (cluster_address: an explicit address, else DASK_SCHEDULER_ADDRESS;
"local" for none):

- `ballast prep CONFIG --dask tcp://HOST:8786`: the prep driver (dataprep/driver.py) on
  DaskRunner below, a `distributed` client; no Prefect involved;
- the `prep` flow's `dask_address` (flows/prep.py): the flow's own Prefect tasks on
  prefect-dask's DaskTaskRunner, whose workers report to the Prefect API.

DaskRunner runs the same steps as the local pool (dataprep/pipeline.py), each item a cluster
task; what travels through the scheduler is the step's function (by name), the config and
the item (a unit, a shard name, a band group): a few KB. Data moves through the Store at
the output URI; a worker's local disk is scratch only.

A worker that dies mid-task is the scheduler's to handle: it reruns the worker's tasks
elsewhere (Dask's `distributed.scheduler.allowed-failures` times), and a rerun item is
safe because every write is atomic and deterministic. Tasks that raise are retried
(RETRIES), as the Prefect flow retries them, for the transient storage errors a cluster
sees.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from rich.console import Console

from core.store import open_store
from dataprep.config import PrepConfig
from dataprep.driver import StepWork
from dataprep.layout import output_store
from dataprep.pipeline import PoolRunner, call_and_trim, release_memory

T = TypeVar("T")
# Dask's own name for "the scheduler to use" (its config key `scheduler-address`): set in
# a pod (k8s/overlays/prep-dask), `ballast prep` and the prep flow use that cluster.
ADDRESS_ENV = "DASK_SCHEDULER_ADDRESS"
RETRIES = 2
# Seconds to reach the scheduler (Dask retries a refused connection until then).
CONNECT_TIMEOUT_S = float(os.environ.get("BALLAST_DASK_CONNECT_TIMEOUT", "10"))
# How long a run waits for the first worker of a cluster that has none yet (worker pods
# still starting): then it stops with an error rather than queue work nobody runs.
WORKERS_TIMEOUT_S = 120.0
# Test hook, read on the WORKER: a worker whose environment has BALLAST_WORKER_FAILPOINT
# set to a step's name ("near: buckets") SIGKILLs itself when it starts an item of that
# step, to show that the cluster reruns a dead worker's tasks elsewhere.
WORKER_FAILPOINT_ENV = "BALLAST_WORKER_FAILPOINT"


class ClusterError(RuntimeError):
    """The Dask cluster cannot be used: unreachable, no workers, workers that cannot see
    the run's output or inputs, or workers that die running a step. One line, for the
    CLI's error."""


def killed_message(desc: str, once: bool) -> str:
    """What to say when Dask gives up on a task whose workers kept dying (KilledWorker):
    most often a worker's memory limit (its nanny kills it at 95%), which for a run-once
    step is the corpus-sized task that `max_task_memory` splits."""
    fix = (
        "It is one task over the whole corpus: set max_task_memory (e.g. a quarter of a "
        "worker's memory limit) to split it into tasks that hold at most that"
        if once
        else "A task holds one shard or one partition: lower ingest.shard_docs or max_task_memory"
    )
    return (
        f"Dask workers died running step '{desc}' until the scheduler gave up on it "
        "(distributed.scheduler.allowed-failures); out of memory? The workers' logs say "
        f"why. {fix}, or give the workers more memory; run again to resume"
    )


# The address that keeps a run off any cluster, whatever the environment says.
NO_CLUSTER = "local"


def cluster_address(explicit: str | None = None) -> str | None:
    """The scheduler a run uses: `explicit` (`--dask`, the flow's `dask_address`), else
    the environment's DASK_SCHEDULER_ADDRESS (set in the pods of k8s/overlays/prep-dask);
    None (this machine) when neither is set or the choice is "local"."""
    address = explicit or os.environ.get(ADDRESS_ENV) or None
    return None if address in (None, "", NO_CLUSTER) else address


def connect(
    address: str, timeout_s: float | None = None, workers_timeout_s: float = WORKERS_TIMEOUT_S
) -> Any:
    """A client of the scheduler at `address` with at least one worker, or ClusterError."""
    from distributed import Client

    timeout_s = CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        client = Client(address, timeout=f"{timeout_s}s", set_as_default=False)
    except (OSError, TimeoutError, ValueError) as e:
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ClusterError(f"cannot reach the Dask scheduler at {address}: {cause}") from None
    try:
        client.wait_for_workers(1, timeout=workers_timeout_s)
    except TimeoutError:
        client.close()
        raise ClusterError(
            f"the Dask scheduler at {address} has no workers (waited {workers_timeout_s:.0f} s)"
        ) from None
    return client


# glibc mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
_malloc_tuned = False


def tune_malloc() -> None:
    """Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536 (its
    `distributed.nanny.pre-spawn-environ`). Setting any threshold turns off glibc's dynamic
    mmap threshold, so every array over 128 KiB becomes an mmap, page faults and an munmap:
    MinHash signatures ran 2.7x slower for it (3.3 s vs 8.9 s for a 50k-document shard).
    Back to the thresholds the dynamic rule settles at on 64-bit (mmap above 32 MiB); the
    memory still goes back to the OS after every unit (release_memory's malloc_trim), which
    is what Dask's setting is for."""
    global _malloc_tuned
    if _malloc_tuned or "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        return
    _malloc_tuned = True
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)


def _run_item(fn: Callable[[Any], Any], item: Any, desc: str) -> None:
    """One item on a worker. Returns nothing: results stay in the Store, so nothing but
    a task's state travels back through the scheduler."""
    if os.environ.get(WORKER_FAILPOINT_ENV) == desc:
        os.kill(os.getpid(), signal.SIGKILL)
    tune_malloc()
    call_and_trim(fn, item)


def _slug(desc: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in desc).strip("-")


def _reach(uri: str, cfg: PrepConfig) -> None:
    """Stat one input (a local path, a directory input, or an s3:// object)."""
    if uri.startswith("s3://"):
        bucket, _, key = uri[len("s3://") :].partition("/")
        open_store(f"s3://{bucket}", cfg.storage).stat(key)
    else:
        os.stat(uri.removeprefix("file://"))


def _worker_sees(cfg: PrepConfig, run_key: str, inputs: list[str]) -> list[str]:
    """On a worker: the run's locations it cannot reach (the output's claim file, one
    input per source), each with its cause."""
    missing = []
    try:
        if not output_store(cfg).exists(run_key):
            missing.append(f"{cfg.output.rstrip('/')}/{run_key} (not found)")
    except Exception as e:
        missing.append(f"{cfg.output} ({_cause(e)})")
    for uri in inputs:
        try:
            _reach(uri, cfg)
        except Exception as e:
            missing.append(f"{uri} ({_cause(e)})")
    return missing


def _cause(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _call(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    tune_malloc()
    try:
        return fn(*args)
    finally:
        release_memory(only_grown=True)


def check_workers(client: Any, cfg: PrepConfig, run_key: str, inputs: list[str]) -> None:
    """Every worker reaches the output (the run's claim file, written before this) and
    one input per source: a local path that only the submitting machine has, or missing
    credentials on the workers, stop the run here with the worker named."""
    seen = client.run(_worker_sees, cfg, run_key, inputs)
    bad = {w: m for w, m in seen.items() if m}
    if bad:
        worker, missing = next(iter(bad.items()))
        raise ClusterError(
            f"Dask worker {worker} cannot read {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f"; {len(bad)} of {len(seen)} workers affected. Workers share no disk with "
            "this machine: put inputs and output in object storage (s3://) or on a "
            "filesystem every worker mounts at the same path"
        )


class DaskRunner(PoolRunner):
    """The driver's runner (dataprep/driver.py) on a Dask cluster at `address`."""

    def __init__(self, address: str, progress: bool = True, console: Console | None = None):
        super().__init__(progress, console)
        self.address = address
        self.client: Any = None
        self._run = uuid.uuid4().hex[:8]  # task keys unique to this run
        self._futures: list[Any] = []  # in flight, for abort

    def connect(self) -> None:
        """Before any work: reach the scheduler and see a worker (ClusterError if not)."""
        if self.client is None:
            self.client = connect(self.address)
            n = len(self.client.scheduler_info(n_workers=-1)["workers"])
            self.console.print(
                f"prep on the Dask cluster at {self.address} ({n} worker{'s' if n != 1 else ''})",
                markup=False,
                highlight=False,
            )

    def start(self, cfg: PrepConfig, run_key: str, inputs: list[str]) -> None:
        check_workers(self.client, cfg, run_key, inputs)

    def map(self, work: StepWork) -> None:
        from distributed.scheduler import KilledWorker

        try:
            super().map(work)
        except KilledWorker:
            raise ClusterError(killed_message(work.desc, work.once)) from None

    def _map(self, fn: Callable[[Any], Any], items: list[Any], desc: str, done: int) -> None:
        from distributed import as_completed

        if not items:
            return
        slug = _slug(desc)
        self._futures = futures = [
            self.client.submit(
                _run_item, fn, it, desc, key=f"{slug}-{self._run}-{i}", pure=False, retries=RETRIES
            )
            for i, it in enumerate(items)
        ]
        with self.bar(desc, len(items) + done, done) as advance:
            try:
                for f in as_completed(futures, loop=self.client.loop):
                    f.result()  # raise the first failure at once (after its retries)
                    advance()
            except BaseException:
                self.client.cancel(futures)
                raise
            finally:
                self._futures = []

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """A run-once piece of work that returns a small result (the dataset's entry)."""
        from distributed.scheduler import KilledWorker

        key = f"{_slug(getattr(fn, '__name__', 'call'))}-{self._run}"
        future = self.client.submit(_call, fn, args, key=key, pure=False, retries=RETRIES)
        self._futures = [future]
        try:
            return future.result()
        except KilledWorker:
            raise ClusterError(killed_message(getattr(fn, "__name__", "call"), True)) from None
        finally:
            self._futures = []

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def abort(self) -> None:
        """An error or Ctrl-C: cancel this run's tasks on the cluster, then disconnect
        (the cluster itself is not ours to stop)."""
        if self.client is not None and self._futures:
            with contextlib.suppress(Exception):  # a lost connection: the scheduler
                self.client.cancel(self._futures)  # drops a gone client's tasks itself
        self.close()
