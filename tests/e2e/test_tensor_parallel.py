"""Tensor parallelism (composed with FSDP2 on one device mesh) under torchrun on CPU
(gloo): the same data and seed give the single-process run's losses and weights, and a
checkpoint written at tp=2 resumes in one process (DCP reshards it). The 4-process meshes
are in test_tensor_parallel_mesh.py, resharding, guards and export in
test_tensor_parallel_resume.py: separate files so that `pytest -n 2 --dist loadfile`
spreads them over both workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.parity import (
    assert_matches_one_process,
    one_process,
    run,
    write_config,
)

# Two small models that between them turn on every model option TP has a plan for.
MODELS = {
    # RoPE, QK-norm, SwiGLU, RMSNorm, tied embeddings (the defaults, plus QK-norm).
    "rope": {"d_model": 32, "n_layer": 2, "n_head": 4, "qk_norm": True},
    # Learned positions, GELU, LayerNorm with biases, a parallel block, an untied head, muP.
    "learned": {
        "d_model": 32,
        "n_layer": 2,
        "n_head": 4,
        "position": "learned",
        "mlp": "gelu",
        "norm": "layernorm",
        "bias": True,
        "parallel_block": True,
        "tie_embeddings": False,
        "mup_base_d_model": 16,
    },
    # Stochastic depth (its per-sample masks come from the RNG every TP rank shares),
    # activation checkpointing, partial rotary.
    "depth": {
        "d_model": 32,
        "n_layer": 2,
        "n_head": 4,
        "drop_path": 0.2,
        "activation_checkpointing": True,
        "rotary_pct": 0.5,
    },
}
TP2, DP2TP2 = (2, {"tp": 2}), (4, {"dp_shard": 2, "tp": 2})
# HSDP: fully_shard on a 2-D (dp_replicate, dp_shard) mesh, with and without TP.
REP2TP2, REP2DP2 = (4, {"dp_replicate": 2, "tp": 2}), (4, {"dp_replicate": 2, "dp_shard": 2})


def check_matches_one_process(
    dataset: str, tmp_path: Path, model: str, nproc: int, mesh: dict
) -> None:
    """The mesh run against the single-process run on the same data and seed."""
    tp = write_config(tmp_path, "tp", dataset, model=MODELS[model], parallel=mesh)
    one = one_process(write_config(tmp_path, "one", dataset, model=MODELS[model]))
    line = assert_matches_one_process(one, run(nproc, tp), tp, nproc // mesh.get("tp", 1))
    print(f"\n{model} {mesh}: {line}")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["rope", "learned", "depth"], ids=lambda m: f"tp2-{m}")
def test_matches_one_process(dataset, tmp_path, model):
    check_matches_one_process(dataset, tmp_path, model, *TP2)
