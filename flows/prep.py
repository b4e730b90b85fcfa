"""The `prep` flow: the data-prep pipeline as Prefect tasks mapped over shards. It reads
like the pipeline diagram; the work lives in tasks/."""

from __future__ import annotations

from typing import Any

from prefect import flow, unmapped
from prefect.artifacts import create_markdown_artifact

from tasks.config import load_config
from tasks.near_dedup import band_groups
from tasks.pipeline import enabled_stages
from tasks.wrappers import (
    exact_apply_task,
    exact_hash_task,
    exact_select_task,
    ingest_task,
    near_apply_task,
    near_bucket_task,
    near_cluster_task,
    near_signature_task,
    plan_task,
    quality_task,
    report_task,
)


@flow(name="prep", log_prints=True)
def prep(config_path: str, output: str | None = None, until: str | None = None) -> dict[str, Any]:
    """Ingest -> exact dedup -> near dedup -> quality filters. Returns the output URI and
    the accounting; re-running with the same config skips every finished shard."""
    cfg = load_config(config_path, {"output": output})
    stages = enabled_stages(cfg, until)
    c = unmapped(cfg)

    units = plan_task(cfg)
    shards = [s for part in ingest_task.map(c, units).result() for s in part]
    accounted = [("ingest", [u.name for u in units])]
    extra: dict[str, Any] = {"config_fingerprint": cfg.fingerprint(), "seed": cfg.seed}
    prev = "ingest"

    if "exact" in stages:
        exact_hash_task.map(c, unmapped(prev), shards).wait()
        exact_select_task(cfg, prev, shards)
        exact_apply_task.map(c, unmapped(prev), shards).wait()
        accounted.append(("exact", shards))
        prev = "exact"

    if "near" in stages:
        near_signature_task.map(c, unmapped(prev), shards).wait()
        near_bucket_task.map(c, unmapped(shards), band_groups(cfg)).wait()
        extra["near"] = near_cluster_task(cfg, shards)
        near_apply_task.map(c, unmapped(prev), shards).wait()
        accounted.append(("near", shards))
        prev = "near"

    if "quality" in stages:
        quality_task.map(c, unmapped(prev), shards).wait()
        accounted.append(("quality", shards))
        prev = "quality"

    extra.update(final_stage=prev, shards=shards)
    report = report_task(cfg, accounted, extra)
    create_markdown_artifact(key="prep-accounting", markdown=_accounting_md(report),
                             description="Documents in, kept and dropped per stage")
    return {"output": cfg.output, "final_stage": prev, "report": report}


def _accounting_md(report: dict[str, Any]) -> str:
    rows = ["| stage | docs in | kept | dropped | top reasons |", "|---|---:|---:|---:|---|"]
    for name, st in report["stages"].items():
        t = st["total"]
        top = sorted(t["dropped"].items(), key=lambda kv: -kv[1])[:4]
        rows.append(f"| {name} | {t['docs_in']:,} | {t['kept']:,} | "
                    f"{sum(t['dropped'].values()):,} | "
                    + ", ".join(f"{r}: {n:,}" for r, n in top) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    print(prep(sys.argv[1]))
