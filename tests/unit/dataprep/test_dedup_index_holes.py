"""Block reads of the dedup index on an object store (a real moto_server): blocks closer
than the hole are fetched by one ranged GET and the gaps dropped; the values are the ones
pread gives block by block on local disk, whatever the hole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from core.s3 import S3Store
from core.store import LocalStore, StorageOptions
from dataprep import dedup_index
from dataprep.dedup_index import BLOCK_KEYS, HOLE_ENV, Stats, _read_blocks, _Reader

VALUES = np.arange(10_003, dtype=np.uint64) * np.uint64(7919)  # last block partial
KEY = "_index/exact/run/k0.u64"
BLOCKS = np.array([0, 3, 5, 400, 625])  # 625: the partial last block


@pytest.fixture
def stores(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> tuple[LocalStore, S3Store]:
    local = LocalStore(tmp_path / "out")
    remote = S3Store(f"s3://{s3_bucket}/out", StorageOptions(endpoint_url=moto_endpoint))
    for s in (local, remote):
        s.put(KEY, VALUES.tobytes())
    return local, remote


def read(store, blocks: np.ndarray) -> tuple[np.ndarray, Stats]:
    stats = Stats()
    reader = _Reader(store, KEY, stats)
    try:
        return _read_blocks(reader, blocks, len(VALUES), np.uint64), stats
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("hole", "requests"),
    # 1 MiB: the whole 80 KB column in one GET; 0: a GET per run of adjacent blocks; 256
    # bytes (2 blocks): 0-3-5 in one GET (gaps of 2 and 1 blocks), 400 and 625 alone.
    [(None, 1), (0, 5), (2 * BLOCK_KEYS * 8, 3)],
)
def test_remote_reads_coalesce_within_the_hole(stores, monkeypatch, hole, requests):
    local, remote = stores
    if hole is not None:
        monkeypatch.setenv(HOLE_ENV, str(hole))
    want = VALUES[dedup_index._block_rows(BLOCKS, len(VALUES))]
    got_local, on_disk = read(local, BLOCKS)
    got_remote, on_s3 = read(remote, BLOCKS)
    assert np.array_equal(got_local, want) and np.array_equal(got_remote, want)
    assert on_disk.requests == 5  # local disk: only the wanted blocks, run by run
    assert on_disk.bytes_read == len(want) * 8
    assert on_s3.requests == requests
    assert on_s3.bytes_read >= on_disk.bytes_read
    if hole == 0:
        assert on_s3.bytes_read == on_disk.bytes_read
