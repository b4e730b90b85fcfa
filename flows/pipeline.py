"""The `pipeline` flow: data prep, then training on the dataset it produced. The dataset
URI is what passes from one to the other (ARCHITECTURE.md: the manifest is the contract).
Both run as subflows, so the Prefect UI shows each with its own tasks and artifacts.

    python -m flows.pipeline PREP_CONFIG TRAIN_CONFIG [--steps N] [--backend local|kubernetes]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from prefect import flow, get_run_logger

from flows.prep import prep
from flows.train import train


@flow(name="pipeline")
def pipeline(prep_config: str, train_config: str, output: str | None = None,
             run_dir: str | None = None, steps: int | None = None, backend: str = "local",
             nproc_per_node: int = 1, max_restarts: int = 3, poll_s: float = 5.0,
             kube: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prep -> train. A re-run skips finished prep shards and resumes training from its
    latest checkpoint."""
    logger = get_run_logger()
    prepared = prep(prep_config, output)
    dataset = prepared["dataset"]
    if dataset is None:
        raise ValueError(f"{prep_config}: prep produced no dataset (is `pack` disabled?)")
    logger.info(f"dataset ready: {dataset}")
    trained = train(train_config, dataset=dataset, run_dir=run_dir, steps=steps,
                    backend=backend, nproc_per_node=nproc_per_node,
                    max_restarts=max_restarts, poll_s=poll_s, kube=kube)
    return {"dataset": dataset, "train": trained}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prep_config")
    ap.add_argument("train_config")
    ap.add_argument("--output")
    ap.add_argument("--run-dir")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--backend", default="local", choices=["local", "kubernetes"])
    a = ap.parse_args()
    r = pipeline(a.prep_config, a.train_config, a.output, a.run_dir, a.steps, a.backend)
    print(json.dumps({"dataset": r["dataset"], **{k: r["train"][k] for k in
                                                  ("ending", "checkpoint", "loss_curve")}},
                     indent=2))


if __name__ == "__main__":
    main()
