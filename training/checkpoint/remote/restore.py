"""Restoring from object storage onto a (fresh) machine.

Guarantees: only a complete checkpoint is restored (its meta.json present, every file it
lists present with its size and sha256, checked before any download and each file hashed
again after its download); it is downloaded into a temporary directory renamed into place,
so a crash or a bad file midway never leaves a partial step directory that looks like a
checkpoint; a partial or corrupt remote checkpoint is skipped with a warning for the next
older one; and storage that cannot be reached raises StorageError (after retries), because
"unreachable" must not read as "nothing to resume from".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from core.errors import IntegrityError, StorageError
from core.files import fsync_dir, sha256_file
from training.checkpoint.format import LATEST, META, CheckpointError, step_name, write_latest
from training.checkpoint.remote.errors import is_integrity
from training.checkpoint.remote.keys import group_steps, step_key
from training.checkpoint.remote.latest import read_latest
from training.checkpoint.remote.storage import RemoteStore
from training.checkpoint.remote.verify import parse_meta, verify_object


def remote_steps(remote: RemoteStore) -> list[int]:
    """Steps with a meta.json remotely (finished uploads; not re-verified here)."""
    return sorted(s for s, names in group_steps(remote.list_keys()).items() if META in names)


def restore_latest(remote: RemoteStore, local_root: Path) -> int | None:
    """Download the newest complete remote checkpoint into `local_root` and point the
    local `latest` at it; return its step, or None when the remote holds none.

    The step `latest` names is tried first, then older ones newest-first; a partial or
    corrupt one is skipped with a warning. Steps newer than `latest` are ignored: their
    upload never committed. Raises StorageError when storage cannot be reached (after
    retries): "unreachable" must not read as "nothing to resume from"."""
    local_root = Path(local_root)
    local_root.mkdir(parents=True, exist_ok=True)
    latest = read_latest(remote, warn=True)
    by_step = group_steps(remote.list_keys())
    if latest is not None:
        if latest not in by_step:
            remote.log(
                f"remote checkpoint: WARNING {remote.uri}/{LATEST} names {step_name(latest)}, "
                "which does not exist remotely; trying older checkpoints"
            )
        candidates = [latest, *sorted((s for s in by_step if s < latest), reverse=True)]
    else:
        candidates = sorted(by_step, reverse=True)
    step = _restore_first(remote, candidates, by_step, local_root)
    if step is None:
        if candidates:
            remote.log(f"remote checkpoint: WARNING no complete checkpoint under {remote.uri}")
        return None
    write_latest(local_root, step)
    remote.log(
        f"remote checkpoint: restored {remote.uri}/{step_name(step)} into "
        f"{local_root / step_name(step)}"
    )
    return step


def restore_at_most(remote: RemoteStore, local_root: Path, max_step: int) -> int | None:
    """Download the newest complete remote checkpoint at or before `max_step` (a
    rollback target that is no longer on local disk); None when there is none."""
    local_root = Path(local_root)
    local_root.mkdir(parents=True, exist_ok=True)
    by_step = group_steps(remote.list_keys())
    candidates = sorted((s for s in by_step if s <= max_step), reverse=True)
    return _restore_first(remote, candidates, by_step, local_root)


def _restore_first(
    remote: RemoteStore, candidates: list[int], by_step: dict[int, set[str]], local_root: Path
) -> int | None:
    """Restore the first of `candidates` (newest first) that is complete and verifies;
    each partial or corrupt one is skipped with a warning. Its step, or None."""
    for step in candidates:
        try:
            _restore_one(remote, step, by_step.get(step, set()), local_root)
        except (IntegrityError, CheckpointError) as exc:
            remote.log(
                f"remote checkpoint: WARNING skipping {remote.uri}/{step_name(step)}, it is "
                f"partial or corrupt: {remote.scrub(str(exc))}"
            )
            continue
        return step
    return None


def _restore_one(remote: RemoteStore, step: int, names: set[str], local_root: Path) -> None:
    name = step_name(step)
    if META not in names:
        raise IntegrityError(f"no {META} (upload never finished)")
    meta_key = step_key(step, META)
    meta_bytes = remote.retry(
        f"read {remote.uri}/{meta_key}", lambda: remote.store.get(meta_key), fatal=is_integrity
    )
    files = parse_meta(meta_bytes, f"{remote.uri}/{name}")
    # Cheap checks (listing + HEAD) before downloading anything.
    for fname, want in files.items():
        if fname not in names:
            raise IntegrityError(f"{fname} listed in {META} is missing")
        key = step_key(step, fname)
        remote.retry(
            f"check {remote.uri}/{key}",
            lambda key=key, want=want: verify_object(remote, key, want["bytes"], want["sha256"]),
            fatal=is_integrity,
        )
    # Download into a temporary directory and rename it into place: a crash or a bad
    # file midway never leaves a partial step directory that looks like a checkpoint.
    tmp = local_root / f".{name}.restore-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for fname, want in files.items():
            dest = tmp / fname
            key = step_key(step, fname)
            remote.retry(
                f"download {remote.uri}/{key}",
                lambda key=key, dest=dest: remote.store.get_file(key, dest),
                fatal=is_integrity,
            )
            if sha256_file(dest) != want["sha256"]:
                raise IntegrityError(f"{fname} downloaded with a sha256 not matching {META}")
        (tmp / META).write_bytes(meta_bytes)
        for p in tmp.iterdir():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        final = local_root / name
        if final.exists():  # a stale local copy of the same step: the remote one wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(local_root)
    except StorageError as exc:
        if is_integrity(exc) and not isinstance(exc, IntegrityError):
            raise IntegrityError(str(exc)) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
