"""Tensor parallelism with data parallelism on 4-process meshes (dp_shard x tp, HSDP)
under torchrun on CPU (gloo): the single-process run's losses and weights
(test_tensor_parallel.py has the check and the tp=2 cases)."""

from __future__ import annotations

import pytest

from tests.e2e.test_tensor_parallel import (
    DP2TP2,
    REP2DP2,
    REP2TP2,
    check_matches_one_process,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "nproc", "mesh"),
    [
        ("rope", *DP2TP2),
        ("learned", *DP2TP2),
        ("rope", *REP2TP2),
        ("learned", *REP2DP2),
        # (No "depth" at dp 2: each data-parallel rank draws its rows' stochastic-depth
        # masks from the same RNG state, so they are not one process's; DDP is the same.)
    ],
    ids=["dp2tp2-rope", "dp2tp2-learned", "rep2tp2-rope", "rep2dp2-learned"],
)
def test_matches_one_process(dataset, tmp_path, model, nproc, mesh):
    check_matches_one_process(dataset, tmp_path, model, nproc, mesh)
