"""The partitioned run-once steps (`max_task_memory`, issue Scale III): exact select split
by hash range across tasks writes the single task's bytes, whatever the number of ranges,
for a first version and for a later one deduplicated against it; no range holds more
documents than the bound allows, and the bytes per document the bound is computed from are
what a task really holds."""

from __future__ import annotations

import io
import itertools
import json
import random
import signal
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from dataprep.config import parse_config
from dataprep.layout import output_store
from dataprep.partition import (
    BINS,
    cut,
    histogram,
    histogram_bytes,
    in_range,
    split_bits,
    split_files_in,
)
from dataprep.pipeline import FAILPOINT_ENV, run_prep
from dataprep.stages import dup_shuffle, exact, exact_ranges, near_parts
from tests.support.helpers import read_jsonl, run_cli, shared_file, write_jsonl

# Files that differ between two runs of one config by design (the run's identity, when it
# finished, timings and the plan in the report), and the files that only one of the two
# select forms writes (its own intermediate files and markers).
VOLATILE = (
    "_run.json",
    "_versions/v0001.json",
    "_versions/v0002.json",
    "_versions/v0002.plan.json",
)
ONE_FORM_ONLY = (
    "exact/ranges/",
    "exact/split/",
    "near/cc/",
    "near/ranges/",
    "exact/dups.json",
    "mixture/keys/",
    "mixture/hist/",
    "mixture/boundary/",
    "mixture/cut.json",
    "mixture/taken.npy",
    "mixture/resolved.json",
    # The dedup index (dataprep/dedup_index.py) and what each select form read of it.
    "_index/",
    "exact/index.json",
    "exact/index/",
)


# The partitioned steps' plans, in the report besides what both forms report (and what
# the single-task exact select read of the dedup index).
PLANS = (
    "exact_index",
    exact_ranges.PLAN_KEY,
    near_parts.PLAN_KEY,
    near_parts.ROUND_KEY,
    near_parts.REPLAY_KEY,
)


def corpus(root: Path, n: int, seed: int) -> list[Path]:
    """Two sources of real web text, a third of the documents exact copies of others
    (within and across sources), some near copies: several shards each."""
    rng = random.Random(seed)
    web = [r["text"] for r in read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 200)]
    paths = []
    for name in ("a", "b"):
        rows = []
        for i in range(n):
            r = rng.random()
            if r < 0.33:
                text = rng.choice(web[:60])  # a copy: most of these 60 repeat
            elif r < 0.4:
                words = rng.choice(web).split()
                text = " ".join([*words[:-1], "tail"])  # a near copy
            else:
                text = rng.choice(web[60:]) + f" ({name}{i})"  # distinct
            rows.append({"id": f"{name}{seed}-{i}", "text": text})
        root.mkdir(parents=True, exist_ok=True)
        paths.append(write_jsonl(root / f"{name}.jsonl", rows))
    return paths


def config(data: Path, out: Path, max_task_memory: int | None, workers: int = 1) -> dict:
    cfg: dict[str, Any] = {
        "output": str(out),
        "workers": workers,
        "sources": [
            {"name": "a", "paths": [str(data / "a*.jsonl")], "id_field": "id", "weight": 0.9},
            {"name": "b", "paths": [str(data / "b*.jsonl")], "id_field": "id", "weight": 0.1},
        ],
        # a is repeated 2.5 times and b sampled down: the plan's remainders are not zero,
        # so both of its partitioned selections (whole bins, and inside the crossing bin)
        # choose documents.
        "mixture": {"max_epochs": 2.5},
        "ingest": {"shard_docs": 37},
        "quality": ["gopher_repetition"],
        "pack": {"seq_len": 128},
        "dataset": {"pack_partitions": 2, "train_shards": 2},
    }
    if max_task_memory is not None:
        cfg["max_task_memory"] = max_task_memory
    return cfg


def files(out: Path) -> dict[str, bytes]:
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and not any(s in p.as_posix() for s in ONE_FORM_ONLY)
    }


def assert_same_output(single: Path, parted: Path) -> None:
    """Every file of both runs, byte for byte: the dataset's shards, its manifest, the
    documents of every stage, dropped/; the report apart from timings and the plan."""
    a, b = files(single), files(parted)
    assert sorted(a) == sorted(b)
    assert any(k.startswith("dropped/exact/") for k in a)
    assert any(k.endswith("manifest.json") for k in a)
    for key in a:
        if key in VOLATILE:
            continue
        if key.endswith("report.json"):
            ra, rb = json.loads(a[key]), json.loads(b[key])
            for r in (ra, rb):
                for k in ("stage_seconds", "step_seconds", "step_epoch_seconds"):
                    r.pop(k, None)
                r["dataset"].pop("uri")
                for k in PLANS:
                    r.pop(k, None)
            assert ra == rb, key
        else:
            assert a[key] == b[key], key


def memory_for(data: Path, out: Path, parts: int) -> int:
    """A max_task_memory that splits the hashes of a run (hashed already, in `out`)
    into `parts` ranges or more: the cap is the total over `parts`."""
    cfg = parse_config(config(data, out, None))
    store = output_store(cfg)
    n = sum(
        len(exact.load_hashes(store, k.split("/")[-1].removesuffix(".npy")))
        for k in store.list("exact/hashes/")
    )
    return -(-n // parts) * exact_ranges.SELECT_DOC_BYTES


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("partitioned")
    corpus(root / "data", 160, seed=1)
    out = root / "single"
    run_prep(parse_config(config(root / "data", out, None)), progress=False)
    return root / "data", out


@pytest.mark.parametrize("parts", [2, 3, 7])
def test_partitioned_steps_write_the_single_task_bytes(single, tmp_path, parts):
    """Exact select over `parts` hash ranges or more, near clustering over components
    and the mixture plan a shard at a time: every file as the single tasks write it."""
    data, ref = single
    out = tmp_path / "parted"
    mem = memory_for(data, ref, parts)
    report = run_prep(parse_config(config(data, out, mem)), progress=False)
    plan = report[exact_ranges.PLAN_KEY]
    assert plan["partitions"] >= parts
    assert report["stages"]["exact"]["total"]["dropped"]  # there were duplicates to find
    cut = json.loads((out / "v0001" / "mixture" / "cut.json").read_text())
    # Both sources end inside a bin (a: 2 epochs and part of a third; b: sampled down).
    assert {k: (v["full"], v["rem"] > 0, v["bin"] >= 0) for k, v in cut["components"].items()} == {
        "a": (2, True, True),
        "b": (0, True, True),
    }
    assert report["stages"]["mixture"]["total"]["dropped"]["downsampled"] > 0
    # Near clustering: components over several partitions, replayed in several.
    assert report[near_parts.PLAN_KEY]["parts"] > 1
    assert report[near_parts.REPLAY_KEY]["replay"] > 1
    assert report["near"]["removed"] > 0
    assert_same_output(ref, out)


def test_keepers_sending_in_batches_writes_the_single_task_bytes(single, tmp_path, monkeypatch):
    """keepers sends its pairs on in batches of max_task_memory's worth: with a batch per
    partition read (a cap of one pair), the duplicates' shards get several pieces from one
    kept shard, and the output is still the single tasks' bytes."""
    monkeypatch.setattr(dup_shuffle, "PAIR_BYTES", 1 << 40)
    data, ref = single
    out = tmp_path / "parted"
    run_prep(parse_config(config(data, out, memory_for(data, ref, 3))), progress=False)
    pieces = [p.name for p in (out / "v0001").rglob("dup/*/*.parquet")]
    assert any(name.endswith("-s00001.parquet") for name in pieces), pieces
    assert_same_output(ref, out)


def test_a_partition_holds_no_more_than_the_bound_allows(single, tmp_path):
    data, ref = single
    out = tmp_path / "parted"
    mem = memory_for(data, ref, 5)
    report = run_prep(parse_config(config(data, out, mem)), progress=False)
    plan = report[exact_ranges.PLAN_KEY]
    cap = mem // exact_ranges.SELECT_DOC_BYTES
    assert plan["cap_documents"] == cap
    cfg = parse_config(config(data, out, mem))
    held = [
        exact_ranges.read_select_marker(cfg, item)["documents"]
        for item in exact_ranges.ranges(plan)
    ]
    # What each task held, as it counted it: every document once, none over the cap.
    assert sum(held) == plan["documents"] == report["stages"]["exact"]["total"]["docs_in"]
    assert max(held) <= cap
    assert len(held) >= 5
    # Near clustering's replay tasks: every candidate once, none over its cap (this
    # corpus's components, a few near copies each, are far smaller than one).
    rp = report[near_parts.REPLAY_KEY]
    assert rp["cap_candidates"] == mem // near_parts.CANDIDATE_BYTES
    replayed = [
        json.loads(
            (
                out / "v0001" / near_parts.replay_done_key(f"{rp['cc']}.{rp['route']}.r{r:05d}")
            ).read_text()
        )
        for r in range(rp["replay"])
    ]
    assert sum(m["held"] for m in replayed) == rp["candidates"] > 0
    assert max(m["held"] for m in replayed) <= rp["cap_candidates"]
    assert rp["replay"] > 1


def test_a_later_version_partitioned_matches_the_single_task(tmp_path):
    """Version 2 adds copies of version 1's documents: both versions' files, partitioned
    (on a pool of 2 processes) and not, are the same bytes; the copies are dropped naming
    version 1's documents."""
    data = tmp_path / "data"
    corpus(data, 90, seed=2)
    runs = {"single": None, "parted": 3000}
    for name, mem in runs.items():
        run_prep(parse_config(config(data, tmp_path / name, mem, workers=2)), progress=False)
    old = read_jsonl(data / "a.jsonl")
    rows = [{"id": f"copy-{i}", "text": old[i * 7]["text"]} for i in range(8)]
    # More new documents than one range holds: with the dedup index, a later version's
    # ranges are cut from its new hashes alone (the earlier ones are looked up).
    rows += [{"id": f"new-{i}", "text": f"a new document {i} " * 40} for i in range(40)]
    write_jsonl(data / "a2.jsonl", rows)
    for name, mem in runs.items():
        report = run_prep(
            parse_config(config(data, tmp_path / name, mem, workers=2)), progress=False
        )
        assert report["version"]["version"] == 2
        if mem is not None:
            assert report[exact_ranges.PLAN_KEY]["partitions"] > 1
    assert_same_output(tmp_path / "single", tmp_path / "parted")
    dropped = pq.read_table(
        tmp_path / "parted" / "dropped" / "exact" / "v0002-u00000-p0000.parquet"
    )
    kept = {r["id"]: r["detail"] for r in dropped.to_pylist()}
    first = {}
    for r in old:
        first.setdefault(r["text"], r["id"])
    assert kept == {f"copy-{i}": first[old[i * 7]["text"]] for i in range(8)}


def _hash_files(out: Path, shards: int, docs: int, distinct: int) -> Any:
    """Hash files of `shards` shards as the hash step writes them for a partitioned run
    (the whole file, the histogram and the sorted split), drawn from `distinct` hashes;
    max_task_memory large enough for one range."""
    cfg = parse_config(
        {
            "output": str(out),
            "sources": [{"name": "a", "paths": [str(out)]}],
            "max_task_memory": "1TB",
        }
    )
    store = output_store(cfg)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 2**64 - 1, size=(distinct, 2), dtype=np.uint64)
    names = [f"s{i:03d}" for i in range(shards)]
    for s in names:
        h = pool[rng.integers(0, distinct, docs)]
        store.put(exact.hist_key(s), histogram_bytes(h[:, 0]))
        exact.write_split(store, s, h)
        buf = io.BytesIO()
        np.save(buf, h)
        store.put(exact.hashes_key(s), buf.getvalue())
    return cfg, names


@pytest.mark.parametrize("distinct", [1000, 100_000, 10_000_000])
def test_a_select_task_holds_at_most_its_bytes_per_document(tmp_path, distinct):
    """One select task over 200k documents (99.5%, 30% and ~1% duplicates): what it
    allocates at its peak, per document held, is within SELECT_DOC_BYTES, the figure the
    partition count is computed from."""
    cfg, names = _hash_files(tmp_path, 20, 10_000, distinct)
    (item,) = exact_ranges.ranges(exact_ranges.plan(cfg, names))
    tracemalloc.start()
    try:
        held = exact_ranges.select_range(cfg, [], names, item)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held == 200_000
    assert peak / held <= exact_ranges.SELECT_DOC_BYTES


def test_ranges_are_cut_at_the_cap_and_cover_every_bin():
    rng = np.random.default_rng(3)
    counts = histogram(rng.integers(0, 2**64, 5000, dtype=np.uint64))
    for cap in (1, 50, 700, 5000):
        ranges = cut(counts, cap)
        assert ranges[0][0] == 0 and ranges[-1][1] == BINS
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        # over the cap only where one bin alone is: the finest cut there is
        assert all(counts[lo:hi].sum() <= max(cap, counts[lo:hi].max()) for lo, hi in ranges)
        assert any(counts[lo:hi].sum() > cap for lo, hi in ranges) == (counts.max() > cap)
    assert len(cut(counts, 5000)) == 1


@pytest.mark.parametrize(
    ("killed_in", "resume_mem"),
    [("mixture: repeats:2", None), ("exact: keepers:3", None), ("exact: select:1", 3000)],
)
def test_a_run_killed_in_one_form_resumes_in_the_other_to_the_same_bytes(
    single, tmp_path, killed_in, resume_mem
):
    """max_task_memory says how a run works, not what it makes (it is not in the config's
    fingerprint): a partitioned run SIGKILLed in its partitioned steps and resumed with one
    task, or a single-task run killed and resumed partitioned, ends with the same bytes."""
    data, ref = single
    out = tmp_path / "out"
    first_mem = 3000 if resume_mem is None else None
    cfg_path = tmp_path / "prep.yaml"
    cfg_path.write_text(yaml.safe_dump(config(data, out, first_mem)))
    r = run_cli("prep", str(cfg_path), "--no-progress", env={FAILPOINT_ENV: killed_in})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not (out / "dataset" / "latest").exists()
    run_prep(parse_config(config(data, out, resume_mem)), progress=False)
    assert_same_output(ref, out)


def test_a_range_task_reads_only_the_split_parts_its_range_overlaps(tmp_path):
    """A shard's hashes sorted and split by top bits: what a range reads from them is what
    filtering the whole hash file gives, from the parts the range overlaps only."""
    cfg, (name,) = _hash_files(tmp_path, 1, 50_000, 40_000)
    store = output_store(cfg)
    whole = exact.load_hashes(store, name)
    parts = store.list(f"exact/split/{name}/")
    assert len(parts) == 1 << split_bits(50_000) > 1
    rng = np.random.default_rng(4)
    for lo, hi in [(0, BINS), (0, 1), (BINS - 1, BINS), *rng.integers(0, BINS, (20, 2)).tolist()]:
        lo, hi = int(min(lo, hi)), int(max(lo, hi)) + (lo == hi)
        h, rows = exact_ranges._in_range(store, name, lo, hi)
        want = np.flatnonzero(in_range(whole[:, 0], lo, hi))
        order = np.argsort(rows)
        assert np.array_equal(rows[order], want)
        assert np.array_equal(h[order], whole[want])
        overlapped = len(split_files_in(split_bits(50_000), lo, hi))
        assert overlapped < len(parts) or hi - lo > BINS // 2
