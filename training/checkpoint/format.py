"""Checkpoints on the local disk: atomic (write a temporary directory, rename it into
place, then rewrite `latest`), checksummed (sha256 in meta.json, verified on restore),
with retention (the last N plus every K-th step), loaded with weights_only.

A checkpoint holds everything exact resume needs: model, optimizer, grad scaler, RNG
states (python, numpy, torch, cuda), sampler position, guard state, step, tokens seen,
and the config it was made with.

Damage is survivable: `verify` tells a good checkpoint from a corrupt or partial one (no or
garbled meta.json, a missing file, a sha256 that does not match), `move_aside` renames a bad
one to `step-XXXXXXXX.corrupt-<time>` (which steps(), retention and restores ignore), and
`clean_stale_tmp` removes what a writer killed half-way left behind.

This module is the on-disk format; which writer a run uses (rank 0 alone, or every rank
with DCP under FSDP2) is training.checkpoint.manager's choice, and which steps retention
deletes is training.checkpoint.retention's rule.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.files import fsync_dir, pid_alive, sha256_file
from training.checkpoint.retention import to_delete

LATEST = "latest"
STATE = "state.pt"
META = "meta.json"
# A checkpoint directory is exactly `step-XXXXXXXX`; anything else in the root (temporary
# directories, checkpoints moved aside as corrupt, upload staging) is not a checkpoint.
_STEP_DIR = re.compile(r"^step-(\d+)$")
# What a writer killed half-way leaves: `.step-XXXXXXXX.tmp-PID` (save), `.latest.tmp-PID`
# (write_latest) and `.step-XXXXXXXX.restore-PID` (training.checkpoint.remote's download).
_STALE_TMP = re.compile(r"^\.(?:step-\d+\.(?:tmp|restore)|latest\.tmp)-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    # numpy's state as plain lists/ints: weights_only loading refuses numpy objects.
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Write checkpoint `step` and point `latest` at it. A crash at any point leaves
    either the previous `latest` or the new one, never a partial checkpoint."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(step)
    tmp = root / f".{step_name(step)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        torch.save(state, tmp / STATE)
        with open(tmp / STATE, "rb") as f:
            os.fsync(f.fileno())
        meta = {
            "step": step,
            "files": {
                STATE: {"sha256": sha256_file(tmp / STATE), "bytes": (tmp / STATE).stat().st_size}
            },
        }
        (tmp / META).write_text(json.dumps(meta, indent=2))
    except (OSError, RuntimeError) as e:
        full = _disk_full(e, root)
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written directory is left behind
        if full is None:
            raise
        raise OSError(full, os.strerror(full), str(final)) from None
    if final.exists():  # a checkpoint of the same step from before a crash: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    write_latest(root, step)
    return final


def _disk_full(e: BaseException, root: Path) -> int | None:
    """The errno of a write that failed for want of space, else None. torch.save reports a
    failed write as a RuntimeError without one ("unexpected pos ..."); then a filesystem
    left with less than a block group free is taken as the cause."""
    if isinstance(e, OSError):
        return e.errno if e.errno in (errno.ENOSPC, errno.EDQUOT) else None
    try:
        return errno.ENOSPC if shutil.disk_usage(root).free < 1 << 20 else None
    except OSError:
        return None


def write_latest(root: Path, step: int) -> None:
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(step_name(step) + "\n")
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def latest_step(root: str | Path) -> int | None:
    p = Path(root) / LATEST
    if not p.is_file():
        return None
    name = p.read_text().strip()
    try:
        return int(name.removeprefix("step-"))
    except ValueError:
        raise CheckpointError(f"{p} does not name a checkpoint ({name!r})") from None


def step_dirs(root: str | Path) -> list[int]:
    """Steps of every `step-XXXXXXXX` directory, complete or not (oldest first)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir():
            out.append(int(m.group(1)))
    return sorted(out)


def steps(root: str | Path) -> list[int]:
    """Steps of the checkpoint directories that have a meta.json (not verified here)."""
    return [s for s in step_dirs(root) if (Path(root) / step_name(s) / META).is_file()]


def verify(root: str | Path, step: int) -> dict[str, Any]:
    """Check checkpoint `step` without loading it: meta.json readable and well-formed,
    every file it lists present with its sha256 (the trainer state among them). Returns
    the meta; raises CheckpointError saying what is wrong."""
    d = Path(root) / step_name(step)
    meta_path = d / META
    if not d.is_dir():
        raise CheckpointError(f"checkpoint {d} does not exist")
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {d} is incomplete (no {META})")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {d}: {META} is not valid JSON ({e})") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or STATE not in files:
        raise CheckpointError(f"checkpoint {d}: {META} does not list {STATE}")
    for name, want in files.items():
        sha = want.get("sha256") if isinstance(want, dict) else None
        # (DCP's `.metadata` is one of the files: names may start with a dot.)
        if not isinstance(sha, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {d}: {META} entry for {name!r} is malformed")
        got = sha256_file(d / name) if (d / name).is_file() else None
        if got != sha:
            raise CheckpointError(
                f"checkpoint {d}: {name} sha256 does not match {META} "
                f"({'missing' if got is None else got[:12]})"
            )
    return meta


def load(
    root: str | Path, step: int, map_location: str | torch.device = "cpu", verified: bool = False
) -> dict[str, Any]:
    """Load checkpoint `step` after checking its sha256 (skipped when the caller has just
    `verify`-ed it); weights_only: a checkpoint is data, never code."""
    if not verified:
        verify(root, step)
    path = Path(root) / step_name(step) / STATE
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {e}") from None


def move_aside(root: str | Path, step: int) -> Path | None:
    """Rename checkpoint `step` to `step-XXXXXXXX.corrupt-<UTC time>` (kept for a post
    mortem, ignored by steps(), retention and restores); None if it does not exist."""
    d = Path(root) / step_name(step)
    if not d.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = d.with_name(f"{d.name}.corrupt-{stamp}")
    n = 1
    while dest.exists():
        dest = d.with_name(f"{d.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(d, dest)
    fsync_dir(d.parent)
    return dest


def clean_stale_tmp(root: str | Path) -> list[str]:
    """Remove what checkpoint writers killed half-way left in `root` (temporary checkpoint
    directories and `latest` files named with a PID that is no longer alive, or with this
    process's own PID: at start nothing of ours is being written). Returns their names."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        m = _STALE_TMP.match(p.name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and pid_alive(pid):
            continue  # another live process may be writing it
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def retain(
    root: str | Path, keep_last: int, keep_every: int | None, protect: set[int] | None = None
) -> list[int]:
    """Delete checkpoints beyond the last `keep_last`, except every `keep_every`-th
    step and `protect`ed ones; returns the deleted steps."""
    latest = latest_step(root)
    keep = (protect or set()) | ({latest} if latest is not None else set())
    deleted = to_delete(steps(root), keep_last, keep_every, keep)
    for s in deleted:
        shutil.rmtree(Path(root) / step_name(s), ignore_errors=True)
    return deleted


def _stage(src: Any, dst: Any) -> Any:
    """Copy a state tree into staging buffers, reusing `dst`'s tensors where shapes match
    (no allocation, no page faults: the copy runs at memory bandwidth)."""
    if isinstance(src, torch.Tensor):
        if (
            isinstance(dst, torch.Tensor)
            and dst.shape == src.shape
            and dst.dtype == src.dtype
            and dst.device.type == "cpu"
        ):
            return dst.copy_(src.detach())
        return src.detach().to("cpu", copy=True)
    if isinstance(src, dict):
        old = dst if isinstance(dst, dict) else {}
        return {k: _stage(v, old.get(k)) for k, v in src.items()}
    if isinstance(src, list | tuple):
        old = dst if isinstance(dst, list | tuple) and len(dst) == len(src) else [None] * len(src)
        out = [_stage(v, o) for v, o in zip(src, old, strict=True)]
        return out if isinstance(src, list) else tuple(out)
    return src  # python scalars and strings are immutable


class AsyncSaver:
    """Checkpoints written by a background thread. The training loop is blocked only
    while the state is copied into staging buffers; the write, fsync, checksum, retention
    and the hand-off to the uploader happen while training goes on. One save in flight at
    a time: the next one (and anything that reads checkpoints) waits for it."""

    def __init__(self) -> None:
        import threading

        self._staging: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_stall_s = 0.0

    def check(self) -> None:
        """Raise a failed background save's error now, without waiting for one in flight:
        the loop calls this every step, so a failed save stops the run when it fails."""
        if self._error is not None:
            self.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err  # its own type: callers tell storage trouble from a bad checkpoint

    def save(self, root: str | Path, step: int, state: dict[str, Any], after: Any = None) -> None:
        import threading
        import time

        self.wait()
        t0 = time.perf_counter()
        self._staging = _stage(state, self._staging)
        self.last_stall_s = time.perf_counter() - t0
        staged = self._staging

        def work() -> None:
            try:
                save(root, step, staged)
                if after is not None:
                    after()
            except BaseException as e:  # surfaced to the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=work, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()


@dataclass
class PendingSharded:
    """A DCP save whose files are still being written in the background (async_save)."""

    future: Any
    root: Path
    step: int
    extra: dict[str, Any]
    with_optim: bool


def _sharded_dirs(root: Path, step: int) -> tuple[Path, Path]:
    return root / step_name(step), root / f".{step_name(step)}.tmp-dcp"


def save_sharded(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    is_main: bool,
    barrier: Any,
    async_pg: Any = None,
) -> PendingSharded | None:
    """An FSDP2 checkpoint with torch.distributed.checkpoint: every rank writes its shards
    into one temporary directory; rank 0 adds the trainer state (`state.pt`), checksums
    every file into meta.json, renames the directory into place and moves `latest`.
    DCP reshards on load, so a run can resume at another world size.

    With `async_pg` (a gloo process group of its own, so DCP's collectives in the writer
    thread never interleave with training's), the shards are staged to CPU memory and
    written by dcp.async_save in the background; the returned PendingSharded is completed
    by finish_sharded() at the next checkpoint or at the end: until then `latest` still
    names the previous checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    root = Path(root)
    _final, tmp = _sharded_dirs(root, step)
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    # Before the first step the optimizer has no state, and asking DCP for it would
    # initialise it with a zero-gradient step, advancing Adam's step count: a run that
    # saved at step 0 would then train differently from one that did not.
    if optimizer.state:
        state["optim"] = get_optimizer_state_dict(
            model, optimizer, options=_optim_options(getattr(model, "pipelined", False))
        )
    if async_pg is not None:
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=async_pg)
        return PendingSharded(future, root, step, extra, "optim" in state)
    dcp.save(state, checkpoint_id=str(tmp))
    finish_sharded(PendingSharded(None, root, step, extra, "optim" in state), is_main, barrier)
    return None


def finish_sharded(p: PendingSharded, is_main: bool, barrier: Any) -> None:
    """Wait for the shards of `p` on every rank, then (rank 0) checksum, rename into place
    and move `latest`. Called by every rank, from the training thread."""
    if p.future is not None:
        p.future.result()
    barrier()
    final, tmp = _sharded_dirs(p.root, p.step)
    if is_main:
        torch.save(p.extra, tmp / STATE)
        files = {
            f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
            for f in sorted(tmp.iterdir())
            if f.is_file()
        }
        (tmp / META).write_text(
            json.dumps(
                {"step": p.step, "format": "dcp", "optimizer": p.with_optim, "files": files},
                indent=2,
            )
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(p.root)
        write_latest(p.root, p.step)
    barrier()


def _optim_options(flat: bool) -> Any:
    """The optimizer's state dict keyed by parameter name throughout (`flat`: its groups'
    settings too, per parameter) or torch's default (the groups as a list). A pipeline
    stage (training/pipeline.py, `model.pipelined`) holds some of the groups, a different
    list on each stage, which DCP would keep one rank's of: its checkpoints are flat, and
    read flat anywhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _flat_optimizer(d: Path) -> bool:
    """Whether DCP checkpoint `d` holds a flat optimizer state dict (see _optim_options)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    return any(k.startswith("optim.param_groups.") and not k.split(".")[2].isdigit() for k in keys)


def is_sharded(root: str | Path, step: int) -> bool:
    return (Path(root) / step_name(step) / ".metadata").is_file()


def load_sharded(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    map_location: str | torch.device = "cpu",
    verified: bool = False,
) -> dict[str, Any]:
    """Load a DCP checkpoint into `model` (and `optimizer`, if it was saved with state),
    sharded or not, at any world size, after checking every file's sha256 (unless
    `verified`: the caller has just done that); returns the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    extra = load(root, step, map_location, verified)  # verifies every file in meta.json
    d = Path(root) / step_name(step)
    with_optim = json.loads((d / META).read_text()).get("optimizer", True)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    pipelined = getattr(model, "pipelined", False)
    flat = with_optim and _flat_optimizer(d)
    options = _optim_options(flat or pipelined)
    groups: dict[str, Any] = {}
    if with_optim:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
        if pipelined and not flat:
            # A checkpoint of a mesh without stages (groups by position) into a stage: the
            # state is keyed by parameter name in both forms; the groups' settings stay
            # this run's (the same config's).
            groups = {k: v for k, v in state["optim"].items() if k.startswith("param_groups.")}
            state["optim"] = {k: v for k, v in state["optim"].items() if k not in groups}
    dcp.load(state, checkpoint_id=str(d))
    set_model_state_dict(model, state["model"])
    if with_optim:
        state["optim"].update(groups)
        set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
    else:  # a step-0 checkpoint: the optimizer starts fresh, as it did then
        optimizer.state.clear()
    return extra


def load_full_into_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """A plain checkpoint (one process or DDP: whole tensors, the optimizer's state keyed
    by parameter index) into a model whose parameters are DTensors (tensor parallelism,
    FSDP2): torch's distributed state-dict API splits every tensor as this rank's
    parameter is split. Every rank holds the whole `state` (the manager broadcasts it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=full)
    saved = state["optimizer"]
    # torch's own state_dict numbers the parameters in the order of the groups; the same
    # optimizer built over the same model holds them in the same order, which names them.
    name = {id(p): n for n, p in model.named_parameters()}
    index_to_name: dict[int, str] = {}
    groups = []
    for live, old in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        names = [name[id(p)] for p in live["params"]]
        index_to_name.update(zip(old["params"], names, strict=True))
        groups.append({**old, "params": names})
    by_name = {"state": {index_to_name[i]: s for i, s in saved["state"].items()}}
    set_optimizer_state_dict(model, optimizer, {**by_name, "param_groups": groups}, options=full)
