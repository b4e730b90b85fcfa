"""Object storage: one small interface, a local-directory store and an S3 store (boto3).

Keys are '/'-separated paths relative to the store's root URI. Every write is atomic
from a reader's point of view: a key either holds the whole object or does not exist.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI, never credentials."""


class StorageOptions(BaseModel):
    """Settings for S3-compatible stores. Anything left None comes from the environment
    (AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION, the usual credential chain)."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = None
    region: str | None = None
    # Names of environment variables holding credentials, so configs never carry secrets.
    access_key_env: str = "AWS_ACCESS_KEY_ID"
    secret_key_env: str = "AWS_SECRET_ACCESS_KEY"
    max_attempts: int = 5
    multipart_threshold_mb: int = 64


@runtime_checkable
class Store(Protocol):
    uri: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def put_file(self, key: str, path: str | Path) -> None: ...
    def get_file(self, key: str, path: str | Path) -> None: ...
    def local_path(self, key: str) -> Path | None: ...


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class LocalStore:
    """A directory on the local filesystem. Writes go to a temporary file in the same
    directory and are renamed into place, so a crash never leaves a half-written key."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if p != self.root and self.root not in p.parents:
            raise StorageError(f"key {key!r} escapes the store root {self.uri}")
        return p

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: str | Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        os.close(fd)
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StorageError(f"{self.uri}/{key} does not exist") from None

    def get_file(self, key: str, path: str | Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise StorageError(f"{self.uri}/{key} does not exist")
        shutil.copyfile(src, path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        # A prefix is a plain string prefix, as in S3: "shard-00" matches "shard-001.bin", and
        # "meta" matches "meta.json" as well as "meta/...". Only a trailing "/" confines the walk
        # to that directory.
        start = base if not prefix or prefix.endswith("/") else base.parent
        if not start.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(start):
            for name in files:
                if name.startswith(".") and name.endswith(".tmp"):
                    continue
                rel = Path(dirpath, name).relative_to(self.root).as_posix()
                if rel.startswith(prefix.strip("/")):
                    keys.append(rel)
        return sorted(keys)

    def delete(self, key: str) -> None:
        p = self._path(key)
        p.unlink(missing_ok=True)
        # Like S3, a "directory" exists only while it holds keys: drop emptied parents.
        root = self._path("")
        for parent in p.parents:
            if parent == root or root not in parent.parents:
                break
            try:
                parent.rmdir()
            except OSError:
                break  # not empty (or gone): the ones above are not empty either

    def iter_prefix(self, prefix: str = "") -> Iterator[str]:
        yield from self.list(prefix)


def open_store(uri: str | Path, options: StorageOptions | None = None) -> Store:
    """A store for a local path or an `s3://bucket/prefix` URI."""
    uri = str(uri)
    if uri.startswith("s3://"):
        from infra.s3 import S3Store

        return S3Store(uri, options or StorageOptions())
    if "://" in uri and not uri.startswith("file://"):
        raise StorageError(f"unsupported storage URI {uri!r}: use a local path or s3://bucket/prefix")
    return LocalStore(uri.removeprefix("file://"))
