"""The dedup stages store their kept documents as views (dataprep/layout.py: ids, source,
meta and rows of the text ingest wrote; no text copied), and near-dedup's clustering loop
runs compiled (native/near_cluster.cpp). Both must change nothing a run produces: views
read back as the tables they replace, the kernel makes the Python loop's every decision,
and a run killed in the middle of a view-writing step resumes to the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.store import open_store
from dataprep import native
from dataprep.layout import TEXT_FROM, doc_location, read_docs, read_view, take_rows
from dataprep.records import DOC_SCHEMA, LOCATION_KEY, meta_location, table_to_parquet_bytes
from dataprep.stages import near
from dataprep.stages.exact import text_hashes
from tests.support.corpus import make_corpus
from tests.support.factories import prep_config
from tests.support.helpers import run_cli


# ---- take_rows / text_hashes / doc_location -------------------------------------------
def test_doc_location_reads_meta_as_json_does():
    # doc_location finds the location without parsing the meta; it must say what a parse
    # says for every meta ingest (or an older ballast) can write, escapes and nesting too.
    rng = np.random.default_rng(1)
    pieces = ['"', "\\", "é", "\u2028", "a", ":", "/", '": "', LOCATION_KEY, "{", "}"]
    metas: list[str] = ["", "{}", json.dumps({"location": "old.jsonl:1"})]
    for _ in range(3000):
        loc = "".join(rng.choice(pieces, size=int(rng.integers(0, 6))))
        fields: dict = {LOCATION_KEY: loc}
        if rng.random() < 0.3:
            fields["nested"] = {LOCATION_KEY: "inner"}
        if rng.random() < 0.3:
            fields["z"] = "".join(rng.choice(pieces, size=3))
        if rng.random() < 0.1:
            fields[LOCATION_KEY] = 7  # not a string: no location
        metas.append(json.dumps(fields, sort_keys=True, ensure_ascii=bool(rng.random() < 0.5)))
    for m in metas:
        parsed = meta_location(json.loads(m)) if m else None
        want = parsed if parsed is not None else "u00000-p0000#row=4"
        assert doc_location(m, "u00000-p0000", 4) == want, m


def test_take_rows_across_chunks_matches_take():
    rng = np.random.default_rng(0)
    texts = [("é" * int(rng.integers(0, 5))) + f"doc{i}" for i in range(2500)]
    col = pa.chunked_array([pa.array(texts[a : a + 700]) for a in range(0, 2500, 700)])
    for keep in (0.0, 0.3, 0.97, 1.0):
        rows = np.flatnonzero(rng.random(2500) < keep)
        got = take_rows(col, rows)
        assert got.to_pylist() == [texts[r] for r in rows]
        assert all(len(c) <= 10_000 for c in got.chunks)
    shuffled = rng.permutation(2500)[:100]  # not ascending: still right
    assert take_rows(col, shuffled).to_pylist() == [texts[r] for r in shuffled]


def test_text_hashes_are_the_digests_of_the_utf8():
    import xxhash

    texts = ["", "a", "naïve café", "日本語テキスト", "x" * 10_000]
    col = pa.chunked_array(
        [pa.array(texts[:2]), pa.array(texts[2:]).slice(0), pa.array([], pa.string())]
    )
    want = b"".join(xxhash.xxh3_128_digest(t.encode("utf-8")) for t in texts)
    assert text_hashes(col) == want
    sliced = pa.chunked_array([pa.array(texts).slice(1, 3)])
    assert text_hashes(sliced) == b"".join(
        xxhash.xxh3_128_digest(t.encode("utf-8")) for t in texts[1:4]
    )


def test_a_view_reads_back_as_the_table(tmp_path: Path):
    store = open_store(str(tmp_path))
    n = 23_456
    full = pa.table(
        {
            "id": [f"d{i}" for i in range(n)],
            "text": [f"text {i} " * (i % 7) for i in range(n)],
            "source": ["web"] * n,
            "meta": [f'{{"i": {i}}}' for i in range(n)],
        },
        schema=DOC_SCHEMA,
    )
    store.put("docs/ingest/s.parquet", table_to_parquet_bytes(full))
    rows = np.flatnonzero(np.arange(n) % 3 != 0)
    view = pa.table(
        {
            "id": full["id"].take(pa.array(rows)),
            "source": full["source"].take(pa.array(rows)),
            "meta": full["meta"].take(pa.array(rows)),
            "row": pa.array(rows, pa.int64()),
        }
    ).replace_schema_metadata({TEXT_FROM: b"ingest"})
    store.put("docs/exact/s.parquet", table_to_parquet_bytes(view))
    assert read_docs(store, "exact", "s").equals(full.take(pa.array(rows)))
    v = read_view(store, "exact", "s")
    assert v.is_view and v.text_stage == "ingest" and np.array_equal(v.rows, rows)
    assert not read_view(store, "ingest", "s").is_view


# ---- the clustering kernel -------------------------------------------------------------
needs_native = pytest.mark.skipif(
    native.module() is None or not hasattr(native.module(), "near_cluster_links"),
    reason="dataprep._native not built (make native)",
)


class _Sets:
    """A shingle scratch file as near._ShingleScratch lays it out."""

    def __init__(self, sets: list[np.ndarray], path: Path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        data = np.concatenate(sets).astype(np.uint32) if sets else np.zeros(0, np.uint32)
        os.pwrite(self.fd, data.tobytes(), 0)
        self.bounds_array = np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(
            np.int64
        )
        from array import array

        self.bounds = array("q", self.bounds_array.tobytes())

    get = near._ShingleScratch.get

    def close(self) -> None:
        os.close(self.fd)


def _random_case(seed: int, nc: int = 400):
    rng = np.random.default_rng(seed)
    # Families of related sets, so Jaccard values straddle the threshold; some empty.
    base = [np.unique(rng.integers(0, 5000, int(rng.integers(1, 80)))) for _ in range(40)]
    sets = []
    for i in range(nc):
        b = base[i % len(base)]
        if i % 37 == 0:
            sets.append(np.zeros(0, np.uint32))
            continue
        drop = rng.random(len(b)) < rng.random() * 0.4
        extra = rng.integers(0, 5000, int(rng.integers(0, 6)))
        sets.append(np.unique(np.concatenate([b[~drop], extra])).astype(np.uint32))
    groups = []
    for _ in range(6):  # bands
        members, offsets = [], [0]
        for _ in range(int(rng.integers(10, 60))):
            g = np.sort(rng.choice(nc, int(rng.integers(2, 12)), replace=False))
            members += g.tolist()
            offsets.append(len(members))
        groups.append((np.array(members, np.int64), np.array(offsets, np.int64)))
    return sets, groups


@needs_native
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("verify", [True, False])
def test_cluster_kernel_matches_the_python_loop(tmp_path: Path, monkeypatch, seed, verify):
    sets, groups = _random_case(seed)
    s = _Sets(sets, tmp_path / "sh") if verify else None
    try:
        for max_checks, threshold in ((8, 0.8), (2, 0.5), (1, 0.0), (0, 0.8), (8, 1.0)):
            nat = near._links(groups, len(sets), max_checks, threshold, s)  # type: ignore[arg-type]
            monkeypatch.setattr(native, "module", lambda: None)
            py = near._links(groups, len(sets), max_checks, threshold, s)  # type: ignore[arg-type]
            monkeypatch.undo()
            assert np.array_equal(nat[0], py[0])
            assert np.array_equal(nat[1], py[1])
            assert nat[2] == py[2]
    finally:
        if s is not None:
            s.close()


# ---- a killed run resumes to the same bytes --------------------------------------------
def _cli(cfg: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("prep", str(cfg), "--no-progress", env=env)


def _same_files(a: Path, b: Path) -> None:
    want = sorted(p.relative_to(a) for p in a.rglob("*.parquet"))
    assert want == sorted(p.relative_to(b) for p in b.rglob("*.parquet"))
    for f in want:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    ds = sorted(p.relative_to(a) for p in (a / "dataset").rglob("*") if p.is_file())
    assert ds == sorted(p.relative_to(b) for p in (b / "dataset").rglob("*") if p.is_file())
    for f in ds:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("failpoint", ["exact: apply:2", "near: apply:3"])
def test_killed_while_writing_views_resumes_to_identical_output(tmp_path: Path, failpoint):
    import yaml

    data = tmp_path / "corpus"
    data.mkdir()
    make_corpus(data)
    ref, out = tmp_path / "ref", tmp_path / "killed"
    for o in (ref, out):
        (tmp_path / f"{o.name}.yaml").write_text(
            yaml.safe_dump(prep_config(data, o, shard_docs=25))
        )
    assert _cli(tmp_path / "ref.yaml").returncode == 0
    killed = _cli(tmp_path / "killed.yaml", env={"BALLAST_FAILPOINT": failpoint})
    assert killed.returncode == -9, killed.stderr
    assert not (out / "v0001" / "report.json").exists()
    resumed = _cli(tmp_path / "killed.yaml")
    assert resumed.returncode == 0, resumed.stderr
    _same_files(ref, out)
    # The views really are views, and read back whole.
    store = open_store(str(out))
    for stage in ("exact", "near"):
        for f in sorted((out / "docs" / stage).glob("*.parquet")):
            assert "text" not in pq.read_schema(f).names
            assert read_docs(store, stage, f.stem).num_rows == pq.read_metadata(f).num_rows
