"""Reusing one prep output's finished stages in another: an ablation's arms share every
stage before the first one their configs disagree on.

A stage's files depend on its own config slice and on everything the stages before it
read. Walking the stages in the graph's order, a stage is reusable while every slice so far
is equal in the two configs (and the stage is on, or off, in both). Its files are then
copied (hard links on local disk) into the other output before that prep runs, and the
prep's own done checks skip the work: the reuse goes through the same markers a resumed
run trusts, nothing is special-cased in the driver.

A differing key that no slice claims and that is not one of the late stages' (mixture,
pack, dataset: versioned, recomputed by every arm) disables all reuse: an unknown key
might be read by any stage, so guessing would risk a wrong dataset.

What a stage owns, by key: `docs/<stage>/`, `dropped/<stage>/`, `_done/<stage>/`,
`<stage>/` (a step's own files: hashes, signatures, duplicate lists) at the output root and
in version 1's directory, plus OWNED below (quality's provenance, tokenize's tokens and
tokenizer). Only single-version outputs are reused from: an ablation compares recipes on
one corpus.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from core.store import Store
from dataprep.config import UNFINGERPRINTED, PrepConfig
from dataprep.graph import STAGES
from dataprep.layout import output_store, version_name

# The config each stage's output reads (dotted prefixes of the config dump), beyond what
# the stages before it read.
SLICES: dict[str, tuple[str, ...]] = {
    "ingest": ("sources", "ingest", "storage"),
    "exact": ("dedup.exact",),
    "near": ("dedup.near", "seed"),
    "lines": ("dedup.line_dedup",),
    "substring": ("dedup.substring",),
    "quality": ("quality",),
    "tokenize": ("tokenizer",),
}
# Keys only the late stages read: a difference there keeps every stage above reusable.
LATE = ("mixture", "pack", "dataset")
# Extra top-level prefixes a stage owns (beyond docs/, dropped/, _done/ and <stage>/).
OWNED: dict[str, tuple[str, ...]] = {
    "quality": ("provenance/",),
    "tokenize": ("tokens/", "tokenizer/"),
}


class ReuseError(ValueError):
    """The outputs cannot share stages (one line)."""


@dataclass
class Reuse:
    stages: list[str]  # reused, in order
    first_redone: str | None  # the first stage the other config must compute
    differing: list[str]  # the config keys that differ
    files: int = 0
    bytes: int = 0
    linked: bool = False
    notes: list[str] = field(default_factory=list)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: d}


def differing_keys(a: PrepConfig, b: PrepConfig) -> list[str]:
    """The dotted keys whose values differ (lists compared whole), unfingerprinted ones
    (output, workers, ...) left out."""
    da = a.model_dump(mode="json", exclude=set(UNFINGERPRINTED))
    db = b.model_dump(mode="json", exclude=set(UNFINGERPRINTED))
    fa, fb = _flat(da), _flat(db)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, object()) != fb.get(k, object()))


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def reusable_stages(base: PrepConfig, other: PrepConfig) -> Reuse:
    """Which of `base`'s stages `other` can take as they are."""
    diff = differing_keys(base, other)
    claimed = tuple(p for s in SLICES.values() for p in s) + LATE
    unknown = [k for k in diff if not _under(k, claimed)]
    order = [st for st in STAGES if st.name in SLICES]
    if unknown:
        return Reuse([], order[0].name if order else None, diff, notes=[f"unknown: {unknown}"])
    reused: list[str] = []
    read: tuple[str, ...] = ()
    for st in order:
        read += SLICES[st.name]
        if any(_under(k, read) for k in diff) or st.enabled(base) != st.enabled(other):
            return Reuse(reused, st.name, diff)
        if st.enabled(base):  # a stage off in both has nothing to share
            reused.append(st.name)
    return Reuse(reused, None, diff)


def stage_prefixes(stage: str) -> list[str]:
    """The keys a stage owns, relative to the output root and to version 1's directory."""
    own = [f"docs/{stage}/", f"dropped/{stage}/", f"_done/{stage}/", f"{stage}/"]
    v1 = version_name(1)
    return own + list(OWNED.get(stage, ())) + [f"{v1}/{p}" for p in own]


def _copy(src: Store, dst: Store, key: str) -> tuple[int, bool]:
    """Copy one object; a hard link when both are local directories."""
    sp, dp = src.local_path(key), dst.local_path(key)
    if sp is not None and dp is not None:
        dp.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            dp.unlink()
        try:
            os.link(sp, dp)
            return sp.stat().st_size, True
        except OSError:  # another filesystem: copy the bytes
            pass
    data = src.get(key)
    dst.put(key, data)
    return len(data), False


def seed_output(base: PrepConfig, other: PrepConfig) -> Reuse:
    """Copy `base`'s reusable stages into `other`'s output (before `other`'s prep runs).
    An output that already holds files of its own is left as it is (a repeated ablation:
    its own markers already say what is done)."""
    reuse = reusable_stages(base, other)
    if not reuse.stages:
        return reuse
    src, dst = output_store(base), output_store(other)
    if dst.list("_done/") or dst.list(f"{version_name(1)}/_done/"):
        reuse.notes.append("the output has finished work of its own; nothing copied")
        return reuse
    if src.exists(f"_versions/{version_name(2)}.json"):
        raise ReuseError(
            f"{src.uri} holds more than one dataset version; reuse is from one version only"
        )
    for stage in reuse.stages:
        for prefix in stage_prefixes(stage):
            for key in src.list(prefix):
                n, linked = _copy(src, dst, key)
                reuse.files += 1
                reuse.bytes += n
                reuse.linked = reuse.linked or linked
    return reuse
