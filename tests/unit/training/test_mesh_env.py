"""The trainer against the mesh its job was launched for (BALLAST_MESH, which the launcher
writes: infra/mesh.py): the same mesh starts, another one is refused in one line naming
both, no variable means no check."""

from __future__ import annotations

import pytest

import infra.mesh
from training.config import ModelConfig
from training.config.parallel import MESH_ENV, MeshShape, ParallelConfig, ParallelSizeError, resolve
from training.model import GPT
from training.parallel import check_mesh_env, check_model

SHAPES = [
    MeshShape(dp_replicate=1, dp_shard=1, tp=1),
    MeshShape(dp_replicate=1, dp_shard=1, tp=2),
    MeshShape(dp_replicate=1, dp_shard=2, tp=1, pp=2),
    MeshShape(dp_replicate=2, dp_shard=2, tp=4, pp=2),
    MeshShape(dp_replicate=16, dp_shard=1, tp=1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=infra.mesh.mesh_name)
def test_the_launched_mesh_starts(shape: MeshShape) -> None:
    # What the launcher writes (infra/mesh.py, the train flow) is what the trainer accepts.
    check_mesh_env(shape, {MESH_ENV: infra.mesh.mesh_name(shape)})


@pytest.mark.parametrize("env", [{}, {MESH_ENV: ""}, {"OTHER": "pp9-dp1x1-tp1"}])
def test_no_launched_mesh_is_no_check(env: dict[str, str]) -> None:
    check_mesh_env(MeshShape(dp_replicate=1, dp_shard=2, tp=2), env)


def test_another_mesh_is_refused_in_one_line_naming_both() -> None:
    # The config says tp 2 on 2 ranks; the job was submitted for a 2-stage pipeline.
    shape = resolve(ParallelConfig(tp=2), 2)
    with pytest.raises(ParallelSizeError) as e:
        check_mesh_env(shape, {MESH_ENV: "pp2-dp1x1-tp1"})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("BALLAST_MESH is pp2-dp1x1-tp1 (the mesh the launcher resolved)")
    assert "parallel: builds pp1-dp1x1-tp2 on 2 ranks" in msg


def test_check_model_checks_the_launched_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_model is what both the mesh path (parallelize) and the pipeline path
    (training/pipeline.py build_pipeline) call after resolving the shape."""
    model = GPT(ModelConfig(d_model=32, n_layer=2, n_head=4), vocab_size=64, max_seq_len=16)
    shape = MeshShape(dp_replicate=1, dp_shard=1, tp=2)
    monkeypatch.setenv(MESH_ENV, "pp1-dp1x1-tp2")
    check_model(model, shape)
    monkeypatch.setenv(MESH_ENV, "pp1-dp2x1-tp1")
    with pytest.raises(ParallelSizeError, match="BALLAST_MESH is pp1-dp2x1-tp1"):
        check_model(model, shape)
