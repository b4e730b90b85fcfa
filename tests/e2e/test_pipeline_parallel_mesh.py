"""Pipeline parallelism composed with FSDP2 (pp=2 x dp_shard=2: fully_shard on each stage)
on 4 processes under torchrun on CPU (gloo): the single-process run's losses and weights
(test_pipeline_parallel.py has the check and the pp=2 cases, test_pipeline_parallel_tp.py
pp with TP)."""

from __future__ import annotations

import pytest

from tests.e2e.test_pipeline_parallel import PP_MODEL, check_pipeline_matches_one_process


@pytest.mark.slow
def test_pp2_dp2_matches_one_process(dataset, tmp_path):
    check_pipeline_matches_one_process(dataset, tmp_path, 4, {"pp": 2, "dp_shard": 2}, PP_MODEL)
