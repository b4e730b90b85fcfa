"""The ownership record of a run's remote prefix (RUN.json).

`uri` is one run's own prefix (the trainer derives it from the run's name, see
`TrainConfig.remote_checkpoint_uri`). Guarantee: `claim()` makes sure it stays that way. At
trainer start it creates RUN.json ({"run_name", "config_fingerprint", "created", and
"config": what the fingerprint hashes, so that a refusal can name the keys that differ}) in an
unclaimed prefix, and refuses (RemoteOwnershipError) a prefix that RUN.json gives to another
run name or config fingerprint, or whose RUN.json is not a valid record, before anything is
restored from, uploaded to or pruned in it. The record is created with a conditional write
(`Store.put_if_absent`), so of two runs claiming an empty prefix at once exactly one wins
and the other is refused.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import torch

from core.config import changed_keys
from core.errors import StorageError
from training import distributed
from training.checkpoint.format import LATEST
from training.checkpoint.remote.errors import RemoteOwnershipError
from training.checkpoint.remote.keys import RUN_RECORD, group_steps
from training.checkpoint.remote.storage import RemoteStore
from training.distributed import World

# What a RUN.json may hold (it is read from storage: untrusted, and echoed in one line).
_RECORD_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
_RECORD_FINGERPRINT = re.compile(r"[0-9a-f]{8,64}")


def claim(remote: RemoteStore, run_name: str, fingerprint: str, renew: bool = False) -> None:
    """Make sure this prefix is this run's before anything touches its checkpoints.

    No RUN.json: create one (with a warning when the prefix already holds checkpoints,
    made by a Ballast from before ownership records: they are adopted). A RUN.json with
    this run name and config fingerprint: nothing to do. Anything else raises
    RemoteOwnershipError (one line: the URI, both runs, how to fix it). StorageError
    when storage cannot be reached (after retries). `renew`: the check made again after
    each upload, so a record the store lost is written again (and a prefix another run
    claimed meanwhile stops the uploads)."""
    uri = remote.uri
    fix = (
        "give this run its own prefix (another run_dir or checkpoint.run_name) or "
        f"delete {uri} to start it over"
    )
    data = remote.retry(f"read {uri}/{RUN_RECORD}", lambda: remote.get_or_none(RUN_RECORD))
    if data is None:
        if renew:
            remote.log(
                f"remote checkpoint: WARNING {uri}/{RUN_RECORD} is gone (the store "
                f"lost data?); writing it again for run {run_name!r}"
            )
        elif (keys := remote.list_keys()) and (group_steps(keys) or LATEST in keys):
            remote.log(
                f"remote checkpoint: WARNING {uri} holds checkpoints but no "
                f"{RUN_RECORD} (written by an older Ballast); adopting them as run "
                f"{run_name!r} (config fingerprint {fingerprint})"
            )
        record = {
            "run_name": run_name,
            "config_fingerprint": fingerprint,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if isinstance(getattr(fingerprint, "hashed", None), dict):
            record["config"] = fingerprint.hashed  # type: ignore[attr-defined]
        body = (json.dumps(record, indent=2) + "\n").encode()
        # A conditional create, so of racing claimants exactly one writes the record. Its
        # body is then checked below like any record read from storage, as before (a run
        # name the record cannot hold is refused even on an empty prefix). Losing the race
        # (False) is not an error in itself: the winner's record is read and checked, so
        # the same run (e.g. a retried write whose first attempt did land) goes on and
        # another run is refused with the usual message. A record deleted between the two
        # calls is a storage fault, as before.
        if remote.retry(
            f"write {uri}/{RUN_RECORD}", lambda: remote.store.put_if_absent(RUN_RECORD, body)
        ):
            data = body
        else:
            data = remote.retry(f"read {uri}/{RUN_RECORD}", lambda: remote.get_or_none(RUN_RECORD))
            if data is None:
                raise StorageError(f"{uri}/{RUN_RECORD} vanished right after its write")
    try:
        owner = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        owner = None
    if (
        not isinstance(owner, dict)
        or not isinstance(owner.get("run_name"), str)
        or not _RECORD_NAME.fullmatch(owner["run_name"])
        or not isinstance(owner.get("config_fingerprint"), str)
        or not _RECORD_FINGERPRINT.fullmatch(owner["config_fingerprint"])
    ):
        raise RemoteOwnershipError(
            remote.scrub(
                f"{uri}/{RUN_RECORD} is not a valid ownership record, so which run "
                f"{uri} belongs to is unknown; not resuming from, uploading to or pruning "
                f"it (this run: {run_name!r}, config fingerprint {fingerprint}): {fix}"
            )
        )
    other, other_fp = owner["run_name"], owner["config_fingerprint"]
    if (other, other_fp) != (run_name, fingerprint):
        changed = ""
        if other == run_name:
            keys = _changed(owner.get("config"), getattr(fingerprint, "hashed", None))
            changed = f" (changed: {keys})" if keys else " (the model or optimizer changed)"
        raise RemoteOwnershipError(
            remote.scrub(
                f"{uri} belongs to run {other!r} (config fingerprint {other_fp}), not to "
                f"this run {run_name!r} (config fingerprint {fingerprint}){changed}; not "
                f"resuming from, uploading to or pruning it: {fix}"
            )
        )


def _changed(old: Any, new: Any) -> str:
    """The keys that differ between the record's config and this run's, on one line; ""
    when either is unknown (a record from before configs were kept). The record is
    untrusted: control characters go, and the line stays short."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ""
    line = re.sub(r"[\x00-\x1f\x7f]", "?", changed_keys(old, new))
    return line if len(line) <= 400 else line[:399] + "…"


def claim_everywhere(
    remote: Any,
    configured: bool,
    run_name: str,
    fingerprint: str,
    world: World,
    device: torch.device,
) -> None:
    """The claim as a distributed run makes it: rank 0 (the one holding `remote`, a
    RemoteCheckpoints) claims; every rank raises the same RemoteOwnershipError (exit 1, bad
    input). `configured`: the run has a remote at all (then every rank joins the
    broadcast)."""
    error = None
    if remote is not None:
        try:
            remote.claim(run_name, fingerprint)
        except RemoteOwnershipError as e:
            error = str(e)
    if configured:
        error = distributed.broadcast_object(error, world, device)
    if error is not None:
        if remote is not None:
            remote.close(drain=False)
        raise RemoteOwnershipError(error)
