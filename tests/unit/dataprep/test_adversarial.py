"""A real prep over the adversarial corpus (tests/support/adversarial.py): it runs to the end, every
quarantine reason the readers have shows up with exactly its expected count, every record
is accounted for, and what reaches the shards is standard JSON. Plus ingest's own
accounting and metadata: the whole size of a quarantined record, a user's `location`
field."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support import adversarial
from tests.support.adversarial import LOCATION_KEY, MAX_DOC_BYTES, REASONS, Expected
from tests.support.helpers import ROOT


def config(data: Path, out: Path) -> dict[str, Any]:
    return {
        "output": str(out),
        "workers": 1,
        "sources": [adversarial.source(data)],
        "ingest": {"max_doc_bytes": MAX_DOC_BYTES, "shard_docs": 8},
        "dedup": {"near": False},
        "quality": [],
        "pack": {"seq_len": 64},
        "dataset": {"validation_fraction": 0.1, "pack_partitions": 2},
    }


def rows(out: Path, kind: str, stage: str) -> list[dict]:
    got: list[dict] = []
    for f in sorted((out / kind / stage).glob("*.parquet")):
        got += pq.read_table(f).to_pylist()
    return got


def strict_json(s: str) -> Any:
    def refuse(token: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {token} in {s[:200]!r}")

    return json.loads(s, parse_constant=refuse)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Expected, Path, dict]:
    data = tmp_path_factory.mktemp("adv")
    expected = adversarial.write_corpus(data)
    out = tmp_path_factory.mktemp("out") / "run"
    # Runs to the end: no reader error, no accounting error, a dataset written.
    report = run_prep(parse_config(config(data, out)), progress=False)
    return expected, out, report


# The web formats' reasons are the web tests' (test_warc.py checks them against its own
# archives); this corpus is text records.
WEB_FORMATS = ("warc.py", "html.py")


def test_the_corpus_covers_every_reason_in_the_readers() -> None:
    src = ROOT / "dataprep"
    files = [
        src / "readers.py",
        *sorted(f for f in (src / "formats").glob("*.py") if f.name not in WEB_FORMATS),
    ]
    code = "\n".join(f.read_text(encoding="utf-8") for f in files)
    in_code = set(re.findall(r'(?:BadRecord|\bbad)\(\s*"([a-z0-9_]+)"', code))
    assert in_code == set(REASONS)


def test_every_reason_with_its_expected_count(run: tuple[Expected, Path, dict]) -> None:
    expected, out, report = run
    ingest = report["stages"]["ingest"]["sources"][adversarial.SOURCE]
    assert ingest["dropped"] == expected.reasons
    quarantined = rows(out, "dropped", "ingest")
    assert dict(sorted(Counter(r["reason"] for r in quarantined).items())) == expected.reasons
    for r in quarantined:
        assert r["location"].startswith(f"{expected.root.name}/"), r
        assert r["detail"], r
        assert r["source"] == adversarial.SOURCE
    # A record too long to keep is shown cut, with a marker, never whole.
    assert all(len(r["text"]) < 70_000 for r in quarantined)


def test_every_record_is_accounted_for(run: tuple[Expected, Path, dict]) -> None:
    expected, out, report = run
    assert report["problems"] == []
    stages = {name: st["sources"][adversarial.SOURCE] for name, st in report["stages"].items()}
    ingest = stages.pop("ingest")
    assert ingest["docs_in"] == expected.records
    assert ingest["kept"] == expected.good
    assert ingest["kept"] + sum(ingest["dropped"].values()) == expected.records
    # The good records are distinct documents: every later stage keeps them all.
    assert set(stages) >= {"exact", "quality"}
    for name, s in stages.items():
        assert (s["docs_in"], s["kept"], s["dropped"]) == (expected.good, expected.good, {}), name
    final = stages[report["final_stage"]]["kept"]
    dropped = sum(sum(s["dropped"].values()) for s in [ingest, *stages.values()])
    assert final + dropped == expected.records
    # The same on disk: the documents of the last document stage, and the quarantine.
    ids = [r["id"] for r in rows(out, "docs", "quality")]
    assert len(ids) == len(set(ids)) == expected.good
    assert len(rows(out, "dropped", "ingest")) == expected.records - expected.good
    assert sorted(p.name for p in (out / "dropped").iterdir()) == ["ingest"]


def test_documents_carry_standard_json_meta(run: tuple[Expected, Path, dict]) -> None:
    expected, out, _ = run
    docs = rows(out, "docs", "ingest")
    metas = {d["id"]: strict_json(d["meta"]) for d in docs}
    assert all(m[LOCATION_KEY].startswith(f"{expected.root.name}/") for m in metas.values())
    assert metas["user-location"]["location"] == "Paris, France"
    assert metas[f"{adversarial.SOURCE}/{expected.root.name}/adv.jsonl:7"]["big"] == 10**30


# --------------------------------------------------------------------------------------
# Ingest accounting and metadata
# --------------------------------------------------------------------------------------


def prep(data: Path, out: Path, until: str, **source: Any) -> dict:
    return run_prep(
        parse_config(
            {
                "output": str(out),
                "workers": 1,
                "sources": [{"name": "s", "paths": [str(data)], **source}],
                "ingest": {"max_doc_bytes": MAX_DOC_BYTES},
                "quality": [],
            }
        ),
        until=until,
        progress=False,
    )


def test_bytes_in_counts_the_whole_quarantined_record(tmp_path: Path) -> None:
    """Not just the first 64 KiB that the quarantine row shows."""
    good = "a few words of text\n"
    parsed = json.dumps({"text": "x" * 300_000}).encode()  # too_large by its text
    unparsed = json.dumps({"text": "y" * 3_000_000}).encode()  # too_large by its line
    deep = b"[" * 200_000  # too_deep
    data = tmp_path / "in.jsonl"
    data.write_bytes(
        b"\n".join([json.dumps({"text": good}).encode(), parsed, unparsed, deep]) + b"\n"
    )
    st = prep(data, tmp_path / "out", "ingest")["stages"]["ingest"]["sources"]["s"]
    assert st["dropped"] == {"too_deep": 1, "too_large": 2}
    assert st["bytes_kept"] == len(good)
    assert st["bytes_dropped"] == len(parsed) + len(unparsed) + len(deep)
    assert st["bytes_in"] == len(good) + len(parsed) + len(unparsed) + len(deep)


def test_bytes_in_of_a_too_large_txt_file_is_its_size(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "big.txt").write_bytes(b"w" * 200_000)
    (tmp_path / "in" / "big.txt.gz").write_bytes(gzip.compress(b"v" * 150_000))
    st = prep(tmp_path / "in", tmp_path / "out", "ingest")["stages"]["ingest"]["sources"]["s"]
    assert st["dropped"] == {"too_large": 2} and st["bytes_in"] == 350_000


def test_a_users_location_field_is_kept(tmp_path: Path) -> None:
    """Ingest's own location goes under its reserved key; dedup reports that one."""
    text = "the same words in two records, so that one is an exact copy\n"
    data = tmp_path / "in.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "text": text, "location": "Paris"},
                {"id": "b", "text": text, "location": {"lat": 48.9, "lon": 2.35}},
                {"id": "c", "text": "other words\n", LOCATION_KEY: "mine"},
            ]
        )
        + "\n"
    )
    out = tmp_path / "out"
    report = prep(data, out, "exact", id_field="id")
    metas = {d["id"]: strict_json(d["meta"]) for d in rows(out, "docs", "ingest")}
    assert metas["a"] == {"id": "a", "location": "Paris", LOCATION_KEY: "in.jsonl:1"}
    assert metas["b"] == {
        "id": "b",
        "location": {"lat": 48.9, "lon": 2.35},
        LOCATION_KEY: "in.jsonl:2",
    }
    (refused,) = rows(out, "dropped", "ingest")
    assert (refused["id"], refused["reason"], refused["location"]) == (
        "c",
        "reserved_field",
        "in.jsonl:3",
    )
    assert LOCATION_KEY in refused["detail"] and refused["text"].endswith('"mine"}')
    (copy,) = rows(out, "dropped", "exact")
    assert (copy["id"], copy["reason"], copy["location"]) == ("b", "exact_dup", "in.jsonl:2")
    assert report["problems"] == []
