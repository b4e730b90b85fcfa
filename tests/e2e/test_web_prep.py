"""Prep end to end from web archives: every record accounted in the report and in
dropped/ingest, the URL carried into the kept documents, ids the same for any worker
count, and a bad extraction setting refused in one line naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.helpers import run_cli, shared_file
from tests.unit.dataprep.warc_files import Rec, crawl, page, write_warc


def _rows(out: Path, kind: str, stage: str) -> list[dict]:
    rows: list[dict] = []
    for f in sorted((out / kind / stage).glob("*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


def _crawl_dir(tmp_path: Path) -> Path:
    d = tmp_path / "crawl"
    d.mkdir()
    write_warc(d / "a.warc.gz", crawl())
    more = [Rec(f"https://b.example/{i}", page(f"Page{i}", words=80 + i)) for i in range(6)]
    write_warc(d / "b.warc", more, gzip=False, version="WARC/1.1")
    return d


def _config(data: Path, out: Path, workers: int) -> dict:
    return {
        "output": str(out),
        "workers": workers,
        "sources": [{"name": "web", "paths": [str(data)]}],
        "ingest": {"extract": {"timeout_s": 30}},
        "dedup": {"near": False},
        "quality": ["url"],
        "pack": {"seq_len": 64},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    tmp = tmp_path_factory.mktemp("web")
    data = _crawl_dir(tmp)
    one, two = tmp / "w1", tmp / "w2"
    report = run_prep(parse_config(_config(data, one, 1)), progress=False)
    run_prep(parse_config(_config(data, two, 2)), progress=False)
    return one, two, report


def test_every_record_is_accounted(runs: tuple[Path, Path, dict]) -> None:
    out, _, report = runs
    ingest = report["stages"]["ingest"]["sources"]["web"]
    # a.warc.gz: warcinfo + 8 records; b.warc: warcinfo + 6 pages.
    assert ingest["docs_in"] == 9 + 7
    assert ingest["kept"] == 3 + 6
    assert ingest["dropped"] == {"not_a_page": 3, "not_html": 1, "http_status": 2, "empty_body": 1}
    dropped = _rows(out, "dropped", "ingest")
    assert len(dropped) == 7
    assert all("#offset=" in r["location"] for r in dropped)
    for st in report["stages"].values():
        for s in st["sources"].values():
            assert s["docs_in"] == s["kept"] + sum(s["dropped"].values())


def test_kept_documents_carry_the_url(runs: tuple[Path, Path, dict]) -> None:
    out, _, _ = runs
    docs = _rows(out, "docs", "ingest")
    metas = [json.loads(d["meta"]) for d in docs]
    assert {m["url"] for m in metas} >= {"https://a.example/one", "https://b.example/0"}
    assert all(m["http_status"] == 200 and m["warc_record_id"] for m in metas)


def test_ids_do_not_depend_on_the_worker_count(runs: tuple[Path, Path, dict]) -> None:
    one, two, _ = runs
    for kind, stage in (("docs", "ingest"), ("dropped", "ingest"), ("docs", "quality")):
        a = sorted(r["id"] for r in _rows(one, kind, stage))
        b = sorted(r["id"] for r in _rows(two, kind, stage))
        assert a == b and a, (kind, stage)


def test_bad_extract_setting_is_one_line_naming_the_key(tmp_path: Path) -> None:
    data = _crawl_dir(tmp_path)
    cfg = _config(data, tmp_path / "out", 1)
    cfg["ingest"]["extract"] = {"engine": "readability"}
    p = tmp_path / "prep.yaml"
    p.write_text(json.dumps(cfg))
    r = run_cli("prep", str(p), "--no-progress")
    assert r.returncode != 0
    # The CLI's config errors: the file on one line, then one line per wrong key.
    assert "Traceback" not in r.stderr
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error: invalid config") and len(lines) == 2, r.stderr
    assert lines[1] == (
        "ingest.extract.engine: Input should be 'resiliparse' or 'trafilatura' (got 'readability')"
    )


def test_shared_crawl_end_to_end(tmp_path: Path) -> None:
    warc = shared_file("web_python_docs.warc.gz")
    cfg = _config(warc, tmp_path / "out", 2)
    cfg["pack"] = {"seq_len": 512}
    report = run_prep(parse_config(cfg), progress=False)
    ingest = report["stages"]["ingest"]["sources"]["web"]
    assert ingest["docs_in"] == 324 and ingest["kept"] == 317
    assert ingest["dropped"] == {"not_a_page": 1, "not_html": 4, "http_status": 2}
