"""configs/ablate-demo.yaml, the config docs/tools.md runs, loads as the `ablate` flow reads
it: its arms share what the docs say they share with the base."""

from __future__ import annotations

import pytest

from dataprep.reuse import reusable_stages
from flows.ablation.config import BASE, load_ablation_config
from tests.support.helpers import ROOT, shared_file


def test_ablate_demo_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    shared_file("web_openwebtext_1k.jsonl")  # the demo's base prep reads the shared corpora
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository
    ab = load_ablation_config("configs/ablate-demo.yaml")
    assert ab.arms == [BASE, "no_filter", "near_0.7"]
    assert ab.prep["no_filter"].quality == []
    assert reusable_stages(ab.prep[BASE], ab.prep["no_filter"]).stages == [
        "ingest",
        "exact",
        "near",
    ]
    assert reusable_stages(ab.prep[BASE], ab.prep["near_0.7"]).stages == ["ingest", "exact"]
    assert ab.proxy["model"]["d_model"] == 64
