"""Versions 2 and 3 of an output dedup their new documents against the dedup index
(dataprep/dedup_index.py) and write exactly the files that re-reading every earlier
version's hashes writes (BALLAST_DEDUP_INDEX=0, the old path), reading a small part of
the history's hashes."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from core.store import open_store
from dataprep import dedup_index
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.inputs import words

HISTORY = 3000


def cfg(data: Path, out: Path) -> dict[str, Any]:
    return {
        "output": str(out),
        "workers": 1,
        "seed": 1,
        "sources": [{"name": "web", "paths": [str(data)], "id_field": "id"}],
        "ingest": {"shard_docs": 400},
        "quality": [],
        "pack": {"seq_len": 64, "strategy": "bfd", "window": 100},
        "dataset": {"validation_fraction": 0.05, "train_shards": 1, "pack_partitions": 1},
    }


def write_rows(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def history(rng: random.Random) -> list[dict[str, str]]:
    rows = [{"id": f"h{i}", "text": words(rng, 40)} for i in range(HISTORY)]
    for i in range(0, HISTORY - 2, 97):  # copies and near copies inside the history too
        rows[i + 1]["text"] = rows[i]["text"]
        rows[i + 2]["text"] = near_copy(rows[i]["text"])
    return rows


def near_copy(text: str) -> str:
    return " ".join([*text.split()[:-1], "zzzzzz"])


def increment(rng: random.Random, old: list[dict[str, str]], tag: str) -> list[dict[str, str]]:
    """New documents, copies of earlier ones (spread over the history's shards), and
    copies among themselves."""
    rows = [{"id": f"{tag}-new{i}", "text": words(rng, 40)} for i in range(20)]
    rows += [
        {"id": f"{tag}-copy{i}", "text": old[rng.randrange(len(old))]["text"]} for i in range(8)
    ]
    rows += [
        {"id": f"{tag}-near{i}", "text": near_copy(old[rng.randrange(len(old))]["text"])}
        for i in range(6)
    ]
    rows += [{"id": f"{tag}-again{i}", "text": rows[i]["text"]} for i in range(3)]
    rows += [{"id": f"{tag}-copy-again", "text": rows[21]["text"]}]
    rng.shuffle(rows)
    return rows


def digests(out: Path) -> dict[str, str]:
    """Every file of an output but the run's records (timestamps, timings, the index)."""
    skip = ("_index/", "_versions/", "_run.json", "report.json", "exact/index.json", "near/index/")
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and not any(s in p.relative_to(out).as_posix() for s in skip)
    }


def grow(
    data: Path,
    rng: random.Random,
    old: list[dict[str, str]],
    versions: int,
    file: Callable[[int], str] = "add{}.jsonl".format,
) -> Iterator[int]:
    """Versions 1..`versions` of the input: before each later one, its increment is written
    to data/file(version) and added to `old`."""
    for v in range(1, versions + 1):
        if v > 1:
            rows = increment(rng, old, f"v{v}")
            write_rows(data / file(v), rows)
            old.extend(rows)
        yield v


def prep_both(
    mp: pytest.MonkeyPatch, data: Path, root: Path, **extra: Any
) -> dict[str, dict[str, Any]]:
    """The next version made with the index (root/index) and on the old path (root/old),
    in that order; `extra`: settings over cfg's."""
    reports = {}
    for form in ("index", "old"):
        mp.setenv(dedup_index.ENV, "1" if form == "index" else "0")
        c = {**cfg(data, root / form), **extra}
        reports[form] = run_prep(parse_config(c), progress=False)
    return reports


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three versions made twice from the same inputs: with the index and without."""
    root = tmp_path_factory.mktemp("index")
    data = root / "data"
    data.mkdir()
    rng = random.Random(0)
    old = history(rng)
    write_rows(data / "a.jsonl", old)
    reports: dict[str, list[dict[str, Any]]] = {"index": [], "old": []}
    with pytest.MonkeyPatch.context() as mp:
        for _ in grow(data, rng, old, 3, lambda v: f"add{v - 1}.jsonl"):
            for form, report in prep_both(mp, data, root).items():
                reports[form].append(report)
    return {"root": root, "reports": reports}


def test_versions_2_and_3_are_byte_identical_to_the_old_path(outputs) -> None:
    root = outputs["root"]
    a, b = digests(root / "index"), digests(root / "old")
    assert a == b
    assert any(k.startswith("exact/dups/v0003") for k in a)  # copies were found
    assert any(k.startswith("near/dups/v0003") for k in a)
    for form in ("index", "old"):
        reps = outputs["reports"][form]
        assert [r["version"]["version"] for r in reps] == [1, 2, 3]
        assert all(r["problems"] == [] for r in reps)
    # Same duplicates, named the same way, in both; the old path used no index.
    assert [r["exact_index"] for r in outputs["reports"]["old"]] == [None, None, None]
    assert outputs["reports"]["index"][0]["exact_index"] is None  # version 1: no history


def test_the_index_reads_a_small_part_of_the_history(outputs) -> None:
    v2, v3 = (r["exact_index"] for r in outputs["reports"]["index"][1:])
    # Version 2 found version 1 without a run (as an output made before the index) and
    # indexed it from its hashes, once.
    assert v2["built_lazily"] == [1]
    assert v3["built_lazily"] == []
    assert v3["runs"] == 2 and v3["history_documents"] == HISTORY + 38
    assert v3["found"] >= 8  # the copies of earlier documents (planted ones may repeat)
    # The index's part of what version 3 read: a fraction of the history's hashes.
    assert 0 < v3["bytes_read"] < v3["history_hash_bytes"] / 4
    assert v3["blocks_read"] < v3["blocks_total"] / 4
    # And its band keys: every band's index, read in part.
    b2, b3 = (r["near_index"] for r in outputs["reports"]["index"][1:])
    assert b2["built_lazily"] == [1] and b3["built_lazily"] == []
    assert b3["found"] >= 6  # the near copies' keys, in every band
    assert 0 < b3["bytes_read"] < b3["history_band_bytes"] / 3


def test_runs_on_disk_hold_every_version(outputs) -> None:
    store = open_store(outputs["root"] / "index")
    runs = dedup_index.list_runs(store, "exact")
    assert sorted(r.versions for r in runs) == [(1,), (2,), (3,)]


def test_compaction_across_versions_keeps_the_outputs(tmp_path: Path, monkeypatch) -> None:
    """Six versions: at version 6 the runs of versions 2-5 (one tier) are merged, and every
    version's files are still those of the old path."""
    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(1)
    old = [{"id": f"h{i}", "text": words(rng, 12)} for i in range(300)]
    write_rows(data / "a.jsonl", old)
    found: list[dict[str, Any] | None] = []
    bands: list[dict[str, Any] | None] = []
    for _ in grow(data, rng, old, 6):
        report = prep_both(monkeypatch, data, tmp_path)["index"]
        found.append(report["exact_index"])
        bands.append(report["near_index"])
    assert digests(tmp_path / "index") == digests(tmp_path / "old")
    assert [f["compactions"] if f else None for f in found] == [None, 0, 0, 0, 0, 1]
    assert found[5]["runs"] == 2  # version 1's run and the merged one of 2-5
    runs = dedup_index.list_runs(open_store(tmp_path / "index"), "exact")
    assert sorted(r.versions for r in runs) == [(1,), (2, 3, 4, 5), (6,)]
    # The same in each band's index.
    assert [b["compactions"] if b else None for b in bands] == [None, 0, 0, 0, 0, 25]
    runs = dedup_index.list_runs(open_store(tmp_path / "index"), "band007")
    assert sorted(r.versions for r in runs) == [(1,), (2, 3, 4, 5), (6,)]


def test_the_partitioned_select_uses_the_index_with_the_same_outputs(
    tmp_path: Path, monkeypatch
) -> None:
    """With max_task_memory (dataprep/stages/exact_ranges.py): the plan indexes version 1
    range by range and cuts the new hashes alone into ranges; versions 2 and 3 write the
    files of the old path (apart from the ranges' own intermediate files)."""
    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(2)
    old = history(rng)[:400]
    write_rows(data / "a.jsonl", old)
    reports = []
    for _ in grow(data, rng, old, 3):
        # max_task_memory: 20 documents a select range
        reports.append(prep_both(monkeypatch, data, tmp_path, max_task_memory=20 * 120)["index"])

    def kept(out: Path) -> dict[str, str]:
        skip = ("exact/ranges/", "exact/index/")
        return {k: v for k, v in digests(out).items() if not any(s in k for s in skip)}

    assert kept(tmp_path / "index") == kept(tmp_path / "old")
    assert [r["exact_ranges"].get("index") for r in reports] == [None, True, True]
    assert reports[2]["exact_ranges"]["documents"] == 38  # the new documents alone
    assert reports[2]["exact_ranges"]["partitions"] >= 2
    assert reports[1]["exact_index"]["built_lazily"] == [1]
    assert reports[2]["exact_index"]["built_lazily"] == [2]  # by the next version's plan
    assert reports[2]["exact_index"]["found"] >= 8
