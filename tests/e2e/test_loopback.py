"""A single-node training run listens on loopback only (issue 27, defect 4): `torchrun
--standalone` bound its rendezvous stores to every interface (`*:PORT`)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import yaml

from tests.support.factories import TINY
from tests.support.helpers import ROOT


def listeners(root: int) -> set[tuple[str, int]]:
    """The listening TCP sockets of process `root` and its descendants."""
    try:
        proc = psutil.Process(root)
        pids = {root} | {c.pid for c in proc.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    }


def test_two_local_ranks_listen_on_loopback_only(train_dataset, tmp_path):
    config = tmp_path / "t.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "dataset": train_dataset,
                "run_dir": str(tmp_path / "run"),
                "steps": 30,
                "micro_batch": 4,
                "eval_every": 1000,
                "eval_batches": 1,
                "model": TINY,
                "checkpoint": {"every": 1000},
                "schedule": {"warmup_steps": 2},
            }
        )
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "training.entrypoint",
            "--nproc-per-node",
            "2",
            "--",
            "--config",
            str(config),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: set[tuple[str, int]] = set()
    while proc.poll() is None:
        seen |= listeners(proc.pid)
        time.sleep(0.1)
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 0, out[-3000:]
    assert seen, "no listening socket was seen while the run trained"
    assert {ip for ip, _ in seen} == {"127.0.0.1"}, seen
    assert (tmp_path / "run" / "final.json").is_file()
