"""The mixture plan in steps that each hold one shard (`max_task_memory` set), in place of
mixture.plan's one task, which holds every training document's key and token count:

    keys      (per shard)  each document's component, sampling key and tokens ->
              mixture/keys/<shard>.npz; the tokens per component summed by the key's top
              16 bits -> mixture/hist/<shard>.npz
    cut       (once, small)  the histograms summed: the tokens each component has, the plan
              (mixture.plan_components), and for each component the bin where its
              remainder (select_documents: the planned tokens past whole epochs) is
              crossed -> mixture/cut.json
    boundary  (per shard)  its documents in those bins -> mixture/boundary/<shard>.npy
    resolve   (once)  the boundary documents of every shard, in select_documents' order:
              which of them are taken -> mixture/taken.npy; the plan's record
    repeats   (per shard)  each document's repeat count -> mixture/repeats/<shard>.npy
    record    (once, small)  the document index and the plan's record, mixture/plan.json

select_documents takes, beyond whole epochs, a prefix of the component's documents in
(key, tokens, input order); documents of bins below the crossing one are all in it, those
above none, so only the crossing bin's documents (1/65,536 of a component's, in
expectation) are ever sorted together. Repeat counts, the plan and every file after them
are those of the single task.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from typing import Any

import numpy as np

from dataprep.config import PrepConfig
from dataprep.layout import output_store, version_store
from dataprep.mixture import SourcePlan
from dataprep.partition import BINS, top_bins
from dataprep.stages.mixture import (
    PLAN_KEY,
    append_base,
    components,
    plan_components,
    plan_summary,
    repeats_key,
    shard_rows,
    write_doc_index,
)

CUT_KEY = "mixture/cut.json"
TAKEN_KEY = "mixture/taken.npy"
RESOLVED_KEY = "mixture/resolved.json"  # the plan's record, until `record` publishes it


def enabled(cfg: PrepConfig) -> bool:
    return cfg.max_task_memory is not None


def single(cfg: PrepConfig) -> bool:
    return cfg.max_task_memory is None


def keys_key(shard: str) -> str:
    return f"mixture/keys/{shard}.npz"


def hist_key(shard: str) -> str:
    return f"mixture/hist/{shard}.npz"


def boundary_key(shard: str) -> str:
    return f"mixture/boundary/{shard}.npy"


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _npz(**arrays: Any) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _load(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def keys_shard(cfg: PrepConfig, shard: str) -> int:
    """A shard's documents for the plan: component (by index into its own list of names;
    -1: validation), key, tokens; and per component the tokens in each key bin."""
    comp, train, keys, ntok = shard_rows(cfg, output_store(cfg), shard)
    names = sorted(set(comp[train].tolist()))
    code = np.full(len(comp), -1, np.int32)
    hist = np.zeros((len(names), BINS), np.int64)
    bins = top_bins(keys)
    for i, name in enumerate(names):
        rows = (comp == name) & train
        code[rows] = i
        np.add.at(hist[i], bins[rows], ntok[rows].astype(np.int64))
    vstore = version_store(cfg)
    vstore.put(keys_key(shard), _npz(code=code, keys=keys, ntok=ntok.astype(np.int64)))
    vstore.put(
        hist_key(shard),
        _npz(
            hist=hist,
            names=np.array(names, dtype=np.str_),
            rows=np.int64(len(comp)),
            val_tokens=np.int64(ntok[~train].sum()),
        ),
    )
    return len(comp)


def cut(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    """The plan from the summed histograms, and where each component's remainder is
    crossed: its bin and the tokens of the bins below it."""
    vstore = version_store(cfg)
    acc: dict[str, np.ndarray] = {}
    sizes: list[int] = []
    val_tokens = 0
    for shard in shards:
        z = _load(vstore.get(hist_key(shard)))
        sizes.append(int(z["rows"]))
        val_tokens += int(z["val_tokens"])
        for name, h in zip(z["names"].tolist(), z["hist"], strict=True):
            acc.setdefault(name, np.zeros(BINS, np.int64))
            acc[name] += h
    available = {c: int(acc[c].sum()) if c in acc else 0 for c in components(cfg, acc)}
    plans = plan_components(cfg, available)
    comps: dict[str, Any] = {}
    for p in plans:
        if p.source not in acc:
            continue  # no documents: nothing to choose
        avail, target = available[p.source], int(p.planned_tokens)
        full, rem = (0, 0) if target == 0 or avail == 0 else divmod(target, avail)
        if full + 1 > np.iinfo(np.int32).max:
            raise ValueError(f"target {target:,} needs more than int32 repeats of {avail:,} tokens")
        b, before = -1, 0
        if rem:
            cum = np.cumsum(acc[p.source])
            b = int(np.searchsorted(cum, rem, side="left"))
            before = int(cum[b - 1]) if b else 0
        comps[p.source] = {"full": full, "rem": rem, "bin": b, "before": before}
    out = {
        "plans": [asdict(p) for p in plans],
        "components": comps,
        "sizes": sizes,
        "val_tokens": val_tokens,
    }
    vstore.put(CUT_KEY, json.dumps(out, sort_keys=True).encode())
    return out


def _read_cut(cfg: PrepConfig) -> dict[str, Any]:
    return json.loads(version_store(cfg).get(CUT_KEY))


def boundary_shard(cfg: PrepConfig, all_shards: list[str], shard: str) -> int:
    """The shard's documents in their component's crossing bin: rows of (component index
    in the cut, key, tokens, shard index, row), as int64 (keys' bits kept)."""
    vstore = version_store(cfg)
    c = _read_cut(cfg)
    names = _load(vstore.get(hist_key(shard)))["names"].tolist()
    z = _load(vstore.get(keys_key(shard)))
    bins = top_bins(z["keys"])
    order = list(c["components"])
    si = all_shards.index(shard)
    parts = []
    for i, name in enumerate(names):
        b = c["components"].get(name, {}).get("bin", -1)
        if b < 0:
            continue
        rows = np.flatnonzero((z["code"] == i) & (bins == b))
        part = np.empty((len(rows), 5), np.int64)
        part[:, 0] = order.index(name)
        part[:, 1] = z["keys"][rows].view(np.int64)
        part[:, 2] = z["ntok"][rows]
        part[:, 3] = si
        part[:, 4] = rows
        parts.append(part)
    found = np.concatenate(parts) if parts else np.zeros((0, 5), np.int64)
    vstore.put(boundary_key(shard), _npy(found))
    return len(found)


def resolve(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    """Which boundary documents select_documents takes, in its order (key, tokens, then
    input order); the plan's record, as mixture.plan writes it."""
    vstore = version_store(cfg)
    c = _read_cut(cfg)
    found = np.concatenate(
        [np.load(io.BytesIO(vstore.get(boundary_key(s)))) for s in shards]
        or [np.zeros((0, 5), np.int64)]
    )
    plans = [SourcePlan(**p) for p in c["plans"]]
    realised = {p.source: 0 for p in plans}
    taken: list[np.ndarray] = []
    for ci, (name, comp) in enumerate(c["components"].items()):
        full, rem, before = comp["full"], comp["rem"], comp["before"]
        extra = 0
        if rem:
            mine = found[found[:, 0] == ci]
            keys = mine[:, 1].view(np.uint64)
            order = np.lexsort((mine[:, 4], mine[:, 3], mine[:, 2], keys))
            cum = before + np.cumsum(mine[order, 2])
            i = int(np.searchsorted(cum, rem, side="left"))  # the crossing document
            prev = int(cum[i - 1]) if i else before
            take = i + 1 if int(cum[i]) - rem < rem - prev else i
            taken.append(mine[order[:take]][:, [0, 3, 4]])
            extra = int(cum[take - 1]) if take else before
        available = next(p.available_tokens for p in plans if p.source == name)
        realised[name] = full * available + extra
    vstore.put(TAKEN_KEY, _npy(np.concatenate(taken or [np.zeros((0, 3), np.int64)])))
    result = plan_summary(cfg, plans, realised, c["val_tokens"])
    vstore.put(RESOLVED_KEY, json.dumps(result, indent=2, sort_keys=True).encode())
    return result


def record(cfg: PrepConfig, shards: list[str]) -> None:
    """Once every shard's repeats are written: the document index and the plan's record
    (PLAN_KEY, which is also the single plan's done key: written last, so a run resumed
    without max_task_memory never finds a plan whose repeats are missing)."""
    vstore = version_store(cfg)
    write_doc_index(vstore, shards, _read_cut(cfg)["sizes"], append_base(cfg))
    vstore.put(PLAN_KEY, vstore.get(RESOLVED_KEY))


def repeats_shard(cfg: PrepConfig, all_shards: list[str], shard: str) -> int:
    """The shard's repeat counts: whole epochs, one more for documents below their
    component's crossing bin and those resolve took in it; validation documents 1."""
    vstore = version_store(cfg)
    c = _read_cut(cfg)
    names = _load(vstore.get(hist_key(shard)))["names"].tolist()
    z = _load(vstore.get(keys_key(shard)))
    code, bins = z["code"], top_bins(z["keys"])
    counts = np.ones(len(code), np.int32)
    taken = np.load(io.BytesIO(vstore.get(TAKEN_KEY)))
    taken = taken[taken[:, 1] == all_shards.index(shard)]
    order = list(c["components"])
    for i, name in enumerate(names):
        rows = code == i
        comp = c["components"][name]
        counts[rows] = comp["full"]
        if comp["rem"]:
            counts[rows & (bins < comp["bin"])] += 1
            counts[taken[taken[:, 0] == order.index(name), 2]] += 1
    vstore.put(repeats_key(shard), _npy(counts))
    return len(counts)
