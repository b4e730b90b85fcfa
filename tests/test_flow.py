"""The `prep` flow against a real temporary Prefect API: same output as the CLI path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.config import parse_config
from tasks.pipeline import run_prep
from tests.test_pipeline import config, make_corpus


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    # One harness per session: it costs ~15 s to start.
    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_prep_flow_matches_cli_output(prefect_api, tmp_path: Path):
    from prefect.artifacts import Artifact

    from flows.prep import prep

    data = tmp_path / "data"
    planted = make_corpus(data)
    cfg = config(data, tmp_path / "flow-out", shard_docs=60)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))

    result = prep(str(cfg_path))
    assert result["output"] == str(tmp_path / "flow-out")
    report = result["report"]
    assert report["problems"] == []
    assert report["stages"]["ingest"]["total"]["docs_in"] == (
        planted["n_web_lines"] + planted["n_code"])

    ref = tmp_path / "cli-out"
    run_prep(parse_config({**cfg, "output": str(ref)}), progress=False)
    out = tmp_path / "flow-out"
    files = sorted(p.relative_to(ref) for p in ref.rglob("*.parquet"))
    assert files == sorted(p.relative_to(out) for p in out.rglob("*.parquet"))
    for f in files:
        assert (ref / f).read_bytes() == (out / f).read_bytes(), f

    art = Artifact.get("prep-accounting")
    assert art is not None and "near" in str(art.data) and "exact" in str(art.data)

    # A second run of the flow finds every shard done and changes nothing.
    before = {f: (out / f).stat().st_mtime_ns for f in files}
    again = prep(str(cfg_path))
    assert again["report"]["stages"] == report["stages"]
    assert {f: (out / f).stat().st_mtime_ns for f in files} == before
