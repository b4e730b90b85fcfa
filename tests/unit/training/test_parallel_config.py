"""The `parallel` setting (training/config/parallel.py): the old names and the mesh mapping,
its checks against the model and the world size, and the data-parallel coordinates a rank
shards data by (training/distributed.py); the pipeline's split of the blocks
(training/pipeline.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from training.config import ModelConfig, TrainConfigError, parse_train_config
from training.config.parallel import MeshShape, ParallelSizeError, check_seq_len, resolve
from training.distributed import World, dp_rank_and_size, rank_slice
from training.model import GPT
from training.parallel import check_model
from training.pipeline import rank_stages, stage_layers


def config(parallel: Any, **over: Any) -> Any:
    model = {"d_model": 32, "n_layer": 2, "n_head": 4}
    return parse_train_config({"dataset": "d", "parallel": parallel, "model": model, **over})


def error(parallel: Any, **over: Any) -> str:
    with pytest.raises(TrainConfigError) as e:
        config(parallel, **over)
    return str(e.value)


def test_old_names_keep_their_meaning():
    assert config("ddp").parallel == "ddp"  # the value is still the string
    assert resolve("ddp", 4) == MeshShape(dp_replicate=4, dp_shard=1, tp=1)
    assert resolve("ddp", 4).mode == "ddp"
    assert resolve("fsdp2", 4) == MeshShape(dp_replicate=1, dp_shard=4, tp=1)
    assert resolve("fsdp2", 4).mode == "fsdp2"
    assert resolve("ddp", 1).mode == resolve("fsdp2", 1).mode == "single"


def test_mapping_fills_the_data_parallel_degree():
    p = config({"tp": 2}).parallel
    assert resolve(p, 8) == MeshShape(dp_replicate=1, dp_shard=4, tp=2)
    assert resolve(p, 8).mode == "mesh"
    assert resolve(p, 2) == MeshShape(dp_replicate=1, dp_shard=1, tp=2)
    # A mapping that is plain FSDP2 or DDP runs the same code as the old names.
    assert resolve(config({"dp_shard": -1}).parallel, 2).mode == "fsdp2"
    assert resolve(config({"dp_replicate": -1, "dp_shard": 1}).parallel, 2).mode == "ddp"


def test_world_size_mismatch_names_the_degrees():
    p = config({"dp_shard": 2, "tp": 2}).parallel
    with pytest.raises(ParallelSizeError, match=r"dp_shard 2 x tp 2 x pp 1 = 4 ranks.*is 2"):
        resolve(p, 2)
    with pytest.raises(ParallelSizeError, match="not a multiple of 2"):
        resolve(config({"tp": 2}).parallel, 3)


def test_mapping_errors_name_the_key():
    assert "parallel.tpp: unknown key; did you mean `tp`?" in error({"tpp": 2})
    assert "parallel.tp: Input should be greater than or equal to 1" in error({"tp": 0})
    assert "parallel: Input should be 'ddp' or 'fsdp2'" in error("fsdp")
    assert "dp_shard must be >= 1, or -1" in error({"dp_shard": 0})
    assert "only one of dp_replicate and dp_shard can be -1" in error(
        {"dp_shard": -1, "dp_replicate": -1}
    )


def test_model_must_split_evenly():
    assert "parallel.tp 8 does not divide model.n_head 4" in error({"tp": 8})
    assert "parallel.tp 3 does not divide model.n_head 4" in error({"tp": 3})
    config({"tp": 4})  # 4 heads of 8 dims over 4 ranks: fine


# Refused under TP and under PP alike: (the key the error names, the config's override).
UNSUPPORTED_SPLIT = [
    ("ema", {"ema": {}}),
    ("stats_every", {"stats_every": 5}),
    ("init_from", {"init_from": "x"}),
    ("optim.agc", {"optim": {"agc": 0.1}}),
    ("optim.name muon", {"optim": {"name": "muon"}}),
]


@pytest.mark.parametrize(
    ("key", "over"),
    [
        *UNSUPPORTED_SPLIT,
        ("model.dropout", {"model": {"d_model": 32, "n_head": 4, "dropout": 0.1}}),
    ],
)
def test_unsupported_options_are_refused_under_tp(key, over):
    assert key in error({"tp": 2}, **over)
    config("ddp", **over)  # the same option without TP is fine


def test_mlp_hidden_and_sequence_must_split_evenly():
    gpt = GPT(ModelConfig(d_model=40, n_head=4, mlp="gelu", mlp_ratio=1.35), 64, 16)
    with pytest.raises(ParallelSizeError, match="does not divide the MLP's hidden size 54"):
        check_model(gpt, MeshShape(1, 1, 4))
    check_model(gpt, MeshShape(1, 1, 2))
    with pytest.raises(ParallelSizeError, match="does not divide the dataset's seq_len 63"):
        check_seq_len(MeshShape(1, 1, 2), 63)


def four_ranks(**degrees: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Each of 4 ranks' data-parallel (rank, size) and its slice of 8 indices."""
    worlds = [World(rank=r, size=4, **degrees) for r in range(4)]
    idx = np.arange(8)
    return [dp_rank_and_size(w) for w in worlds], [rank_slice(idx, w).tolist() for w in worlds]


def test_ranks_of_a_tp_group_read_the_same_data():
    idx = np.arange(8)
    # 4 ranks as (dp 2) x (tp 2): ranks 0, 1 are one TP group, 2, 3 the other.
    coords, slices = four_ranks(tp=2)
    assert coords == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert slices == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    # Without TP the data-parallel rank is the rank.
    assert dp_rank_and_size(World(rank=3, size=4)) == (3, 4)
    assert rank_slice(idx, World(rank=3, size=4)).tolist() == [6, 7]


UNTIED = {"d_model": 32, "n_layer": 4, "n_head": 4, "tie_embeddings": False}


def pp_error(parallel: Any, **over: Any) -> str:
    return error({"pp": 2, **parallel}, **{"model": UNTIED, **over})


def test_pipeline_must_split_the_layers_and_the_pieces():
    config({"pp": 2, "pp_schedule": "interleaved_1f1b"}, model=UNTIED)  # 4 stages of 1 block
    assert "parallel.pp 8 does not divide model.n_layer 4" in error({"pp": 8}, model=UNTIED)
    six = {**UNTIED, "n_layer": 6}
    assert (
        "parallel.pp 2 x 2 virtual stages (pp_schedule interleaved_1f1b) does not divide "
        "model.n_layer 6"
    ) in error({"pp": 2, "pp_schedule": "interleaved_1f1b"}, model=six)
    assert "pp_microbatches 1 is fewer than pp 2; pp_schedule 1f1b" in pp_error(
        {"pp_microbatches": 1}
    )
    config({"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 1}, model=UNTIED)
    assert "pp_microbatches 5 is not a multiple of the schedule's rounds (2" in pp_error(
        {"pp_microbatches": 5, "pp_schedule": "interleaved_1f1b"}
    )


def test_tied_embeddings_are_refused_across_stages():
    tied = {**UNTIED, "tie_embeddings": True}
    assert "model.tie_embeddings is not supported with parallel.pp > 1" in error(
        {"pp": 2}, model=tied
    )


@pytest.mark.parametrize(
    ("key", "over"),
    [
        *UNSUPPORTED_SPLIT,
        ("model.compile", {"model": {**UNTIED, "compile": True}}),
        ("precision.dtype fp16", {"precision": {"dtype": "fp16"}}),
    ],
)
def test_unsupported_options_are_refused_under_pp(key, over):
    assert key in pp_error({}, **over)
    config("ddp", **{"model": UNTIED, **over})  # the same option without PP is fine


def test_pipeline_degree_is_part_of_the_world_size():
    p = config({"pp": 2}, model=UNTIED).parallel
    assert resolve(p, 4) == MeshShape(dp_replicate=1, dp_shard=2, tp=1, pp=2)
    assert resolve(p, 2).mode == "mesh"
    with pytest.raises(ParallelSizeError, match=r"dp_shard 1 x tp 2 x pp 2 = 4 ranks.*is 2"):
        resolve(config({"pp": 2, "tp": 2, "dp_shard": 1}, model=UNTIED).parallel, 2)


def test_stages_of_a_pipeline_read_the_same_data():
    # 4 ranks as (pp 2) x (dp 2), pp outermost: ranks 0, 1 are stage 0, ranks 2, 3 stage 1.
    coords, slices = four_ranks(pp=2)
    assert coords == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert slices == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    # (pp 2) x (tp 2): one data-parallel rank, every rank reads the whole micro-batch.
    assert {dp_rank_and_size(World(rank=r, size=4, tp=2, pp=2)) for r in range(4)} == {(0, 1)}


def test_blocks_split_evenly_and_interleaved_stages_loop():
    assert stage_layers(4, 2) == [[0, 1], [2, 3]]
    assert stage_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Interleaved: 2 virtual stages per rank, rank r runs stages r and r + pp.
    assert rank_stages(0, 2, 2) == [0, 2]
    assert rank_stages(1, 2, 2) == [1, 3]
    assert rank_stages(1, 4, 1) == [1]
