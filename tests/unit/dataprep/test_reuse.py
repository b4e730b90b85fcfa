"""Sharing finished stages between two prep outputs (dataprep/reuse.py): which stages two
configs share, and that an output seeded with them ends byte for byte where a run from
scratch ends, without redoing the shared work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from dataprep.reuse import differing_keys, reusable_stages, seed_output
from tests.support.corpus import make_corpus
from tests.support.factories import merge, prep_config


def _cfg(data: Path, out: Path, **over: object):
    return parse_config(merge(prep_config(data, out), **over))


def test_which_stages_two_configs_share(tmp_path: Path) -> None:
    base = _cfg(tmp_path, tmp_path / "a")
    # Only the quality rules differ: ingest and both dedup stages are shared.
    r = reusable_stages(base, _cfg(tmp_path, tmp_path / "b", quality=["char_repetition"]))
    assert r.stages == ["ingest", "exact", "near"] and r.first_redone == "quality"
    assert r.differing == ["quality"]
    # The mixture is read after tokenize: everything before it is shared.
    r = reusable_stages(base, _cfg(tmp_path, tmp_path / "b", mixture={"alpha": 0.3}))
    assert r.stages == ["ingest", "exact", "near", "quality", "tokenize"]
    assert r.first_redone is None
    # The near threshold: ingest and exact only.
    r = reusable_stages(base, _cfg(tmp_path, tmp_path / "b", dedup={"near": {"threshold": 0.7}}))
    assert r.stages == ["ingest", "exact"] and r.first_redone == "near"
    # A source changes: nothing.
    other = prep_config(tmp_path, tmp_path / "b")
    other["sources"][0]["text_field"] = "body"
    r = reusable_stages(base, parse_config(other))
    assert r.stages == [] and r.differing == ["sources"]
    # The output and the worker count are not part of any stage's input.
    assert differing_keys(base, _cfg(tmp_path, tmp_path / "c", workers=2)) == []


@pytest.mark.slow
def test_a_seeded_output_ends_as_one_made_from_scratch(tmp_path: Path) -> None:
    data = tmp_path / "data"
    make_corpus(data)
    base = _cfg(data, tmp_path / "base")
    run_prep(base, progress=False)
    arm_over = {"quality": ["char_repetition"]}
    arm = _cfg(data, tmp_path / "arm", **arm_over)
    reuse = seed_output(base, arm)
    assert reuse.stages == ["ingest", "exact", "near"] and reuse.files > 0 and reuse.linked
    run_prep(arm, progress=False)
    scratch = _cfg(data, tmp_path / "scratch", **arm_over)
    run_prep(scratch, progress=False)

    def files(root: Path, sub: str) -> dict[str, bytes]:
        return {
            str(p.relative_to(root / sub)): p.read_bytes()
            for p in sorted((root / sub).rglob("*"))
            if p.is_file()
        }

    # The dataset: the same bytes as the run that computed every stage itself.
    a, s = files(tmp_path / "arm", "dataset"), files(tmp_path / "scratch", "dataset")
    assert a.keys() == s.keys() and a == s
    # The shared stages were not redone: their files are still the base's (hard links,
    # the same inodes; a step that ran again would have replaced them, writes are atomic).
    for stage in ("ingest", "exact", "near"):
        shared = sorted((tmp_path / "arm" / "docs" / stage).glob("*.parquet"))
        assert shared
        for p in shared:
            b = tmp_path / "base" / "docs" / stage / p.name
            assert os.stat(p).st_ino == os.stat(b).st_ino
    # Quality was computed for this arm: its own files, not the base's.
    for p in (tmp_path / "arm" / "docs" / "quality").glob("*.parquet"):
        b = tmp_path / "base" / "docs" / "quality" / p.name
        assert os.stat(p).st_ino != os.stat(b).st_ino
    # Seeding again (a repeated ablation) copies nothing over the arm's own work.
    again = seed_output(base, arm)
    assert again.files == 0 and again.notes
