"""Pipeline parallelism composed with tensor parallelism (pp=2 x tp=2, gpipe: the mesh's pp
and tp dimensions, TP inside each stage) on 4 processes under torchrun on CPU (gloo): the
single-process run's losses and weights (test_pipeline_parallel.py has the check)."""

from __future__ import annotations

import pytest

from tests.e2e.test_pipeline_parallel import PP_MODEL, check_pipeline_matches_one_process


@pytest.mark.slow
def test_pp2_tp2_matches_one_process(dataset, tmp_path):
    mesh = {"pp": 2, "tp": 2, "pp_schedule": "gpipe"}
    check_pipeline_matches_one_process(dataset, tmp_path, 4, mesh, PP_MODEL)
