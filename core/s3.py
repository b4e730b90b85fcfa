"""S3 (and S3-compatible: MinIO, Ceph, R2, moto) object storage behind the Store interface."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from s3transfer.exceptions import RetriesExceededError

from core.errors import BucketMissing, IntegrityError, NotFound, StorageError
from core.files import sha256_file
from core.redact import hide_userinfo, redact
from core.store import ObjectInfo, StorageOptions, check_range, join

__all__ = ["S3Store"]

T = TypeVar("T")

_MIB = 1024 * 1024
# S3 rejects multipart parts under 5 MiB (except the last one).
_MIN_PART = 5 * _MIB
_METADATA_SHA256 = "sha256"
# Botocore's per-attempt socket timeouts. Its defaults are 60 s each, which with retries
# turns an unreachable endpoint into minutes of hanging; 5 s is ample to open a TCP/TLS
# connection, and 60 s of silence mid-response means the connection is dead.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0

# Errors we catch and translate. Anything else (a bug, KeyboardInterrupt) propagates as is.
_TRANSLATED: tuple[type[BaseException], ...] = (
    ClientError,
    BotoCoreError,
    RetriesExceededError,
    OSError,
    ValueError,
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
# A ranged GET whose start is at or past the object's end (416 Requested Range Not
# Satisfiable); get_range answers b"" there, as a slice does.
_INVALID_RANGE = frozenset({"InvalidRange", "416"})
# put_if_absent: the key exists (412), or a concurrent conditional write to it is in
# progress (409: S3 asks for a retry, which then answers 412 or succeeds).
_PRECONDITION_FAILED = frozenset({"PreconditionFailed", "412"})
_CONDITIONAL_CONFLICT = frozenset({"ConditionalRequestConflict", "409"})
_CONFLICT_RETRIES = 5
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "403",
    }
)


def _parse_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise StorageError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise StorageError(f"S3 URI {uri!r} names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def _check_relative(key: str, what: str, uri: str) -> str:
    """Strip surrounding slashes and refuse '.'/'..' segments. S3 would store 'a/../b'
    literally, while LocalStore resolves it; refusing both keeps the two stores in step."""
    parts = key.strip("/").split("/")
    if any(p in (".", "..") for p in parts):
        raise StorageError(f"{what} {key!r} escapes the store root {uri}")
    return "/".join(p for p in parts if p)


class S3Store:
    """Objects under `s3://bucket/prefix`, keys relative to the prefix.

    Integrity: every object written here carries the sha256 of its content in the user
    metadata field `sha256`; reads verify it when present (objects written by other tools
    have none and are returned unchecked).

    Retries are botocore's "standard" mode with `options.max_attempts` attempts in total
    (first try included) and jittered exponential backoff. Retried: connection failures
    (refused, reset, DNS, connect/read timeouts), HTTP 500/502/503/504, throttling codes
    (SlowDown, Throttling, RequestLimitExceeded, ...) and RequestTimeout. Not retried: 4xx
    client errors such as NoSuchKey, NoSuchBucket and AccessDenied. The managed transfers
    (put_file/get_file) also retry interrupted download streams themselves. With the default
    5 attempts a refused connection fails after at most 1+2+4+8 = 15 s of backoff (about half
    that on average), a black-holed endpoint after at most 5 x 5 s connect timeouts more
    (~40 s): seconds, not the minutes of botocore's 60 s default timeouts.

    Errors are raised as StorageError without the botocore exception chained: botocore
    exceptions keep the raw error response, which for auth failures can carry the access
    key id. Messages are scrubbed of credential values as a second line of defence.
    """

    def __init__(self, uri: str, options: StorageOptions | None = None):
        options = options or StorageOptions()
        self.bucket, self.prefix = _parse_uri(uri)
        self.uri = f"s3://{join(self.bucket, self.prefix)}"
        self.options = options

        endpoint = (
            options.endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        region = (
            options.region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1"
        )
        access_key = os.environ.get(options.access_key_env) or None
        secret_key = os.environ.get(options.secret_key_env) or None
        if (access_key is None) != (secret_key is None):
            missing = options.secret_key_env if secret_key is None else options.access_key_env
            raise StorageError(
                f"incomplete credentials for {self.uri}: ${missing} is not set "
                f"(set both ${options.access_key_env} and ${options.secret_key_env}, "
                "or neither to use the default AWS credential chain)"
            )
        # A session token only belongs with the standard variable names; with custom names
        # (e.g. a MinIO key pair) an unrelated AWS token in the environment would be wrong.
        token = None
        if options.access_key_env == "AWS_ACCESS_KEY_ID" and access_key is not None:
            token = os.environ.get("AWS_SESSION_TOKEN") or None

        config = Config(
            region_name=region,
            retries={"mode": "standard", "total_max_attempts": max(1, options.max_attempts)},
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
            # Transfers use up to 10 threads; leave headroom for callers sharing the client.
            max_pool_connections=32,
            # Custom endpoints (MinIO, moto, Ceph, IPs) rarely resolve bucket subdomains.
            s3={"addressing_style": "path"} if endpoint else None,
            # Since botocore 1.36 CRC checksums are sent by default, which several
            # S3-compatible services reject; our own sha256 covers end-to-end integrity.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        # A private session: boto3's default session is not thread-safe to set up, and
        # explicit keys must not leak into other stores.
        self._session = boto3.session.Session(
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            aws_session_token=token,
            region_name=region,
        )
        try:
            self.client: Any = self._session.client("s3", endpoint_url=endpoint, config=config)
        except ValueError as exc:  # botocore rejects malformed endpoint URLs here
            raise StorageError(
                hide_userinfo(f"invalid S3 endpoint URL for {self.uri}: {exc}")
            ) from None
        self.endpoint = hide_userinfo(str(self.client.meta.endpoint_url))
        threshold = max(1, options.multipart_threshold_mb) * _MIB
        self._transfer_config = TransferConfig(
            multipart_threshold=threshold,
            multipart_chunksize=max(threshold, _MIN_PART),
            # awscrt, when installed, would otherwise be picked on some hosts and behaves
            # differently (own retry/credential handling); keep the one we test.
            preferred_transfer_client="classic",
        )
        # Set once a HeadBucket succeeded, so negative exists() checks cost one request.
        self._bucket_seen = False

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint={self.endpoint!r})"

    # -- Store interface ---------------------------------------------------------------

    def local_path(self, key: str) -> Path | None:
        return None

    def put(self, key: str, data: bytes) -> None:
        full = self._full_key(key)

        def op() -> None:
            self.client.put_object(
                Bucket=self.bucket,
                Key=full,
                Body=data,
                Metadata={_METADATA_SHA256: hashlib.sha256(data).hexdigest()},
            )

        self._call("write", key, op)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` holding `data` unless it exists; True if this call created it.
        One conditional PutObject (If-None-Match: *), so of racing callers exactly one
        wins. AWS S3 (since 2024-08) and moto honour the condition; an S3-compatible
        service that ignores the header would silently overwrite instead (one that rejects
        it raises StorageError)."""
        full = self._full_key(key)

        def op() -> bool:
            for attempt in range(_CONFLICT_RETRIES):
                try:
                    self.client.put_object(
                        Bucket=self.bucket,
                        Key=full,
                        Body=data,
                        IfNoneMatch="*",
                        Metadata={_METADATA_SHA256: hashlib.sha256(data).hexdigest()},
                    )
                    return True
                except ClientError as exc:
                    code = _code(exc)
                    if code in _PRECONDITION_FAILED:
                        return False
                    if code not in _CONDITIONAL_CONFLICT or attempt == _CONFLICT_RETRIES - 1:
                        raise
                time.sleep(0.05 * 2**attempt)
            raise AssertionError("unreachable")

        return self._call("write", key, op)

    def get(self, key: str) -> bytes:
        full = self._full_key(key)

        def op() -> bytes:
            resp = self.client.get_object(Bucket=self.bucket, Key=full)
            with resp["Body"] as body:
                data: bytes = body.read()
            self._verify(key, resp.get("Metadata") or {}, hashlib.sha256(data).hexdigest())
            return data

        return self._call("read", key, op)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged GET. Not verified against the sha256 metadata: that digest is of the
        whole object, and a part cannot be checked against it (reading the rest to check
        would undo the point of a ranged read)."""
        check_range(start, length)
        if length == 0:
            return b""
        full = self._full_key(key)

        def op() -> bytes:
            try:
                resp = self.client.get_object(
                    Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}"
                )
            except ClientError as exc:
                if _code(exc) not in _INVALID_RANGE:
                    raise
                return b""
            with resp["Body"] as body:
                data: bytes = body.read()
            # A service that ignores Range answers 200 with the whole object (no
            # Content-Range): still return only the part asked for.
            if "ContentRange" not in resp:
                data = data[start : start + length]
            return data

        return self._call("read", key, op)

    def exists(self, key: str) -> bool:
        full = self._full_key(key)

        def op() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=full)
                return True
            except ClientError as exc:
                if _code(exc) not in _NOT_FOUND_CODES:
                    raise
            # HEAD responses have no body, so a missing bucket also reads as a bare 404;
            # a misconfigured bucket must not look like "nothing written yet".
            self._require_bucket("check", key)
            return False

        return self._call("check", key, op)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_sizes(prefix))

    def stat(self, key: str) -> ObjectInfo | None:
        """Size, our sha256 metadata and the ETag from one HEAD (no download); None if
        the key does not exist."""
        full = self._full_key(key)

        def op() -> ObjectInfo | None:
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=full)
            except ClientError as exc:
                if _code(exc) not in _NOT_FOUND_CODES:
                    raise
                self._require_bucket("check", key)
                return None
            sha = (head.get("Metadata") or {}).get(_METADATA_SHA256)
            return ObjectInfo(int(head["ContentLength"]), sha, str(head.get("ETag", "")))

        return self._call("check", key, op)

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Keys under `prefix` with their sizes in bytes, from the same listing (so input
        planning can size work units without a HEAD request per object)."""
        rel = _check_relative(prefix, "prefix", self.uri)
        if rel and prefix.endswith("/"):
            rel += "/"  # "meta/" must not match "metadata.json"
        base = f"{self.prefix}/" if self.prefix else ""

        def op() -> dict[str, int]:
            sizes: dict[str, int] = {}
            # ListObjectsV2 returns at most 1000 keys per page.
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + rel
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name: str = obj["Key"]
                    # Zero-byte "folder" markers made by consoles are not keys of ours.
                    if not name.endswith("/"):
                        sizes[name[len(base) :]] = int(obj.get("Size", 0))
            return dict(sorted(sizes.items()))

        return self._call("list", prefix, op)

    def delete(self, key: str) -> None:
        full = self._full_key(key)
        # DeleteObject succeeds for missing keys, matching LocalStore.delete.
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))

    def copy_from(self, src: S3Store, src_key: str, key: str) -> None:
        """`src_key` of `src` (the same endpoint) to `key`, server-side: no byte passes
        through this machine. The managed copy splits objects over 5 GB into parts; the
        sha256 metadata goes with the object."""
        full, src_full = self._full_key(key), src._full_key(src_key)
        sha = (src.stat(src_key) or ObjectInfo(0, None, "")).sha256
        extra = {"Metadata": {_METADATA_SHA256: sha}, "MetadataDirective": "REPLACE"} if sha else {}

        def op() -> None:
            self.client.copy(
                {"Bucket": src.bucket, "Key": src_full},
                self.bucket,
                full,
                ExtraArgs=extra or None,
                Config=self._transfer_config,
            )

        self._call("copy", key, op)

    def put_file(self, key: str, path: str | Path) -> None:
        full = self._full_key(key)

        def op() -> None:
            # Hashing reads the file once more, which is cheap next to the upload and is
            # the only way to get a whole-object digest for multipart uploads.
            digest = sha256_file(path)
            with create_transfer_manager(self.client, self._transfer_config) as tm:
                tm.upload(
                    str(path),
                    self.bucket,
                    full,
                    extra_args={"Metadata": {_METADATA_SHA256: digest}},
                ).result()

        self._call("upload", key, op)

    def get_file(self, key: str, path: str | Path) -> None:
        full = self._full_key(key)
        dest = Path(path)

        def op() -> None:
            head: dict[str, Any] | None = None
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=full)
            except ClientError as exc:
                if _code(exc) not in _NOT_FOUND_CODES:
                    raise
            if head is None:
                self._require_bucket("download", key)
                raise StorageError(f"{self._key_uri(key)} does not exist")
            dest.parent.mkdir(parents=True, exist_ok=True)
            # Download next to the destination and rename only after verification, so
            # `path` never holds a partial or corrupt object (same filesystem: atomic).
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
            os.close(fd)
            try:
                with create_transfer_manager(self.client, self._transfer_config) as tm:
                    tm.download(self.bucket, full, tmp).result()
                self._verify(key, head.get("Metadata") or {}, sha256_file(tmp))
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

        self._call("download", key, op)

    # -- helpers ------------------------------------------------------------------------

    def _full_key(self, key: str) -> str:
        rel = _check_relative(key, "key", self.uri)
        if not rel:
            raise StorageError(f"empty key for {self.uri}")
        return join(self.prefix, rel)

    def _key_uri(self, key: str) -> str:
        rel = key.strip("/")
        return f"{self.uri}/{rel}" if rel else self.uri

    def _verify(self, key: str, metadata: dict[str, str], actual: str) -> None:
        expected = metadata.get(_METADATA_SHA256)
        if expected is not None and expected != actual:
            raise IntegrityError(
                f"checksum mismatch for {self._key_uri(key)}: metadata sha256 {expected}, "
                f"content sha256 {actual} (object corrupted or overwritten by another writer)"
            )

    def _require_bucket(self, action: str, key: str) -> None:
        """Raise the bucket-missing error if HeadBucket says so; otherwise return."""
        if self._bucket_seen:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                return  # e.g. 403 without s3:ListBucket: cannot tell, assume it exists
        else:
            self._bucket_seen = True
            return
        # Raised outside the except block so no botocore exception rides along (see _call).
        raise self._bucket_missing(action, key)

    def _bucket_missing(self, action: str, key: str) -> StorageError:
        return BucketMissing(
            f"bucket {self.bucket!r} does not exist at {self.endpoint} "
            f"(while trying to {action} {self._key_uri(key)})"
        )

    def _call(self, action: str, key: str, op: Callable[[], T]) -> T:
        try:
            return op()
        except _TRANSLATED as exc:
            err = self._translate(action, key, exc)
        # Raised outside the except block on purpose: no __context__ pointing at the
        # botocore exception (and its raw response) rides along with the StorageError.
        raise err

    def _translate(self, action: str, key: str, exc: BaseException) -> StorageError:
        uri = self._key_uri(key)
        if isinstance(exc, RetriesExceededError) and exc.last_exception is not None:
            exc = exc.last_exception
        if isinstance(exc, ClientError):
            code = _code(exc)
            message = str(exc.response.get("Error", {}).get("Message", "")).strip()
            if code == "NoSuchBucket":
                return BucketMissing(self._redact(str(self._bucket_missing(action, key))))
            elif code in _NOT_FOUND_CODES:
                return NotFound(self._redact(f"{uri} does not exist"))
            elif code in _AUTH_CODES:
                msg = (
                    f"access denied trying to {action} {uri} ({code}): check the credentials "
                    f"in ${self.options.access_key_env} / ${self.options.secret_key_env} "
                    "and the bucket policy"
                )
            else:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                detail = f": {message}" if message else ""
                msg = f"cannot {action} {uri}: {code or 'error'} (HTTP {status}){detail}"
        elif isinstance(exc, NoCredentialsError | PartialCredentialsError):
            msg = (
                f"no usable credentials to {action} {uri}: set "
                f"${self.options.access_key_env} and ${self.options.secret_key_env} "
                "or configure the AWS credential chain"
            )
        elif isinstance(exc, BotoConnectionError | HTTPClientError):
            msg = (
                f"cannot reach object storage at {self.endpoint}: {type(exc).__name__} "
                f"({exc}) while trying to {action} {uri}"
            )
        elif isinstance(exc, BotoCoreError):
            msg = f"cannot {action} {uri}: {type(exc).__name__}: {exc}"
        elif isinstance(exc, OSError):
            msg = f"cannot {action} {uri}: local I/O error: {exc}"
        else:
            msg = f"cannot {action} {uri}: {type(exc).__name__}: {exc}"
        return StorageError(self._redact(msg))

    def _redact(self, text: str) -> str:
        values: list[str] = []
        try:
            # Credentials from profiles/IMDS are cached on the session after the first call.
            creds = self._session.get_credentials()
            if creds is not None:
                values = [v for v in (creds.access_key, creds.secret_key, creds.token) if v]
        except Exception:  # scrubbing must never mask the real error
            pass
        return redact(text, (self.options.access_key_env, self.options.secret_key_env), values)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
