"""Thin Prefect task wrappers around the prep steps. The steps themselves import no
Prefect, so they run and are tested without a server; here they gain retries (writes are
atomic and deterministic, so a retried shard cannot duplicate output) and names in the UI.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks import exact_dedup, near_dedup, quality_filter
from tasks.config import PrepConfig
from tasks.ingest import Unit, ingest_unit, plan_units
from tasks.report import build as build_report
from tasks.stage import is_done, output_store, read_done

# Transient storage errors (throttling, a dropped connection) are worth a retry; a bad
# config is not, and fails before these tasks run.
RETRY = {"retries": 2, "retry_delay_seconds": [2, 10]}


@task(name="plan-inputs")
def plan_task(cfg: PrepConfig) -> list[Unit]:
    from tasks.pipeline import claim_output

    units = plan_units(cfg)
    claim_output(output_store(cfg), cfg)
    return units


@task(name="ingest-unit", task_run_name="ingest-{unit.name}", **RETRY)
def ingest_task(cfg: PrepConfig, unit: Unit) -> list[str]:
    store = output_store(cfg)
    if not is_done(store, "ingest", unit.name):
        ingest_unit(cfg, unit)
    return read_done(store, "ingest", unit.name)["shards"]


@task(name="exact-hash", task_run_name="exact-hash-{shard}", **RETRY)
def exact_hash_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    if not output_store(cfg).exists(exact_dedup.hashes_key(shard)):
        exact_dedup.hash_shard(cfg, prev, shard)


@task(name="exact-select", **RETRY)
def exact_select_task(cfg: PrepConfig, prev: str, shards: list[str]) -> None:
    if not output_store(cfg).exists(exact_dedup.DUPS_KEY):
        exact_dedup.select(cfg, prev, shards)


@task(name="exact-apply", task_run_name="exact-apply-{shard}", **RETRY)
def exact_apply_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    if not is_done(output_store(cfg), "exact", shard):
        exact_dedup.apply_shard(cfg, prev, shard)


@task(name="near-signatures", task_run_name="near-signatures-{shard}", **RETRY)
def near_signature_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    if not output_store(cfg).exists(near_dedup.sig_key(shard)):
        near_dedup.signature_shard(cfg, prev, shard)


@task(name="near-buckets", **RETRY)
def near_bucket_task(cfg: PrepConfig, shards: list[str], bands: list[int]) -> None:
    store = output_store(cfg)
    if not all(store.exists(near_dedup.bucket_key(b)) for b in bands):
        near_dedup.bucket_bands(cfg, shards, bands)


@task(name="near-cluster", **RETRY)
def near_cluster_task(cfg: PrepConfig, shards: list[str]) -> dict[str, Any]:
    import json

    store = output_store(cfg)
    if not store.exists(near_dedup.CLUSTER_KEY):
        near_dedup.cluster(cfg, shards)
    return json.loads(store.get(near_dedup.CLUSTER_KEY))


@task(name="near-apply", task_run_name="near-apply-{shard}", **RETRY)
def near_apply_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    if not is_done(output_store(cfg), "near", shard):
        near_dedup.apply_shard(cfg, prev, shard)


@task(name="quality-filter", task_run_name="quality-{shard}", **RETRY)
def quality_task(cfg: PrepConfig, prev: str, shard: str) -> None:
    if not is_done(output_store(cfg), "quality", shard):
        quality_filter.filter_shard(cfg, prev, shard)


@task(name="report")
def report_task(cfg: PrepConfig, stages: list[tuple[str, list[str]]],
                extra: dict[str, Any]) -> dict[str, Any]:
    return build_report(output_store(cfg), stages, extra)
