"""Splitting an uncompressed WARC into parts that start at records: read one after the
other, the parts give exactly what the whole file gives (ids, locations, texts, reasons,
sizes), damage included, for any unit size; a prep over a split archive keeps the same ids
and accounting for any unit size and worker count. Compressed archives stay whole."""

from __future__ import annotations

import gzip
import itertools
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import dataprep.stages.ingest as ingest
from dataprep.config import ExtractConfig, SourceConfig, parse_config
from dataprep.formats import BadRecord, InputFile, RawDoc
from dataprep.pipeline import run_prep
from dataprep.readers import read_local, split_input
from dataprep.stages.ingest import plan_units
from tests.support.helpers import shared_file
from tests.unit.dataprep.test_warc import offsets
from tests.unit.dataprep.warc_files import Rec, crawl, page, write_warc

Out = list[RawDoc | BadRecord]


def whole(p: Path, fmt: str = "warc") -> InputFile:
    return InputFile("web", str(p), p.name, fmt, p.stat().st_size)


def read(files: list[InputFile]) -> Out:
    out: Out = []
    for f in files:
        src = SourceConfig(name="web", paths=[f.uri], format=f.format)
        out += read_local(src, f, f.uri, 16 << 20, ExtractConfig(timeout_s=None))
    return out


def _damaged(p: Path) -> None:
    """crawl() with record 2 declaring 40 bytes fewer than it has, garbage before record 6,
    and the separator after record 4's block missing (the next header right after it)."""
    write_warc(p, crawl(), gzip=False)
    data = p.read_bytes()
    starts = offsets(p)
    # Record 4's block ends with "\r\n\r\n" just before record 5: drop those 4 bytes.
    assert data[starts[5] - 4 : starts[5]] == b"\r\n\r\n"
    data = data[: starts[5] - 4] + data[starts[5] :]
    head_end = data.index(b"\r\n\r\n", starts[2])
    cl = data.rindex(b"Content-Length: ", starts[2], head_end)
    n = int(data[cl + 16 : head_end])
    bad = data[:cl] + f"Content-Length: {n - 40}".encode() + data[head_end:]
    g = starts[6] + len(bad) - len(data) - 4
    p.write_bytes(bad[:g] + b"this is not a record\r\n" * 3 + bad[g:])


def _archives(tmp: Path) -> list[tuple[Path, str]]:
    out = []
    for version in ("WARC/1.0", "WARC/1.1"):
        p = tmp / f"clean-{version[-1]}.warc"
        write_warc(p, crawl(), gzip=False, version=version)
        out.append((p, "warc"))
    _damaged(tmp / "damaged.warc")
    out.append((tmp / "damaged.warc", "warc"))
    cut = tmp / "cut.warc"
    write_warc(cut, crawl(), gzip=False)
    cut.write_bytes(cut.read_bytes()[: offsets(cut)[7] + 300])  # inside the last page
    out.append((cut, "warc"))
    wet = tmp / "c.wet"
    texts = [Rec(f"https://w/{i}", f"text {i} ".encode() * 30, kind="conversion") for i in range(5)]
    for r in texts:
        r.content_type = "text/plain"
    write_warc(wet, texts, gzip=False)
    out.append((wet, "wet"))
    garbage = tmp / "g.warc"
    garbage.write_bytes(b"<html>not an archive</html>\n" * 40)
    out.append((garbage, "warc"))
    return out


def test_parts_read_exactly_like_the_whole_file(tmp_path: Path) -> None:
    for p, fmt in _archives(tmp_path):
        f = whole(p, fmt)
        serial = read([f])
        size = f.size
        records = [0, *sorted({int(r.location.split("=")[1].split()[0]) for r in serial})]
        # Every size from one byte (every eligible record starts a part) to the file, and
        # each record start and the bytes either side of it.
        units = {1, 2, 97, 1000, 4096, size - 1, *(o + d for o in records for d in (-1, 0, 1))}
        n_parts = set()
        for unit in sorted(u for u in units if 0 < u < size):
            parts = split_input(f, unit)
            n_parts.add(len(parts))
            assert parts[0].start == 0 and parts[-1].end is None
            assert all(a.end == b.start for a, b in itertools.pairwise(parts))
            assert sum(q.size for q in parts) == size
            assert read(parts) == serial, (p.name, unit)
        if p.name != "g.warc":
            assert max(n_parts) > 3, p.name
    # The damage is what the whole-file reader makes of it (test_warc), kept by the parts.
    got = Counter(
        r.reason
        for r in read(split_input(whole(tmp_path / "damaged.warc"), 1))
        if isinstance(r, BadRecord)
    )
    assert got["corrupt_record"] == 1 and got["corrupt_file"] == 2


def test_every_record_after_a_record_starts_a_part_at_one_byte(tmp_path: Path) -> None:
    p = tmp_path / "c.warc"
    write_warc(p, crawl(), gzip=False)
    assert [q.start for q in split_input(whole(p), 1)] == offsets(p)


def test_the_shared_crawl_uncompressed_splits_exactly(tmp_path: Path) -> None:
    p = tmp_path / "docs.warc"
    p.write_bytes(gzip.decompress(shared_file("web_python_docs.warc.gz").read_bytes()))
    parts = split_input(whole(p), 2 << 20)
    assert len(parts) >= 10
    assert read(parts) == read([whole(p)])


def test_compressed_archives_stay_one_unit(tmp_path: Path) -> None:
    per_record = tmp_path / "c.warc.gz"
    write_warc(per_record, crawl())
    plain = tmp_path / "p.warc"
    write_warc(plain, crawl(), gzip=False)
    whole_gz = tmp_path / "w.warc.gz"
    whole_gz.write_bytes(gzip.compress(plain.read_bytes()))
    for p in (per_record, whole_gz):
        assert split_input(whole(p), 100) == [whole(p)]


# -- a prep over a split archive ----------------------------------------------------------


def _crawl(path: Path) -> None:
    """Pages (some exact and near copies of others), and what is not a page."""
    recs = crawl()
    for i in range(24):
        recs.append(Rec(f"https://b.example/{i}", page(f"Page{i % 18}", words=60 + i % 18)))
    recs.append(
        Rec(
            "https://b.example/near",
            page("Page3", 63).replace(b"more to say", b"more to tell"),
        )
    )
    recs.append(Rec("https://porn.example/x", page("Blocked")))
    write_warc(path, recs, gzip=False)


def _config(data: Path, out: Path, workers: int) -> dict:
    return {
        "output": str(out),
        "workers": workers,
        "sources": [{"name": "web", "paths": [str(data)]}],
        "ingest": {"extract": {"timeout_s": None}, "shard_docs": 5},
        "dedup": {"exact": True, "near": {"threshold": 0.7}},
        "quality": ["url"],
        "pack": {"seq_len": 64},
    }


def _outcome(out: Path, report: dict) -> tuple:
    rows = {}
    for kind in ("docs", "dropped"):
        for stage in ("ingest", "exact", "near", "quality"):
            got = []
            for f in sorted((out / kind / stage).glob("*.parquet")):
                cols = ["id"] if kind == "docs" else ["id", "reason", "detail", "location"]
                got += pq.read_table(f, columns=cols).to_pylist()
            rows[kind, stage] = sorted(got, key=lambda r: r["id"])
    stats = {
        name: {
            s: {k: v[k] for k in ("docs_in", "kept", "dropped")} for s, v in st["sources"].items()
        }
        for name, st in report["stages"].items()
    }
    return rows, stats


def test_prep_of_a_split_archive_is_the_same_for_any_unit_and_worker_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "crawl.warc"
    _crawl(data)
    size = data.stat().st_size
    cfg = _config(data, tmp_path / "whole", 1)
    assert len(plan_units(parse_config(cfg))) == 1
    base = _outcome(tmp_path / "whole", run_prep(parse_config(cfg), progress=False))
    (rows, stats) = base
    assert stats["ingest"]["web"]["docs_in"] == 35
    assert {r["reason"] for r in rows["dropped", "exact"]} == {"exact_dup"}
    assert [r["reason"] for r in rows["dropped", "near"]] == ["near_dup"]
    assert [r["reason"] for r in rows["dropped", "quality"]] == ["url:adult_words"]
    for unit, workers in ((size // 7, 1), (size // 7, 2), (size // 3 + 1, 2)):
        monkeypatch.setattr(ingest, "UNIT_BYTES", unit)
        cfg = _config(data, tmp_path / f"u{unit}-w{workers}", workers)
        assert len(plan_units(parse_config(cfg))) >= 3
        report = run_prep(parse_config(cfg), progress=False)
        assert _outcome(tmp_path / f"u{unit}-w{workers}", report) == base, (unit, workers)
