"""The `prep` flow: the data-prep pipeline as Prefect tasks mapped over shards. It reads
like the pipeline diagram; the work lives in tasks/.

    python -m flows.prep CONFIG [--runner local|dask] [--workers N]
"""

from __future__ import annotations

import argparse
from typing import Any

from prefect import Flow, flow, get_run_logger, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.runs import run_name
from tasks.config import load_config
from tasks.dataset import dataset_uri
from tasks.mixture_stage import train_partitions, validation_partitions
from tasks.near_dedup import band_groups
from tasks.pack_stage import packing_summary
from tasks.pipeline import enabled_stages
from tasks.wrappers import (
    dataset_task,
    exact_apply_task,
    exact_hash_task,
    exact_select_task,
    ingest_task,
    mixture_order_task,
    mixture_plan_task,
    near_apply_task,
    near_bucket_task,
    near_cluster_task,
    near_signature_task,
    pack_task,
    plan_task,
    quality_task,
    report_task,
    tokenize_task,
    tokenizer_task,
)


@flow(name="prep", log_prints=True, flow_run_name=run_name)
def prep(config_path: str, output: str | None = None, until: str | None = None) -> dict[str, Any]:
    """Ingest -> exact dedup -> near dedup -> quality -> tokenize -> mixture -> pack ->
    dataset. Returns the dataset URI and the summary; a re-run skips finished shards.

    Args:
        config_path: The prep config (YAML), as the worker sees it: absolute, or relative
            to the worker's working directory.
        output: Where the shards, reports and the dataset go (a directory or s3://...);
            overrides the config's `output`.
        until: Stop after this stage (ingest, exact, near, quality, tokenize, mixture,
            pack); empty runs every enabled stage.
    """
    cfg = load_config(config_path, {"output": output})
    stages = enabled_stages(cfg, until)
    c = unmapped(cfg)

    units = plan_task(cfg)
    shards = [s for part in ingest_task.map(c, units).result() for s in part]
    accounted = [("ingest", [u.name for u in units])]
    extra: dict[str, Any] = {"config_fingerprint": cfg.fingerprint(), "seed": cfg.seed}
    prev = unmapped("ingest")

    if "exact" in stages:
        exact_hash_task.map(c, prev, shards).wait()
        exact_select_task(cfg, prev.value, shards)
        exact_apply_task.map(c, prev, shards).wait()
        accounted.append(("exact", shards))
        prev = unmapped("exact")

    if "near" in stages:
        near_signature_task.map(c, prev, shards).wait()
        near_bucket_task.map(c, unmapped(shards), band_groups(cfg)).wait()
        extra["near"] = near_cluster_task(cfg, shards)
        near_apply_task.map(c, prev, shards).wait()
        accounted.append(("near", shards))
        prev = unmapped("near")

    if "quality" in stages:
        quality_task.map(c, prev, shards).wait()
        accounted.append(("quality", shards))
        prev = unmapped("quality")

    if "tokenize" in stages:
        tokenizer_task(cfg, prev.value, shards)
        tokenize_task.map(c, prev, shards).wait()
        accounted.append(("tokenize", shards))
        prev = unmapped("tokenize")

    if "mixture" in stages:
        extra["mixture"] = mixture_plan_task(cfg, shards)
        mixture_order_task.map(c, shards).wait()
        accounted.append(("mixture", shards))
        prev = unmapped("mixture")

    dataset = None
    if "pack" in stages:
        parts = train_partitions(cfg, extra["mixture"])
        vparts = validation_partitions(extra["mixture"])
        packed = pack_task.map(c, unmapped(shards), [*parts, *vparts]).result()
        extra["packing"] = {"strategy": cfg.pack.strategy, "seq_len": cfg.pack.seq_len,
                            "train": packing_summary(packed[:len(parts)]),
                            "validation": packing_summary(packed[len(parts):])}

    extra.update(final_stage=prev.value, shards=shards)
    report = report_task(cfg, accounted, extra)
    if "pack" in stages:
        manifest = dataset_task(cfg, parts, {"mixture": extra["mixture"],
                                             "packing": extra["packing"],
                                             "accounting": report["stages"]}, vparts)
        dataset = dataset_uri(cfg)
        report["dataset"] = {"uri": dataset, "splits": {
            k: {"rows": v["rows"], "real_tokens": v["real_tokens"]}
            for k, v in manifest["splits"].items()}}
    publish_artifacts(report)
    return {"dataset": dataset, "output": cfg.output, "final_stage": prev.value,
            "report": report}


def publish_artifacts(report: dict[str, Any]) -> None:
    """Tables in the Prefect UI (Artifacts page): accounting, mixture, packing; and the
    accounting as one log line per stage."""
    logger = get_run_logger()
    rows = []
    for name, st in report["stages"].items():
        t = st["total"]
        top = sorted(t["dropped"].items(), key=lambda kv: -kv[1])[:4]
        rows.append({"stage": name, "docs in": t["docs_in"], "kept": t["kept"],
                     "dropped": sum(t["dropped"].values()),
                     "top reasons": ", ".join(f"{r}: {n}" for r, n in top)})
        r = rows[-1]
        logger.info(f"{name}: {r['docs in']:,} documents in, {r['kept']:,} kept, "
                    f"{r['dropped']:,} dropped" + (f" ({r['top reasons']})" if top else ""))
    create_table_artifact(key="prep-accounting", table=rows,
                          description="Documents in, kept and dropped per stage")
    mix = report.get("mixture")
    if mix:
        create_table_artifact(key="prep-mixture", description="Planned vs realised tokens", table=[
            {"source": s, "available": m["available_tokens"], "planned": m["planned_tokens"],
             "realised": m["realised_tokens"], "planned share": round(m["planned_share"], 4),
             "realised share": round(m["realised_share"], 4), "warning": m["warning"] or ""}
            for s, m in mix["sources"].items()])
    pk = report.get("packing")
    if pk:
        md = (f"**{pk['strategy']}**, seq_len {pk['seq_len']}\n\n| split | rows | efficiency "
              f"| docs | split docs |\n|---|---:|---:|---:|---:|\n")
        for split in ("train", "validation"):
            s = pk[split]
            md += (f"| {split} | {s['rows']:,} | {100 * s['efficiency']:.2f}% | {s['docs']:,} "
                   f"| {s['split_docs']:,} |\n")
        create_markdown_artifact(key="prep-packing", markdown=md,
                                 description="Packing efficiency (non-pad / all tokens)")


def with_runner(kind: str, workers: int = 2) -> Flow:
    """The prep flow on the default thread-pool task runner, or on a local Dask cluster of
    `workers` processes (prefect-dask); a Dask address can be set in the environment."""
    if kind == "local":
        return prep
    if kind == "dask":
        from prefect_dask import DaskTaskRunner

        return prep.with_options(task_runner=DaskTaskRunner(cluster_kwargs={
            "n_workers": workers, "threads_per_worker": 1, "processes": True}))
    raise ValueError(f"unknown task runner {kind!r}: use local or dask")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--output")
    ap.add_argument("--until")
    ap.add_argument("--runner", default="local", choices=["local", "dask"])
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    result = with_runner(args.runner, args.workers)(args.config, args.output, args.until)
    print(f"dataset: {result['dataset']}")


if __name__ == "__main__":
    main()
