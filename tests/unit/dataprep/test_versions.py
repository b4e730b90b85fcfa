"""Dataset versions (dataprep/versions.py): a run on an existing output reads only the data
that arrived since its last version, dedups it against everything kept before, and
writes a new dataset version; nothing of an earlier version changes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from datasets import load_from_disk

from core.dataset import resolve, verify
from dataprep.config import parse_config
from dataprep.inputs import InputsChanged
from dataprep.pipeline import run_prep
from tests.support.inputs import (
    build,
    cfg_dict,
    cli,
    copy_output,
    jsonl_rows,
    make_corpus,
    mtimes,
    one_line_error,
)


def prep(cfg: dict[str, Any]) -> dict[str, Any]:
    return run_prep(parse_config(cfg), progress=False)


def snapshot(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dropped(out: Path, stage: str, prefix: str) -> list[dict[str, Any]]:
    """The rows stage `stage` dropped from the shards named `prefix`..."""
    found = []
    for p in sorted((out / "dropped" / stage).glob(f"{prefix}*.parquet")):
        found += pq.read_table(p).to_pylist()
    return found


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    return build(tmp_path_factory, "versions", prep)


@pytest.fixture
def copy(first, tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """The first version, copied (data and output) for a test to add to."""
    data, out, report = first
    d, o = copy_output(data, out, tmp_path)
    return d, o, report


def test_new_file_with_copies_of_earlier_documents_makes_version_2(copy) -> None:
    data, out, first_report = copy
    before = snapshot(out)
    old = rows(data / "web" / "small.jsonl")
    new_docs = [
        {"id": f"fresh-{i}", "text": f"fresh document {i} " + "lorem ipsum " * 30} for i in range(4)
    ]
    exact_copy = {"id": "copy-exact", "text": old[2]["text"]}
    words = old[5]["text"].split()
    near_copy = {"id": "copy-near", "text": " ".join([*words[:-1], "zzzzzz"])}
    with open(data / "web" / "added.jsonl", "w") as f:
        for r in [*new_docs, exact_copy, near_copy]:
            f.write(json.dumps(r) + "\n")

    report = prep(cfg_dict(data, out))

    assert report["version"] == {
        "version": 2,
        "parent": 1,
        "added": [{"source": "web", "uri": str(data / "web" / "added.jsonl"), "kind": "new"}],
    }
    # Only the new file was read: one unit, named for the version.
    assert report["stages"]["ingest"]["total"]["docs_in"] == 6
    assert report["shards"] == ["v0002-u00000-p0000"]
    # The copies are dropped naming the first version's documents.
    ex = dropped(out, "exact", "v0002-")
    assert [(r["id"], r["reason"], r["detail"]) for r in ex] == [
        ("copy-exact", "exact_dup", old[2]["id"])
    ]
    nr = dropped(out, "near", "v0002-")
    assert [(r["id"], r["reason"], r["detail"]) for r in nr] == [
        ("copy-near", "near_dup", old[5]["id"])
    ]
    # Everything of version 1 is as it was, byte for byte; `latest` names version 2 now.
    after = snapshot(out)
    assert before.pop("dataset/latest") != after["dataset/latest"]
    assert {k: after[k] for k in before} == before
    # The report and the manifest account for both versions.
    total = report["all_versions"]["ingest"]["total"]["docs_in"]
    assert total == first_report["stages"]["ingest"]["total"]["docs_in"] + 6
    assert (
        report["stages"]["mixture"]["total"]["docs_in"]
        == report["all_versions"]["tokenize"]["total"]["kept"]
    )
    ds = out / "dataset" / "v0002"
    assert report["dataset"]["uri"] == str(ds)
    manifest = json.loads((ds / "manifest.json").read_text())
    assert manifest["version"]["parent"] == 1
    assert manifest["accounting_all_versions"] == report["all_versions"]
    assert [i["uri"] for i in manifest["inputs"]] == [str(data / "web" / "added.jsonl")]
    assert (out / "dataset" / "latest").read_text() == "v0002\n"
    assert resolve(str(out / "dataset")) == str(ds)
    assert verify(str(ds)) == [] and verify(str(out / "dataset" / "v0001")) == []
    v1_rows = load_from_disk(str(out / "dataset" / "v0001"))["train"].num_rows
    assert load_from_disk(str(ds))["train"].num_rows > v1_rows  # the new documents too

    # And a run after that, with nothing new, does nothing.
    quiet = mtimes(out)
    again = prep(cfg_dict(data, out))
    assert again["version"]["version"] == 2
    assert mtimes(out) == quiet


def test_appended_rows_are_the_only_new_documents(copy) -> None:
    data, out, _ = copy
    small = data / "web" / "small.jsonl"
    n_old, size_old = len(rows(small)), small.stat().st_size
    jsonl_rows(small, n_old, 3, seed=7, mode="a")

    report = prep(cfg_dict(data, out))

    assert report["version"]["added"] == [
        {
            "source": "web",
            "uri": str(small),
            "kind": "appended",
            "from_byte": size_old,
            "first_line": n_old + 1,
        }
    ]
    assert report["stages"]["ingest"]["total"]["docs_in"] == 3
    docs = pq.read_table(out / "docs" / "ingest" / "v0002-u00000-p0000.parquet").to_pylist()
    assert [d["id"] for d in docs] == [f"small-{i}" for i in range(n_old, n_old + 3)]
    # Their locations are the lines of the whole file.
    locs = [json.loads(d["meta"])["_ballast_location"] for d in docs]
    assert locs == [f"web/small.jsonl:{n_old + 1 + i}" for i in range(3)]


def test_changed_file_is_refused_naming_it_or_rebuilt_from_scratch(copy) -> None:
    data, out, first_report = copy
    big = data / "web" / "big.jsonl"
    raw = big.read_bytes()
    big.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(InputsChanged, match="since version v0001") as e:
        prep(cfg_dict(data, out))
    assert str(big) in str(e.value) and "--from-scratch" in str(e.value)
    # `ballast prep` says it in one line, exit 1.
    cfg_file = out.parent / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg_dict(data, out)))
    one_line_error(cli("prep", str(cfg_file), "--no-progress"), str(big), "--from-scratch")
    assert not (out / "_versions" / "v0002.plan.json").exists()

    report = run_prep(parse_config(cfg_dict(data, out)), progress=False, from_scratch=True)
    assert report["version"]["version"] == 2 and report["version"]["parent"] is None
    # Every current input was read again, and nothing is dropped as a copy of version 1.
    assert (
        report["stages"]["ingest"]["total"]["docs_in"]
        < first_report["stages"]["ingest"]["total"]["docs_in"]
    )
    assert "all_versions" not in report
    assert dropped(out, "exact", "v0002-") == []


def test_every_version_has_its_directories(first, tmp_path: Path) -> None:
    """Version 1 is in v0001/ and dataset/v0001/ like any later one, `latest` naming it."""
    from dataprep.export import check

    _, out, report = first
    ds = out / "dataset" / "v0001"
    assert report["dataset"]["uri"] == str(ds)
    assert sorted(p.name for p in (out / "dataset").iterdir()) == ["latest", "v0001"]
    assert (out / "dataset" / "latest").read_text() == "v0001\n"
    assert resolve(str(out / "dataset")) == str(ds) and verify(str(ds)) == []
    assert check(str(out / "dataset"), "llmc", str(tmp_path / "exp"), ("train",))[0] == str(ds)
    assert json.loads((out / "v0001" / "report.json").read_text())["stages"] == report["stages"]
    assert not (out / "report.json").exists() and not (out / "mixture").exists()
    assert json.loads((out / "_run.json").read_text())["layout"] == 4


def old_layout(out: Path) -> None:
    """Turn an output of version 1 into what ballast wrote before versions had
    directories (layout 3): version 1's files at the output's and the dataset's roots,
    no `latest`."""
    for src, dst in ((out / "v0001", out), (out / "dataset" / "v0001", out / "dataset")):
        shutil.copytree(src, dst, dirs_exist_ok=True)
        shutil.rmtree(src)
    (out / "dataset" / "latest").unlink()
    report = out / "report.json"
    report.write_text(
        report.read_text().replace(str(out / "dataset" / "v0001"), str(out / "dataset"))
    )
    claim = json.loads((out / "_run.json").read_text())
    (out / "_run.json").write_text(json.dumps({**claim, "layout": 3}))


def test_an_old_layout_output_is_read_as_it_is_and_grows_in_the_new_one(tmp_path: Path) -> None:
    from dataprep.export import check
    from training.data import load_data

    d, staged, out = tmp_path / "data", tmp_path / "staged", tmp_path / "out"
    make_corpus(d)
    prep(cfg_dict(d, staged))
    old_layout(staged)
    staged.rename(out)  # a path this process has not seen with another layout
    root = out / "dataset"

    # Every reader takes the old root as version 1.
    assert resolve(str(root)) == str(root) and verify(str(root)) == []
    v1_rows = load_from_disk(str(root))["train"].num_rows
    assert load_data(str(root)).manifest == json.loads((root / "manifest.json").read_text())
    assert check(str(root), "llmc", str(tmp_path / "exp"), ("train",))[0] == str(root)

    # A run with nothing new finds version 1 where it is, and writes nothing.
    quiet = mtimes(out)
    again = prep(cfg_dict(d, out))
    assert again["version"]["version"] == 1 and again["dataset"]["uri"] == str(root)
    assert mtimes(out) == quiet and not (out / "v0001").exists()
    # A killed dataset write of that version 1 is finished in place.
    (root / "manifest.json").unlink()
    prep(cfg_dict(d, out))
    assert verify(str(root)) == [] and sorted(p.name for p in root.iterdir()) == [
        "dataset_dict.json",
        "manifest.json",
        "provenance",
        "tokenizer.json",
        "train",
        "validation",
    ]

    # New data makes version 2 in the directories every version now has.
    before = snapshot(out)
    with open(d / "web" / "added.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"fresh-{i}", "text": f"fresh {i} " + "lorem " * 40}) + "\n")
    report = prep(cfg_dict(d, out))
    assert report["version"]["version"] == 2
    ds = root / "v0002"
    assert report["dataset"]["uri"] == str(ds) and (out / "v0002" / "report.json").is_file()
    assert (root / "latest").read_text() == "v0002\n" and resolve(str(root)) == str(ds)
    after = snapshot(out)
    assert {k: after[k] for k in before} == before  # version 1 as it was, byte for byte
    assert verify(str(ds)) == [] and verify(str(root)) == []
    assert load_from_disk(str(root))["train"].num_rows == v1_rows
    assert load_from_disk(str(ds))["train"].num_rows > v1_rows
    assert load_data(str(root)).manifest["version"]["version"] == 2
