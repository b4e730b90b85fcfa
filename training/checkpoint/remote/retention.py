"""Remote retention. Guarantee: it is local retention's rule
(`training.checkpoint.retention.to_delete`): after each successful upload, remote checkpoints
beyond the newest `keep_last` are deleted, except every `keep_every`-th step and the one
`latest` names; debris of failed uploads older than the newest kept step goes too. meta.json
is deleted first so a half-deleted checkpoint never looks complete."""

from __future__ import annotations

from training.checkpoint.format import META, step_name
from training.checkpoint.remote.keys import group_steps
from training.checkpoint.remote.latest import read_latest
from training.checkpoint.remote.storage import RemoteStore
from training.checkpoint.retention import to_delete


def retain(remote: RemoteStore, keep_last: int, keep_every: int | None, just_uploaded: int) -> None:
    by_step = group_steps(remote.list_keys())
    complete = [s for s, names in by_step.items() if META in names]
    latest = read_latest(remote, warn=False)
    doomed = to_delete(
        complete,
        keep_last,
        keep_every,
        () if latest is None else (latest,),
        partial=[s for s in by_step if s not in complete],
        uploaded=just_uploaded,
    )
    for s in doomed:
        remote.delete_step(s, by_step[s])
    if doomed:
        remote.log(
            "remote checkpoint: retention deleted "
            f"{', '.join(step_name(s) for s in doomed)} from {remote.uri}"
        )
