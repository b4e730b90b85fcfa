"""Near-dedup clustering at scale keeps its result: groups met again in later bands are
skipped and shingle sets come from a random-access scratch copy, and the clusters, the
duplicates file and the summary are those of the plain algorithm (every bucket group of
every band, in order, with a memo of every pair), computed here from the same files."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dataprep import minhash
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from dataprep.stages import exact, near
from tests.support.helpers import edit_words, read_jsonl, shared_file
from tests.support.union_find import UnionFind


def reference_clusters(
    out: Path, shards: list[str], bands: int, threshold: float, max_checks: int = 8
) -> tuple[np.ndarray, int, int]:
    def npz(key: str) -> dict[str, np.ndarray]:
        with np.load(io.BytesIO((out / key).read_bytes())) as z:
            return {k: z[k] for k in z.files}

    sets: list[np.ndarray] = []
    for s in shards:
        z = npz(near.shingles_key(s))
        sets += [
            z["shingles"][z["offsets"][r] : z["offsets"][r + 1]]
            for r in range(len(z["offsets"]) - 1)
        ]
    uf = UnionFind.of(len(sets))
    checked: dict[tuple[int, int], bool] = {}
    for band in range(bands):
        z = npz(f"v0001/{near.bucket_key(band)}")  # the version's store
        members, goff = z["members"].tolist(), z["offsets"].tolist()
        for g in range(len(goff) - 1):
            grp = members[goff[g] : goff[g + 1]]
            for i in range(1, len(grp)):
                for other in grp[: min(i, max_checks)]:
                    if uf.find(grp[i]) == uf.find(other):
                        break
                    key = (other, grp[i])
                    if key not in checked:
                        checked[key] = minhash.jaccard(sets[other], sets[grp[i]]) >= threshold
                    if checked[key]:
                        uf.union(other, grp[i])
                        break
    return uf.roots(), len(checked), sum(checked.values())


def chained_corpus(path: Path) -> None:
    """Real web pages, copies with a few words changed, copies of copies (chains whose
    ends fall below the threshold), and one paragraph pasted into many documents (large
    buckets where the first member is not a duplicate of the rest)."""
    rng = random.Random(5)
    web = [r["text"] for r in read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 120)]
    docs = list(web)
    for _ in range(150):
        docs.append(edit_words(rng.choice(docs), rng.uniform(0.01, 0.06), rng))
    boiler = " ".join(web[0].split(" ")[:120])
    for k in range(40):
        docs.append(boiler + "\n" + " ".join(rng.choice(web).split(" ")[: 40 + k]))
    rng.shuffle(docs)
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": f"d{i}", "text": d}) + "\n")


@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_cluster_matches_the_plain_algorithm(tmp_path: Path, threshold: float) -> None:
    chained_corpus(tmp_path / "docs.jsonl")
    cfg = parse_config(
        {
            "output": str(tmp_path / "out"),
            "workers": 1,
            "sources": [{"name": "web", "paths": [str(tmp_path / "docs.jsonl")], "id_field": "id"}],
            "ingest": {"shard_docs": 37},
            "dedup": {"exact": True, "near": {"threshold": threshold}},
            "quality": [],
        }
    )
    report = run_prep(cfg, until="near", progress=False)
    out = tmp_path / "out"
    shards = report["shards"]
    bands, _ = near.bands_rows(cfg.dedup.near)
    roots, candidates, confirmed = reference_clusters(out, shards, bands, threshold)

    summary = json.loads((out / "v0001" / near.CLUSTER_KEY).read_text())
    assert summary["removed"] > 20  # the corpus does exercise clustering
    assert summary["candidate_pairs"] == candidates
    assert summary["confirmed_pairs"] == confirmed
    dups = [
        {"shard": s, **d}
        for s in shards
        if (out / exact.dups_key("near", s)).exists()
        for d in pq.read_table(out / exact.dups_key("near", s)).to_pylist()
    ]
    n_per = [pq.read_metadata(out / "docs" / "exact" / f"{s}.parquet").num_rows for s in shards]
    offsets = np.concatenate([[0], np.cumsum(n_per)])
    ids = [
        i
        for s in shards
        for i in pq.read_table(out / "docs" / "exact" / f"{s}.parquet")["id"].to_pylist()
    ]
    got = {int(offsets[shards.index(d["shard"])] + d["row"]): d["kept_id"] for d in dups}
    want = {i: ids[r] for i, r in enumerate(roots.tolist()) if r != i}
    assert got == want


def test_buckets_in_passes_are_the_same_buckets(tmp_path: Path, monkeypatch) -> None:
    """Bucketing a band in passes over key ranges (a corpus larger than one pass) gives
    the same groups, in the same order, as one sort of the whole band."""
    chained_corpus(tmp_path / "docs.jsonl")
    out = tmp_path / "out"
    cfg = parse_config(
        {
            "output": str(out),
            "workers": 1,
            "quality": [],
            "sources": [{"name": "web", "paths": [str(tmp_path / "docs.jsonl")], "id_field": "id"}],
            "ingest": {"shard_docs": 37},
            "dedup": {"exact": True, "near": {}},
        }
    )
    report = run_prep(cfg, until="near", progress=False)  # one sort per band
    bands, _ = near.bands_rows(cfg.dedup.near)

    def buckets() -> list[tuple[list[int], list[int]]]:
        arrays = []
        for band in range(bands):
            with np.load(out / "v0001" / near.bucket_key(band)) as z:
                arrays.append((z["members"].tolist(), z["offsets"].tolist()))
        return arrays

    got = [buckets()]
    monkeypatch.setattr(near, "BUCKET_PASS_DOCS", 23)  # many passes per band
    near.bucket_bands(cfg, [], report["shards"], list(range(bands)))
    got.append(buckets())
    assert sum(len(m) for m, _ in got[0]) > 50  # there are buckets to compare
    assert got[0] == got[1]
