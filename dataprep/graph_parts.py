"""The partitioned forms of the run-once steps (`max_task_memory`): exact select by hash
range (dataprep/stages/exact_ranges.py), near clustering over components
(dataprep/stages/near_parts.py) and the mixture plan a shard at a time
(dataprep/stages/mixture_parts.py). Each is a run of steps that dataprep/graph.py puts in
place of the single task, switched by Step.when; the functions here draw their items."""

from __future__ import annotations

from functools import partial
from typing import Any

from dataprep.partition import shard_item
from dataprep.stages import exact_ranges, mixture, mixture_parts, near, near_parts
from dataprep.steps import Run, Step, fixed_key, mix_shards_of


def _exact_plan(run: Run) -> dict[str, Any]:
    return exact_ranges.plan(run.cfg, run.all_shards)


def _exact_ranges(run: Run) -> list[str]:
    return exact_ranges.ranges(run.extra[exact_ranges.PLAN_KEY])


def _exact_keeper_shards(run: Run) -> list[str]:
    return exact_ranges.shard_items(run.extra[exact_ranges.PLAN_KEY], run.all_shards)


def _exact_dup_shards(run: Run) -> list[str]:
    return exact_ranges.shard_items(run.extra[exact_ranges.PLAN_KEY], run.shards)


EXACT_PARTITIONED = (
    Step(
        "exact: select ranges",
        exact_ranges.select_range,
        exact_ranges.select_done_key,
        _exact_ranges,
        ("prior", "shards"),
        versioned=True,
        plan=(exact_ranges.PLAN_KEY, _exact_plan),
        when=exact_ranges.enabled,
    ),
    Step(
        "exact: keepers",
        exact_ranges.keepers,
        exact_ranges.keepers_done_key,
        _exact_keeper_shards,
        ("prev", "prior", "shards"),
        versioned=True,
        when=exact_ranges.enabled,
    ),
    Step(
        "exact: dups",
        exact_ranges.dups,
        exact_ranges.dups_done_key,
        _exact_dup_shards,
        versioned=True,
        when=exact_ranges.enabled,
    ),
)


def _near_plan(run: Run) -> dict[str, Any]:
    return near_parts.plan(run.cfg, run.all_shards)


def _near_edge_items(run: Run) -> list[str]:
    tag = run.extra[near_parts.PLAN_KEY]["tag"]
    return [f"{tag}.{','.join(map(str, g))}" for g in near.band_groups(run.cfg)]


def _near_round(run: Run) -> dict[str, Any]:
    return near_parts.round_state(run.cfg, run.extra[near_parts.PLAN_KEY])


def _near_round_items(run: Run) -> list[str]:
    planned, state = run.extra[near_parts.PLAN_KEY], run.extra[near_parts.ROUND_KEY]
    if state["done"]:
        return []
    rnd = state["round"]
    return [f"{planned['tag']}.r{rnd:03d}.q{q:05d}" for q in range(planned["parts"])]


def _near_replay(run: Run) -> dict[str, Any]:
    return near_parts.replay_plan(
        run.cfg, run.extra[near_parts.PLAN_KEY], run.extra[near_parts.ROUND_KEY]
    )


def _near_label_items(run: Run) -> list[str]:
    planned, state = run.extra[near_parts.PLAN_KEY], run.extra[near_parts.ROUND_KEY]
    final = state["round"] - 1  # the round whose input every partition found in stars
    return [f"{planned['tag']}.f{final:03d}.q{q:05d}" for q in range(planned["parts"])]


def _routed(run: Run) -> tuple[str, str, int]:
    rp = run.extra[near_parts.REPLAY_KEY]
    return rp["cc"], rp["route"], rp["replay"]


def _near_band_items(run: Run) -> list[str]:
    cc, rt, _n = _routed(run)
    assert run.cfg.dedup.near is not None
    bands, _ = near.bands_rows(run.cfg.dedup.near)
    return [f"{cc}.{rt}.b{b:03d}" for b in range(bands)]


def _near_set_items(run: Run) -> list[str]:
    cc, rt, _n = _routed(run)
    assert run.cfg.dedup.near is not None
    if not run.cfg.dedup.near.verify:
        return []
    return [f"{cc}.{rt}.{s}" for s in run.all_shards]


def _near_replay_items(run: Run) -> list[str]:
    cc, rt, n = _routed(run)
    return [f"{cc}.{rt}.r{r:05d}" for r in range(n)]


def _near_keeper_items(run: Run) -> list[str]:
    tag = run.extra[near_parts.REPLAY_KEY]["tag"]
    return [shard_item(tag, s) for s in run.all_shards]


def _near_dup_items(run: Run) -> list[str]:
    tag = run.extra[near_parts.REPLAY_KEY]["tag"]
    return [shard_item(tag, s) for s in run.shards]


def _near_summary_items(run: Run) -> list[str]:
    cc, rt, n = _routed(run)
    return [f"{cc}.{rt}.n{n}"]


# max_task_memory: near clustering partitioned (dataprep/stages/near_parts.py says how and
# why it writes what near.cluster writes).
NEAR_PARTITIONED = (
    Step(
        "near: edges",
        near_parts.edges,
        near_parts.edges_done_key,
        _near_edge_items,
        versioned=True,
        plan=(near_parts.PLAN_KEY, _near_plan),
        when=near_parts.enabled,
    ),
    Step(
        "near: components",
        near_parts.components,
        near_parts.components_done_key,
        _near_round_items,
        versioned=True,
        plan=(near_parts.ROUND_KEY, _near_round),
        when=near_parts.enabled,
        repeat=True,
    ),
    Step(
        "near: labels",
        near_parts.labels,
        near_parts.labels_done_key,
        _near_label_items,
        ("prior", "shards"),
        versioned=True,
        when=near_parts.enabled,
    ),
    Step(
        "near: route groups",
        near_parts.route_groups,
        near_parts.route_groups_done_key,
        _near_band_items,
        versioned=True,
        plan=(near_parts.REPLAY_KEY, _near_replay),
        when=near_parts.enabled,
    ),
    Step(
        "near: route sets",
        near_parts.route_sets,
        near_parts.route_sets_done_key,
        _near_set_items,
        versioned=True,
        when=near_parts.enabled,
    ),
    Step(
        "near: replay",
        near_parts.replay,
        near_parts.replay_done_key,
        _near_replay_items,
        ("prev", "prior", "shards"),
        versioned=True,
        when=near_parts.enabled,
    ),
    Step(
        "near: keepers",
        near_parts.keepers,
        near_parts.keepers_done_key,
        _near_keeper_items,
        ("prev", "prior", "shards"),
        versioned=True,
        when=near_parts.enabled,
    ),
    Step(
        "near: dups",
        near_parts.dups,
        near_parts.dups_done_key,
        _near_dup_items,
        versioned=True,
        when=near_parts.enabled,
    ),
    Step(
        "near: summary",
        near_parts.summary,
        partial(fixed_key, near.CLUSTER_KEY),
        _near_summary_items,
        versioned=True,
        when=near_parts.enabled,
    ),
)


MIXTURE_PARTITIONED = (
    Step(
        "mixture: keys",
        mixture_parts.keys_shard,
        mixture_parts.hist_key,
        mix_shards_of,
        versioned=True,
        when=mixture_parts.enabled,
    ),
    Step(
        "mixture: cut",
        mixture_parts.cut,
        partial(fixed_key, mixture_parts.CUT_KEY),
        versioned=True,
        all_versions=True,
        when=mixture_parts.enabled,
    ),
    Step(
        "mixture: boundary",
        mixture_parts.boundary_shard,
        mixture_parts.boundary_key,
        mix_shards_of,
        ("mix_shards",),
        versioned=True,
        when=mixture_parts.enabled,
    ),
    Step(
        "mixture: resolve",
        mixture_parts.resolve,
        partial(fixed_key, mixture_parts.RESOLVED_KEY),
        versioned=True,
        all_versions=True,
        when=mixture_parts.enabled,
    ),
    Step(
        "mixture: repeats",
        mixture_parts.repeats_shard,
        mixture.repeats_key,
        mix_shards_of,
        ("mix_shards",),
        versioned=True,
        when=mixture_parts.enabled,
    ),
    Step(
        "mixture: record",
        mixture_parts.record,
        partial(fixed_key, mixture.PLAN_KEY),
        versioned=True,
        all_versions=True,
        when=mixture_parts.enabled,
    ),
)
