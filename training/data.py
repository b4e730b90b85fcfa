"""The training data: a prepared dataset (verified against its manifest), read straight
from its memory-mapped Arrow files, a sampler whose whole state is one counter, and a
loader that prefetches the next micro-batches by that counter while a step runs.

The order is a pure function of (seed, epoch): epoch e is the permutation drawn from
PCG64(seed, e), and the sampler's position is `samples_seen`. So a checkpoint stores one
integer, resume is exact, and skipping a window of data (after a rollback) is moving the
counter forward.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from core.dataset import COLUMNS, MANIFEST, not_a_dataset, read_manifest, resolve, verify
from core.store import StorageError, StorageOptions, open_store


class DatasetError(ValueError):
    """The dataset cannot be trained on (missing, or does not match its manifest)."""


@dataclass
class Split:
    """One split as fixed-size rows; rows are gathered with Arrow's take, so memory holds
    the batch, not the split."""

    table: pa.Table
    seq_len: int

    @property
    def rows(self) -> int:
        return self.table.num_rows

    def batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        t = self.table.take(pa.array(idx, pa.int64()))
        out = {}
        for name in COLUMNS:
            col = t.column(name).combine_chunks()
            arr = col.flatten().to_numpy(zero_copy_only=False).reshape(len(idx), self.seq_len)
            dtype = torch.long if name == "input_ids" else torch.int32
            out[name] = torch.from_numpy(arr.astype(np.int64 if name == "input_ids" else np.int32))
            out[name] = out[name].to(dtype)
        return out


@dataclass
class TrainData:
    manifest: dict[str, Any]
    train: Split
    validation: Split
    root: Path | None = None  # the local dataset directory (its provenance is there)

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])


def fetch_dataset(uri: str, cache_root: Path, options: StorageOptions | None = None) -> Path:
    """A local copy of the dataset at `uri` (s3://...): every file its manifest lists,
    downloaded into `cache_root/<hash of uri + manifest>/` (a temporary directory renamed
    into place, so a killed download is never mistaken for a dataset). A copy that is
    already there is reused; load_data verifies it either way."""
    store = open_store(uri, options)
    try:
        manifest_bytes = store.get(MANIFEST)
        listed = sorted(json.loads(manifest_bytes).get("files", {}))
    except StorageError as e:
        raise DatasetError(f"{uri}: cannot read {MANIFEST}: {e}") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{uri}/{MANIFEST} is not valid JSON: {e}") from None
    key = hashlib.sha256(uri.encode() + b"\0" + manifest_bytes).hexdigest()[:16]
    final = cache_root / key
    if (final / MANIFEST).is_file():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache_root))
    try:
        for rel in listed:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            store.get_file(rel, tmp / rel)
        (tmp / MANIFEST).write_bytes(manifest_bytes)  # last: its presence means complete
        os.replace(tmp, final)
    except StorageError as e:
        raise DatasetError(f"{uri}: download failed: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def dataset_cache() -> Path:
    return Path(
        os.environ.get("BALLAST_DATASET_CACHE") or Path.home() / ".cache" / "ballast" / "datasets"
    )


def load_data(uri: str, check: bool = True, options: StorageOptions | None = None) -> TrainData:
    """Open a prepared dataset (a local directory, or s3://... fetched into the dataset
    cache first). With `check`, refuse it unless every file matches the manifest (sha256
    of every shard): training on silently altered data is worse than not training."""
    from datasets import load_from_disk

    try:
        # A dataset root: its newest version (`latest`); a version's directory: itself.
        uri = resolve(uri, options)
    except StorageError as e:
        raise DatasetError(f"{uri}: {e}") from None
    if "://" in uri:
        uri = str(fetch_dataset(uri, dataset_cache(), options))
    missing = not_a_dataset(uri)
    if missing is not None:  # says where it looked, and <output>/dataset for a prep output
        raise DatasetError(missing)
    if check:
        problems = verify(uri)
        if problems:
            raise DatasetError(f"{uri} does not match its manifest:\n  " + "\n  ".join(problems))
    manifest = read_manifest(uri)
    dd = load_from_disk(uri)
    seq_len = int(manifest["seq_len"])
    splits = {name: Split(dd[name].data.table, seq_len) for name in ("train", "validation")}
    if splits["train"].rows == 0:
        raise DatasetError(f"{uri}: the train split is empty")
    return TrainData(manifest, splits["train"], splits["validation"], Path(uri))


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)


class Sampler:
    """Row indices for the next `k` samples, from position `samples_seen`."""

    def __init__(self, n_rows: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n_rows, seed, shuffle
        self._perm: tuple[int, np.ndarray] | None = None

    def _epoch(self, e: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        # One read of the cache: the prefetch thread may replace it meanwhile (epoch edge).
        perm = self._perm
        if perm is None or perm[0] != e:
            perm = (e, epoch_permutation(self.n, self.seed, e))
            self._perm = perm
        return perm[1]

    def take(self, samples_seen: int, k: int) -> np.ndarray:
        out = []
        pos = samples_seen
        while k > 0:
            e, off = divmod(pos, self.n)
            chunk = self._epoch(e)[off : off + k]
            out.append(chunk)
            k -= len(chunk)
            pos += len(chunk)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class Loader:
    """Training micro-batches by sampler position, the next `depth` of them loaded by a
    background thread while the current step computes (a synchronous gather stalls the
    accelerator for the Arrow take and the host-to-device copy; nanoGPT prefetches too).

    Exact by construction: a micro-batch is named by (position, size) and is a pure function
    of them (`Sampler.take`, this rank's `select`ion, `Split.batch`), and a prefetched batch
    is handed out only for the key it was loaded for. Sample j of a step is sample
    `samples_seen + j` whatever the step's size, so consecutive steps (and a changing grad
    accumulation) hit the prefetched batches; after a rollback or a data skip the position
    jumps, the queued batches miss and are dropped. The loader holds no state of its own: the
    position lives in the trainer (`samples_seen`, advanced only after a step consumed its
    batches), so a checkpoint never records a batch that was merely prefetched.

    `pin_memory` (CUDA): batches come back in page-locked memory, so the caller's
    `.to(device, non_blocking=True)` overlaps the copy with compute. `depth=0` loads
    synchronously, in the caller's thread. `close()` (or `with`) stops the thread; at most
    `depth` micro-batch loads are ever pending, so neither close nor exit can hang."""

    def __init__(
        self,
        split: Split,
        sampler: Sampler,
        select: Callable[[np.ndarray], np.ndarray] | None = None,
        pin_memory: bool = False,
        depth: int = 2,
    ) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.split, self.sampler, self.depth = split, sampler, depth
        self._select = select
        self._pin = pin_memory
        self._ahead: collections.deque[tuple[tuple[int, int], Future[dict[str, torch.Tensor]]]]
        self._ahead = collections.deque()
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") if depth else None
        )

    def load(self, pos: int, k: int) -> dict[str, torch.Tensor]:
        """The micro-batch of the `k` samples from position `pos`, loaded now."""
        idx = self.sampler.take(pos, k)
        if self._select is not None:
            idx = self._select(idx)
        batch = self.split.batch(idx)
        return {n: t.pin_memory() for n, t in batch.items()} if self._pin else batch

    def get(self, pos: int, k: int) -> dict[str, torch.Tensor]:
        """`load(pos, k)`, from the prefetched batches when they hold it; then the next
        `depth` micro-batches (positions pos+k, pos+2k...) are queued."""
        if self._pool is None:
            return self.load(pos, k)
        batch = None
        while self._ahead:
            key, fut = self._ahead.popleft()
            if key == (pos, k):
                batch = fut.result()  # a load error surfaces here, as it would unprefetched
                break
            fut.cancel()  # a position the trainer left (rollback, skip): never used
        if batch is None:
            batch = self.load(pos, k)
        nxt = self._ahead[-1][0][0] + k if self._ahead else pos + k
        while len(self._ahead) < self.depth:
            self._ahead.append(((nxt, k), self._pool.submit(self.load, nxt, k)))
            nxt += k
        return batch

    def close(self) -> None:
        """Drop the prefetched batches and stop the thread (idempotent)."""
        for _, fut in self._ahead:
            fut.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def validation_batches(split: Split, batch: int, limit: int | None) -> list[np.ndarray]:
    idx = np.arange(split.rows)
    batches = [idx[i : i + batch] for i in range(0, len(idx), batch)]
    return batches[:limit] if limit else batches
