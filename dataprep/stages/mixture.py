"""Mixture: plan each source's share of training tokens, realise it deterministically
(downsample by a stable hash of the document id, upsample by repeating whole documents
up to the source's epoch cap), and lay the chosen documents out in training order.

Steps: `plan` (once; reads only ids and token counts) -> `scatter` (per token shard:
each chosen (document, repeat) gets an order key and goes to the partition of the
training order its key falls in). Packing then works partition by partition, so no step
holds the corpus. Documents the plan leaves out are accounted as `downsampled`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.store import NotFound, Store
from dataprep.config import PrepConfig
from dataprep.layout import (
    DroppedRows,
    ShardStats,
    done_key,
    output_store,
    version_store,
    write_shard,
)
from dataprep.mixture import doc_keys, expand_repeats, order_keys, plan_mixture, select_documents
from dataprep.stages.tokenize import read_tokens, tokens_key

STAGE = "mixture"
PLAN_KEY = "mixture/plan.json"
_MASK56 = np.uint64((1 << 56) - 1)
# Training tokens per pack partition (expected; the split is by hash): 32 MiB of int32.
PARTITION_TOKENS = 1 << 23
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")

# `doc`: the document's global index in the version (its shard's first_doc + its row),
# which the packed rows' provenance names.
MIX_SCHEMA = pa.schema(
    [
        ("key", pa.uint64()),
        ("source", pa.string()),
        ("doc", pa.int64()),
        ("tokens", pa.list_(pa.int32())),
    ]
)
# The version's documents, numbered: [shard, first_doc, docs] per shard in all_shards order.
DOC_INDEX_KEY = "mixture/doc_index.json"


def repeats_key(shard: str) -> str:
    return f"mixture/repeats/{shard}.npy"


def first_doc_key(shard: str) -> str:
    return f"mixture/first_doc/{shard}.json"


def read_doc_index(cfg: PrepConfig) -> list[tuple[str, int, int]]:
    return [(s, int(f), int(n)) for s, f, n in json.loads(version_store(cfg).get(DOC_INDEX_KEY))]


def appended_parent(cfg: PrepConfig) -> PrepConfig | None:
    """The config of the version this one appends to (dataset.versions: append, a version
    that builds on another); None when the version is mixed whole."""
    if cfg.dataset.versions != "append" or cfg.version == 1:
        return None
    from dataprep.versions import plan_key  # it imports the stages

    parent = json.loads(output_store(cfg).get(plan_key(cfg.version))).get("parent")
    return None if parent is None else cfg.model_copy(update={"version": int(parent)})


def append_base(cfg: PrepConfig) -> list[tuple[str, int, int]]:
    """What an appending version starts from: its parent's document index (the new
    documents are numbered on from it), with the parent's mixture accounting of those
    documents carried into this version's store, so that the report over all versions
    reads one store (a small marker a shard; no document is read). [] for a version
    mixed whole."""
    parent = appended_parent(cfg)
    if parent is None:
        return []
    before = read_doc_index(parent)
    pstore, vstore = version_store(parent), version_store(cfg)
    for shard, _, _ in before:
        vstore.put(done_key(STAGE, shard), pstore.get(done_key(STAGE, shard)))
    return before


def part_key(part: str, shard: str) -> str:
    return f"mix/{part}/{shard}.arrows"


def groups(cfg: PrepConfig) -> dict[str, int]:
    """Curriculum group of each source: its rank in mixture.order; the rest after."""
    order = cfg.mixture.order or []
    return {s.name: (order.index(s.name) if s.name in order else len(order)) for s in cfg.sources}


def partition_count(cfg: PrepConfig, train_tokens: int) -> int:
    """Partitions of the training order: at least `dataset.pack_partitions`, and enough
    that none holds much more than PARTITION_TOKENS tokens, so packing's memory is set by
    that bound, not by the corpus."""
    return max(cfg.dataset.pack_partitions, -(-train_tokens // PARTITION_TOKENS))


def train_partitions(cfg: PrepConfig, plan: dict[str, Any]) -> list[str]:
    """The training order's partitions, named by curriculum group and partition."""
    n_groups = len(cfg.mixture.order or []) + 1 if cfg.mixture.order else 1
    n_parts = plan.get("train_partitions", cfg.dataset.pack_partitions)
    return [f"train/g{g:02d}-p{p:04d}" for g in range(n_groups) for p in range(n_parts)]


def validation_partitions(plan: dict[str, Any]) -> list[str]:
    """One partition for a validation split of up to PARTITION_TOKENS; more beyond."""
    n = plan.get("validation_partitions", 1)
    return ["validation"] if n == 1 else [f"validation/p{p:04d}" for p in range(n)]


def read_plan(cfg: PrepConfig) -> dict[str, Any]:
    return json.loads(version_store(cfg).get(PLAN_KEY))


def write_parts(
    store: Store,
    shard: str,
    parts: list[tuple[str, int]],
    code: np.ndarray,
    okeys: np.ndarray,
    rows: np.ndarray,
    first: int,
    sources: pa.Array,
    tokens: pa.ChunkedArray,
) -> None:
    """Write the shard's piece of each partition in `parts` (name, code): the chosen rows
    (`rows`, into the shard's token table, with their order keys `okeys`) whose `code` is
    the partition's, in their given order. One take of the tokens for the whole
    shard, then a zero-copy slice per partition: at 10M documents a shard goes to ~130
    partitions, and a take, a table and a Parquet file per partition cost 0.9 s a shard
    (0.4 at 14 partitions), the mixture's whole growth past linear."""
    order = np.argsort(code, kind="stable")  # within a partition: the rows' own order
    code, rows = code[order], rows[order]
    table = pa.table(
        {
            "key": pa.array(okeys[order], pa.uint64()),
            "source": sources.take(pa.array(rows)),
            "doc": pa.array(rows + first, pa.int64()),
            "tokens": tokens.take(pa.array(rows)),
        },
        schema=MIX_SCHEMA,
    )
    for part, c in parts:
        a, b = np.searchsorted(code, [c, c + 1])
        store.put(part_key(part, shard), mix_part_bytes(table.slice(a, b - a)))


def mix_part_bytes(table: pa.Table) -> bytes:
    """A partition piece as an Arrow IPC stream (zstd): written ~130 times a shard and
    read back once by packing, where Parquet's fixed cost per file (2.7 ms to write, 1.5
    to read a 100 kB piece) dominated; IPC takes 1.1 and 0.4 at the same size."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, MIX_SCHEMA, options=_IPC_OPTIONS) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def read_mix_part(store: Store, part: str, shard: str) -> pa.Table:
    """A partition piece as write_parts stored it; a run scattered by a ballast before
    this format (Parquet pieces) and resumed by this one packs from those."""
    try:
        data = store.get(part_key(part, shard))
    except NotFound:
        old = store.get(f"mix/{part}/{shard}.parquet")
        return pq.read_table(pa.BufferReader(old))
    return pa.ipc.open_stream(pa.BufferReader(data)).read_all()


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def plan(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    """The mixture plan and each document's repeat count (mixture/repeats/<shard>.npy:
    0 = left out, k = used k times; validation documents are used once, as they are).
    `shards`: every shard of the version, earlier versions' too: the mixture is planned
    anew for each version, over all of its documents (with dataset.versions: append,
    this run's shards only: its documents follow the parent's). With max_task_memory the same plan
    is made in steps that each hold one shard (dataprep/stages/mixture_parts.py)."""
    store, vstore = output_store(cfg), version_store(cfg)
    if vstore.exists(PLAN_KEY):
        return json.loads(vstore.get(PLAN_KEY))
    # Mixture components: a source, or one language of a source mixed per language.
    per: dict[str, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {}
    sizes = []
    val_tokens = 0
    for si, shard in enumerate(shards):
        comp, train, keys, ntok = shard_rows(cfg, store, shard)
        sizes.append(len(comp))
        val_tokens += int(ntok[~train].sum())
        for name in sorted(set(comp[train].tolist())):
            rows = np.flatnonzero((comp == name) & train)
            per.setdefault(name, []).append((si, rows, keys[rows], ntok[rows]))
    available = {c: int(sum(int(p[3].sum()) for p in per.get(c, []))) for c in components(cfg, per)}
    plans = plan_components(cfg, available)
    repeats = [np.ones(n, dtype=np.int32) for n in sizes]  # validation rows: 1
    realised: dict[str, int] = {}
    for p in plans:
        parts = per.get(p.source, [])
        if parts:
            keys = np.concatenate([x[2] for x in parts])
            ntok = np.concatenate([x[3] for x in parts])
            counts = select_documents(keys, ntok, p.planned_tokens)
            pos = 0
            for si, rows, _, _ in parts:
                repeats[si][rows] = counts[pos : pos + len(rows)]
                pos += len(rows)
            realised[p.source] = int((counts.astype(np.int64) * ntok).sum())
        else:
            realised[p.source] = 0
    for shard, r in zip(shards, repeats, strict=True):
        vstore.put(repeats_key(shard), _npy(r))
    write_doc_index(vstore, shards, sizes, append_base(cfg))
    result = plan_summary(cfg, plans, realised, val_tokens)
    vstore.put(PLAN_KEY, json.dumps(result, indent=2, sort_keys=True).encode())
    return result


def shard_rows(
    cfg: PrepConfig, store: Store, shard: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A token shard's documents as the plan sees them: each one's mixture component (its
    source, or "<source>/<language>" for a source mixed per language), whether it is in
    the train split, its sampling key and its token count."""
    by_lang = {s.name for s in cfg.sources if s.languages is not None}
    cols = ["id", "source", "split", "n_tokens", *(["language"] if by_lang else [])]
    t = read_tokens(store, shard, cols)
    comp = np.asarray(t["source"].to_pylist(), dtype=object)
    if by_lang:
        lang = np.asarray([x or "und" for x in t["language"].to_pylist()], dtype=object)
        split_rows = np.isin(comp, list(by_lang))
        comp[split_rows] = comp[split_rows] + "/" + lang[split_rows]
    train = np.asarray(t["split"].to_pylist(), dtype=object) == "train"
    keys = doc_keys(t["id"].to_pylist(), cfg.seed)
    return comp, train, keys, t["n_tokens"].to_numpy()


def plan_components(cfg: PrepConfig, available: dict[str, int]) -> list[Any]:
    """The plan of every component, given its available train tokens."""
    weights, alpha = component_weights(cfg, available)
    caps = {c: _source(cfg, c).max_epochs or cfg.mixture.max_epochs for c in available}
    return plan_mixture(available, weights, alpha, caps, cfg.mixture.total_tokens)


def write_doc_index(
    vstore: Store,
    shards: list[str],
    sizes: list[int],
    before: list[tuple[str, int, int]] | None = None,
) -> None:
    """Each shard's first global document index, read by its scatter (one small key a
    shard, not the whole index); the index itself for the dataset step. `before`: the
    index an appending version numbers its shards on from (append_base)."""
    index: list[Any] = [list(e) for e in before or []]
    first = sum(n for _, _, n in before or [])
    for shard, n in zip(shards, sizes, strict=True):
        vstore.put(first_doc_key(shard), json.dumps(first).encode())
        index.append([shard, first, n])
        first += n
    vstore.put(DOC_INDEX_KEY, json.dumps(index).encode())


def plan_summary(
    cfg: PrepConfig, plans: list[Any], realised: dict[str, int], val_tokens: int
) -> dict[str, Any]:
    """The plan's record (PLAN_KEY, the report's and the manifest's "mixture")."""
    sources: dict[str, Any] = {}
    for p in plans:
        sources[p.source] = {
            "available_tokens": p.available_tokens,
            "target_share": p.target_share,
            "planned_tokens": p.planned_tokens,
            "planned_epochs": p.planned_epochs,
            "realised_tokens": realised[p.source],
            "capped": p.capped,
            "shortfall_tokens": p.shortfall_tokens,
            "warning": p.warning,
        }
    total = sum(s["realised_tokens"] for s in sources.values()) or 1
    planned_total = sum(s["planned_tokens"] for s in sources.values()) or 1
    for s in sources.values():
        s["planned_share"] = s["planned_tokens"] / planned_total
        s["realised_share"] = s["realised_tokens"] / total
    return {
        "sources": sources,
        "total_planned_tokens": planned_total,
        "total_realised_tokens": total,
        "train_partitions": partition_count(cfg, total),
        "validation_partitions": max(1, -(-val_tokens // PARTITION_TOKENS)),
        "warnings": [s["warning"] for s in sources.values() if s["warning"]],
    }


def _source(cfg: PrepConfig, component: str) -> Any:
    name = component.split("/", 1)[0]
    return next(s for s in cfg.sources if s.name == name)


def components(cfg: PrepConfig, seen: Mapping[str, Any]) -> list[str]:
    """The mixture's components in plan order: each source, or for a source mixed per
    language, "<source>/<lang>" for every language its documents have and every one its
    `languages` mapping names (a named language with no documents gets the mixture's
    empty-source warning), sorted."""
    out: list[str] = []
    for s in cfg.sources:
        if s.languages is None:
            out.append(s.name)
            continue
        langs = {c.split("/", 1)[1] for c in seen if c.startswith(s.name + "/")}
        if isinstance(s.languages, dict):
            langs |= set(s.languages)
        out += [f"{s.name}/{lang}" for lang in sorted(langs)]
    return out


def component_weights(
    cfg: PrepConfig, available: dict[str, int]
) -> tuple[dict[str, float] | None, float | None]:
    """(weights, alpha) for plan_mixture. Without per-language sources: the sources'
    weights when every source has one (and alpha is unset), else alpha / natural shares,
    as before. With them, explicit weights per component: a language a `languages`
    mapping leaves out gets 0; the others get n ** alpha with mixture.alpha, else their
    source's weight (or, without weights, the source's tokens) split by the mapping's
    weights or, for "all", by tokens."""
    alpha = cfg.mixture.alpha
    weighted = alpha is None and all(s.weight is not None for s in cfg.sources)
    if not any(s.languages is not None for s in cfg.sources):
        return (
            {s.name: float(s.weight) for s in cfg.sources}
            if weighted  # type: ignore[arg-type]
            else None
        ), alpha
    out: dict[str, float] = {}
    for s in cfg.sources:
        comps = [c for c in available if c == s.name or c.startswith(s.name + "/")]
        langs = s.languages
        kept = [c for c in comps if not isinstance(langs, dict) or c.split("/", 1)[1] in langs]
        total = sum(available[c] for c in kept)
        base = float(s.weight) if weighted else float(total)  # type: ignore[arg-type]
        for c in comps:
            if c not in kept:
                out[c] = 0.0
            elif alpha is not None:
                out[c] = float(available[c]) ** alpha
            elif isinstance(langs, dict):
                out[c] = base * langs[c.split("/", 1)[1]] / sum(langs.values())
            elif langs == "all":
                out[c] = base * available[c] / total if total else 0.0
            else:
                out[c] = base
    return out, None


def scatter_shard(cfg: PrepConfig, shard: str) -> dict:
    """Send each chosen (document, repeat) of a shard to its partition of the training
    order; validation documents go to one partition of their own. Tokens are read from
    the output; what the version's plan makes of them goes to the version's store."""
    store = version_store(cfg)
    plan = json.loads(store.get(PLAN_KEY))
    t = read_tokens(output_store(cfg), shard)
    counts = np.load(io.BytesIO(store.get(repeats_key(shard))))
    first = int(json.loads(store.get(first_doc_key(shard))))
    ids, sources, splits = (t[c].to_pylist() for c in ("id", "source", "split"))
    keys = doc_keys(ids, cfg.seed)
    val = np.asarray(splits, dtype=object) == "validation"
    grp = groups(cfg)
    group = np.array([grp[s] for s in sources], dtype=np.uint64)
    train_counts = np.where(val, 0, counts).astype(np.int64)
    doc_idx, rep_idx = expand_repeats(train_counts)
    okeys = order_keys(keys[doc_idx], rep_idx, group[doc_idx], cfg.seed)
    n_parts = plan.get("train_partitions", cfg.dataset.pack_partitions)
    # Partition by the hash bits of the key, inside the curriculum group (top 8 bits).
    p = (((okeys & _MASK56) >> np.uint64(24)) * np.uint64(n_parts)) >> np.uint64(32)
    g = okeys >> np.uint64(56)
    src_col = pa.array(sources, pa.string())
    write_parts(
        store,
        shard,
        [(part, int(part[7:9]) * n_parts + int(part[11:])) for part in train_partitions(cfg, plan)],
        (g * np.uint64(n_parts) + p).astype(np.int64),
        okeys,
        doc_idx,
        first,
        src_col,
        t["tokens"],
    )
    vparts = validation_partitions(plan)
    vp = ((keys & _MASK56) >> np.uint64(24)) * np.uint64(len(vparts)) >> np.uint64(32)
    vrows = np.flatnonzero(val)
    write_parts(
        store,
        shard,
        [(part, k) for k, part in enumerate(vparts)],
        vp[vrows].astype(np.int64),
        keys[vrows],
        vrows,
        first,
        src_col,
        t["tokens"],
    )

    # Accounting: a document the plan leaves out is dropped as `downsampled` (its text
    # stays in docs/<previous stage>/; the row here points at it).
    stats = ShardStats()
    dropped = DroppedRows()
    ntok = t["n_tokens"].to_numpy()
    nbytes = t["n_bytes"].to_numpy()
    realised: dict[str, int] = {}
    for i, src in enumerate(sources):
        st = stats[src]
        st.add_in(int(nbytes[i]))
        if val[i] or counts[i] > 0:
            st.add_kept(int(nbytes[i]))
            if not val[i]:
                realised[src] = realised.get(src, 0) + int(counts[i]) * int(ntok[i])
        else:
            st.add_dropped("downsampled", int(nbytes[i]))
            dropped.add(
                ids[i],
                src,
                "downsampled",
                "not chosen by the mixture plan",
                f"{tokens_key(shard)}#row={i}",
                "",
            )
    return write_shard(store, STAGE, shard, None, dropped, stats, {"realised_tokens": realised})
