"""Store contract tests (LocalStore and S3Store against a real moto_server) plus S3 specifics."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from core.s3 import S3Store
from core.store import LocalStore, StorageError, StorageOptions, Store, open_store

PREFIX = "runs/r1"
MIB = 1024 * 1024


def s3_options(endpoint: str, **overrides: Any) -> StorageOptions:
    # A 5 MB threshold makes a ~12 MB file a real multipart transfer while staying fast.
    settings: dict[str, Any] = {
        "endpoint_url": endpoint,
        "multipart_threshold_mb": 5,
        "max_attempts": 3,
    }
    settings.update(overrides)
    return StorageOptions(**settings)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    endpoint: str = request.getfixturevalue("moto_endpoint")
    bucket: str = request.getfixturevalue("s3_bucket")
    return S3Store(f"s3://{bucket}/{PREFIX}", s3_options(endpoint))


@pytest.fixture
def s3_store(moto_endpoint: str, s3_bucket: str) -> S3Store:
    return S3Store(f"s3://{s3_bucket}/{PREFIX}", s3_options(moto_endpoint))


def closed_endpoint() -> str:
    """An HTTP endpoint on a loopback port nothing listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# -- contract: every Store behaves the same ----------------------------------------------


def test_satisfies_protocol(store: Store) -> None:
    assert isinstance(store, Store)


def test_put_get_overwrite(store: Store) -> None:
    store.put("a.bin", b"first")
    assert store.get("a.bin") == b"first"
    store.put("a.bin", b"second, longer")
    assert store.get("a.bin") == b"second, longer"
    store.put("nested/dir/empty.bin", b"")
    assert store.get("nested/dir/empty.bin") == b""


def test_exists_and_delete(store: Store) -> None:
    assert not store.exists("k")
    store.put("k", b"v")
    assert store.exists("k")
    store.delete("k")
    assert not store.exists("k")
    store.delete("k")  # deleting a missing key is not an error
    store.delete("never/was")


LIST_KEYS = [
    "shard-000.bin",
    "shard-001.bin",
    "shard-010.bin",
    "shards/x.bin",
    "meta.json",
    "meta/info.json",
    "meta/deep/a.txt",
    "z",
]


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("", sorted(LIST_KEYS)),
        ("shard-00", ["shard-000.bin", "shard-001.bin"]),
        ("shard", ["shard-000.bin", "shard-001.bin", "shard-010.bin", "shards/x.bin"]),
        # A prefix naming a directory is still a string prefix: "meta" matches "meta.json".
        ("meta", ["meta.json", "meta/deep/a.txt", "meta/info.json"]),
        ("meta/", ["meta/deep/a.txt", "meta/info.json"]),
        ("meta/de", ["meta/deep/a.txt"]),
        ("meta/info.json", ["meta/info.json"]),
        ("nope", []),
        ("nope/deeper/", []),
    ],
)
def test_list_prefixes(store: Store, prefix: str, expected: list[str]) -> None:
    for key in LIST_KEYS:
        store.put(key, key.encode())
    assert store.list(prefix) == expected


def test_list_paginates_past_1000_keys(store: Store) -> None:
    keys = [f"many/k-{i:05d}" for i in range(1100)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda k: store.put(k, b"x"), keys))

    list_calls = 0

    def count(**_: Any) -> None:
        nonlocal list_calls
        list_calls += 1

    if isinstance(store, S3Store):
        store.client.meta.events.register("before-call.s3.ListObjectsV2", count)
    assert store.list("many/") == keys
    assert store.list("many/k-010") == keys[1000:1100]
    if isinstance(store, S3Store):
        assert list_calls >= 3  # two pages for the first listing, one for the second


def test_missing_key(store: Store, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match=r"missing\.bin does not exist"):
        store.get("missing.bin")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StorageError, match=r"missing\.bin does not exist"):
        store.get_file("missing.bin", out / "dest.bin")
    assert list(out.iterdir()) == []


def test_put_file_get_file_multipart(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    payload = os.urandom(12 * MIB)
    src.write_bytes(payload)
    store.put_file("blobs/big.bin", src)
    assert store.exists("blobs/big.bin")

    out = tmp_path / "out"
    out.mkdir()
    dest = out / "copy.bin"
    store.get_file("blobs/big.bin", dest)
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(payload).digest()
    assert leftovers(out) == []

    if isinstance(store, S3Store):
        head = store.client.head_object(Bucket=store.bucket, Key=f"{PREFIX}/blobs/big.bin")
        # A multipart ETag ends in "-<parts>": 12 MiB in 5 MiB parts is 3 parts.
        assert head["ETag"].strip('"').endswith("-3")
        assert head["Metadata"]["sha256"] == hashlib.sha256(payload).hexdigest()


@pytest.mark.parametrize("key", ["../x", "a/../../x", "../../etc/passwd"])
def test_refuses_keys_escaping_the_root(store: Store, key: str, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="escapes the store root"):
        store.put(key, b"nope")
    with pytest.raises(StorageError, match="escapes the store root"):
        store.get(key)
    with pytest.raises(StorageError, match="escapes the store root"):
        store.exists(key)
    with pytest.raises(StorageError, match="escapes the store root"):
        store.delete(key)
    assert not (tmp_path / "x").exists()


def test_local_path(store: Store) -> None:
    if isinstance(store, LocalStore):
        assert store.local_path("a/b") == store.root / "a" / "b"
    else:
        assert store.local_path("a/b") is None


# -- S3 specifics --------------------------------------------------------------------------


def test_open_store_returns_s3store(moto_endpoint: str, s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}/{PREFIX}/", s3_options(moto_endpoint))
    assert isinstance(store, S3Store)
    assert store.uri == f"s3://{s3_bucket}/{PREFIX}"
    store.put("k", b"v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize("uri", ["s3://", "s3:///prefix"])
def test_rejects_uri_without_bucket(uri: str, aws_env: None) -> None:
    with pytest.raises(StorageError, match="names no bucket"):
        S3Store(uri, StorageOptions())


def test_keys_are_relative_to_prefix(s3_store: S3Store, s3_client: Any) -> None:
    s3_store.put("a/b.txt", b"1")
    bucket = s3_store.bucket
    assert s3_client.get_object(Bucket=bucket, Key=f"{PREFIX}/a/b.txt")["Body"].read() == b"1"
    # Neighbours that merely share the prefix string are outside the store.
    s3_client.put_object(Bucket=bucket, Key="runs/r10/other.txt", Body=b"2")
    s3_client.put_object(Bucket=bucket, Key=PREFIX, Body=b"3")
    # Console-made "folder" markers are not keys.
    s3_client.put_object(Bucket=bucket, Key=f"{PREFIX}/a/", Body=b"")
    assert s3_store.list() == ["a/b.txt"]


def test_bucket_root_store(moto_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(f"s3://{s3_bucket}", s3_options(moto_endpoint))
    assert store.uri == f"s3://{s3_bucket}"
    store.put("top.txt", b"t")
    store.put("d/e.txt", b"e")
    assert store.list() == ["d/e.txt", "top.txt"]
    assert store.list("d") == ["d/e.txt"]


def test_checksum_stored_in_metadata(s3_store: S3Store, s3_client: Any) -> None:
    s3_store.put("c.bin", b"content")
    head = s3_client.head_object(Bucket=s3_store.bucket, Key=f"{PREFIX}/c.bin")
    assert head["Metadata"]["sha256"] == hashlib.sha256(b"content").hexdigest()


def test_checksum_mismatch_detected(s3_store: S3Store, s3_client: Any, tmp_path: Path) -> None:
    s3_store.put("c.bin", b"original content")
    full = f"{PREFIX}/c.bin"
    old_meta = s3_client.head_object(Bucket=s3_store.bucket, Key=full)["Metadata"]
    # Another writer replaces the body but leaves the old checksum in place.
    s3_client.put_object(Bucket=s3_store.bucket, Key=full, Body=b"tampered", Metadata=old_meta)

    uri = f"s3://{s3_store.bucket}/{full}"
    with pytest.raises(StorageError, match="checksum mismatch") as info:
        s3_store.get("c.bin")
    assert uri in str(info.value)

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StorageError, match="checksum mismatch") as info:
        s3_store.get_file("c.bin", out / "c.bin")
    assert uri in str(info.value)
    assert list(out.iterdir()) == []  # neither the destination nor a temp file remains


def test_object_without_checksum_is_read_unchecked(s3_store: S3Store, s3_client: Any) -> None:
    s3_client.put_object(Bucket=s3_store.bucket, Key=f"{PREFIX}/foreign", Body=b"from elsewhere")
    assert s3_store.get("foreign") == b"from elsewhere"


def test_missing_bucket(moto_endpoint: str, aws_env: None, tmp_path: Path) -> None:
    store = S3Store("s3://no-such-bucket-ballast/p", s3_options(moto_endpoint))
    src = tmp_path / "f"
    src.write_bytes(b"x")
    operations: list[Callable[[], object]] = [
        lambda: store.get("k"),
        lambda: store.exists("k"),
        lambda: store.list(),
        lambda: store.put("k", b"v"),
        lambda: store.delete("k"),
        lambda: store.put_file("k", src),
        lambda: store.get_file("k", tmp_path / "out"),
    ]
    for operation in operations:
        with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-ballast' does not exist"):
            operation()
    assert not (tmp_path / "out").exists()


def test_put_file_missing_local_file(s3_store: S3Store, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="local I/O error"):
        s3_store.put_file("k", tmp_path / "absent")


def test_endpoint_and_region_from_environment(
    moto_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    store = S3Store(f"s3://{s3_bucket}/{PREFIX}", StorageOptions())
    assert store.client.meta.region_name == "eu-west-1"
    store.put("env.txt", b"ok")
    assert store.get("env.txt") == b"ok"


def test_client_config(s3_store: S3Store) -> None:
    config = s3_store.client.meta.config
    assert config.retries == {"mode": "standard", "total_max_attempts": 3}
    assert config.connect_timeout <= 10
    assert config.read_timeout <= 120
    assert s3_store.client.meta.region_name == "us-east-1"


def test_custom_credential_env_names(
    moto_endpoint: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    fake_credentials: tuple[str, str],
) -> None:
    key_id, secret = fake_credentials
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("MINIO_KEY", key_id)
    monkeypatch.setenv("MINIO_SECRET", secret)
    options = s3_options(moto_endpoint, access_key_env="MINIO_KEY", secret_key_env="MINIO_SECRET")
    store = S3Store(f"s3://{s3_bucket}/{PREFIX}", options)
    creds = store.client._request_signer._credentials
    assert (creds.access_key, creds.secret_key) == (key_id, secret)
    store.put("k", b"v")
    assert store.get("k") == b"v"


def test_incomplete_credentials(
    monkeypatch: pytest.MonkeyPatch, aws_env: None, fake_credentials: tuple[str, str]
) -> None:
    monkeypatch.setenv("ONLY_KEY", fake_credentials[0])
    monkeypatch.delenv("ONLY_SECRET", raising=False)
    options = StorageOptions(access_key_env="ONLY_KEY", secret_key_env="ONLY_SECRET")
    with pytest.raises(StorageError, match=r"\$ONLY_SECRET is not set") as info:
        S3Store("s3://b/p", options)
    assert fake_credentials[0] not in str(info.value)


@pytest.mark.parametrize("op", ["get", "put", "exists", "list", "delete", "put_file", "get_file"])
def test_unreachable_endpoint_fails_fast(
    op: str, aws_env: None, fake_credentials: tuple[str, str], tmp_path: Path
) -> None:
    endpoint = closed_endpoint()
    store = S3Store("s3://bucket/prefix", StorageOptions(endpoint_url=endpoint, max_attempts=2))
    src = tmp_path / "src"
    src.write_bytes(b"x")
    calls: dict[str, Callable[[], object]] = {
        "get": lambda: store.get("k"),
        "put": lambda: store.put("k", b"v"),
        "exists": lambda: store.exists("k"),
        "list": lambda: store.list("p"),
        "delete": lambda: store.delete("k"),
        "put_file": lambda: store.put_file("k", src),
        "get_file": lambda: store.get_file("k", tmp_path / "dest"),
    }
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        calls[op]()
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert message.startswith(f"cannot reach object storage at {endpoint}: ")
    assert "s3://bucket/prefix" in message
    assert_no_credentials(info.value, fake_credentials)
    assert not (tmp_path / "dest").exists()


# -- credentials never leak --------------------------------------------------------------


def assert_no_credentials(exc: BaseException, credentials: tuple[str, str]) -> None:
    # format_exception walks __cause__/__context__, so this covers anything chained.
    texts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    for secret in credentials:
        for text in texts:
            assert secret not in text
    # Nothing chained at all: botocore exceptions keep the raw response around.
    assert exc.__cause__ is None
    assert exc.__context__ is None


def test_credentials_never_in_errors(
    moto_endpoint: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fake_credentials: tuple[str, str],
    tmp_path: Path,
) -> None:
    caplog.set_level(logging.DEBUG, logger="infra")
    key_id, secret = fake_credentials
    # Non-default variable names, so scrubbing cannot rely on the AWS_* names alone.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("BALLAST_S3_KEY", key_id)
    monkeypatch.setenv("BALLAST_S3_SECRET", secret)
    names = {"access_key_env": "BALLAST_S3_KEY", "secret_key_env": "BALLAST_S3_SECRET"}
    store = S3Store(f"s3://{s3_bucket}/{PREFIX}", s3_options(moto_endpoint, **names))
    assert key_id not in repr(store) and secret not in repr(store)

    errors: list[StorageError] = []

    def capture(operation: Callable[[], object]) -> None:
        with pytest.raises(StorageError) as info:
            operation()
        errors.append(info.value)

    capture(lambda: store.get("missing"))
    capture(lambda: store.get_file("missing", tmp_path / "d"))
    missing_bucket = S3Store("s3://no-such-bucket-ballast", s3_options(moto_endpoint, **names))
    capture(lambda: missing_bucket.list())
    closed = closed_endpoint()
    unreachable = S3Store("s3://b/p", StorageOptions(endpoint_url=closed, max_attempts=1, **names))
    capture(lambda: unreachable.get("k"))

    # Servers and proxies may echo credentials back; the message must still be clean.
    def echo_error(**_: Any) -> None:
        raise ClientError(
            {
                "Error": {
                    "Code": "InternalError",
                    "Message": f"bad request from {key_id} signed with {secret}",
                    "AWSAccessKeyId": key_id,
                },
                "ResponseMetadata": {"HTTPStatusCode": 500},
            },
            "GetObject",
        )

    monkeypatch.setattr(store.client, "get_object", echo_error)
    capture(lambda: store.get("k"))

    def denied(**_: Any) -> None:
        raise ClientError(
            {
                "Error": {
                    "Code": "SignatureDoesNotMatch",
                    "Message": "The request signature we calculated does not match",
                    "AWSAccessKeyId": key_id,
                    "StringToSign": f"AWS4-HMAC-SHA256 {key_id}",
                },
                "ResponseMetadata": {"HTTPStatusCode": 403},
            },
            "PutObject",
        )

    monkeypatch.setattr(store.client, "put_object", denied)
    capture(lambda: store.put("k", b"v"))

    def unreachable_with_userinfo(**_: Any) -> None:
        raise EndpointConnectionError(endpoint_url=f"http://{key_id}:{secret}@10.0.0.1:9000/b")

    monkeypatch.setattr(store.client, "head_object", unreachable_with_userinfo)
    capture(lambda: store.exists("k"))

    assert len(errors) == 7
    for error in errors:
        assert_no_credentials(error, fake_credentials)
    assert "does not exist" in str(errors[0])
    assert "bucket 'no-such-bucket-ballast' does not exist" in str(errors[2])
    assert str(errors[3]).startswith(f"cannot reach object storage at {closed}")
    assert "InternalError" in str(errors[4])
    assert "$BALLAST_S3_KEY" in str(errors[5])  # names the variable, not its value
    for record in caplog.records:
        assert key_id not in record.getMessage() and secret not in record.getMessage()


def test_local_delete_drops_emptied_directories(tmp_path):
    from core.store import LocalStore

    s = LocalStore(tmp_path / "store")
    s.put("step-1/a", b"1")
    s.put("step-1/b", b"2")
    s.put("keep", b"3")
    s.delete("step-1/a")
    assert (tmp_path / "store" / "step-1").is_dir()  # still holds b
    s.delete("step-1/b")
    assert not (tmp_path / "store" / "step-1").exists()
    assert (tmp_path / "store").is_dir() and s.list("") == ["keep"]


def test_copy_key_does_not_read_the_object(store: Store, tmp_path: Path) -> None:
    """copy_key: a hard link between local stores, a server-side copy (multipart past the
    threshold) between S3 stores; the copy reads back verified, and no byte of the
    object came through this process (the source's reads are refused)."""
    from core.store import copy_key

    data = os.urandom(12 * MIB)
    store.put("a/x.bin", data)
    other = (
        LocalStore(tmp_path / "other")
        if isinstance(store, LocalStore)
        else S3Store(store.uri + "-other", store.options)  # type: ignore[attr-defined]
    )

    def refused(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("copy_key read the object")

    for name in ("get", "get_file", "get_range"):
        setattr(store, name, refused)
    copy_key(store, "a/x.bin", other, "b/y.bin")
    assert other.get("b/y.bin") == data
    if isinstance(store, LocalStore):
        assert (tmp_path / "store" / "a" / "x.bin").stat().st_ino == (
            tmp_path / "other" / "b" / "y.bin"
        ).stat().st_ino
    else:
        info = other.stat("b/y.bin")
        assert info is not None and info.sha256 == hashlib.sha256(data).hexdigest()
