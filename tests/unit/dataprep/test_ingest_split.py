"""Tests for splitting one big input into several ingest units: jsonl by byte ranges
aligned to line starts, parquet by row groups; compressed files stay whole. Every split
read must give exactly what a serial read of the whole file gives."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import dataprep.readers as readers
from core.store import StorageOptions
from dataprep.config import PrepConfig, SourceConfig, parse_config
from dataprep.formats import BadRecord, InputFile, RawDoc, jsonl
from dataprep.layout import SourceStats, dropped_key, output_store, read_docs, read_done
from dataprep.readers import read_file, resolve_inputs, split_input
from dataprep.records import parquet_bytes_to_table
from dataprep.stages.ingest import SPLITS_KEY, Splits, Unit, ingest_unit, plan_units

OPTS = StorageOptions()
MAX_DOC = 64  # small, so that a modest record is `too_large` by max_doc_bytes
LINE_LIMIT = 6 * MAX_DOC + (1 << 20)  # formats.jsonl.line_limit: longer lines are not parsed
UNIT_SIZES = (1, 7, 100, 4096)

Rec = RawDoc | BadRecord


def src(path: Path, **kw: Any) -> SourceConfig:
    return SourceConfig(name="s", paths=[str(path)], **kw)


def one_input(source: SourceConfig) -> InputFile:
    (f,) = resolve_inputs(source, OPTS)
    return f


def read(source: SourceConfig, files: list[InputFile]) -> list[Rec]:
    return [r for f in files for r in read_file(source, f, OPTS, MAX_DOC)]


def tricky_jsonl() -> bytes:
    """Every kind of line the jsonl reader treats specially, some long enough that unit
    boundaries fall inside them, ending without a newline."""
    lines = [
        b'\xef\xbb\xbf{"text": "bom on line one"}\n',
        b'{"text": "plain", "n": 1}\n',
        b"\n",  # blank
        b"   \t \n",  # whitespace only
        b'{"text": "crlf"}\r\n',
        b"\r\n",  # blank, CRLF
        b"{not json\n",
        b'{"text": "caf\xff bad utf8"}\n',
        b'\xef\xbb\xbf{"text": "bom not on line one"}\n',  # invalid json there
        b'{"text": "' + b"y" * 200 + b'"}\n',  # too_large by max_doc_bytes
        b'{"text": "' + b"z" * (LINE_LIMIT + 5000) + b'"}\n',  # too_large line, not parsed
        b'{"text": "after the long line \xe2\x82\xac"}\r\n',
        b'{"text": "\xc3"}\n',  # invalid utf8 after the long line: offset is the file's
        b"[1, 2]\n",
        b'{"body": "no text field"}\n',
        b'{"text": "id field", "id": "doc-x"}\n',
    ]
    lines += [
        json.dumps({"text": f"filler {i} " + "w" * (i % 13)}).encode() + b"\n" for i in range(40)
    ]
    lines.append(b'{"text": "last line, no newline"}')
    return b"".join(lines)


def line_starts(data: bytes) -> list[int]:
    return [0] + [m.end() for m in re.finditer(b"\n", data) if m.end() < len(data)]


def naive_first_line_at(data: bytes, pos: int) -> tuple[int, int]:
    """(offset, 1-based number) of the first line starting at or after pos; the oracle."""
    for n, s in enumerate(line_starts(data), start=1):
        if s >= pos:
            return s, n
    return len(data), len(line_starts(data)) + 1


# --------------------------------------------------------------------------------------
# jsonl byte ranges
# --------------------------------------------------------------------------------------


def boundary_unit_sizes(data: bytes) -> list[int]:
    # A unit size that puts a boundary exactly on a line start, one just before, one after.
    s = line_starts(data)[20]
    return [s - 1, s, s + 1]


@pytest.mark.parametrize("block", [None, 5])
def test_jsonl_split_reads_exactly_like_serial(
    tmp_path: Path, block: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block is not None:  # tiny planning blocks: line starts found across block edges
        monkeypatch.setattr(jsonl, "_PLAN_BLOCK", block)
    data = tricky_jsonl()
    p = tmp_path / "big.jsonl"
    p.write_bytes(data)
    for kw in ({}, {"id_field": "id"}):
        source = src(p, **kw)
        whole = one_input(source)
        serial = read(source, [whole])
        reasons = {r.reason for r in serial if isinstance(r, BadRecord)}
        assert reasons == {
            "empty_line",
            "invalid_json",
            "invalid_utf8",
            "too_large",
            "not_an_object",
            "missing_text",
        }
        # A BOM is dropped on line 1 of the file only, not on the first line of a part.
        assert [r.reason for r in serial if r.location == "big.jsonl:9"] == ["invalid_json"]
        assert serial[0] == RawDoc("s/big.jsonl:1", "bom on line one", {}, "big.jsonl:1")
        for unit in (*UNIT_SIZES, *boundary_unit_sizes(data)):
            parts = split_input(whole, unit)
            assert len(parts) > 1
            assert parts[0].start == 0 and parts[0].first_record == 1
            assert parts[-1].end is None
            assert all(a.end == b.start for a, b in itertools.pairwise(parts))
            # Parts start at line starts (test_part_starts_match_a_naive_oracle: which).
            assert all(data[q.start - 1] == 0x0A for q in parts[1:])
            if unit == 1:  # every line starts a part
                assert [q.start for q in parts] == line_starts(data)
            assert read(source, parts) == serial, unit
            assert sum(q.size for q in parts) == len(data)


def test_part_starts_match_a_naive_oracle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tricky_jsonl()[:3000] + b"\n\n" + b"x" * 50 + b"\n"  # ends with newlines
    p = tmp_path / "o.jsonl"
    p.write_bytes(data)
    for block in (1, 3, 64, 1 << 20):
        monkeypatch.setattr(jsonl, "_PLAN_BLOCK", block)
        for unit in (1, 2, 5, 17, 333, 2999, 3001):
            want: list[tuple[int, int]] = [(0, 1)]
            for b in range(unit, len(data), unit):
                s = naive_first_line_at(data, b)
                if s[0] < len(data) and s != want[-1]:
                    want.append(s)
            got = jsonl.part_starts(str(p), len(data), unit)
            assert got == want, (block, unit)


def test_reader_aligns_arbitrary_ranges(tmp_path: Path) -> None:
    """The reader itself honours [start, end) at any offsets, not only planned ones: it
    begins at the first line start >= start and stops before the first one >= end."""
    data = tricky_jsonl()
    p = tmp_path / "r.jsonl"
    p.write_bytes(data)
    source = src(p)
    whole = one_input(source)
    serial = read(source, [whole])
    long_line = data.index(b"z" * 100)  # a cut inside the too-long line, too
    cuts = [0, 1, 2, 30, 31, 57, long_line, long_line + 70_000, len(data) - 3]
    parts = []
    for i, c in enumerate(cuts):
        end = cuts[i + 1] if i + 1 < len(cuts) else None
        parts.append(replace(whole, start=c, end=end, first_record=naive_first_line_at(data, c)[1]))
    assert read(source, parts) == serial


def test_split_keeps_invalid_utf8_file_offset(tmp_path: Path) -> None:
    data = tricky_jsonl()
    p = tmp_path / "u.jsonl"
    p.write_bytes(data)
    source = src(p)
    parts = split_input(one_input(source), 4096)
    bad = [
        r
        for r in read(source, parts[1:])
        if isinstance(r, BadRecord) and r.reason == "invalid_utf8"
    ]
    assert len(bad) == 1
    want = data.index(b'{"text": "\xc3"}') + len(b'{"text": "')
    assert f"(byte {want} of the stream)" in bad[0].detail
    line_no = data[:want].count(b"\n") + 1
    assert bad[0].location == f"u.jsonl:{line_no}"


def test_one_line_longer_than_a_unit_is_not_split(tmp_path: Path) -> None:
    p = tmp_path / "one.jsonl"
    p.write_bytes(b'{"text": "' + b"a" * 5000 + b'"}\n')
    f = one_input(src(p))
    assert split_input(f, 100) == [f]
    assert split_input(f, f.size) == [f]  # not bigger than a unit


# --------------------------------------------------------------------------------------
# plan_units and the whole ingest
# --------------------------------------------------------------------------------------


def prep_config(paths: list[Path], out: Path, shard_docs: int = 7, **source: Any) -> PrepConfig:
    return parse_config(
        {
            "output": str(out),
            "sources": [{"name": "web", "paths": [str(p) for p in paths], **source}],
            "ingest": {"shard_docs": shard_docs, "max_doc_bytes": MAX_DOC},
        }
    )


def run_ingest(cfg: PrepConfig, units: list[Unit]) -> tuple[pa.Table, pa.Table, dict]:
    """Concatenated kept documents, dropped rows and summed stats of the units, in order."""
    store = output_store(cfg)
    kept: list[pa.Table] = []
    dropped: list[pa.Table] = []
    stats = SourceStats()
    for u in units:
        ingest_unit(cfg, u)
        marker = read_done(store, "ingest", u.name)
        kept += [read_docs(store, "ingest", s) for s in marker["shards"]]
        if store.exists(dropped_key("ingest", u.name)):
            dropped.append(parquet_bytes_to_table(store.get(dropped_key("ingest", u.name))))
        stats.merge(SourceStats.from_json(marker["stats"]["web"]))
    return pa.concat_tables(kept), pa.concat_tables(dropped), stats.to_json()


def test_whole_ingest_split_equals_one_unit(tmp_path: Path) -> None:
    data = tricky_jsonl()
    d = tmp_path / "in"
    d.mkdir()
    (d / "big.jsonl").write_bytes(data)
    one = prep_config([d / "big.jsonl"], tmp_path / "one")
    split = prep_config([d / "big.jsonl"], tmp_path / "split")
    assert len(plan_units(one)) == 1
    units = plan_units(split, unit_bytes=300)
    assert len(units) > 5
    assert plan_units(split, unit_bytes=300) == units  # deterministic
    assert [u.name for u in units] == [f"u{i:05d}" for i in range(len(units))]
    assert pickle.loads(pickle.dumps(units)) == units
    assert len({f for u in units for f in u.files}) == len(units)  # hashable, distinct
    k1, d1, s1 = run_ingest(one, plan_units(one))
    k2, d2, s2 = run_ingest(split, units)
    assert k1.num_rows > 40 and d1.num_rows > 8
    assert k2.to_pylist() == k1.to_pylist()
    assert d2.to_pylist() == d1.to_pylist()
    assert s2 == s1


def test_small_files_grouped_as_before_big_one_split(tmp_path: Path) -> None:
    d = tmp_path / "in"
    d.mkdir()
    small = b"".join(json.dumps({"text": f"t{i}"}).encode() + b"\n" for i in range(20))
    for name in ("a.jsonl", "c.jsonl", "d.jsonl", "e.jsonl"):
        (d / name).write_bytes(small)
    (d / "b.jsonl").write_bytes(tricky_jsonl())
    cfg = prep_config([d], tmp_path / "out")
    unit = 2 * len(small) + 10  # two small files fit a unit, three do not
    units = plan_units(cfg, unit_bytes=unit)
    rels = [[(f.rel, f.is_part) for f in u.files] for u in units]
    assert rels[0] == [("in/a.jsonl", False)]
    assert all(r == [("in/b.jsonl", True)] for r in rels[1:-2])
    assert rels[-2:] == [[("in/c.jsonl", False), ("in/d.jsonl", False)], [("in/e.jsonl", False)]]
    # Without a big file, the plan is the same as with the default unit size.
    for p in d.glob("b.jsonl"):
        p.unlink()
    assert [[f.rel for f in u.files] for u in plan_units(cfg)] == [
        ["in/a.jsonl", "in/c.jsonl", "in/d.jsonl", "in/e.jsonl"]
    ]
    assert all(not f.is_part for u in plan_units(cfg) for f in u.files)


@pytest.mark.parametrize("ext", ["jsonl.gz", "jsonl.zst", "txt"])
def test_compressed_and_txt_stay_one_unit(tmp_path: Path, ext: str) -> None:
    data = tricky_jsonl()
    p = tmp_path / f"big.{ext}"
    if ext.endswith("gz"):
        p.write_bytes(gzip.compress(data))
    elif ext.endswith("zst"):
        p.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        p.write_bytes(data)
    cfg = prep_config([p], tmp_path / "out")
    units = plan_units(cfg, unit_bytes=100)
    assert len(units) == 1
    (f,) = units[0].files
    assert f.size > 100 and not f.is_part and f == one_input(cfg.sources[0])


def test_reading_a_part_of_a_compressed_file_refuses(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl.gz"
    p.write_bytes(gzip.compress(tricky_jsonl()))
    source = src(p)
    with pytest.raises(readers.IngestError, match="cannot read this part"):
        read(source, [replace(one_input(source), start=10, end=200, first_record=2)])


# --------------------------------------------------------------------------------------
# parquet row groups
# --------------------------------------------------------------------------------------


def parquet_rows(n: int) -> list[dict]:
    rows: list[dict] = [{"text": f"row {i} " + "p" * (i % 17), "id": None} for i in range(n)]
    rows[13]["text"] = None  # wrong_type
    rows[41]["text"] = "q" * 100  # too_large
    rows[77]["id"] = "named-77"
    return rows


def test_parquet_split_by_row_groups(tmp_path: Path) -> None:
    p = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(parquet_rows(95)), p, row_group_size=10)
    md = pq.read_metadata(p)
    assert md.num_row_groups == 10
    rg_bytes = [
        sum(
            md.row_group(i).column(c).total_compressed_size
            for c in range(md.row_group(i).num_columns)
        )
        for i in range(10)
    ]
    source = src(p, id_field="id")
    whole = one_input(source)
    serial = read(source, [whole])
    assert len(serial) == 95
    assert serial[-1].location == "t.parquet#row=95"
    for unit in (1, max(rg_bytes) * 2, max(rg_bytes) * 3 + 1):
        parts = split_input(whole, unit)
        assert 1 < len(parts) <= 10
        assert parts[0].row_groups is not None and parts[0].row_groups[0] == 0
        assert parts[-1].row_groups is not None and parts[-1].row_groups[1] == 10
        for a, b in itertools.pairwise(parts):
            assert a.row_groups is not None and b.row_groups is not None
            assert a.row_groups[1] == b.row_groups[0]
            assert b.first_record == 1 + 10 * b.row_groups[0]
        assert all(q.size <= unit for q in parts if q.row_groups[1] - q.row_groups[0] > 1)
        assert read(source, parts) == serial
    assert len(split_input(whole, 1)) == 10


def test_parquet_one_row_group_stays_whole(tmp_path: Path) -> None:
    p = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist(parquet_rows(95)), p, row_group_size=1000)
    f = one_input(src(p))
    assert split_input(f, 1) == [f]
    cfg = prep_config([p], tmp_path / "out")
    assert [u.files for u in plan_units(cfg, unit_bytes=1)] == [(replace(f, source="web"),)]


def test_a_later_plan_takes_an_unchanged_files_parts_from_the_output(tmp_path: Path) -> None:
    """Splits: the parts are kept in the output and reused while the file's size and
    version tag stand; the proof it was not read again: bytes changed under the same size
    and mtime still give the recorded parts, where a fresh split finds other ones."""
    d = tmp_path / "in"
    d.mkdir()
    big = d / "big.jsonl"
    big.write_bytes(tricky_jsonl())
    cfg = prep_config([big], tmp_path / "out")
    store = output_store(cfg)
    first = Splits.load(store)
    units = plan_units(cfg, unit_bytes=300, splits=first)
    first.save(store)
    assert store.exists(SPLITS_KEY) and len(units) > 5

    st = big.stat()
    data = big.read_bytes()
    moved = data.replace(b"\n", b" ", 3)  # the first line starts move, the size stays
    big.write_bytes(moved)
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = Splits.load(store)
    assert plan_units(cfg, unit_bytes=300, splits=again) == units
    assert plan_units(cfg, unit_bytes=300) != units  # what reading the file gives now
    before = store.get(SPLITS_KEY)
    again.save(store)
    assert store.get(SPLITS_KEY) == before  # nothing new: not rewritten

    # A touched file (a new tag) is split afresh, and the record follows it.
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = Splits.load(store)
    fresh = plan_units(cfg, unit_bytes=300, splits=touched)
    assert fresh == plan_units(cfg, unit_bytes=300) != units
    touched.save(store)
    assert len(json.loads(store.get(SPLITS_KEY))) == 1  # the old file's entry is gone
