"""The pod entrypoint: runs the trainer under torchrun and passes the workers' exit code
through. torchrun exits 1 whatever code its workers exited with, and Kubernetes'
podFailurePolicy and the supervisor must tell "diverged" (3) and "bad config or data"
(1) from a crash. So every worker writes its exit code to a file; this script reads them.

    python -m training.entrypoint [--nproc-per-node N] [--max-restarts R] [torchrun args] \
        -- --config X

Exit codes: 0 done, 1 bad config or data, 3 diverged beyond the rollback budget,
2 crashed or killed (anything torchrun reports without a worker code).

One process on one node with no restarts (`--nproc-per-node 1 --max-restarts 0` and no
other torchrun argument; a local run, a one-GPU pod) needs nothing torchrun gives: the
worker is this script's child, with SIGTERM and SIGINT forwarded as torchrun forwards them,
and its exit code read the same way. That spares the torchrun agent, a torch import and
about four seconds of every start.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from core.files import run_forwarding_signals
from core.protocol import EXIT_CRASHED
from training.console import EVENTS_ENV

EXIT_DIR_ENV = "BALLAST_EXIT_DIR"


def record_exit(code: int) -> None:
    """Called by each worker on its way out (training.train.main)."""
    d = os.environ.get(EXIT_DIR_ENV)
    if d:
        rank = os.environ.get("RANK", "0")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        Path(d, f"rank-{rank}.restart-{restart}.exit").write_text(str(code))


def worker_codes(exit_dir: Path) -> list[int]:
    """Codes of the last attempt (torchelastic restarts count up)."""
    files = list(exit_dir.glob("rank-*.restart-*.exit"))
    if not files:
        return []
    last = max(int(f.name.split(".restart-")[1].split(".")[0]) for f in files)
    return [int(f.read_text()) for f in files if f".restart-{last}." in f.name]


def decide(torchrun_code: int, codes: list[int]) -> int:
    """Diverged wins over bad input, bad input over a crash: a divergence on one rank
    brings the others down with it."""
    if torchrun_code == 0:
        return 0
    if 3 in codes:
        return 3
    if 1 in codes:
        return 1
    return EXIT_CRASHED


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m training.entrypoint [torchrun args] -- --config X", file=sys.stderr)
        return 1
    cut = argv.index("--")
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--nproc-per-node", default="1")
    ap.add_argument("--max-restarts", default="0")
    known, passthrough = ap.parse_known_args(argv[:cut])
    worker = ["-m", "training.train", *argv[cut + 1 :]]
    # One process, no restarts: the worker is this script's child (see the top).
    alone = (known.nproc_per_node, known.max_restarts, passthrough) == ("1", "0", [])
    with tempfile.TemporaryDirectory(prefix="ballast-exit-") as exit_dir:
        # Events on stderr beside the human lines: the supervisor (local backend,
        # Kubernetes) reads them from the job's log (training/console.py).
        env = {**os.environ, EXIT_DIR_ENV: exit_dir, EVENTS_ENV: "stderr"}
        if alone:
            launcher, code = "trainer", run_forwarding_signals([sys.executable, *worker], env)
        else:
            cmd = torchrun(known, passthrough, worker)
            launcher, code = "torchrun", subprocess.run(cmd, env=env).returncode
        result = decide(code, worker_codes(Path(exit_dir)))
    print(f"entrypoint: {launcher} exited {code}; passing on exit code {result}", file=sys.stderr)
    return result


def torchrun(known: argparse.Namespace, passthrough: list[str], worker: list[str]) -> list[str]:
    """The torchrun command line for `worker` (on one node: the loopback rendezvous)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={known.nproc_per_node}",
        f"--max-restarts={known.max_restarts}",
        *passthrough,
    ]
    if not any(a.startswith(("--rdzv", "--nnodes", "--standalone")) for a in passthrough):
        # One node: torchrun with its rendezvous on loopback, not --standalone's
        # stores on every interface.
        from training.loopback_run import rendezvous_args

        cmd[1:3] = ["-m", "training.loopback_run"]
        cmd[3:3] = rendezvous_args()
    return cmd + worker


if __name__ == "__main__":
    sys.exit(main())
