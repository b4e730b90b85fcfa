"""The training config's device mesh against the launch (infra/mesh.py): what fits, what is
refused with the keys named, what is only warned about; and the train flow's use of it
before anything is submitted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.errors import ConfigError
from infra.launch import parse_launch
from infra.mesh import MESH_ENV, check_fit, fit_launch, mesh_name, pp_warnings
from training.config.parallel import MeshShape, ParallelConfig


def mesh(**degrees: int) -> ParallelConfig:
    return ParallelConfig(**degrees)  # type: ignore[arg-type]


def refusal(parallel: Any, nnodes: int, nproc: int) -> str:
    with pytest.raises(ConfigError) as err:
        fit_launch(parallel, nnodes, nproc)
    message = str(err.value)
    assert "\n" not in message  # one line: the flow's error and a terminal show it whole
    return message


# --- what fits ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parallel", "nnodes", "nproc", "expected"),
    [
        ("ddp", 1, 1, MeshShape(1, 1, 1)),
        ("ddp", 2, 8, MeshShape(16, 1, 1)),
        ("fsdp2", 2, 8, MeshShape(1, 16, 1)),
        (mesh(tp=4), 2, 8, MeshShape(1, 4, 4)),
        (mesh(tp=8, dp_replicate=2, dp_shard=1), 2, 8, MeshShape(2, 1, 8)),
        (mesh(dp_replicate=-1, dp_shard=8), 4, 8, MeshShape(4, 8, 1)),
        (mesh(tp=2), 1, 2, MeshShape(1, 1, 2)),
        (mesh(pp=2, tp=4), 2, 8, MeshShape(1, 2, 4, pp=2)),
        (mesh(pp=4, tp=2, dp_replicate=-1, dp_shard=1), 2, 8, MeshShape(2, 1, 2, pp=4)),
    ],
)
def test_meshes_that_fit(parallel: Any, nnodes: int, nproc: int, expected: MeshShape) -> None:
    fit = fit_launch(parallel, nnodes, nproc)
    assert fit.shape == expected
    assert fit.warnings == ()
    assert fit.shape.world_size == nnodes * nproc


def test_mesh_name_is_a_label_value() -> None:
    assert mesh_name(MeshShape(dp_replicate=1, dp_shard=2, tp=4, pp=2)) == "pp2-dp1x2-tp4"
    assert fit_launch("ddp", 2, 8).name == "pp1-dp16x1-tp1"
    assert MESH_ENV == "BALLAST_MESH"


# --- refused: TP across nodes, sizes that do not multiply out ------------------------------------


@pytest.mark.parametrize(
    ("parallel", "nnodes", "nproc", "prefix"),
    [
        (mesh(tp=3), 1, 8, "launch.nproc_per_node 8 is not a multiple of parallel.tp 3"),
        # 2 x 8 = 16 = tp: the sizes multiply out, but every TP group would span both nodes.
        (
            mesh(tp=16, dp_shard=1),
            2,
            8,
            "launch.nproc_per_node 8 is not a multiple of parallel.tp 16",
        ),
    ],
    ids=["tp-3-in-8-gpus", "tp-16-across-2-nodes-although-the-world-fits"],
)
def test_tp_must_divide_the_gpus_of_a_node(
    parallel: Any, nnodes: int, nproc: int, prefix: str
) -> None:
    message = refusal(parallel, nnodes, nproc)
    assert message.startswith(prefix)
    assert "within one node" in message


@pytest.mark.parametrize(
    ("parallel", "nnodes", "nproc", "expected"),
    [
        (
            mesh(dp_shard=2, tp=4),
            1,
            16,
            "parallel.pp 1 x parallel.tp 4 x parallel.dp_replicate 1 x parallel.dp_shard 2 = 8 "
            "processes, but launch.nnodes 1 x launch.nproc_per_node 16 = 16; make them equal, "
            "or set parallel.dp_shard: -1",
        ),
        (
            mesh(dp_replicate=3, tp=2),
            1,
            8,
            "launch.nnodes 1 x launch.nproc_per_node 8 = 8 processes is not a multiple of "
            "parallel.pp 1 x parallel.tp 2 x parallel.dp_replicate 3 = 6, so parallel.dp_shard "
            "-1 has no whole value",
        ),
    ],
    ids=["fixed-degrees", "a-fill-degree-without-a-whole-value"],
)
def test_degrees_must_multiply_to_nodes_times_processes(
    parallel: Any, nnodes: int, nproc: int, expected: str
) -> None:
    assert refusal(parallel, nnodes, nproc) == expected


def test_check_fit_refuses_a_shape_of_another_size() -> None:
    with pytest.raises(ConfigError, match=r"= 16 processes, but launch.nnodes 1 x "):
        check_fit(MeshShape(dp_replicate=1, dp_shard=2, tp=4, pp=2), 1, 8)
    with pytest.raises(ConfigError, match=r"not a multiple of parallel\.tp 4"):
        check_fit(MeshShape(dp_replicate=1, dp_shard=3, tp=4, pp=1), 2, 6)


# --- pipeline stages and nodes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "nnodes", "nproc"),
    [
        # pp divides nnodes: each stage is whole nodes (here one node, or two).
        (MeshShape(dp_replicate=1, dp_shard=2, tp=4, pp=2), 2, 8),
        (MeshShape(dp_replicate=2, dp_shard=2, tp=4, pp=2), 4, 8),
        # nnodes divides pp: each node holds whole stages.
        (MeshShape(dp_replicate=1, dp_shard=1, tp=4, pp=4), 2, 8),
        (MeshShape(dp_replicate=1, dp_shard=1, tp=2, pp=8), 2, 8),
        # One node: every stage is within it.
        (MeshShape(dp_replicate=1, dp_shard=1, tp=2, pp=3), 1, 6),
        # No pipeline: nothing to line up.
        (MeshShape(dp_replicate=3, dp_shard=1, tp=8), 3, 8),
    ],
)
def test_stages_that_line_up_with_nodes(shape: MeshShape, nnodes: int, nproc: int) -> None:
    assert check_fit(shape, nnodes, nproc) == ()


@pytest.mark.parametrize(
    ("shape", "nnodes", "nproc", "stage"),
    [
        # 3 nodes x 8, pp 2: stage 0 is node 0 and half of node 1.
        (MeshShape(dp_replicate=1, dp_shard=3, tp=4, pp=2), 3, 8, 12),
        # 2 nodes x 6, pp 3: stage 1 is the last 2 GPUs of node 0 and the first 2 of node 1.
        (MeshShape(dp_replicate=1, dp_shard=2, tp=2, pp=3), 2, 6, 4),
    ],
)
def test_stages_that_straddle_nodes_are_warned_about(
    shape: MeshShape, nnodes: int, nproc: int, stage: int
) -> None:
    (warning,) = check_fit(shape, nnodes, nproc)
    assert warning.startswith(
        f"parallel.pp {shape.pp} and launch.nnodes {nnodes} divide neither way, so a pipeline "
        f"stage's {stage} processes (dp x tp) straddle the {nproc}-GPU nodes"
    )
    assert "\n" not in warning


def _straddles(nnodes: int, gpus: int, pp: int) -> bool:
    """Some stage has ranks on two nodes and shares one of them with another stage. Stage s
    holds ranks [s*S, (s+1)*S), node n ranks [n*G, (n+1)*G): torchrun numbers a node's
    processes consecutively, and pp is the outermost mesh dimension."""
    stage = nnodes * gpus // pp
    for s in range(pp):
        ranks = set(range(s * stage, (s + 1) * stage))
        nodes = {r // gpus for r in ranks}
        if len(nodes) > 1 and any(set(range(n * gpus, (n + 1) * gpus)) - ranks for n in nodes):
            return True
    return False


def test_the_rule_is_exactly_no_stage_straddling_a_node() -> None:
    """pp | nnodes or nnodes | pp, checked against the rank layout itself."""
    for nnodes in range(1, 9):
        for gpus in (1, 2, 4, 6, 8):
            world = nnodes * gpus
            for pp in (p for p in range(1, world + 1) if world % p == 0):
                shape = MeshShape(dp_replicate=1, dp_shard=world // pp, tp=1, pp=pp)
                warned = bool(pp_warnings(shape, nnodes, gpus))
                assert warned == _straddles(nnodes, gpus, pp), (nnodes, gpus, pp)


def test_the_pp_rules_through_the_config() -> None:
    assert fit_launch(mesh(pp=2, tp=4, dp_shard=-1), 2, 8).shape == MeshShape(1, 2, 4, 2)
    assert fit_launch(mesh(pp=2, tp=4, dp_shard=-1), 3, 8).warnings
    assert "parallel.pp 2 x parallel.tp 4 x parallel.dp_replicate 1 x parallel.dp_shard 1" in (
        refusal(mesh(pp=2, tp=4, dp_shard=1), 2, 8)
    )


# --- the train flow ------------------------------------------------------------------------------


def test_launch_keys_name_the_mesh_rules() -> None:
    """The generated config docs (docs/config.md) say where the mesh's degrees go."""
    from infra.launch import LaunchConfig

    fields = LaunchConfig.model_fields
    assert "parallel.tp" in (fields["nproc_per_node"].description or "")
    assert "parallel.pp" in (fields["nnodes"].description or "")


class _Reached(Exception):
    """The flow asked for its backend: the mesh check let the config through."""


def _no_backend(*args: Any, **kwargs: Any) -> Any:
    raise _Reached


def _flow_config(tmp_path: Path, parallel: Any, launch: dict[str, Any]) -> Path:
    cfg = {
        "dataset": str(tmp_path / "dataset"),
        "run_dir": str(tmp_path / "run"),
        "model": {"d_model": 64, "n_layer": 2, "n_head": 4},
        "parallel": parallel,
        "tracking": {"enabled": False},
        "launch": launch,
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_train_flow_refuses_a_mesh_before_submitting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flows.train as flow

    monkeypatch.setattr(flow, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(flow, "_backend", _no_backend)
    path = _flow_config(tmp_path, {"tp": 4}, {"nproc_per_node": 2})
    with pytest.raises(ConfigError, match=r"^launch.nproc_per_node 2 is not a multiple of "):
        flow.train.fn(str(path))
    # A flow run's launch overrides count: the same config at 4 processes per node passes
    # the check (and reaches the backend).
    with pytest.raises(_Reached):
        flow.train.fn(str(path), launch={"nproc_per_node": 4})


def test_the_train_flow_puts_the_mesh_in_the_jobs_environment(tmp_path: Path) -> None:
    from flows.train import CONFIG_ENV, job_spec

    path = _flow_config(tmp_path, "ddp", {"nproc_per_node": 2})
    spec = job_spec(str(path), "kubernetes", "run-1", [], 2, 8, "pp1-dp16x1-tp1")
    assert spec.env[MESH_ENV] == "pp1-dp16x1-tp1"
    assert CONFIG_ENV in spec.env
    assert job_spec(str(path), "local", "run-1", [], 1, 2, "pp1-dp2x1-tp1").env == {
        MESH_ENV: "pp1-dp2x1-tp1"
    }
    assert job_spec(str(path), "local", "run-1", []).env == {}


def test_the_3d_example_validates_and_fits_its_launch() -> None:
    """configs/train-3d.yaml: 2 nodes x 8 GPUs, pp 2 across them, tp 4 within, dp_shard 2;
    the trainer's parser takes it (the model splits over the mesh) and the flow's check
    passes it without a warning."""
    from tests.support.helpers import ROOT
    from training.config import parse_train_config

    data = yaml.safe_load((ROOT / "configs" / "train-3d.yaml").read_text())
    cfg = parse_train_config(data, "configs/train-3d.yaml")
    launch = parse_launch(data["launch"], where="configs/train-3d.yaml")
    fit = fit_launch(cfg.parallel, launch.nnodes, launch.nproc_per_node)
    assert fit.shape == MeshShape(dp_replicate=1, dp_shard=2, tp=4, pp=2)
    assert fit.warnings == ()
    assert (launch.backend, launch.nnodes, launch.nproc_per_node) == ("kubernetes", 2, 8)
