"""Checkpoints: the on-disk format (`format`), how a run writes and reads it (`manager`), the
retention rule (`retention`) and the copy in object storage (`remote`).

`from training import checkpoint as ckpt` gives the format's API (`ckpt.save`, `ckpt.load`,
`ckpt.step_name`, `ckpt.CheckpointError`, ...); the manager and the remote side are imported
from their own modules (`training.checkpoint.manager`, `training.checkpoint.remote`).
"""

from training.checkpoint.format import (
    LATEST,
    META,
    STATE,
    AsyncSaver,
    CheckpointError,
    PendingSharded,
    clean_stale_tmp,
    finish_sharded,
    is_sharded,
    latest_step,
    load,
    load_full_into_sharded,
    load_sharded,
    move_aside,
    retain,
    rng_state,
    save,
    save_sharded,
    set_rng_state,
    step_dirs,
    step_name,
    steps,
    verify,
    write_latest,
)

__all__ = [
    "LATEST",
    "META",
    "STATE",
    "AsyncSaver",
    "CheckpointError",
    "PendingSharded",
    "clean_stale_tmp",
    "finish_sharded",
    "is_sharded",
    "latest_step",
    "load",
    "load_full_into_sharded",
    "load_sharded",
    "move_aside",
    "retain",
    "rng_state",
    "save",
    "save_sharded",
    "set_rng_state",
    "step_dirs",
    "step_name",
    "steps",
    "verify",
    "write_latest",
]
