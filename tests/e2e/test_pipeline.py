"""End to end through `ballast prep`: a mixed corpus of real web and code documents with
planted duplicates and junk, checked document by document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from core.dataset import verify
from dataprep.config import parse_config
from dataprep.driver import OutputConflict
from dataprep.pipeline import run_prep
from dataprep.readers import IngestError
from dataprep.stages.ingest import plan_units
from tests.support.corpus import make_corpus
from tests.support.factories import prep_config
from tests.support.helpers import ROOT


def dropped(out: Path, stage: str) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for f in sorted((out / "dropped" / stage).glob("*.parquet")):
        for r in pq.read_table(f).to_pylist():
            rows[r["id"]] = r
    return rows


def kept_ids(out: Path, stage: str) -> list[str]:
    ids: list[str] = []
    for f in sorted((out / "docs" / stage).glob("*.parquet")):
        ids += pq.read_table(f, columns=["id"])["id"].to_pylist()
    return ids


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    data = tmp_path_factory.mktemp("corpus")
    return data, make_corpus(data)


@pytest.fixture(scope="module")
def run(corpus: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    data, _ = corpus
    out = tmp_path_factory.mktemp("out") / "run"
    report = run_prep(parse_config(prep_config(data, out)), progress=False)
    return out, report


def test_every_document_is_accounted_for(corpus, run):
    _, planted = corpus
    out, report = run
    n_in = planted["n_web_lines"] + planted["n_code"]
    assert report["stages"]["ingest"]["total"]["docs_in"] == n_in
    final = kept_ids(out, "quality")
    gone = [i for s in ("ingest", "exact", "near", "quality") for i in dropped(out, s)]
    assert len(final) + len(gone) == n_in
    assert len(set(final) | set(gone)) == n_in  # nothing counted twice
    for name, st in report["stages"].items():
        for src, s in st["sources"].items():
            assert s["docs_in"] == s["kept"] + sum(s["dropped"].values()), (name, src)
    assert report["problems"] == []


def test_bad_records_are_quarantined_with_location(corpus, run):
    _, planted = corpus
    out, _ = run
    bad = dropped(out, "ingest")
    by_line = {int(r["location"].rsplit(":", 1)[1]): r for r in bad.values()}
    assert {ln: r["reason"] for ln, r in by_line.items()} == planted["junk"]
    assert all(r["location"].startswith("web.jsonl.gz:") for r in bad.values())


def test_exact_copies_dropped_pointing_at_the_first_copy(corpus, run):
    _, planted = corpus
    out, _ = run
    ex = dropped(out, "exact")
    assert {i: r["detail"] for i, r in ex.items()} == planted["exact"]
    assert all(r["reason"] == "exact_dup" for r in ex.values())


def test_near_copies_dropped_and_distinct_documents_stay(corpus, run):
    _, planted = corpus
    out, _ = run
    near = dropped(out, "near")
    for copy, (orig, j) in planted["near"].items():
        assert j >= 0.8, f"planted copy {copy} is not a near duplicate (J={j:.2f})"
        assert near[copy]["reason"] == "near_dup"
        assert near[copy]["detail"] == orig
    assert set(near) == set(planted["near"])  # no real document was caught
    final = set(kept_ids(out, "quality"))
    for d in planted["distinct"]:
        assert d in final or d in dropped(out, "quality")
        assert d not in near


def test_quality_drops_the_slash_document_and_keeps_code(corpus, run):
    _, planted = corpus
    out, report = run
    q = dropped(out, "quality")
    assert q["slashes"]["reason"].startswith("char_repetition")
    code = report["stages"]["quality"]["sources"]["code"]
    assert code["kept"] == planted["n_code"]


def test_workers_do_not_change_the_output(corpus, run, tmp_path):
    data, _ = corpus
    out1, _ = run
    out2 = tmp_path / "two-workers"
    run_prep(parse_config(prep_config(data, out2, workers=2)), progress=False)
    files1 = sorted(p.relative_to(out1) for p in out1.rglob("*.parquet"))
    files2 = sorted(p.relative_to(out2) for p in out2.rglob("*.parquet"))
    assert files1 == files2
    for f in files1:
        assert (out1 / f).read_bytes() == (out2 / f).read_bytes(), f


def test_missing_input_fails_before_any_work(tmp_path):
    out = tmp_path / "out"
    cfg = parse_config(
        {
            "output": str(out),
            "sources": [{"name": "web", "paths": [str(tmp_path / "nope/*.jsonl")]}],
        }
    )
    with pytest.raises(IngestError, match="web"):
        run_prep(cfg, progress=False)
    assert not out.exists()


def test_other_config_on_same_output_is_refused(corpus, run):
    data, _ = corpus
    out, _ = run
    other = prep_config(data, out)
    other["seed"] = 1
    with pytest.raises(OutputConflict, match="different config"):
        run_prep(parse_config(other), progress=False)


def _cli(cfg_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "prep", str(cfg_path), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_killed_during_near_dedup_resumes_to_identical_output(corpus, tmp_path):
    import yaml

    data, _ = corpus
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    for o in (ref_out, out):
        (tmp_path / f"{o.name}.yaml").write_text(
            yaml.safe_dump(prep_config(data, o, shard_docs=25))
        )
    assert _cli(tmp_path / "ref.yaml", "--no-progress").returncode == 0

    killed = _cli(
        tmp_path / "killed.yaml", "--no-progress", env={"BALLAST_FAILPOINT": "near: signatures:3"}
    )
    assert killed.returncode == -9, killed.stderr
    sigs = sorted((out / "near" / "sig").glob("*.npz"))
    assert len(sigs) == 3 and not (out / "v0001" / "report.json").exists()
    before = {p.name: p.stat().st_mtime_ns for p in sigs}

    resumed = _cli(tmp_path / "killed.yaml", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert {p.name: p.stat().st_mtime_ns for p in sigs} == before  # not recomputed
    ref_files = sorted(p.relative_to(ref_out) for p in ref_out.rglob("*.parquet"))
    assert ref_files == sorted(p.relative_to(out) for p in out.rglob("*.parquet"))
    for f in ref_files:
        assert (ref_out / f).read_bytes() == (out / f).read_bytes(), f
    ref_ds = sorted(p.relative_to(ref_out) for p in (ref_out / "dataset").rglob("*"))
    assert ref_ds == sorted(p.relative_to(out) for p in (out / "dataset").rglob("*"))
    for f in ref_ds:
        if (ref_out / f).is_file():
            assert (ref_out / f).read_bytes() == (out / f).read_bytes(), f

    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if not k.endswith("_seconds") and k != "dataset"}

    assert strip(json.loads((out / "v0001" / "report.json").read_text())) == strip(
        json.loads((ref_out / "v0001" / "report.json").read_text())
    )


def test_cli_reports_config_errors_with_exit_1(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("output: x\nsources: [{name: a, paths: [a.jsonl], text_feild: t}]\n")
    r = _cli(p)
    assert r.returncode == 1
    assert "sources[0].text_feild: unknown key" in r.stderr


def test_s3_input_and_output(corpus, tmp_path, s3_bucket, s3_client, moto_endpoint, monkeypatch):
    """Sources under s3:// and the output under s3:// through the object-storage
    interface, against a real S3-protocol server on loopback."""
    data, planted = corpus
    s3_client.upload_file(str(data / "web" / "web.jsonl.gz"), s3_bucket, "in/web/web.jsonl.gz")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    cfg = prep_config(data, tmp_path, shard_docs=100)
    cfg["output"] = f"s3://{s3_bucket}/out/run1"
    cfg["sources"][0]["paths"] = [f"s3://{s3_bucket}/in/web/*.jsonl.gz"]
    parsed = parse_config(cfg)
    s3_files = [f for u in plan_units(parsed) if u.source == "web" for f in u.files]
    assert [f.size for f in s3_files] == [(data / "web" / "web.jsonl.gz").stat().st_size]
    report = run_prep(parsed, progress=False)
    assert report["stages"]["ingest"]["sources"]["web"]["docs_in"] == planted["n_web_lines"]
    keys = [
        o["Key"]
        for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="out/run1/")["Contents"]
    ]
    assert "out/run1/v0001/report.json" in keys
    assert any(k.startswith("out/run1/dropped/near/") for k in keys)
    # The dataset went to S3 through the store, and verifies there against its manifest.
    assert "out/run1/dataset/v0001/manifest.json" in keys
    ds = f"s3://{s3_bucket}/out/run1/dataset/v0001"
    assert verify(ds) == []
    s3_client.put_object(Bucket=s3_bucket, Key="out/run1/dataset/v0001/tokenizer.json", Body=b"{}")
    assert any("tokenizer.json" in p for p in verify(ds))


def test_output_of_an_older_file_layout_is_refused(corpus, run, tmp_path):
    """Intermediate files change shape between versions (per-shard duplicate lists, say):
    resuming an output half-made by an older ballast could keep duplicates silently, so
    it is refused with a message that says why."""
    import shutil

    data, _ = corpus
    out, _ = run
    old = tmp_path / "old"
    shutil.copytree(out, old)
    run_json = json.loads((old / "_run.json").read_text())
    del run_json["layout"]  # what ballast wrote before layouts were versioned
    (old / "_run.json").write_text(json.dumps(run_json))
    with pytest.raises(OutputConflict, match="file layout 1"):
        run_prep(parse_config(prep_config(data, old)), progress=False)
