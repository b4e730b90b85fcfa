"""Config parsing: every error names its key path and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import ConfigError, load_config, parse_config

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
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_quality_rule_errors_name_the_rule():
    msg = _err({**GOOD, "quality": ["no_such_rule"]})
    assert "quality" in msg and "no_such_rule" in msg
