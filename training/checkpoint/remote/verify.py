"""Checking remote checkpoint data: a meta.json's `files` table, validated (it is read from
storage or from a staged copy: untrusted input), and one remote object against the size and
sha256 meta.json gives it.

Guarantee: an object is checked with a HEAD request (size, and the sha256 our writes record
as metadata), never a download; an object written by a tool that records no sha256 is
checked by size alone here, and by content when it is downloaded.
"""

from __future__ import annotations

import json
import re
from typing import Any

from core.errors import IntegrityError
from core.files import sha256_file
from training.checkpoint.format import LATEST, META, CheckpointError
from training.checkpoint.remote.storage import RemoteStore

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def parse_meta(data: bytes, where: str) -> dict[str, dict[str, Any]]:
    """The `files` table of a meta.json, validated. File names must be plain names: a remote
    meta.json is untrusted input and must not make restore write outside its directory.
    A leading dot is allowed (not "." or ".."): DCP's own index of a sharded checkpoint is
    `.metadata`, and without it no TP, PP or FSDP2 checkpoint could be uploaded."""
    try:
        meta = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: {META} is not valid JSON ({exc})") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{where}: {META} lists no files")
    for name, want in files.items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..", META, LATEST)
            or "/" in name
            or "\\" in name
        ):
            raise CheckpointError(f"{where}: {META} lists an invalid file name {name!r}")
        if (
            not isinstance(want, dict)
            or not isinstance(want.get("sha256"), str)
            or not _SHA256.match(want["sha256"])
            or not isinstance(want.get("bytes"), int)
            or want["bytes"] < 0
        ):
            raise CheckpointError(f"{where}: {META} entry for {name!r} is malformed")
    return files


def verify_object(remote: RemoteStore, key: str, size: int, sha256: str) -> None:
    """Raise IntegrityError unless the remote object has this size and sha256."""
    info = _remote_info(remote, key)
    if info is None:
        raise IntegrityError(f"{remote.uri}/{key} does not exist")
    got_size, got_sha = info
    if got_size != size:
        raise IntegrityError(f"{remote.uri}/{key} has {got_size} bytes, expected {size}")
    if got_sha is None:
        # Written by a tool that sets no sha256 metadata: the size is all a HEAD can
        # tell, and get_file/our own hash check the content on download.
        return
    if got_sha != sha256:
        raise IntegrityError(
            f"{remote.uri}/{key} has sha256 {got_sha[:12]}…, expected {sha256[:12]}…"
        )


def _remote_info(remote: RemoteStore, key: str) -> tuple[int, str | None] | None:
    """(size, sha256 if known) of a remote object, or None if it does not exist: a
    HEAD on S3 (our sha256 metadata, no download), the file itself locally."""
    info = remote.store.stat(key)
    if info is None:
        return None
    local = remote.store.local_path(key)
    if info.sha256 is None and local is not None:
        return info.size, sha256_file(local)
    return info.size, info.sha256
