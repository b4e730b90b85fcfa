"""The step's host reads under tensor and pipeline parallelism (torchrun, 2 processes, CPU
with gloo): every rank reads back from the device as often per optimizer step as the
one-process trainer (tests/unit/training/test_host_sync.py), once, besides torch's
optimizer's step counters. Each rank counts its own main thread's reads
(tests/support/host_sync_rank.py), so a read that one rank alone makes (the last pipeline
stage's loss) shows too.

The gloo collectives are not counted: they run in C++ (and on CUDA, NCCL's run on a stream
without a host read). What the pipeline schedule reads on its first call only (the stages
exchange their shapes as pickled objects, `recv_object_list`) is torch's, in warm-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_pipeline_parallel import PP_MODEL
from tests.e2e.test_tensor_parallel import MODELS
from tests.support.helpers import ROOT
from tests.support.host_sync import BUDGET
from tests.support.parity import write_config

MESHES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tp2": (MODELS["rope"], {"tp": 2}),
    "pp2": (PP_MODEL, {"pp": 2}),
}
WARMUP, STEPS = 2, 4


def rank_reads(dataset: str, tmp_path: Path, mesh: str, *extra: str) -> list[dict[str, Any]]:
    """Each rank's record of WARMUP + STEPS steps (accum_steps 2, micro_batch 4, no eval or
    checkpoint among them) of the `mesh` run."""
    model, parallel = MESHES[mesh]
    over = {"eval_every": 1000, "checkpoint": {"every": 1000}}
    config = write_config(tmp_path, mesh, dataset, model=model, parallel=parallel, **over)
    out = tmp_path / f"{mesh}-reads"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "tests.support.host_sync_rank", str(config), str(out)]
    cmd += ["--warmup", str(WARMUP), "--steps", str(STEPS), *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def ours(step: dict[str, Any]) -> int:
    """The step's reads besides torch's optimizer's."""
    return sum(n for method, n in step["reads"].items() if not method.startswith("optim."))


def in_training(step: dict[str, Any]) -> dict[str, int]:
    """The step's reads that training/ code makes itself, by site."""
    return {s: n for s, n in step["sites"].items() if s.split(" @ ")[1].startswith("training/")}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_every_rank_reads_once_per_step(dataset, tmp_path, mesh):
    """After warm-up every rank makes the one-process budget of reads per step: the step's
    one transfer (training/step.py's tolist), on every rank, the same steps taken; in the
    warm-up too, training/ makes no other read (what more the pipeline's first step reads
    is torch's shape exchange)."""
    for rank in rank_reads(dataset, tmp_path, mesh):
        steps = rank["steps"]
        measured = steps[rank["warmup"] :]
        assert [ours(s) for s in measured] == [BUDGET] * STEPS, (rank["rank"], measured)
        for s in steps:
            [(site, n)] = in_training(s).items()
            assert (n, site.split(":")[0]) == (BUDGET, "tolist @ training/step.py"), s["sites"]
        assert [s["action"] for s in steps] == ["ok"] * (WARMUP + STEPS)


@pytest.mark.slow
def test_a_read_in_the_last_stage_loss_would_show(dataset, tmp_path):
    """The count can fail, and per rank: a loss read back on the host (a hook the pipeline's
    loss function calls, as step.py's does) adds a read per piece (pp_microbatches 2 per
    micro-batch, accum_steps 2) on the last stage only."""
    first, last = rank_reads(dataset, tmp_path, "pp2", "--read-loss")
    assert [ours(s) for s in first["steps"][WARMUP:]] == [BUDGET] * STEPS
    assert [ours(s) for s in last["steps"][WARMUP:]] == [BUDGET + 2 * 2] * STEPS
