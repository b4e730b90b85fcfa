"""Object storage: one small interface, a local-directory store and an S3 store (boto3).

Keys are '/'-separated paths relative to the store's root URI. Every write is atomic
from a reader's point of view: a key either holds the whole object or does not exist.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict


def _read_umask() -> int:
    # os.umask can only be read by setting it, and it is process-wide: done once, here at
    # import (before any thread of ours runs), never per write.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()
# The mode a plain open(path, "w") gives a new file under this umask; mkstemp's 0600 is
# widened to it, so the output is as readable as any other file its user writes.
FILE_MODE = 0o666 & ~UMASK


def temp_beside(dest: Path) -> tuple[int, Path]:
    """A new, empty temporary file next to `dest` (same filesystem, so it can be renamed
    onto it atomically), under a hidden temporary name (see `is_temp_name`) and with the
    mode of a normal new file (FILE_MODE), not mkstemp's 0600. Returns (fd, path)."""
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    return fd, Path(name)


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of our temporary names (".<key name>.<random>.tmp"): a
    file being written, or one left behind by a killed writer. Such files are never keys."""
    return name.startswith(".") and name.endswith(".tmp")


def remove_temp_files(root: Path) -> list[Path]:
    """Delete every temporary-named file under the directory `root` (debris of killed
    writes) and return them. Only for a directory no other process is writing into."""
    removed = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if is_temp_name(name):
                p = Path(dirpath, name)
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


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
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
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

    def _write_temp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_beside(path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` holding `data` unless it exists; True if this call created it.
        Atomic against other writers (processes, hosts on one NFS export): the complete
        file is hard-linked into place, and link(2) fails if the name is taken, so a
        reader never sees a partial key and exactly one of racing callers wins."""
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
            # A filesystem without hard links: an exclusive create. A racing reader may
            # see the file before its bytes are written (json readers then fail loudly).
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            except FileExistsError:
                return False
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def put_file(self, key: str, path: str | Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_beside(dest)
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
                if is_temp_name(name):
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
