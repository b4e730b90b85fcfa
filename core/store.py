"""Object storage: one small interface, a local-directory store and an S3 store (boto3).

Keys are '/'-separated paths relative to the store's root URI. Every write is atomic
from a reader's point of view: a key either holds the whole object or does not exist.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from core.errors import SECRET_IN_CONFIG, NotFound, StorageError
from core.files import FILE_MODE, is_temp_name, temp_beside, write_atomic

__all__ = [
    "LocalStore",
    "NotFound",
    "ObjectInfo",
    "RangedFile",
    "StorageError",
    "StorageOptions",
    "Store",
    "check_range",
    "join",
    "open_file",
    "open_ranged",
    "open_store",
]


class StorageOptions(BaseModel):
    """Settings for S3-compatible stores. Anything left None comes from the environment
    (AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION, the usual credential chain)."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = Field(
        default=None, description=("Any S3-compatible store's endpoint; unset = AWS_ENDPOINT_URL.")
    )
    region: str | None = Field(
        default=None, description=("Unset = AWS_REGION / AWS_DEFAULT_REGION.")
    )
    access_key_env: str = Field(
        default="AWS_ACCESS_KEY_ID",
        description=(
            "The name of the environment variable holding the access key id, never the "
            "secret itself: configs never carry secrets."
        ),
    )
    secret_key_env: str = Field(
        default="AWS_SECRET_ACCESS_KEY",
        description=("The name of the environment variable holding the secret access key."),
    )

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        # The config is copied verbatim into records (prep's _run.json, final.json, every
        # checkpoint, MLflow): a password in the URL would travel with them. The error is of
        # its own type so that the config error does not echo the value.
        if url is not None and urlsplit(url).username is not None:
            raise PydanticCustomError(
                SECRET_IN_CONFIG,
                "credentials in the URL (user@ or user:password@) are not "
                "allowed; put them in the environment ($AWS_ACCESS_KEY_ID and "
                "$AWS_SECRET_ACCESS_KEY, or the variables access_key_env and secret_key_env name)",
            )
        return url

    max_attempts: int = Field(
        default=5, description=('Attempts per request in all (botocore\'s "standard" retry mode).')
    )
    multipart_threshold_mb: int = Field(
        default=64, description=("Uploads above this many MiB are multipart.")
    )


@dataclass(frozen=True)
class ObjectInfo:
    """What a store can say about one object without reading it: its size, the sha256
    we recorded when writing it (None for objects written by other tools), and a version
    tag that changes whenever the object does (S3 ETag; local size and mtime in ns)."""

    size: int
    sha256: str | None
    version: str


@runtime_checkable
class Store(Protocol):
    uri: str

    def put(self, key: str, data: bytes) -> None: ...
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of `key`, clipped at its end as a slice is (b""
        from a start at or past the end); NotFound if the key does not exist. Length 0
        answers b"" without looking at the key."""
        ...

    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def list_sizes(self, prefix: str = "") -> dict[str, int]: ...
    def stat(self, key: str) -> ObjectInfo | None: ...
    def delete(self, key: str) -> None: ...
    def put_file(self, key: str, path: str | Path) -> None: ...
    def get_file(self, key: str, path: str | Path) -> None: ...
    def local_path(self, key: str) -> Path | None: ...


def copy_key(src: Store, src_key: str, dst: Store, dst_key: str) -> None:
    """`src_key` of `src` to `dst_key` of `dst` without reading it where that can be done:
    a hard link between local stores on one filesystem (files of a finished dataset are
    never written again, so sharing their inode is safe), a server-side copy between S3
    stores; otherwise read and written."""
    s, d = src.local_path(src_key), dst.local_path(dst_key)
    if s is not None and d is not None:
        d.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_beside(d)
        os.close(fd)
        os.unlink(tmp)
        try:
            try:
                os.link(s, tmp)
            except OSError:  # another filesystem, or links not allowed
                shutil.copyfile(s, tmp)
            os.replace(tmp, d)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    from core.s3 import S3Store

    if isinstance(src, S3Store) and isinstance(dst, S3Store) and same_endpoint(src, dst):
        dst.copy_from(src, src_key, dst_key)
        return
    dst.put(dst_key, src.get(src_key))


def same_endpoint(a: Any, b: Any) -> bool:
    return bool(a.client.meta.endpoint_url == b.client.meta.endpoint_url)


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def check_range(start: int, length: int) -> None:
    """Refuse what a slice would read from the end: a ranged read starts at an offset."""
    if start < 0 or length < 0:
        raise ValueError(f"a byte range needs start >= 0 and length >= 0, got {start}, {length}")


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
        write_atomic(self._path(key), data)

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
            raise NotFound(f"{self.uri}/{key} does not exist") from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(start, length)
        if length == 0:
            return b""
        try:
            with open(self._path(key), "rb") as f:
                return os.pread(f.fileno(), length, start)
        except FileNotFoundError:
            raise NotFound(f"{self.uri}/{key} does not exist") from None

    def get_file(self, key: str, path: str | Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFound(f"{self.uri}/{key} does not exist")
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

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        return {k: self._path(k).stat().st_size for k in self.list(prefix)}

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and a size-mtime version; None if the key does not exist. A local
        directory records no sha256 (hash `local_path(key)` where one is needed)."""
        p = self._path(key)
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        if not p.is_file():
            return None
        return ObjectInfo(st.st_size, None, f"{st.st_size}-{st.st_mtime_ns}")


class RangedFile(io.RawIOBase):
    """A read-only, seekable file over one key's ranged reads, for readers that seek to
    the parts they need (a zip's directory and one member, a .npy header, a parquet footer
    and some column chunks) on a store without local files, where opening the file would
    otherwise mean downloading it whole. Each read is one request: wrap it in
    io.BufferedReader (open_ranged) so that small reads share one. `fetched` counts the
    bytes the store returned. The size is asked (one HEAD) only when a reader seeks from
    the end."""

    def __init__(self, store: Store, key: str) -> None:
        super().__init__()
        self.store, self.key = store, key
        self.fetched = 0
        self._pos = 0
        self._size: int | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        if self._size is None:
            info = self.store.stat(self.key)
            if info is None:
                raise NotFound(f"{self.store.uri}/{self.key} does not exist")
            self._size = info.size
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence)
        pos = offset + (self.size() if base is None else base)
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.store.get_range(self.key, self._pos, len(view))
        view[: len(data)] = data
        self._pos += len(data)
        self.fetched += len(data)
        return len(data)

    def readall(self) -> bytes:
        # RawIOBase's readall would ask in DEFAULT_BUFFER_SIZE pieces: one request each.
        data = self.store.get_range(self.key, self._pos, max(self.size() - self._pos, 0))
        self._pos += len(data)
        self.fetched += len(data)
        return data


# What a small read of a RangedFile fetches at least: a zip entry's or .npy's header is
# tens of bytes, read in several pieces; one request of 8 KiB answers them together
# without reading much past a small member.
RANGED_READAHEAD = 8 * 1024


def open_ranged(store: Store, key: str) -> tuple[io.BufferedReader, RangedFile]:
    """A buffered file over `key`'s ranged reads, and its raw file (for `fetched`)."""
    raw = RangedFile(store, key)
    return io.BufferedReader(raw, RANGED_READAHEAD), raw


def open_file(store: Store, key: str) -> BinaryIO:
    """`key` as a seekable binary file for reading parts of it: the local file where the
    store has one, else ranged reads of the object (never a whole download)."""
    local = store.local_path(key)
    if local is None:
        return open_ranged(store, key)[0]
    try:
        return open(local, "rb")
    except FileNotFoundError:
        raise NotFound(f"{store.uri}/{key} does not exist") from None


def open_store(uri: str | Path, options: StorageOptions | None = None) -> Store:
    """A store for a local path or an `s3://bucket/prefix` URI."""
    uri = str(uri)
    if uri.startswith("s3://"):
        from core.s3 import S3Store

        return S3Store(uri, options or StorageOptions())
    if "://" in uri and not uri.startswith("file://"):
        raise StorageError(
            f"unsupported storage URI {uri!r}: use a local path or s3://bucket/prefix"
        )
    return LocalStore(uri.removeprefix("file://"))
