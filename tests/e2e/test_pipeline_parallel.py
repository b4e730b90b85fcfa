"""Pipeline parallelism (torch.distributed.pipelining) under torchrun on CPU (gloo): at
pp=2, each schedule gives the single-process run's losses, gradient norms, validation
losses and weights on the same data and seed. The 4-process meshes are in
test_pipeline_parallel_mesh.py (with FSDP2) and test_pipeline_parallel_tp.py (with TP);
resharding in test_pipeline_parallel_resume.py, the guards in
test_pipeline_parallel_guards.py, export and refusals in test_pipeline_parallel_export.py:
separate files so that `pytest -n 2 --dist loadfile` spreads them over both workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.parity import (
    assert_matches_one_process,
    one_process,
    run,
    write_config,
)

# Untied embeddings (the first stage holds wte, the last the head); 4 blocks, so that
# interleaved 1F1B has 2 virtual stages of one block on each of 2 ranks.
PP_MODEL: dict[str, Any] = {"d_model": 32, "n_layer": 4, "n_head": 4, "tie_embeddings": False}
# Learned positions, GELU, LayerNorm with biases, a parallel block, QK-norm, muP, activation
# checkpointing (inside the stages: the schedule's backward recomputes them).
PP_LEARNED: dict[str, Any] = {
    **PP_MODEL,
    "position": "learned",
    "mlp": "gelu",
    "norm": "layernorm",
    "bias": True,
    "parallel_block": True,
    "qk_norm": True,
    "mup_base_d_model": 16,
    "activation_checkpointing": True,
}
# The loss terms the last stage computes besides cross-entropy.
LOSS_TERMS: dict[str, Any] = {"precision": {"z_loss": 1e-3}, "label_smoothing": 0.1}


def check_pipeline_matches_one_process(
    dataset: str,
    tmp_path: Path,
    nproc: int,
    mesh: dict[str, Any],
    model: dict[str, Any],
    **over: Any,
) -> None:
    """The pipeline run against the single-process run on the same data and seed (20
    steps, micro_batch 4, accum_steps 2, an eval and a checkpoint every 10; `over`: more
    config). Validation runs through the pipeline (forward only); the run record's world
    size is the data-parallel size: the stages share the batch."""
    pp = write_config(tmp_path, "pp", dataset, model=model, parallel=mesh, **over)
    one = one_process(write_config(tmp_path, "one", dataset, model=model, **over))
    dp = nproc // (mesh["pp"] * mesh.get("tp", 1))
    print(f"\n{mesh}: {assert_matches_one_process(one, run(nproc, pp), pp, dp)}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "model"),
    [("1f1b", PP_MODEL), ("gpipe", PP_LEARNED), ("interleaved_1f1b", PP_MODEL)],
    ids=["pp2-1f1b", "pp2-gpipe-learned", "pp2-interleaved"],
)
def test_matches_one_process(dataset, tmp_path, schedule, model):
    over = LOSS_TERMS if model is PP_LEARNED else {}
    check_pipeline_matches_one_process(
        dataset, tmp_path, 2, {"pp": 2, "pp_schedule": schedule}, model, **over
    )
