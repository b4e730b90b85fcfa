"""Ranged reads (Store.get_range, RangedFile): LocalStore and S3Store (a real moto_server)
answer the same bytes for the same ranges, as a slice of the whole object would."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from core.s3 import S3Store
from core.store import LocalStore, NotFound, StorageOptions, Store, open_ranged

DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes, every offset's byte distinct mod 256
KEY = "dir/blob.bin"
# (start, length): inside, from the first byte, up to the last byte, crossing the end,
# starting at the end, starting past it, length 0 inside and past the end.
RANGES = [
    (100, 50),
    (0, 1),
    (len(DATA) - 10, 10),
    (len(DATA) - 10, 100),
    (len(DATA), 5),
    (len(DATA) + 1000, 5),
    (10, 0),
    (len(DATA) + 1000, 0),
]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    endpoint: str = request.getfixturevalue("moto_endpoint")
    bucket: str = request.getfixturevalue("s3_bucket")
    return S3Store(f"s3://{bucket}/runs/r1", StorageOptions(endpoint_url=endpoint))


@pytest.mark.parametrize(("start", "length"), RANGES)
def test_get_range_is_a_slice(store: Store, start: int, length: int) -> None:
    store.put(KEY, DATA)
    assert store.get_range(KEY, start, length) == DATA[start : start + length]


def test_get_range_of_an_empty_object(store: Store) -> None:
    store.put("empty", b"")
    assert store.get_range("empty", 0, 10) == b""


def test_get_range_of_a_missing_key_is_not_found(store: Store) -> None:
    store.put(KEY, DATA)
    with pytest.raises(NotFound):
        store.get_range("dir/other.bin", 0, 10)


def test_get_range_refuses_negative_offsets(store: Store) -> None:
    with pytest.raises(ValueError, match="start >= 0"):
        store.get_range(KEY, -1, 10)


def test_ranged_file_reads_a_zip_member_without_the_rest(store: Store) -> None:
    """What the stages do on S3: one member of an .npz read through seeks and ranges."""
    small, big = np.arange(10, dtype=np.int64), np.arange(200_000, dtype=np.uint64)
    buf = io.BytesIO()
    np.savez(buf, small=small, big=big)
    store.put("a.npz", buf.getvalue())
    f, raw = open_ranged(store, "a.npz")
    with f, np.load(f) as z:
        assert np.array_equal(z["small"], small)
    assert 0 < raw.fetched < big.nbytes // 10
    with zipfile.ZipFile(open_ranged(store, "a.npz")[0]) as zf:
        assert sorted(zf.namelist()) == ["big.npy", "small.npy"]


def test_ranged_file_of_a_missing_key_is_not_found(store: Store) -> None:
    f, _raw = open_ranged(store, "missing.npz")
    with pytest.raises(NotFound):
        f.seek(0, io.SEEK_END)
