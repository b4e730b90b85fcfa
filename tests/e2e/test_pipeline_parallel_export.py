"""Pipeline parallelism under torchrun on CPU (gloo): `ballast export hf` reads a pp=2
checkpoint, and what pipelining cannot run is refused in one line (test_pipeline_parallel.py
has the model and the parity check)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from tests.e2e.test_pipeline_parallel import PP_MODEL
from tests.support.helpers import ROOT
from tests.support.parity import final_params, run, write_config
from training.config import parse_train_config


@pytest.mark.slow
def test_exports_from_a_pp_checkpoint(dataset, tmp_path):
    """`ballast export hf` reads a pp=2 checkpoint (each stage wrote its own blocks; DCP
    gathers them into whole tensors) and writes the weights a one-process read gives."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from training.export_hf import export_hf, hf_state_dict

    p = write_config(tmp_path, "pp", dataset, steps=2, model=PP_MODEL, parallel={"pp": 2})
    run_dir = run(2, p)
    out, _arch = export_hf(run_dir, tmp_path / "hf")
    exported = load_file(str(out / "model.safetensors"))
    cfg = parse_train_config(yaml.safe_load(p.read_text()))
    params = final_params(run_dir, 2, yaml.safe_load(p.read_text()))
    assert any(k.startswith("blocks.3.") for k in params)  # the last stage's blocks
    want = hf_state_dict(cfg.model, params)
    assert want and set(want) == set(exported)
    for k in want:
        assert torch.equal(exported[k], want[k].contiguous()), k


@pytest.mark.slow
def test_options_pipelining_cannot_run_are_one_line(dataset, tmp_path):
    """Checked when the config is read, before any process group: one process says it."""
    p = write_config(tmp_path, "bad", dataset, parallel={"pp": 2}, steps=2)  # tied embeddings
    cmd = [sys.executable, "-m", "training.train", "--config", str(p)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "model.tie_embeddings is not supported with parallel.pp > 1" in r.stderr
