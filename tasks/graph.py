"""The prep stage graph: WHAT runs, in one list (STAGES) that every runner reads. WHERE it
runs is the runner's business: tasks/pipeline.py runs it in a local process pool (what
`ballast prep` runs), flows/prep.py as Prefect tasks; nothing here knows about either.

A stage is steps run in order. A step either maps its function over items (ingest units,
shards, band groups, pack partitions) or runs it once with every shard as its one item.
It names the output keys whose presence means an item is done: runners skip those items,
which is how a killed run resumes where it stopped. It is called as
`fn(cfg, *inputs, item)`, the inputs drawn from the run by name ("prev": the stage whose
documents it reads; "shards": every shard), so runners need no per-step code.

Adding a stage: a module under tasks/stages/ with its step functions, and one Stage in
STAGES. Step functions, `over` and `done` are module-level functions (not lambdas): a
process pool or a Dask worker then imports them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from core.store import Store
from tasks.config import PrepConfig
from tasks.inputs import listed, marker_parts, with_parts
from tasks.layout import done_key, output_store, read_done
from tasks.stages import dataset, exact, mixture, near, pack, quality, tokenize
from tasks.stages.ingest import Unit, ingest_unit


@dataclass
class Run:
    """What a run knows as it goes: steps draw their items and inputs from it."""

    cfg: PrepConfig
    units: list[Unit]
    prev: str = "ingest"  # the stage whose documents the next stage reads
    # The report's entries besides the accounting; the stages' summaries land here
    # (Stage.reports), "shards" and "inputs" among them.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shards(self) -> list[str]:
        return self.extra["shards"]


@dataclass(frozen=True)
class Step:
    # The step's name in progress bars, timings, failpoints ("near: signatures:3") and,
    # as "near-signatures", in task names.
    name: str
    fn: Callable[..., Any]
    # An item's output keys (one or several); all present = the item is done.
    done: Callable[[Any], str | tuple[str, ...]]
    # The items to map over; None: run once, with the list of every shard as the item.
    over: Callable[[Run], Sequence[Any]] | None = None
    # Run attributes passed after cfg and before the item: "prev", "shards".
    inputs: tuple[str, ...] = ()
    # The name shown when the config completes it, formatted with cfg ("pack: {cfg...}").
    label: str = ""

    def title(self, cfg: PrepConfig) -> str:
        return self.label.format(cfg=cfg) if self.label else self.name

    def args(self, run: Run) -> tuple[Any, ...]:
        return tuple(getattr(run, name) for name in self.inputs)

    def items(self, run: Run) -> list[Any]:
        return list(self.over(run)) if self.over is not None else [run.shards]

    def is_done(self, store: Store, item: Any) -> bool:
        keys = self.done(item)
        return all(store.exists(k) for k in ((keys,) if isinstance(keys, str) else keys))


def _always(_cfg: PrepConfig) -> bool:
    return True


def _shards(run: Run) -> list[str]:
    return run.shards


@dataclass(frozen=True)
class Stage:
    name: str  # as `--until` names it
    steps: tuple[Step, ...]
    enabled: Callable[[PrepConfig], bool] = _always
    # The names whose _done/<stage>/<name>.json hold the stage's document accounting;
    # the stage's documents are then what the next stage reads. None: the stage works on
    # rows, not documents, and is reported apart.
    accounting: Callable[[Run], list[str]] | None = _shards
    # (key, read) each: read(run), once the steps are done, goes into the report under key.
    reports: tuple[tuple[str, Callable[[Run], Any]], ...] = ()


def item_name(item: Any) -> str:
    """A short name of a work item, for task names and logs."""
    if isinstance(item, str):
        return item
    if isinstance(item, Unit):
        return item.name
    return str(item[0]) if isinstance(item, list | tuple) and item else "all"


def _key(key: str, _item: Any) -> str:
    return key


def _units(run: Run) -> list[Unit]:
    return run.units


def _unit_names(run: Run) -> list[str]:
    return [u.name for u in run.units]


def _unit_done(unit: Unit) -> str:
    return done_key("ingest", unit.name)


def _ingested_shards(run: Run) -> list[str]:
    store = output_store(run.cfg)
    return [s for u in run.units for s in read_done(store, "ingest", u.name)["shards"]]


def _ingested_inputs(run: Run) -> list[dict[str, Any]]:
    """What the run read (tasks/inputs.py): one entry per input file, its parts inside."""
    store = output_store(run.cfg)
    files = listed(f for u in run.units for f in u.files)
    parts = marker_parts(store, (read_done(store, "ingest", u.name) for u in run.units))
    return [f.to_json() for f in with_parts(files, parts)]


def _exact_on(cfg: PrepConfig) -> bool:
    return cfg.dedup.exact


def _near_on(cfg: PrepConfig) -> bool:
    return cfg.dedup.near is not None


def _band_groups(run: Run) -> list[list[int]]:
    return near.band_groups(run.cfg)


def _bucket_keys(bands: list[int]) -> tuple[str, ...]:
    return tuple(near.bucket_key(b) for b in bands)


def _near_summary(run: Run) -> dict[str, Any]:
    return near.read_summary(run.cfg)


def _mixture_plan(run: Run) -> dict[str, Any]:
    return mixture.read_plan(run.cfg)


def _partitions(run: Run) -> list[str]:
    return pack.partitions(run.cfg, run.extra["mixture"])


def _packing(run: Run) -> dict[str, Any]:
    return pack.summary(run.cfg, run.extra["mixture"])


def _applied(stage: str) -> Callable[[str], str]:
    """The done check of a step that writes the stage's per-shard accounting marker."""
    return partial(done_key, stage)


STAGES: list[Stage] = [
    Stage("ingest", (
        Step("ingest", ingest_unit, _unit_done, over=_units),
    ), accounting=_unit_names,
        reports=(("shards", _ingested_shards), ("inputs", _ingested_inputs))),
    Stage("exact", (
        Step("exact: hash", exact.hash_shard, exact.hashes_key, _shards, ("prev",)),
        Step("exact: select", exact.select, partial(_key, exact.DUPS_KEY), None, ("prev",)),
        Step("exact: apply", exact.apply_shard, _applied("exact"), _shards, ("prev",)),
    ), enabled=_exact_on),
    Stage("near", (
        Step("near: signatures", near.signature_shard, near.sig_key, _shards, ("prev",)),
        Step("near: buckets", near.bucket_bands, _bucket_keys, _band_groups, ("shards",)),
        Step("near: cluster", near.cluster, partial(_key, near.CLUSTER_KEY)),
        Step("near: apply", near.apply_shard, _applied("near"), _shards, ("prev",)),
    ), enabled=_near_on, reports=(("near", _near_summary),)),
    Stage("quality", (
        Step("quality", quality.filter_shard, _applied("quality"), _shards, ("prev",)),
    )),
    Stage("tokenize", (
        Step("tokenizer", tokenize.prepare_tokenizer, partial(_key, tokenize.TOKENIZER_KEY),
             None, ("prev",), label="tokenizer: {cfg.tokenizer.kind}"),
        Step("tokenize", tokenize.tokenize_shard, _applied("tokenize"), _shards, ("prev",)),
    )),
    Stage("mixture", (
        Step("mixture: plan", mixture.plan, partial(_key, mixture.PLAN_KEY)),
        Step("mixture: order", mixture.scatter_shard, _applied("mixture"), _shards),
    ), reports=(("mixture", _mixture_plan),)),
    Stage("pack", (
        Step("pack", pack.pack_partition, pack.packed_done_key, _partitions, ("shards",),
             label="pack: {cfg.pack.strategy}"),
    ), accounting=None, reports=(("packing", _packing),)),
]


def enabled_stages(cfg: PrepConfig, until: str | None = None) -> list[Stage]:
    """The stages this config runs, in order, up to and including `until`."""
    names = [s.name for s in STAGES]
    if until is not None and until not in names:
        raise ValueError(f"unknown stage {until!r}; stages are: {', '.join(names)}")
    out = []
    for s in STAGES:
        if s.enabled(cfg):
            out.append(s)
        if s.name == until:
            break
    return out


def writes_dataset(stages: Sequence[Stage]) -> bool:
    """Whether the run ends by writing the dataset: when it packed."""
    return any(s.name == "pack" for s in stages)


def write_dataset(cfg: PrepConfig, extra: dict[str, Any],
                  accounting: dict[str, Any]) -> dict[str, Any]:
    """The run's last step, after the report (a run whose documents do not add up never
    gets here): the packed rows as a dataset. Returns the report's "dataset" entry."""
    plan = extra["mixture"]
    manifest = dataset.write_dataset(
        cfg, mixture.train_partitions(cfg, plan),
        {"mixture": plan, "packing": extra["packing"], "accounting": accounting,
         "inputs": extra["inputs"]},
        mixture.validation_partitions(plan))
    return {"uri": dataset.dataset_uri(cfg),
            "splits": {k: {"rows": v["rows"], "real_tokens": v["real_tokens"]}
                       for k, v in manifest["splits"].items()}}
