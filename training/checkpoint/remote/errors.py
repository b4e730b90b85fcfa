"""What the remote side raises, and which storage errors are facts about the data."""

from __future__ import annotations

from core.errors import IntegrityError, NotFound
from training.checkpoint.format import CheckpointError


class RemoteCheckpointError(RuntimeError):
    """Too many checkpoints in a row failed to upload (raised from `submit()`)."""


class RemoteOwnershipError(CheckpointError):
    """The remote prefix belongs to another run (another run name or config fingerprint),
    or its ownership record is unreadable: nothing is restored from, uploaded to or
    deleted in it. Bad input (the trainer exits 1), not a storage failure."""


class Aborted(Exception):
    """close(drain=False) interrupted an upload."""


def is_integrity(exc: BaseException) -> bool:
    """A fact about the remote data (missing, wrong size or sha256), not the network:
    retrying it only wastes time."""
    return isinstance(exc, IntegrityError | NotFound)
