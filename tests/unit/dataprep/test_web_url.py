"""The page URL goes wherever a web document goes: a `url` rule drops a blocked domain's
pages with its reason; exact and near duplicates across pages (and files) are dropped with
rows that name the dropped page's URL; the kept pages' provenance and the documents blame
describes name theirs. A real prep of two small warcio-written WARC files."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from core.dataset import read_manifest, resolve
from core.provenance import Provenance
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.unit.dataprep.warc_files import Rec, page, write_warc
from training.blame import documents_of

ORIGINALS = [f"https://a.example/p{i}" for i in range(4)]
EXACT = "https://mirror.example/copy-of-p1"
NEAR = "https://mirror.example/near-p2"
SPAM = "https://spam.example/x"


def _near_copy() -> bytes:
    """p2 with one word changed in its second paragraph."""
    return page("Topic2", words=120).replace(
        b"again, with more to say", b"again, with little more to say"
    )


def _rows(out: Path, kind: str, stage: str) -> list[dict]:
    rows: list[dict] = []
    for f in sorted((out / kind / stage).glob("*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


def url_of(location: str) -> str:
    return location.partition(" url=")[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    tmp = tmp_path_factory.mktemp("weburl")
    data = tmp / "crawl"
    data.mkdir()
    write_warc(
        data / "a.warc.gz", [Rec(u, page(f"Topic{i}", 120)) for i, u in enumerate(ORIGINALS)]
    )
    copies = [
        Rec(EXACT, page("Topic1", 120)),
        Rec(NEAR, _near_copy()),
        Rec(SPAM, page("Spam", 120)),
    ]
    write_warc(data / "b.warc", copies, gzip=False)
    (tmp / "blocked.txt").write_text("spam.example\n")
    cfg = {
        "output": str(tmp / "out"),
        "workers": 1,
        "sources": [{"name": "web", "paths": [str(data)]}],
        "ingest": {"extract": {"timeout_s": None}},
        "dedup": {"exact": True, "near": {"threshold": 0.7}},
        "quality": [{"url": {"blocklist": str(tmp / "blocked.txt")}}],
        "pack": {"seq_len": 64},
        "dataset": {"validation_fraction": 0.0},
    }
    report = run_prep(parse_config(cfg), progress=False)
    return tmp / "out", data, report


def test_url_rule_drops_the_blocked_domain_naming_it(run: tuple[Path, Path, dict]) -> None:
    out, _, report = run
    (row,) = _rows(out, "dropped", "quality")
    assert row["reason"] == "url:blocklist"
    assert "domain 'spam.example' is blocked" in row["detail"]
    assert url_of(row["location"]) == SPAM
    assert row["location"].startswith("crawl/b.warc#offset=")
    assert report["stages"]["quality"]["sources"]["web"]["dropped"] == {"url:blocklist": 1}


def test_duplicates_are_dropped_naming_their_url(run: tuple[Path, Path, dict]) -> None:
    out, _, _ = run
    kept = {r["id"]: url_of(r["location"]) for r in _provenance(out)[2]}
    (exact,) = _rows(out, "dropped", "exact")
    assert exact["reason"] == "exact_dup" and url_of(exact["location"]) == EXACT
    assert kept[exact["detail"]] == ORIGINALS[1]  # the copy that stays is p1
    (near,) = _rows(out, "dropped", "near")
    assert near["reason"] == "near_dup" and url_of(near["location"]) == NEAR
    assert kept[near["detail"]] == ORIGINALS[2]
    # Ids stay the record's offset alone.
    assert exact["id"] == "web/" + exact["location"].partition(" ")[0]


def _provenance(out: Path) -> tuple[Provenance, dict, list[dict]]:
    """The dataset's provenance, its manifest, and every kept document's entry."""
    root = Path(resolve(str(out / "dataset")))
    manifest = read_manifest(str(root))
    prov = Provenance(root, manifest)
    return prov, manifest, [prov.document(i).to_json() for i in range(prov.n_docs)]


def test_provenance_and_blame_name_the_page_url(run: tuple[Path, Path, dict]) -> None:
    out, data, _ = run
    prov, manifest, docs = _provenance(out)
    assert sorted(url_of(d["location"]) for d in docs) == ORIGINALS
    # What blame prints for a training step's rows (and the guard puts in its events):
    # the input's full path, the record's offset, its URL.
    rows = list(range(prov.rows("train")))
    described = documents_of(prov, rows, limit=100, inputs=manifest["inputs"])
    paths = {d["path"] for d in described["documents"]}
    assert {url_of(x) for x in paths} == set(ORIGINALS)
    assert all(x.startswith(f"{data / 'a.warc.gz'}#offset=") for x in paths), paths
