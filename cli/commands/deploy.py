"""`ballast deploy`: the Prefect deployments (the pipeline on a schedule, prep only, train
only) registered on a work pool (flows/deployments.py), and how to start its worker."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from core.protocol import EXIT_OK
from dataprep.arguments import add_output
from training.arguments import add_train_overrides


def add_parser(subparsers: Any) -> None:
    from infra.jobs import POOLS
    from infra.k8s_manifests import IMAGE

    p = subparsers.add_parser(
        "deploy",
        help="register the Prefect deployments (pipeline on "
        "a schedule, prep only, train only) on a work "
        "pool",
    )
    p.add_argument("--prep-config", default="configs/demo.yaml")
    p.add_argument("--train-config", default="configs/train-demo.yaml")
    p.add_argument("--pool-type", choices=list(POOLS), default="process")
    p.add_argument("--pool", help=f"work pool name (default {' / '.join(POOLS.values())})")
    p.add_argument("--cron", default="0 3 * * *", help="pipeline schedule ('' for none)")
    add_output(p)
    add_train_overrides(p, ("run_dir", "steps"))
    p.add_argument("--image", default=IMAGE, help="image for the kubernetes pool")
    p.add_argument(
        "--dask",
        metavar="ADDRESS",
        help="prep (prep-only and the pipeline) runs on this Dask cluster",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flows.deployments import deploy_all
    from infra.jobs import POOLS

    ids = deploy_all(
        args.prep_config,
        args.train_config,
        pool_type=args.pool_type,
        pool=args.pool,
        cron=args.cron or None,
        output=args.output,
        run_dir=args.run_dir,
        steps=args.steps,
        image=args.image,
        dask_address=args.dask,
    )
    out = Console()
    for name, dep_id in ids.items():
        out.print(f"deployment {name}: {dep_id}", markup=False)
    pool = args.pool or POOLS[args.pool_type]
    out.print(f"start a worker: prefect worker start --pool {pool}", markup=False)
    return EXIT_OK
