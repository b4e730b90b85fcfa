"""Thin Prefect task wrappers around the prep steps. The steps themselves import no
Prefect, so they run and are tested without a server. Here they gain:
- retries: writes are atomic and deterministic, so a retried shard cannot duplicate output;
- a cache policy: inputs + task source + the output's run id, with persisted results, so
  a re-run of the flow does not even schedule finished shards. The run id is new
  whenever the output is made anew, so a deleted output is never taken for a finished one.
  (Inside each step, the shard's completion marker is still checked: that is the truth.)
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy

from tasks import dataset, exact_dedup, mixture_stage, near_dedup, pack_stage, quality_filter
from tasks import tokenize_stage as tok_stage
from tasks.config import PrepConfig
from tasks.ingest import Unit, ingest_unit, plan_units
from tasks.report import build as build_report
from tasks.stage import is_done, output_store, read_done


def _output_run_id(_ctx: Any, inputs: dict[str, Any]) -> str:
    from tasks.pipeline import RUN_KEY

    try:
        return json.loads(output_store(inputs["cfg"]).get(RUN_KEY))["run_id"]
    except Exception:  # no claimed output: never reuse a cached result
        return uuid.uuid4().hex


CACHE = INPUTS + TASK_SOURCE + CachePolicy.from_cache_key_fn(_output_run_id)
# Transient storage errors (throttling, a dropped connection) are worth a retry; a bad
# config is not, and fails before these tasks run.
STEP: dict[str, Any] = {"retries": 2, "retry_delay_seconds": [2, 10], "cache_policy": CACHE,
                        "persist_result": True}


@task(name="plan-inputs")
def plan_task(cfg: PrepConfig) -> list[Unit]:
    from tasks.pipeline import claim_output

    units = plan_units(cfg)
    claim_output(output_store(cfg), cfg)
    return units


@task(name="ingest-unit", task_run_name="ingest-{unit.name}", **STEP)
def ingest_task(cfg: PrepConfig, unit: Unit) -> list[str]:
    store = output_store(cfg)
    if not is_done(store, "ingest", unit.name):
        ingest_unit(cfg, unit)
    return read_done(store, "ingest", unit.name)["shards"]


def _once(stage: str, fn: Any, cfg: PrepConfig, *args: Any) -> None:
    shard = args[-1]
    if not is_done(output_store(cfg), stage, shard):
        fn(cfg, *args)


@task(name="exact-hash", task_run_name="exact-hash-{shard}", **STEP)
def exact_hash_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    if not output_store(cfg).exists(exact_dedup.hashes_key(shard)):
        exact_dedup.hash_shard(cfg, prev, shard)


@task(name="exact-select", **STEP)
def exact_select_task(cfg: PrepConfig, prev: str, shards: list[str]) -> None:
    if not output_store(cfg).exists(exact_dedup.DUPS_KEY):
        exact_dedup.select(cfg, prev, shards)


@task(name="exact-apply", task_run_name="exact-apply-{shard}", **STEP)
def exact_apply_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    _once("exact", exact_dedup.apply_shard, cfg, prev, shard)


@task(name="near-signatures", task_run_name="near-signatures-{shard}", **STEP)
def near_signature_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    if not output_store(cfg).exists(near_dedup.sig_key(shard)):
        near_dedup.signature_shard(cfg, prev, shard)


@task(name="near-buckets", **STEP)
def near_bucket_task(cfg: PrepConfig, shards: list[str], bands: list[int]) -> None:
    store = output_store(cfg)
    if not all(store.exists(near_dedup.bucket_key(b)) for b in bands):
        near_dedup.bucket_bands(cfg, shards, bands)


@task(name="near-cluster", **STEP)
def near_cluster_task(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    store = output_store(cfg)
    if not store.exists(near_dedup.CLUSTER_KEY):
        near_dedup.cluster(cfg, shards)
    return json.loads(store.get(near_dedup.CLUSTER_KEY))


@task(name="near-apply", task_run_name="near-apply-{shard}", **STEP)
def near_apply_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    _once("near", near_dedup.apply_shard, cfg, prev, shard)


@task(name="quality-filter", task_run_name="quality-{shard}", **STEP)
def quality_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    _once("quality", quality_filter.filter_shard, cfg, prev, shard)


@task(name="tokenizer", **STEP)
def tokenizer_task(cfg: PrepConfig, prev: str, shards: list[str]) -> None:
    tok_stage.prepare_tokenizer(cfg, prev, shards)


@task(name="tokenize", task_run_name="tokenize-{shard}", **STEP)
def tokenize_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    _once("tokenize", tok_stage.tokenize_shard, cfg, prev, shard)


@task(name="mixture-plan", **STEP)
def mixture_plan_task(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    return mixture_stage.plan(cfg, shards)


@task(name="mixture-order", task_run_name="mixture-order-{shard}", **STEP)
def mixture_order_task(cfg: PrepConfig, shard: str) -> None:
    _once("mixture", mixture_stage.scatter_shard, cfg, shard)


@task(name="pack", task_run_name="pack-{part}", **STEP)
def pack_task(cfg: PrepConfig, shards: list[str], part: str) -> dict[str, Any]:
    store = output_store(cfg)
    key = pack_stage.packed_done_key(part)
    if not store.exists(key):
        pack_stage.pack_partition(cfg, shards, part)
    return json.loads(store.get(key))


@task(name="report")
def report_task(cfg: PrepConfig, stages: list[tuple[str, list[str]]],
                extra: dict[str, Any]) -> dict[str, Any]:
    return build_report(output_store(cfg), stages, extra)


@task(name="write-dataset", **STEP)
def dataset_task(cfg: PrepConfig, parts: list[str], extra: dict[str, Any],
                 validation_parts: list[str] | None = None) -> dict[str, Any]:
    return dataset.write_dataset(cfg, parts, extra, validation_parts)
