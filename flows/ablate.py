"""The `ablate` flow: which data recipe trains the better model, in one run. Each arm is
the base prep config with some keys changed; every arm is prepared (sharing the base's
finished stages up to the first one its config changes: dataprep/reuse.py), the same proxy
model is trained on each arm's dataset to the same token budget from several seeds (each
proxy a supervised training job on the train flow's JobBackend, `parallel` at a time), and
the proxies' in-loop evals (training/evals/) are compared: each arm's mean over seeds with
its standard error, and its difference to the base.

    python -m flows.ablate ABLATION_CONFIG        (or `ballast ablate ABLATION_CONFIG`)

The config (YAML):

    base: configs/demo.yaml                 # the base prep config (the arm `base`)
    out: runs/ablate-demo                   # arms/<arm>/{prep,seed-N}, ablation.json/.png
    arms:                                   # arm -> dotted overrides of the prep config
      no_filter: {quality: []}
      near_0.7: {dedup.near.threshold: 0.7}
    proxy:
      config: configs/train-demo.yaml       # the proxy's training config
      tokens: 2000000                       # or steps: N; the same budget for every arm
      seeds: [0, 1]
      overrides: {model.d_model: 64}
    evals: {every: 100, texts: [{name: heldout, path: data/heldout.jsonl}]}
    parallel: 2

A repeated run computes only what is missing: finished prep stages are skipped by their
done markers, a proxy whose run dir has finished its steps starts no job. The results: a
table artifact, a summary with the plot's path, `ablation.json` and `ablation.png` under
`out`, and the CLI's table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from core.dataset import read_manifest, resolve
from dataprep.reuse import Reuse, seed_output
from flows.ablation.config import BASE, load_ablation_config, proxy_dir, write_yaml
from flows.ablation.results import (
    aggregate,
    compared_keys,
    kept_by_source,
    plot,
    proxy_result,
    rows,
    table_text,
)
from flows.errors import register
from flows.prep import prep
from flows.runs import run_name
from flows.train import HANDLE, job_name, job_spec, run_token
from infra.jobs import make_backend
from infra.launch import LaunchConfig
from infra.supervisor import supervise
from infra.tracking import TrackingError, log_run, tracking_on
from training.config import load_train_config, parse_train_config
from training.config.evals import EvalsConfig

register()  # a config error fails the run with its line, no traceback


@task(name="ablation-proxy", task_run_name="proxy-{arm}-seed{seed}", cache_policy=NO_CACHE)
def run_proxy(
    ablation: str, arm: str, seed: int, config_path: str, run_dir: str, launch: LaunchConfig
) -> dict[str, Any]:
    """One proxy: a training job under the supervisor (restarts after a crash or a lost
    node; no recovery after a divergence: a rollback with a lower LR would change the
    recipe under comparison). With `tracking:` in the proxy config, the proxy is an MLflow
    run tagged ballast.ablation/arm/seed."""
    from prefect.runtime import flow_run

    logger = get_run_logger()
    rd = Path(run_dir)
    spec = job_spec(
        config_path,
        launch.backend,
        job_name(run_dir, run_token()),
        [],
        launch.nnodes,
        launch.nproc_per_node,
    )
    backend = make_backend(launch.backend, run_dir=rd, kubernetes=launch.kubernetes)
    policy = dataclasses.replace(launch.policy(), max_recoveries=0)
    outcome = supervise(
        backend,
        spec,
        policy,
        log=logger.info,
        handle_file=rd / HANDLE,
        handle_extra={"flow_run": flow_run.get_id(), "arm": arm, "seed": seed},
    )
    result: dict[str, Any] = {
        "ok": outcome.ok,
        "ending": outcome.ending,
        "message": outcome.message,
    }
    cfg = load_train_config(config_path)
    if tracking_on(cfg):  # one MLflow run per proxy, tagged with its arm and seed
        tags = {
            "ballast.ablation": ablation,
            "ballast.arm": arm,
            "ballast.seed": str(seed),
            "prefect.flow_run_id": str(flow_run.get_id()),
        }
        try:
            result["mlflow"] = log_run(cfg, outcome.ok, outcome.ending, tags)
        except TrackingError as e:
            logger.error(str(e))
            result["mlflow_error"] = str(e)
    return result


def _reuse_record(r: Reuse | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "stages": r.stages,
        "first_redone": r.first_redone,
        "differing": r.differing,
        "files": r.files,
        "bytes": r.bytes,
        "notes": r.notes,
    }


def _report(result: dict[str, Any], output: str) -> dict[str, Any]:
    """The prep's report; a repeated run that found nothing new returns the version's
    report as written (its accounting is still the dataset's)."""
    report = result.get("report") or {}
    if report.get("stages"):
        return report
    store = output_store_for(output)
    versions = sorted(k for k in store.list("_versions/") if k.endswith(".json"))
    if not versions:
        return report
    name = Path(versions[-1]).stem
    return json.loads(store.get(f"{name}/report.json"))


def output_store_for(output: str) -> Any:
    from core.store import open_store

    return open_store(output)


@flow(name="ablate", flow_run_name=run_name)
def ablate(config_path: str) -> dict[str, Any]:
    """Prepare every arm, train its proxies, compare their evals.

    Args:
        config_path: The ablation config (YAML), as the worker sees it.
    """
    log = get_run_logger()
    ab = load_ablation_config(config_path)
    cfg = ab.cfg
    evals = cfg.evals or EvalsConfig.model_validate(ab.proxy["evals"])
    keys = compared_keys(evals)

    # 1. The arms' datasets, the base first: the others start from its finished stages.
    preps: dict[str, dict[str, Any]] = {}
    for arm in ab.arms:
        pc = ab.prep[arm]
        reuse = seed_output(ab.prep[BASE], pc) if arm != BASE else None
        if reuse is not None:
            shared = ", ".join(reuse.stages) or "no stage"
            how = (
                f"{reuse.files} files linked or copied"
                if reuse.files
                else "; ".join(reuse.notes) or "nothing to copy"
            )
            log.info(
                f"arm {arm}: {', '.join(reuse.differing) or 'nothing'} changed; "
                f"shares {shared} with the base ({how})"
            )
        path = write_yaml(
            cfg.arm_dir(arm) / "prep.yaml", pc.model_dump(mode="json", exclude={"version"})
        )
        t0 = time.perf_counter()
        result = prep(str(path))
        preps[arm] = {
            "dataset": result["dataset"],
            "kept": kept_by_source(_report(result, pc.output)),
            "reuse": _reuse_record(reuse),
            "overrides": cfg.arms.get(arm, {}),
            "prep_seconds": round(time.perf_counter() - t0, 2),
        }

    # 2. The proxies: the same token budget on every arm, every seed.
    plan: list[tuple[str, int, Path, int]] = []
    tokens: dict[str, int] = {}
    for arm in ab.arms:
        dataset = preps[arm]["dataset"]
        seq_len = int(read_manifest(resolve(dataset))["seq_len"])
        for seed in cfg.proxy.seeds:
            doc = ab.proxy_doc(arm, seed, dataset, seq_len)
            t = parse_train_config(doc, f"(arm {arm}, seed {seed})")
            tokens[arm] = t.steps * t.micro_batch * t.accum_steps * seq_len
            rd = proxy_dir(cfg, arm, seed)
            path = write_yaml(rd / "train.yaml", doc)
            plan.append((arm, seed, path, t.steps))
    todo = []
    for arm, seed, path, steps in plan:
        done = proxy_result(path.parent, keys)
        if done is not None and done["step"] == steps:
            log.info(f"proxy {arm} seed {seed}: finished earlier; no job")
            continue
        todo.append((arm, seed, path))
    # `parallel` jobs in flight: the next starts as soon as one ends (not in waves that
    # each wait for their slowest proxy).
    endings: dict[str, dict[str, Any]] = {}
    running: dict[Any, str] = {}
    queue = list(todo)
    while queue or running:
        while queue and len(running) < cfg.parallel:
            arm, seed, path = queue.pop(0)
            fut = run_proxy.submit(
                Path(ab.path).stem, arm, seed, str(path), str(path.parent), ab.launch
            )
            running[fut] = f"{arm}/{seed}"
        fut = next(as_completed(list(running)))
        endings[running.pop(fut)] = fut.result()

    # 3. The comparison, from each proxy's own records.
    runs: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in ab.arms}
    for arm, seed, path, _ in plan:
        r = proxy_result(path.parent, keys)
        if r is not None:
            runs[arm][seed] = r
    table = aggregate(runs, keys)
    rws = rows(table, keys, preps, tokens, runs)
    out = cfg.out_dir()
    png = plot(table, keys, out / "ablation.png")
    result = {
        "config": ab.path,
        "keys": keys,
        "arms": preps,
        "tokens": tokens,
        "proxies": {a: {str(s): r for s, r in v.items()} for a, v in runs.items()},
        "jobs": endings,
        "table": {
            a: {k: dataclasses.asdict(c) for k, c in cells.items()} for a, cells in table.items()
        },
        "rows": rws,
        "plot": str(png),
    }
    (out / "ablation.json").write_text(json.dumps(result, indent=2, default=str))
    create_table_artifact(
        key="ablation-results",
        table=rws,
        description=(
            "Each arm's proxies: mean ± standard error over seeds, (difference to the base; "
            "* beyond 2 standard errors)"
        ),
    )
    create_markdown_artifact(
        key="ablation-summary", markdown=summary_md(result), description="The ablation"
    )
    return result


def summary_md(r: dict[str, Any]) -> str:
    lines = ["## Ablation", "", f"- config: `{r['config']}`", f"- plot: `{r['plot']}`", ""]
    for arm, p in r["arms"].items():
        reuse = p.get("reuse")
        shared = (
            f"reused {', '.join(reuse['stages']) or 'no stage'} of the base"
            if reuse
            else "the base"
        )
        lines.append(f"- **{arm}** ({shared}): `{p['dataset']}`")
    lines += ["", *(f"    {line}" for line in table_text(r["rows"], r["keys"]))]
    return "\n".join(lines)


def summary_text(r: dict[str, Any]) -> str:
    lines = table_text(r["rows"], r["keys"])
    lines.append("")
    lines.append(
        "mean ± standard error over seeds (difference to base; * beyond 2 standard errors); "
        "skipped / rollbacks: per seed, the steps its guard dropped (read, not trained on) "
        "and its rollbacks (trained on past the data window)"
    )
    for row, (arm, p) in zip(r["rows"], r["arms"].items(), strict=True):
        shared = p.get("reuse")
        how = f"reused {', '.join(shared['stages']) or 'no stage'} of base; " if shared else ""
        lines.append(f"{arm}: {how}kept {row['kept']}")
    lines.append(f"results: {Path(r['plot']).with_suffix('.json')}; plot: {r['plot']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    a = ap.parse_args()
    print(summary_text(ablate(a.config)))


if __name__ == "__main__":
    main()
