"""The `pipeline` flow: data prep, then training on the dataset it produced. The dataset
URI is what passes from one to the other (its manifest is the contract: core/dataset.py).
Both run as subflows, so the Prefect UI shows each with its own tasks and artifacts.

    python -m flows.pipeline PREP_CONFIG TRAIN_CONFIG [--steps N] [--backend local|kubernetes]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from dataprep.arguments import add_output
from flows.prep import prep
from flows.runs import run_name
from flows.train import train
from flows.train_evals import downstream_md, regressions_md
from infra.launch import add_launch_arguments, launch_overrides
from training.arguments import add_train_overrides


@flow(name="pipeline", flow_run_name=run_name)
def pipeline(
    prep_config: str,
    train_config: str,
    output: str | None = None,
    run_dir: str | None = None,
    steps: int | None = None,
    launch: dict[str, Any] | None = None,
    dask_address: str | None = None,
) -> dict[str, Any]:
    """Prep -> train. A re-run skips finished prep shards and resumes training from its
    latest checkpoint.

    Args:
        prep_config: The prep config (YAML), as the worker sees it: absolute, or relative
            to the worker's working directory.
        train_config: The training config (YAML), resolved the same way.
        output: Where prep writes (a directory or s3://...); overrides the prep config's.
        run_dir: Where training keeps checkpoints and metrics; overrides the training
            config's. The same run dir on the next night resumes from its checkpoints.
        steps: Total optimizer steps; overrides the training config's.
        launch: Overrides of the training config's `launch:` section for this run, key by
            key: backend (`local`: torchrun on the worker's machine; `kubernetes`),
            nnodes, nproc_per_node, max_restarts, max_node_losses, max_recoveries,
            recovery_lr_scale, poll_s, kubernetes (namespace, image, gpus_per_node...).
        dask_address: Run prep's steps on the Dask cluster whose scheduler is here
            (tcp://HOST:8786); empty: the environment's DASK_SCHEDULER_ADDRESS if set, else
            the flow run's own task runner.
    """
    logger = get_run_logger()
    prepared = prep(prep_config, output, dask_address=dask_address)
    dataset = prepared["dataset"]
    if dataset is None:
        raise ValueError(f"{prep_config}: prep produced no dataset (is `pack` disabled?)")
    logger.info(f"dataset ready: {dataset}")
    trained = train(train_config, dataset=dataset, run_dir=run_dir, steps=steps, launch=launch)
    create_markdown_artifact(
        key="pipeline-summary",
        markdown=summary_md(prepared, trained),
        description="What this run made: the dataset and the model",
    )
    return {"dataset": dataset, "train": trained}


def summary_md(prepared: dict[str, Any], trained: dict[str, Any]) -> str:
    """The pipeline run in one artifact: the dataset (absolute URI, config fingerprint,
    splits), the training outcome, checkpoints and final loss, and the in-loop evals (the
    latest results, the regressions) when the training config has any."""
    report = prepared.get("report") or {}
    ds = report.get("dataset") or {}
    uri = prepared["dataset"]
    uri = uri if "://" in uri else str(Path(uri).resolve())
    lines = [
        "## Dataset",
        "",
        f"- URI: `{uri}`",
        f"- config fingerprint: `{report.get('config_fingerprint', '?')}`",
    ]
    for split, v in (ds.get("splits") or {}).items():
        lines.append(f"- {split}: {v['rows']:,} rows, {v['real_tokens']:,} real tokens")
    lines += [
        "",
        "## Training",
        "",
        f"- **{trained['ending']}**: {trained['message']}",
        f"- run dir: `{trained['run_dir']}`",
    ]
    if trained.get("val_loss") is not None:
        lines.append(
            f"- final validation loss: **{trained['val_loss']:.4f}** at step {trained['val_step']}"
        )
    if trained.get("checkpoint"):
        ck = trained["checkpoint"]
        lines.append(
            f"- final checkpoint: `{ck if '://' in ck else Path(ck).resolve()}` "
            f"(step {trained['step']})"
        )
    if trained.get("remote"):
        lines.append(f"- object storage: `{trained['remote']}`")
    lines.append("- loss curve: the `train-loss-curve` artifact")
    if trained.get("mlflow"):  # prep and training in one MLflow run (infra/tracking.py)
        m = trained["mlflow"]
        lines.append(
            f"- MLflow: run `{m['run_id']}` (experiment `{m['experiment']}`, `{m['uri']}`)"
        )
    evals = downstream_md(trained.get("downstream"), heading="Latest results")
    if evals:  # the training config's `evals` section: benchmarks scored in the loop
        lines += ["", "## Evals", "", evals]
        regressions = regressions_md(trained.get("eval_regressions"))
        lines += ["", regressions] if regressions else ["", "No eval regressions."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prep_config")
    ap.add_argument("train_config")
    add_output(ap)
    add_train_overrides(ap, ("run_dir", "steps"))
    add_launch_arguments(ap, nproc=False)
    a = ap.parse_args()
    r = pipeline(a.prep_config, a.train_config, a.output, a.run_dir, a.steps, launch_overrides(a))
    print(
        json.dumps(
            {
                "dataset": r["dataset"],
                **{k: r["train"][k] for k in ("ending", "checkpoint", "loss_curve")},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
