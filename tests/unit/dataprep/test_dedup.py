"""Dedup decisions against the truth: a planted copy is removed exactly when its Jaccard
with the original (word 5-gram sets, computed here independently) reaches the threshold."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.corpus import string_jaccard
from tests.support.helpers import edit_words, read_jsonl, shared_file, write_jsonl


def _removed(out: Path) -> dict[str, str]:
    got = {}
    for stage in ("exact", "near"):
        for f in sorted((out / "dropped" / stage).glob("*.parquet")):
            t = pq.read_table(f, columns=["id", "detail"]).to_pylist()
            got.update({r["id"]: r["detail"] for r in t})
    return got


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[str, float]]]:
    rng = random.Random(11)
    web = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 300)
    rows = [{"id": r["id"], "text": r["text"]} for r in web]
    copies: dict[str, tuple[str, float]] = {}
    for k, r in enumerate(rng.sample(web, 80)):
        text = edit_words(r["text"], rng.uniform(0.01, 0.10), rng)
        copies[f"copy-{k}"] = (r["id"], string_jaccard(r["text"], text))
        rows.append({"id": f"copy-{k}", "text": text})
    path = write_jsonl(tmp_path_factory.mktemp("dedup") / "web.jsonl", rows)
    return path, copies


@pytest.mark.parametrize("threshold", [0.8, 0.5])
def test_removal_follows_exact_jaccard(planted, tmp_path, threshold):
    path, copies = planted
    # Both sides of the threshold must be represented, or the test proves nothing.
    assert any(j >= threshold for _, j in copies.values())
    assert any(j < threshold for _, j in copies.values())
    out = tmp_path / "out"
    cfg = parse_config(
        {
            "output": str(out),
            "workers": 1,
            "sources": [{"name": "web", "paths": [str(path)], "id_field": "id"}],
            "ingest": {"shard_docs": 100},
            "dedup": {"near": {"threshold": threshold}},
            "quality": [],
        }
    )
    run_prep(cfg, until="near", progress=False)
    removed = _removed(out)
    for cid, (orig, j) in copies.items():
        if abs(j - threshold) < 0.005:
            continue  # 32-bit shingle hashes may round a pair sitting on the threshold
        assert (cid in removed) == (j >= threshold), f"{cid}: J={j:.3f}"
        if cid in removed:
            assert removed[cid] == orig
    # The real documents are distinct from each other: none of them may be removed.
    assert all(i.startswith("copy-") for i in removed)


def test_exact_duplicates_across_sources_keep_the_first_source(tmp_path):
    web = read_jsonl(shared_file("web_c4_olmo_fixtures.jsonl"), 10)
    a = write_jsonl(
        tmp_path / "a.jsonl", [{"id": f"a{i}", "text": r["text"]} for i, r in enumerate(web)]
    )
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"id": f"b{i}", "text": r["text"]} for i, r in enumerate(web[::-1])]
    )
    out = tmp_path / "out"
    cfg = parse_config(
        {
            "output": str(out),
            "workers": 1,
            "sources": [
                {"name": "second", "paths": [str(b)], "id_field": "id"},
                {"name": "first", "paths": [str(a)], "id_field": "id"},
            ],
            "quality": [],
        }
    )
    run_prep(cfg, until="exact", progress=False)
    removed = _removed(out)
    # Sources in config order: every copy in "first" duplicates one in "second".
    assert sorted(removed) == sorted(f"a{i}" for i in range(10))
    assert all(removed[f"a{i}"] == f"b{9 - i}" for i in range(10))


def test_exact_select_in_passes_gives_the_same_duplicates(tmp_path, monkeypatch):
    """A corpus larger than one pass of exact select is split by hash value into passes;
    the duplicates and the copies kept are those of a single pass."""
    from dataprep.stages import exact

    rng = random.Random(2)
    web = [r["text"] for r in read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 60)]
    rows = [{"id": f"d{i}", "text": rng.choice(web)} for i in range(400)]
    path = write_jsonl(tmp_path / "docs.jsonl", rows)
    results = []
    for pass_docs in (1 << 24, 37):
        monkeypatch.setattr(exact, "PASS_DOCS", pass_docs)
        out = tmp_path / f"out-{pass_docs}"
        cfg = parse_config(
            {
                "output": str(out),
                "workers": 1,
                "quality": [],
                "ingest": {"shard_docs": 29},
                "sources": [{"name": "w", "paths": [str(path)], "id_field": "id"}],
            }
        )
        run_prep(cfg, until="exact", progress=False)
        results.append(_removed(out))
    first_of = {}
    for r in rows:
        first_of.setdefault(r["text"], r["id"])
    want = {r["id"]: first_of[r["text"]] for r in rows if first_of[r["text"]] != r["id"]}
    assert results[0] == want
    assert results[1] == want
