"""The prep stage graph: WHAT runs, in one list (STAGES) that everything else reads: the
driver (dataprep/driver.py, the one walk over it), `--until`, the flow's docstring, the
CLI's and the flow's summaries. WHERE it runs is a runner's business (dataprep/driver.py
lists them); nothing here knows about any.

A stage is steps run in order. A step either maps its function over items (ingest units,
shards, band groups, pack partitions) or runs it once with every shard as its one item.
It names the output keys whose presence means an item is done: runners skip those items,
which is how a killed run resumes where it stopped. It is called as
`fn(cfg, *inputs, item)`, the inputs drawn from the run by name ("prev": the stage whose
documents it reads; "shards": every shard), so runners need no per-step code.

Adding a stage: a module under dataprep/stages/ with its step functions and its name (STAGE),
and one Stage in STAGES. Step functions, `over` and `done` are module-level functions (not
lambdas): a process pool or a Dask worker then imports them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from dataprep.config import PrepConfig
from dataprep.graph_parts import EXACT_PARTITIONED, MIXTURE_PARTITIONED, NEAR_PARTITIONED
from dataprep.inputs import listed, marker_parts, with_parts
from dataprep.layout import done_key, output_store, read_done
from dataprep.stages import (
    dataset,
    exact,
    exact_ranges,
    ingest,
    lines,
    mixture,
    mixture_parts,
    near,
    near_index,
    near_parts,
    pack,
    quality,
    substring,
    tokenize,
)
from dataprep.stages.ingest import Unit, ingest_unit

# Run, Stage, Step and item_name live in dataprep/steps.py; the graph's users import them
# from here, as before the split.
from dataprep.steps import Run as Run
from dataprep.steps import Stage as Stage
from dataprep.steps import Step as Step
from dataprep.steps import fixed_key as _key
from dataprep.steps import item_name as item_name
from dataprep.steps import mix_shards_of as _mix_shards
from dataprep.steps import shards_of as _shards


def _units(run: Run) -> list[Unit]:
    return run.units


def _unit_names(run: Run) -> list[str]:
    return [u.name for u in run.units]


def _all_unit_names(run: Run) -> list[str]:
    return [*run.prior_units, *_unit_names(run)]


def _unit_done(unit: Unit) -> str:
    return done_key(ingest.STAGE, unit.name)


def _ingested_shards(run: Run) -> list[str]:
    store = output_store(run.cfg)
    return [s for u in run.units for s in read_done(store, ingest.STAGE, u.name)["shards"]]


def _ingested_inputs(run: Run) -> list[dict[str, Any]]:
    """What the run read (dataprep/inputs.py): one entry per input file, its parts inside."""
    store = output_store(run.cfg)
    files = listed(f for u in run.units for f in u.files)
    parts = marker_parts(store, (read_done(store, ingest.STAGE, u.name) for u in run.units))
    return [f.to_json() for f in with_parts(files, parts)]


def _exact_on(cfg: PrepConfig) -> bool:
    return cfg.dedup.exact


def _near_on(cfg: PrepConfig) -> bool:
    return cfg.dedup.near is not None


def _lines_summary(run: Run) -> dict[str, Any]:
    return lines.summary(run.cfg, run.shards)


def _exact_index(run: Run) -> dict[str, Any] | None:
    return exact.index_record(run.cfg)


def _near_index(run: Run) -> dict[str, Any] | None:
    return near_index.index_record(run.cfg)


def _band_groups(run: Run) -> list[list[int]]:
    return near.band_groups(run.cfg)


def _bucket_keys(bands: list[int]) -> tuple[str, ...]:
    return tuple(near.bucket_key(b) for b in bands)


def _substring_plan(run: Run) -> dict[str, Any]:
    return substring.plan(run.cfg, run.all_shards)


def _substring_parts(run: Run) -> list[str]:
    return substring.partitions(run.extra[substring.STAGE])


def _substring_summary(run: Run) -> dict[str, Any]:
    return substring.summary(run.cfg, run.shards)


def _near_summary(run: Run) -> dict[str, Any]:
    return near.read_summary(run.cfg)


def _new_tokens(run: Run) -> dict[str, int]:
    """Tokens of this run's documents (a later version's: of the data it added)."""
    store = output_store(run.cfg)
    out = {"train": 0, "validation": 0}
    for shard in run.shards:
        for split in read_done(store, tokenize.STAGE, shard).get("tokens", {}).values():
            for k in out:
                out[k] += int(split.get(k, 0))
    return out


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
    Stage(
        ingest.STAGE,
        (Step(ingest.STAGE, ingest_unit, _unit_done, over=_units),),
        accounting=_unit_names,
        accounting_all=_all_unit_names,
        reports=(("shards", _ingested_shards), ("inputs", _ingested_inputs)),
    ),
    Stage(
        exact.STAGE,
        (
            Step("exact: hash", exact.hash_shard, exact.hashes_key, _shards, ("prev",)),
            Step(
                "exact: select",
                exact.select,
                partial(_key, exact.DUPS_KEY),
                None,
                ("prev", "prior"),
                versioned=True,
                when=exact_ranges.single,
            ),
            *EXACT_PARTITIONED,
            Step("exact: apply", exact.apply_shard, _applied(exact.STAGE), _shards, ("prev",)),
        ),
        enabled=_exact_on,
        reports=(("exact_index", _exact_index),),
    ),
    Stage(
        near.STAGE,
        (
            Step("near: signatures", near.signature_shard, near.sig_key, _shards, ("prev",)),
            Step(
                "near: buckets",
                near.bucket_bands,
                _bucket_keys,
                _band_groups,
                ("prior", "shards"),
                versioned=True,
            ),
            Step(
                "near: cluster",
                near.cluster,
                partial(_key, near.CLUSTER_KEY),
                None,
                ("prev", "prior"),
                versioned=True,
                when=near_parts.single,
            ),
            *NEAR_PARTITIONED,
            Step("near: apply", near.apply_shard, _applied(near.STAGE), _shards, ("prev",)),
        ),
        enabled=_near_on,
        reports=(("near", _near_summary), ("near_index", _near_index)),
    ),
    Stage(
        lines.STAGE,
        (
            Step("lines: count", lines.count_shard, lines.hashes_key, _shards, ("prev",)),
            Step(
                "lines: select",
                lines.select,
                partial(_key, lines.COMMON_KEY),
                None,
                ("prior",),
                versioned=True,
            ),
            Step("lines: apply", lines.apply_shard, _applied(lines.STAGE), _shards, ("prev",)),
        ),
        enabled=lines.enabled,
        reports=(("lines", _lines_summary),),
    ),
    Stage(
        substring.STAGE,
        (
            Step(
                "substring: hash",
                substring.hash_shard,
                substring.windows_key,
                _shards,
                ("prev",),
            ),
            Step(
                "substring: select",
                substring.select,
                substring.select_key,
                _substring_parts,
                ("prior", "shards"),
                versioned=True,
                plan=(substring.STAGE, _substring_plan),
            ),
            Step(
                "substring: apply",
                substring.apply_shard,
                _applied(substring.STAGE),
                _shards,
                ("prev",),
            ),
        ),
        enabled=substring.enabled,
        reports=(("substring", _substring_summary),),
    ),
    Stage(
        quality.STAGE,
        (Step(quality.STAGE, quality.filter_shard, _applied(quality.STAGE), _shards, ("prev",)),),
    ),
    Stage(
        tokenize.STAGE,
        (
            Step(
                "tokenizer",
                tokenize.prepare_tokenizer,
                partial(_key, tokenize.TOKENIZER_KEY),
                None,
                ("prev",),
                label="tokenizer: {cfg.tokenizer.kind}",
            ),
            Step(
                tokenize.STAGE,
                tokenize.tokenize_shard,
                _applied(tokenize.STAGE),
                _shards,
                ("prev",),
            ),
        ),
        reports=(("tokens", _new_tokens),),
        docs=False,
    ),
    Stage(
        mixture.STAGE,
        (
            Step(
                "mixture: plan",
                mixture.plan,
                partial(_key, mixture.PLAN_KEY),
                versioned=True,
                all_versions=True,
                when=mixture_parts.single,
            ),
            *MIXTURE_PARTITIONED,
            Step(
                "mixture: order",
                mixture.scatter_shard,
                _applied(mixture.STAGE),
                _mix_shards,
                versioned=True,
            ),
        ),
        accounting=_mix_shards,
        reports=(("mixture", _mixture_plan),),
        versioned=True,
        docs=False,
    ),
    Stage(
        pack.STAGE,
        (
            Step(
                pack.STAGE,
                pack.pack_partition,
                pack.packed_done_key,
                _partitions,
                ("mix_shards",),
                label="pack: {cfg.pack.strategy}",
                versioned=True,
            ),
        ),
        accounting=None,
        reports=(("packing", _packing),),
        versioned=True,
        docs=False,
    ),
]
STAGE_NAMES: list[str] = [s.name for s in STAGES]
# The stages whose kept documents are text (Stage.docs), in order.
TEXT_STAGES: list[str] = [s.name for s in STAGES if s.docs]


def enabled_stages(cfg: PrepConfig, until: str | None = None) -> list[Stage]:
    """The stages this config runs, in order, up to and including `until`."""
    if until is not None and until not in STAGE_NAMES:
        raise ValueError(f"unknown stage {until!r}; stages are: {', '.join(STAGE_NAMES)}")
    out = []
    for s in STAGES:
        if s.enabled(cfg):
            out.append(s)
        if s.name == until:
            break
    return out


def writes_dataset(stages: Sequence[Stage]) -> bool:
    """Whether the run ends by writing the dataset: when it packed."""
    return any(s.name == pack.STAGE for s in stages)


def write_dataset(
    cfg: PrepConfig,
    extra: dict[str, Any],
    accounting: dict[str, Any],
    all_versions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's last step, after the report (a run whose documents do not add up never
    gets here): the packed rows as a dataset. Returns the report's "dataset" entry.
    The manifest names the version, its parent and the inputs it added; a version that
    builds on others also carries the accounting over all of their documents."""
    plan = extra["mixture"]
    manifest_extra = {
        "mixture": plan,
        "packing": extra["packing"],
        "accounting": accounting,
        "inputs": extra["inputs"],
        "version": extra["version"],
    }
    if all_versions is not None:
        manifest_extra["accounting_all_versions"] = all_versions
    manifest = dataset.write_dataset(
        cfg,
        mixture.train_partitions(cfg, plan),
        manifest_extra,
        mixture.validation_partitions(plan),
    )
    return {
        "uri": dataset.dataset_uri(cfg),
        "splits": {
            k: {"rows": v["rows"], "real_tokens": v["real_tokens"]}
            for k, v in manifest["splits"].items()
        },
    }


def all_versions(
    run: Run, accounted: Sequence[tuple[str, list[str], bool]]
) -> dict[str, list[str]] | None:
    """For a version that builds on earlier ones: each accounted stage's names over every
    version (report.build's `all_versions`); None for a run that builds on nothing."""
    if not run.prior:
        return None
    by_name = {s.name: s for s in STAGES}
    return {name: by_name[name].all_versions(run) for name, _names, _v in accounted}
