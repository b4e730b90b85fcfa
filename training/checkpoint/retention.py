"""Checkpoint retention as one pure function, shared by the local checkpoint directory
(`training.checkpoint.retain`) and object storage (`training.checkpoint.remote`): which steps
to delete, given the steps that exist. Neither side deletes anything the other would keep."""

from __future__ import annotations

from collections.abc import Iterable


def to_delete(
    complete: Iterable[int],
    keep_last: int,
    keep_every: int | None,
    protect: Iterable[int] = (),
    *,
    partial: Iterable[int] = (),
    uploaded: int | None = None,
) -> list[int]:
    """The steps to delete, oldest first.

    Kept among the `complete` checkpoints (those with a meta.json): the newest `keep_last`,
    every `keep_every`-th step (None or 0: no milestones) and every `protect`ed step (the one
    `latest` names, step 0...). A protected step is kept even when it is not in `complete`.

    `partial`: step directories without a meta.json (object storage only: what a failed or
    running upload left). One older than the newest kept step, or than `uploaded` (the step
    just uploaded), is debris of a failed upload and deleted; a newer one may be an upload in
    progress elsewhere, so it stays."""
    done = sorted(set(complete))
    keep = set(done[-keep_last:]) | set(protect)
    if keep_every:
        keep |= {s for s in done if s % keep_every == 0}
    newest = max(keep | ({uploaded} if uploaded is not None else set()), default=None)
    debris = {s for s in partial if newest is not None and s < newest} - set(done)
    return sorted((set(done) | debris) - keep)
