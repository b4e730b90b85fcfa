"""Multi-process training under torchrun on CPU (gloo): the same global batch gives the
same loss curve at world size 2 as at world size 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_train import cfg, dataset  # noqa: F401  (the module-scoped dataset fixture)
from training.metrics import read

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, config: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "training.train", "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


@pytest.mark.slow
def test_ddp_two_processes_match_one(dataset, tmp_path):  # noqa: F811
    runs = {}
    for n in (1, 2):
        run_dir = tmp_path / f"world{n}"
        c = cfg(dataset, run_dir, steps=20, micro_batch=4, accum_steps=2, eval_every=10,
                checkpoint={"every": 10})
        p = tmp_path / f"w{n}.yaml"
        p.write_text(yaml.safe_dump(c))
        r = torchrun(n, p)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[n] = run_dir
    a, b = losses(runs[1]), losses(runs[2])
    assert len(a) == len(b) == 20
    # Same samples, token-weighted across ranks: only the floating-point summation order
    # differs (gloo all-reduce vs one batch), so the curves agree to ~1e-5; stated
    # tolerance 1e-3 over 20 steps.
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3, (a, b)
    assert a[-1] < a[0]
    va = [r["val_loss"] for r in read(runs[1] / "metrics.jsonl") if r.get("kind") == "eval"]
    vb = [r["val_loss"] for r in read(runs[2] / "metrics.jsonl") if r.get("kind") == "eval"]
    assert max(abs(x - y) for x, y in zip(va, vb, strict=True)) < 1e-3


def entrypoint(config: Path, *extra: str, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "training.entrypoint", "--nproc-per-node", "1",
           "--max-restarts", str(restarts), "--", "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_entrypoint_passes_worker_exit_codes_through(dataset, tmp_path):  # noqa: F811
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump(cfg(dataset, tmp_path / "ok", steps=4)))
    assert entrypoint(ok).returncode == 0

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**cfg(dataset, tmp_path / "bad"), "stpes": 3}))
    r = entrypoint(bad, restarts=1)
    assert r.returncode == 1, r.stderr[-2000:]  # torchrun alone would say 1 for anything

    div = tmp_path / "div.yaml"
    div.write_text(yaml.safe_dump(cfg(dataset, tmp_path / "div", steps=120,
                                      guards={"warmup_steps": 10, "max_rollbacks": 0},
                                      checkpoint={"every": 10})))
    r = entrypoint(div, "--fault", "lr_blowup_persistent@30-200", restarts=1)
    assert r.returncode == 3, r.stderr[-2000:]
    assert (tmp_path / "div" / "DIVERGED").is_file()  # the restart did not train on
    assert "diverged beyond its rollback budget" in r.stderr
