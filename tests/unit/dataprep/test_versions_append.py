"""dataset.versions: append (dataprep/versions.py): a later version mixes and packs only
its new documents and appends their rows to its parent's, which it takes over unread
(hard links here; server-side copies on S3), numbering its documents on from the
parent's. Compared with the same version built `whole` and with the partitioned plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from datasets import load_from_disk

from core.dataset import resolve, verify
from core.provenance import Provenance
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.inputs import build, cfg_dict, copy_output, mtimes

APPEND = {"validation_fraction": 0.05, "train_shards": 1, "pack_partitions": 2}


def prep(cfg: dict[str, Any]) -> dict[str, Any]:
    return run_prep(parse_config(cfg), progress=False)


def appending(data: Path, out: Path, **more: Any) -> dict[str, Any]:
    c = cfg_dict(data, out)
    c["dataset"] = {**c["dataset"], "versions": "append"}
    return {**c, **more}


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    return build(tmp_path_factory, "append", prep)


def copy_of(first: tuple[Path, Path, dict[str, Any]], at: Path) -> tuple[Path, Path]:
    """Version 1, data and output copied, with new documents in a new file."""
    data, out, _ = first
    d, o = copy_output(data, out, at)
    with open(d / "web" / "added.jsonl", "w") as f:
        for i in range(30):
            text = f"fresh document {i} " + " ".join(f"w{(i * 7 + k) % 97}" for k in range(60))
            f.write(json.dumps({"id": f"fresh-{i}", "text": text}) + "\n")
    return d, o


def test_a_version_appends_its_rows_after_its_parents(first, tmp_path: Path) -> None:
    data, out = copy_of(first, tmp_path)
    v1 = out / "dataset" / "v0001"
    m1 = json.loads((v1 / "manifest.json").read_text())

    report = prep(appending(data, out))

    v2 = out / "dataset" / "v0002"
    m2 = json.loads((v2 / "manifest.json").read_text())
    assert verify(str(v2)) == [] and verify(str(v1)) == []
    assert m2["appended_to"] == {
        "version": 1,
        "rows": {s: m1["splits"][s]["rows"] for s in ("train", "validation")},
    }
    for split in ("train", "validation"):
        old, new = m1["splits"][split]["files"], m2["splits"][split]["files"]
        # The parent's shards come first, the same files (one inode: not read, not
        # copied), renamed for the split's new shard count.
        for a, b in zip(old, new, strict=False):
            assert (v1 / a).stat().st_ino == (v2 / b).stat().st_ino
        got = load_from_disk(str(v2))[split]
        before = load_from_disk(str(v1))[split]
        assert got.select(range(before.num_rows))[:] == before[:]
    train_new = m2["splits"]["train"]["rows"] - m1["splits"]["train"]["rows"]
    assert train_new > 0 and len(m2["splits"]["train"]["files"]) == 2

    # Only the new documents were mixed: the plan saw this run's tokens, and the
    # accounting over both versions still adds up, documents numbered on.
    mixed = report["stages"]["mixture"]["total"]["docs_in"]
    assert mixed == report["stages"]["tokenize"]["total"]["kept"]
    assert (
        report["all_versions"]["mixture"]["total"]["docs_in"]
        == report["all_versions"]["tokenize"]["total"]["kept"]
    )
    prov = Provenance(v2)
    assert prov.n_docs == Provenance(v1).n_docs + report["stages"]["quality"]["total"]["kept"]
    appended_rows = range(m1["splits"]["train"]["rows"], m2["splits"]["train"]["rows"])
    ids = {prov.document(s.doc).id for r in appended_rows for s in prov.spans("train", r)}
    assert ids and all(i.startswith("fresh-") for i in ids)
    old_ids = {prov.document(s.doc).id for s in prov.spans("train", 0)}
    assert old_ids == {Provenance(v1).document(s.doc).id for s in Provenance(v1).spans("train", 0)}

    # Nothing new: nothing happens.
    quiet = mtimes(out)
    assert prep(appending(data, out))["version"]["version"] == 2
    assert mtimes(out) == quiet


def test_appended_rows_are_the_new_documents_prepared_alone_at_any_partitioning(
    first, tmp_path: Path
) -> None:
    """The rows an appending version adds are those its new documents (no copies of old
    ones among them) make when prepared alone into a fresh output: the same plan and
    packing, over the new documents only. The partitioned plan (max_task_memory) writes
    the same bytes as the single task."""
    data, out = copy_of(first, tmp_path / "a")
    prep(appending(data, out))
    data_p, out_p = copy_of(first, tmp_path / "b")
    prep(appending(data_p, out_p, max_task_memory=1 << 20))
    alone = tmp_path / "alone"
    (alone / "web").mkdir(parents=True)
    shutil.copy(data / "web" / "added.jsonl", alone / "web")
    c = cfg_dict(alone, tmp_path / "alone-out")
    c["sources"] = c["sources"][:1]
    prep(c)

    def arrows(o: Path) -> dict[str, bytes]:
        d = o / "dataset" / "v0002"
        return {p.name: p.read_bytes() for p in sorted(d.rglob("*.arrow"))}

    assert arrows(out) == arrows(out_p)
    v1 = load_from_disk(str(out / "dataset" / "v0001"))
    v2 = load_from_disk(str(out / "dataset" / "v0002"))
    fresh = load_from_disk(resolve(str(tmp_path / "alone-out" / "dataset")))
    for split in ("train", "validation"):
        added = v2[split].select(range(v1[split].num_rows, v2[split].num_rows))
        assert fresh[split].num_rows > 0 or split == "validation"
        assert added[:] == fresh[split][:]
