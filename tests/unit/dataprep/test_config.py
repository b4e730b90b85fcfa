"""Config parsing: every error names its key path and what was expected."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dataprep.config import ConfigError, load_config, parse_config
from tests.support.helpers import ROOT

GOOD = {
    "output": "runs/x",
    "sources": [{"name": "web", "paths": ["a.jsonl"], "text_field": "text", "weight": 0.7}],
}


def _err(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data, where="t.yaml")
    return str(e.value)


def test_good_config_defaults():
    cfg = parse_config(GOOD)
    assert cfg.dedup.exact and cfg.dedup.near is not None
    assert cfg.dedup.near.threshold == 0.8 and cfg.dedup.near.ngram == 5


def test_unknown_top_level_key_is_named():
    msg = _err({**GOOD, "outptu": "x"})
    assert "outptu: unknown key" in msg


def test_unknown_nested_key_names_the_path():
    bad = {**GOOD, "sources": [{**GOOD["sources"][0], "text_feild": "t"}]}
    assert "sources[0].text_feild: unknown key" in _err(bad)


def test_wrong_type_names_path_and_value():
    msg = _err({**GOOD, "dedup": {"near": {"threshold": "high"}}})
    assert "dedup.near.threshold" in msg and "'high'" in msg


def test_missing_required_key():
    assert "output: required key is missing" in _err({"sources": GOOD["sources"]})


def test_bands_rows_must_fit_num_perm():
    msg = _err({**GOOD, "dedup": {"near": {"bands": 30, "rows": 5}}})
    assert "dedup.near" in msg and "exceeds num_perm" in msg


def test_duplicate_source_names():
    msg = _err({**GOOD, "sources": GOOD["sources"] * 2})
    assert "sources" in msg and "repeated: web" in msg


def test_near_false_disables_near_dedup():
    assert parse_config({**GOOD, "dedup": {"near": False}}).dedup.near is None


def test_yaml_errors_and_relative_paths(tmp_path: Path):
    p = tmp_path / "c.yaml"
    p.write_text("output: o\nsources: [{name: a, paths: [data/*.jsonl]}]\n")
    cfg = load_config(p)
    assert cfg.sources[0].paths == [str(tmp_path / "data" / "*.jsonl")]
    p.write_text("output: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist") as e:
        load_config(tmp_path / "missing.yaml")
    assert "resolved against" not in str(e.value)  # absolute: nothing to add
    # A relative path (a deployment's parameter) names the directory it was looked up in.
    with pytest.raises(
        ConfigError,
        match=rf"configs/missing.yaml does not exist \(resolved "
        rf"against {re.escape(str(Path.cwd()))}\)",
    ):
        load_config("configs/missing.yaml")


def test_quality_rule_errors_name_the_rule():
    msg = _err({**GOOD, "quality": ["no_such_rule"]})
    assert "quality" in msg and "no_such_rule" in msg


# -- the training config: where a run's remote checkpoints go -------------------------------


def _train(**checkpoint: object) -> dict:
    return {"dataset": "ds", "run_dir": "runs/train-demo", "checkpoint": checkpoint}


def _train_err(data: dict) -> str:
    from training.config import TrainConfigError, parse_train_config

    with pytest.raises(TrainConfigError) as e:
        parse_train_config(data, "t.yaml")
    return str(e.value)


def test_remote_checkpoint_uri_is_the_root_plus_the_run_name():
    from training.config import parse_train_config

    cfg = parse_train_config(_train(remote="s3://b/ckpt"))
    assert cfg.run_name() == "train-demo"
    assert cfg.remote_checkpoint_uri() == "s3://b/ckpt/train-demo"
    slash = parse_train_config(_train(remote="s3://b/"))
    assert slash.remote_checkpoint_uri() == "s3://b/train-demo"
    local = parse_train_config(_train(remote="runs/object-store"))
    assert local.remote_checkpoint_uri() == "runs/object-store/train-demo"
    assert parse_train_config(_train()).remote_checkpoint_uri() is None
    # The default name is the run_dir's last part, sanitised; a trailing '/' changes nothing.
    odd = parse_train_config({**_train(remote="s3://b"), "run_dir": "/x/my run:2/"})
    assert odd.run_name() == "my-run-2" and odd.remote_checkpoint_uri() == "s3://b/my-run-2"
    # The demo keeps its location (k8s/base/train.yaml: tests/unit/infra/test_k8s_manifests.py).
    from training.config import load_train_config

    root = ROOT
    demo = load_train_config(root / "configs" / "train-demo.yaml")
    assert demo.remote_checkpoint_uri() == "runs/object-store/train-demo"


def test_remote_checkpoint_uri_with_explicit_run_name_and_placeholder():
    from training.config import parse_train_config

    named = parse_train_config(_train(remote="s3://b/ckpt", run_name="exp.7_b-2"))
    assert named.run_name() == "exp.7_b-2"
    assert named.remote_checkpoint_uri() == "s3://b/ckpt/exp.7_b-2"
    placed = parse_train_config(_train(remote="s3://b/exp-{run}/ckpt"))
    assert placed.remote_checkpoint_uri() == "s3://b/exp-train-demo/ckpt"
    both = parse_train_config(_train(remote="s3://b/exp-{run}/ckpt", run_name="r9"))
    assert both.remote_checkpoint_uri() == "s3://b/exp-r9/ckpt"


@pytest.mark.parametrize("bad", ["", "a/b", "..", "a b", "/abs"])
def test_bad_run_name_names_the_key(bad: str):
    msg = _train_err(_train(remote="s3://b", run_name=bad))
    assert "checkpoint.run_name" in msg and repr(bad) in msg


def test_bad_remote_placeholder_names_the_key():
    msg = _train_err(_train(remote="s3://b/{name}/x"))
    assert "checkpoint.remote" in msg and "{run}" in msg


def test_run_dir_without_a_name_asks_for_run_name():
    msg = _train_err({**_train(remote="s3://b"), "run_dir": "/"})
    assert "run_dir '/'" in msg and "checkpoint.run_name" in msg
    from training.config import parse_train_config

    # Without checkpoint.remote no run name is needed; with an explicit one, any run_dir.
    assert parse_train_config({**_train(), "run_dir": "/"}).remote_checkpoint_uri() is None
    named = parse_train_config({**_train(remote="s3://b", run_name="r"), "run_dir": "/"})
    assert named.remote_checkpoint_uri() == "s3://b/r"


def test_config_fingerprint_covers_what_checkpoints_share():
    from training.config import parse_train_config

    base = _train(remote="s3://b")
    fp = parse_train_config(base).checkpoint_fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    same = [  # nothing a resumed checkpoint must match
        {
            "steps": 5,
            "dataset": "other",
            "run_dir": "elsewhere/x",
            "eval_every": 7,
            "log_every": 3,
            "device": "cpu",
            "seed": 4,
            "micro_batch": 2,
        },
        {"checkpoint": {"every": 3, "keep_last": 1, "remote": "s3://c", "run_name": "r"}},
        {"model": {"compile": True, "activation_checkpointing": True}},
        {"optim": {"lr": 0.5}},
    ]
    for over in same:
        assert parse_train_config({**base, **over}).checkpoint_fingerprint() == fp, over
    differ = [
        {"model": {"d_model": 64}},
        {"model": {"n_layer": 2}},
        {"model": {"mlp": "gelu"}},
        {"optim": {"name": "lion"}},
    ]
    for over in differ:
        assert parse_train_config({**base, **over}).checkpoint_fingerprint() != fp, over
