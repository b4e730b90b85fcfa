"""Exact substring dedup (the `substring` stage): the kernel against a brute-force reference
on random corpora, and whole runs through run_prep: planted boilerplate across shards and
versions, keep: first, accounting, the memory bound, workers, provenance, config."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from core.store import open_store
from dataprep import substring as sub
from dataprep.config import ConfigError, parse_config
from dataprep.pipeline import run_prep
from dataprep.stages import substring as stage
from tests.support.helpers import read_jsonl, run_cli, shared_file, write_jsonl

# ---- the kernel against the reference ---------------------------------------------------
VOCAB = ["a", "b", "cc", "dé", "日本", "x\ny", "🙂", "end."]


def random_corpus(rng: random.Random, n: int) -> list[str]:
    """Documents of a few repeated pieces and random filler over a tiny vocabulary: repeats
    of every length, overlapping, at document starts and ends, across line breaks, in
    multi-byte characters; some documents empty or whitespace only."""
    words = lambda m: " ".join(rng.choice(VOCAB) for _ in range(m))  # noqa: E731
    pieces = [words(rng.randint(3, 12)) for _ in range(6)]
    docs = []
    for _ in range(n):
        parts = [
            rng.choice(pieces) if rng.random() < 0.5 else words(rng.randint(1, 8))
            for _ in range(rng.randint(0, 6))
        ]
        docs.append(rng.choice([" ", "\n", "  \t", "\n\n"]).join(parts))
    return docs


def kernel_ranges(
    shards: list[list[str]], k: int, unit: str, keep: str
) -> list[list[tuple[int, int]]]:
    """The stage's path through the kernel, in memory: distinct hashes per shard, select
    over all, marks and merged ranges per shard."""
    hasher = sub.Hasher(0)
    cols = [pa.chunked_array([pa.array(docs, pa.string())]) for docs in shards]
    h, p, g = [], [], []
    for gi, col in enumerate(cols):
        hs = [np.zeros(0, np.uint64)]
        ps = [np.zeros(0, np.uint64)]
        for row0, data, off in sub.batches(col):
            w = sub.windows(hasher, data, off, k, unit)
            hs.append(w.hash)
            ps.append(sub.positions(row0 + w.doc, w.index))
        hh, pp = sub.distinct(np.concatenate(hs), np.concatenate(ps))
        h.append(hh)
        p.append(pp)
        g.append(np.full(len(hh), gi, np.int32))
    shard_of, dup_h, dup_keep = sub.select(
        np.concatenate(h), np.concatenate(p), np.concatenate(g), keep == "first"
    )
    out: list[list[tuple[int, int]]] = []
    for gi, (docs, col) in enumerate(zip(shards, cols, strict=True)):
        mine = shard_of == gi
        order = np.argsort(dup_h[mine])
        repeated = sub.Repeated(dup_h[mine][order], dup_keep[mine][order])
        ranges: list[list[tuple[int, int]]] = [[] for _ in docs]
        for row0, data, off in sub.batches(col):
            w = sub.windows(hasher, data, off, k, unit)
            m = repeated.marked(w, row0 + w.doc)
            docs_, starts, ends = (x.tolist() for x in sub.union(w.doc[m], w.start[m], w.end[m]))
            for d, a, b in zip(docs_, starts, ends, strict=True):
                if unit == "bytes":
                    a, b = sub.char_aligned(data[off[d] : off[d + 1]].tobytes(), a, b)
                    if a >= b:
                        continue
                ranges[row0 + d].append((a, b))
        out += ranges
    return out


@pytest.mark.parametrize("unit", ["tokens", "bytes"])
@pytest.mark.parametrize("keep", ["first", "none"])
@pytest.mark.parametrize("batch", [1 << 20, 16])
def test_kernel_removes_exactly_the_reference_ranges(
    unit: str, keep: str, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random corpora split into three shards at random points, documents hashed in one
    batch or a few documents at a time: the same removed byte ranges as the reference,
    which compares every window's content."""
    monkeypatch.setattr(sub, "BATCH_BYTES", batch)
    rng = random.Random(f"{unit}-{keep}-{batch}")
    for _ in range(60):
        docs = random_corpus(rng, rng.randint(1, 14))
        k = rng.randint(1, 8)
        a, b = sorted(rng.choice(range(len(docs) + 1)) for _ in range(2))
        got = kernel_ranges([docs[:a], docs[a:b], docs[b:]], k, unit, keep)
        assert got == sub.reference_ranges(docs, k, unit, keep), (docs, k)


def test_reference_semantics_on_a_small_case() -> None:
    """What the ranges mean, by hand: a 3-token span in three documents (one of them
    with other whitespace); keep: first spares its first occurrence only."""
    docs = ["p q r s", "x p  q\nr y", "p q r"]
    assert sub.reference_ranges(docs, 3, "tokens", "first") == [[], [(2, 8)], [(0, 5)]]
    assert sub.reference_ranges(docs, 3, "tokens", "none") == [[(0, 5)], [(2, 8)], [(0, 5)]]
    # bytes: "é" and "è" (2 bytes each) share their first byte: the repeated window
    # "abc" + that byte is cut back to whole characters
    assert sub.reference_ranges(["abcé", "abcè"], 4, "bytes", "none") == [[(0, 3)], [(0, 3)]]
    assert sub.reference_ranges(["abcdé", "abcdè"], 4, "bytes", "none") == [[(0, 4)], [(0, 4)]]


def test_hashes_do_not_depend_on_position_or_batch() -> None:
    hasher = sub.Hasher(3)
    col = pa.chunked_array([pa.array(["one two three", "zero one two three"], pa.string())])
    (_, data, off) = next(sub.batches(col))
    w = sub.windows(hasher, data, off, 3, "tokens")
    assert w.hash[0] == w.hash[2] and len(set(w.hash.tolist())) == 2
    assert sub.Hasher(4).table[0] != hasher.table[0]  # the seed picks the hash


# ---- whole runs -------------------------------------------------------------------------
BOILER = (
    "This website uses cookies to improve your experience. By continuing to browse the "
    "site you agree to our use of cookies, our privacy policy and our terms of service, "
    "which you can read at any time from the link at the bottom of every page."
)  # 44 tokens
LICENSE = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of "
    "this software and associated documentation files, to deal in the Software without "
    "restriction, including without limitation the rights to use, copy, modify, merge."
)
K = 20


def clean_pages(n: int) -> list[dict[str, Any]]:
    """The first n real pages that share no span of K tokens with one another (some web
    pages do: a quote, a byline), so that what goes is what the tests planted."""
    pages = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 2 * n)
    ranges = sub.reference_ranges([p["text"] for p in pages], K, "tokens", "none")
    clean = [p for p, r in zip(pages, ranges, strict=True) if not r]
    assert len(clean) >= n
    return clean[:n]


def make_corpus(root: Path) -> dict[str, str]:
    """web: 60 real pages, 30 with the cookie banner appended (at a page end, after a
    line break), 10 with the license at the start; one page that is nothing but the
    banner. forum: 20 pages, 5 of them quoting the middle of the license."""
    pages = clean_pages(90)
    web = []
    for k, r in enumerate(pages[:60]):
        text = r["text"]
        if k % 2 == 0:
            text = text + "\n" + BOILER
        if k % 6 == 1:
            text = LICENSE + "\n\n" + text
        web.append({"id": f"web-{k:02d}", "text": text})
    web.append({"id": "only-banner", "text": "  " + BOILER + "\n"})
    write_jsonl(root / "web" / "web.jsonl", web)
    middle = " ".join(LICENSE.split()[5:30])
    forum = [
        {
            "id": f"forum-{k:02d}",
            "text": (f"As quoted: {middle} end. " if k < 5 else "") + r["text"],
        }
        for k, r in enumerate(pages[60:80])
    ]
    write_jsonl(root / "forum" / "forum.jsonl", forum)
    return {r["id"]: r["text"] for r in [*web, *forum]}


def config(data: Path, out: Path, workers: int = 1, **substring: Any) -> dict[str, Any]:
    return {
        "output": str(out),
        "workers": workers,
        "sources": [
            {"name": "web", "paths": [str(data / "web")], "id_field": "id"},
            {"name": "forum", "paths": [str(data / "forum")], "id_field": "id"},
        ],
        "ingest": {"shard_docs": 16},
        "dedup": {"exact": False, "near": False, "substring": {"min_tokens": K, **substring}},
        "quality": ["length"],
        "pack": {"seq_len": 256, "window": 200},
        "dataset": {"validation_fraction": 0.05, "train_shards": 1, "pack_partitions": 2},
    }


def prep(cfg: dict[str, Any], until: str | None = "substring") -> dict[str, Any]:
    return run_prep(parse_config(cfg), until=until, progress=False)


def stage_docs(out: Path, stage: str, shards: list[str]) -> list[tuple[str, str]]:
    """(id, text) of a stage's kept documents, in input order."""
    rows = []
    for s in shards:
        t = pq.read_table(out / "docs" / stage / f"{s}.parquet", columns=["id", "text"])
        rows += list(zip(t["id"].to_pylist(), t["text"].to_pylist(), strict=True))
    return rows


def dropped(out: Path) -> list[dict[str, Any]]:
    return [
        r
        for f in sorted((out / "dropped" / "substring").glob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]


def expected(inputs: list[tuple[str, str]], k: int, unit: str, keep: str) -> dict[str, str]:
    """Each input document's text after the reference's cuts."""
    texts = [t for _, t in inputs]
    out = {}
    for (i, t), ranges in zip(inputs, sub.reference_ranges(texts, k, unit, keep), strict=True):
        out[i] = sub.cut(t.encode("utf-8"), ranges).decode("utf-8")
    return out


# The files that differ between identical runs (run id, timings, finish time).
VARIES = {"_run.json", "report.json", "v0001.json", "v0002.json"}


def snapshot(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in VARIES
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    data = tmp_path_factory.mktemp("substring-data")
    return data, make_corpus(data)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("substring-out") / "run"
    return out, prep(config(corpus[0], out))


def test_the_stage_cuts_what_the_reference_cuts(run) -> None:
    out, report = run
    shards = report["shards"]
    assert len(shards) > 2  # the repeats cross shards
    inputs = stage_docs(out, "ingest", shards)
    want = expected(inputs, K, "tokens", "first")
    got = dict(stage_docs(out, "substring", shards))
    gone = {r["id"] for r in dropped(out)}
    assert gone == {"only-banner"}
    assert set(got) | gone == set(want)
    for i, text in got.items():
        assert text == want[i], i


def test_planted_boilerplate_goes_and_its_first_occurrence_stays(run, corpus) -> None:
    out, report = run
    _, planted = corpus
    got = dict(stage_docs(out, "substring", report["shards"]))
    banner = [i for i in sorted(got) if i.startswith("web-") and int(i[4:]) % 2 == 0]
    # keep: first: the first page in input order keeps its banner, no later one does
    assert got[banner[0]].endswith(BOILER)
    for i in banner[1:]:
        assert BOILER[:60] not in got[i], i
        assert got[i] == planted[i][: -len(BOILER)], i  # only the banner went
    lic = [i for i in sorted(got) if i.startswith("web-") and int(i[4:]) % 6 == 1]
    assert got[lic[0]].startswith(LICENSE)
    for i in lic[1:]:
        # The license goes; so may the page's first word where two pages start with the
        # same one ("merge.\n\nThe": a window of the license's last K-1 tokens and it).
        assert LICENSE[:60] not in got[i] and planted[i].endswith(got[i]), i
        assert len(planted[i]) - len(got[i]) - len(LICENSE) < 10, i
    # The forum's quotes of the license's middle (25 tokens >= K) go too, in another
    # source. The first quote keeps what is its own ("As quoted:", "end."); the later
    # ones repeat the first one whole, and lose all of it.
    assert got["forum-00"].startswith("As quoted:  end. ")
    quote = f"As quoted: {' '.join(LICENSE.split()[5:30])} end."
    for k in range(1, 5):
        i = f"forum-{k:02d}"
        assert planted[i].startswith(quote) and got[i] == planted[i][len(quote) :], i


def test_a_document_of_nothing_but_boilerplate_is_dropped(run) -> None:
    out, _ = run
    (row,) = dropped(out)
    assert (row["id"], row["reason"], row["source"]) == ("only-banner", "substring_dup", "web")
    assert row["detail"].startswith(f"{len(BOILER.encode())} bytes in 1 repeated spans removed")
    assert row["text"] == "  " + BOILER + "\n" and row["location"]


def test_accounting_adds_up(run) -> None:
    _, report = run
    stage = report["stages"]["substring"]
    assert list(report["stages"]) == ["ingest", "substring"]
    assert report["problems"] == []
    summary = report["substring"]
    for src, s in stage["sources"].items():
        e = summary["sources"].get(src, {"bytes_removed": 0})
        assert s["docs_in"] == s["kept"] + sum(s["dropped"].values())
        assert s["bytes_in"] == s["bytes_kept"] + s["bytes_dropped"] + e["bytes_removed"], src
    web = summary["sources"]["web"]
    assert web["edited"] == 29 + 9  # banner pages but the first, license pages but the first
    assert summary["sources"]["forum"]["edited"] == 5
    assert stage["sources"]["web"]["dropped"] == {"substring_dup": 1}
    assert summary["partitions"] >= 1 and summary["repeated_hashes"] > 0
    assert summary["hash_disk_bytes"] > 0


def test_a_tiny_memory_bound_gives_the_same_output(corpus, run, tmp_path: Path) -> None:
    """1 MiB: the hash step goes in passes and select in many partitions; the documents
    are byte for byte the same."""
    out, report = run
    small = tmp_path / "small"
    r = prep(config(corpus[0], small, max_memory="1MiB"))
    assert r["substring"]["partitions"] > 4 > report["substring"]["partitions"]
    passes = [
        json.loads((small / "substring" / "windows" / f"{s}.json").read_text())["passes"]
        for s in r["shards"]
    ]
    assert max(passes) > 1
    # Apply holds a shard's repeated hashes a group of partitions at a time when they
    # exceed its share of the bound: the same ranges as from all at once.
    cfg, store = parse_config(config(corpus[0], small)), open_store(str(small))
    groups = []
    for s in r["shards"]:
        text = pq.read_table(small / "docs" / "ingest" / f"{s}.parquet")["text"]
        whole = stage.removed_ranges(cfg, text, stage.shard_dups(store, s))
        groups.append(len(list(stage.shard_dups(store, s, 16))))
        assert stage.removed_ranges(cfg, text, stage.shard_dups(store, s, 16)) == whole
    assert max(groups) > 1
    for s in r["shards"]:
        for d in ("docs", "dropped"):
            a, b = out / d / "substring" / f"{s}.parquet", small / d / "substring" / f"{s}.parquet"
            assert a.exists() == b.exists() and (not a.exists() or a.read_bytes() == b.read_bytes())


def test_hash_files_finer_than_the_partitions_give_the_same_output(
    corpus, run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's hash files split by more top bits than select's ranges (a large shard, or
    an earlier version's shards under a bound that now needs fewer ranges): select reads
    several files a range. workers 1 runs in this process, so the constant holds."""
    out, _ = run
    monkeypatch.setattr(stage, "FILE_ENTRIES", 64)
    fine = tmp_path / "fine"
    r = prep(config(corpus[0], fine))
    bits = {
        json.loads((fine / "substring" / "windows" / f"{s}.json").read_text())["bits"]
        for s in r["shards"]
    }
    assert min(bits) > 3 and r["substring"]["partitions"] == 1
    for s in r["shards"]:
        a, b = (
            out / "docs" / "substring" / f"{s}.parquet",
            fine / "docs" / "substring" / f"{s}.parquet",
        )
        assert a.read_bytes() == b.read_bytes()


def test_output_is_the_same_with_one_or_two_workers(corpus, run, tmp_path: Path) -> None:
    out, _ = run
    two = tmp_path / "two"
    prep(config(corpus[0], two, workers=2))
    assert snapshot(two) == snapshot(out)


def test_keep_none_removes_every_occurrence(corpus, tmp_path: Path) -> None:
    out = tmp_path / "none"
    report = prep(config(corpus[0], out, keep="none"))
    got = dict(stage_docs(out, "substring", report["shards"]))
    assert not any(BOILER[:60] in t for t in got.values())
    assert not any(t.startswith(LICENSE[:60]) for t in got.values())
    want = expected(stage_docs(out, "ingest", report["shards"]), K, "tokens", "none")
    assert all(t == want[i] for i, t in got.items())


def test_bytes_unit_matches_the_reference(corpus, tmp_path: Path) -> None:
    out = tmp_path / "bytes"
    report = prep(config(corpus[0], out, unit="bytes", min_tokens=120))
    want = expected(stage_docs(out, "ingest", report["shards"]), 120, "bytes", "first")
    got = dict(stage_docs(out, "substring", report["shards"]))
    assert got and all(t == want[i] for i, t in got.items())
    assert set(want) - set(got) == {r["id"] for r in dropped(out)}


def test_a_later_version_loses_what_the_history_holds(corpus, tmp_path: Path) -> None:
    """Version 2's pages with the banner lose it (its first occurrence is in version 1);
    version 1's documents are untouched; a span repeated only inside version 2 goes from
    its second page on."""
    data = tmp_path / "data"
    shutil.copytree(corpus[0], data)
    out = tmp_path / "out"
    cfg = config(data, out)
    v1 = prep(cfg, until=None)
    before = dict(stage_docs(out, "substring", v1["shards"]))
    pages = clean_pages(90)[80:90]
    fresh = " ".join(f"novel{k} paragraph words here" for k in range(8))  # 32 tokens
    rows = [{"id": f"new-{k}", "text": r["text"] + "\n" + BOILER} for k, r in enumerate(pages)]
    rows[3]["text"] += "\n" + fresh
    rows[7]["text"] = fresh + "\n" + rows[7]["text"]
    write_jsonl(data / "web" / "added.jsonl", rows)
    v2 = prep(cfg, until=None)
    assert v2["version"]["version"] == 2
    new = dict(stage_docs(out, "substring", v2["shards"]))
    assert set(new) == {f"new-{k}" for k in range(10)}
    assert not any(BOILER[:60] in t for t in new.values())
    assert fresh in new["new-3"] and fresh not in new["new-7"]
    assert dict(stage_docs(out, "substring", v1["shards"])) == before
    assert v2["substring"]["sources"]["web"]["edited"] == 10
    assert v2["problems"] == []


def test_provenance_records_the_bytes_removed(corpus, tmp_path: Path) -> None:
    out = tmp_path / "prov"
    report = prep(config(corpus[0], out), until="quality")
    kept = stage_docs(out, "quality", report["shards"])
    prov = [
        r
        for s in report["shards"]
        for r in pq.read_table(out / "provenance" / f"{s}.parquet").to_pylist()
    ]
    assert [r["id"] for r in prov] == [i for i, _ in kept]
    by_id = {r["id"]: r["substring.removed_bytes"] for r in prov}
    assert by_id["web-02"] == len(("\n" + BOILER).encode()) - 1  # the banner, not the "\n"
    assert by_id["web-03"] == 0.0


def test_off_by_default_and_the_fingerprint_is_unchanged(corpus, tmp_path: Path) -> None:
    cfg = config(corpus[0], tmp_path / "x")
    del cfg["dedup"]["substring"]
    parsed = parse_config(cfg)
    assert parsed.dedup.substring is None and "substring" not in parsed.model_dump()["dedup"]
    cfg["dedup"]["substring"] = True
    on = parse_config(cfg).dedup.substring
    assert on is not None and (on.min_tokens, on.unit, on.keep) == (50, "tokens", "first")
    assert on.max_memory == 1 << 30


def test_bad_values_name_the_key(tmp_path: Path) -> None:
    def error(**kw: Any) -> str:
        with pytest.raises(ConfigError) as e:
            parse_config(config(tmp_path, tmp_path / "out", **kw))
        return str(e.value)

    assert "dedup.substring.unit" in error(unit="words")
    assert "dedup.substring.keep" in error(keep="last")
    assert "dedup.substring.min_tokens" in error(min_tokens=0)
    assert "dedup.substring.max_memory" in error(max_memory="lots")
    assert "dedup.substring.max_memory" in error(max_memory="10KiB")
    assert "dedup.substring.min_token: unknown key" in error(min_token=5)
    assert parse_config(config(tmp_path, tmp_path / "o", max_memory="2GB")).dedup.substring


# ---- kill -9 and resume; Dask ------------------------------------------------------------
def _cli(cfg: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("prep", str(cfg), "--no-progress", env=env)


@pytest.mark.parametrize("failpoint", ["substring: select:3", "substring: apply:2"])
def test_killed_and_resumed_gives_the_same_bytes(corpus, tmp_path: Path, failpoint: str) -> None:
    """A run SIGKILLed after the 3rd select partition (of many: a 1 MiB bound) or the 2nd
    shard's apply, then run again, ends with every file of an uninterrupted run."""
    ref, out = tmp_path / "ref", tmp_path / "killed"
    prep(config(corpus[0], ref, max_memory="1MiB"), until=None)
    cfg = tmp_path / "killed.yaml"
    cfg.write_text(yaml.safe_dump(config(corpus[0], out, max_memory="1MiB")))
    killed = _cli(cfg, env={"BALLAST_FAILPOINT": failpoint})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "v0001" / "report.json").exists()
    resumed = _cli(cfg)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "substring-dedup: windows of 20 tokens, keep first: 43 documents edited" in (
        resumed.stdout
    )
    assert snapshot(out) == snapshot(ref)


def test_on_a_dask_cluster_the_output_is_the_local_pools(corpus, run, tmp_path: Path) -> None:
    from distributed import LocalCluster

    from dataprep.cluster import DaskRunner

    out, _ = run
    on_dask = tmp_path / "dask"
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        runner = DaskRunner(cluster.scheduler_address, progress=False)
        try:
            run_prep(parse_config(config(corpus[0], on_dask)), "substring", runner=runner)
        finally:
            runner.close()
    assert snapshot(on_dask) == snapshot(out)


def test_output_on_s3_is_the_local_outputs(
    corpus, run, s3_bucket, s3_client, moto_endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output on a real S3-protocol server (moto_server on loopback): the stage reads
    and writes only through the store (its hash files listed and sized there)."""
    out, _ = run
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    cfg = config(corpus[0], out)
    cfg["output"] = f"s3://{s3_bucket}/substring"
    prep(cfg)
    for f in sorted((out / "docs" / "substring").glob("*.parquet")):
        key = f"substring/docs/substring/{f.name}"
        assert s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == f.read_bytes()
