"""Tests for dataprep.readers: input resolution (and its up-front errors) and every reader,
bad-record kind and location."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import dataprep.readers as readers
from core.store import LocalStore, StorageError, StorageOptions
from dataprep.config import ConfigError, SourceConfig, parse_config
from dataprep.formats import (
    CHOICES,
    FORMATS,
    RAW_LIMIT,
    BadRecord,
    Format,
    InputFile,
    RawDoc,
    Records,
    format_from_name,
    jsonl,
)
from dataprep.readers import IngestError, read_file, resolve_inputs
from tests.support.helpers import SHARED

OPTS = StorageOptions()
BIG = 16 * 1024 * 1024


def src(*paths: Any, **kw: Any) -> SourceConfig:
    return SourceConfig(name=kw.pop("name", "s"), paths=[str(p) for p in paths], **kw)


def read_all(source: SourceConfig, max_doc_bytes: int = BIG) -> list[RawDoc | BadRecord]:
    out: list[RawDoc | BadRecord] = []
    for f in resolve_inputs(source, OPTS):
        out.extend(read_file(source, f, OPTS, max_doc_bytes))
    return out


def docs(recs: list[RawDoc | BadRecord]) -> list[RawDoc]:
    return [r for r in recs if isinstance(r, RawDoc)]


def bads(recs: list[RawDoc | BadRecord]) -> list[BadRecord]:
    return [r for r in recs if isinstance(r, BadRecord)]


def jl(*objs: Any) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


# --------------------------------------------------------------------------------------
# jsonl: every bad-record kind, with its exact location
# --------------------------------------------------------------------------------------


def test_jsonl_every_bad_record_kind(tmp_path: Path) -> None:
    lines = [
        b'{"text": "hello", "a": 1}',  # 1 ok
        b"{not json",  # 2
        b"[1, 2]",  # 3
        b'{"text": "caf\xff"}',  # 4: byte 13 is not UTF-8
        b'{"body": "x", "lang": "en"}',  # 5
        b'{"text": 5}',  # 6
        b'{"text": " \\n\\t "}',  # 7
        b'{"text": "a\\u0000b"}',  # 8
        json.dumps({"text": "x" * 200}).encode(),  # 9: over max_doc_bytes=100
        b'{"text": "fine", "id": 1.5}',  # 10
        b"",  # 11 blank
        b'{"text": "lone \\ud800 surrogate"}',  # 12
        b'{"text": "last", "id": "doc-13"}',  # 13 ok, no trailing newline
    ]
    p = tmp_path / "mixed.jsonl"
    p.write_bytes(b"\n".join(lines))
    recs = read_all(src(p, id_field="id"), max_doc_bytes=100)
    got = [(r.reason if isinstance(r, BadRecord) else "ok", r.location) for r in recs]
    assert got == [
        ("ok", "mixed.jsonl:1"),
        ("invalid_json", "mixed.jsonl:2"),
        ("not_an_object", "mixed.jsonl:3"),
        ("invalid_utf8", "mixed.jsonl:4"),
        ("missing_text", "mixed.jsonl:5"),
        ("wrong_type", "mixed.jsonl:6"),
        ("empty_text", "mixed.jsonl:7"),
        ("nul_bytes", "mixed.jsonl:8"),
        ("too_large", "mixed.jsonl:9"),
        ("bad_id", "mixed.jsonl:10"),
        ("empty_line", "mixed.jsonl:11"),
        ("invalid_utf8", "mixed.jsonl:12"),
        ("ok", "mixed.jsonl:13"),
    ]
    by_line = {r.location.rsplit(":", 1)[1]: r for r in recs}
    assert "Expecting" in by_line["2"].detail and by_line["2"].raw == "{not json"
    assert "array" in by_line["3"].detail
    assert "byte 13" in by_line["4"].detail and "\\xff" in by_line["4"].raw
    assert "'text'" in by_line["5"].detail and "body, lang" in by_line["5"].detail
    assert "integer" in by_line["6"].detail
    assert "index 1" in by_line["8"].detail
    assert "200 bytes" in by_line["9"].detail
    assert "number" in by_line["10"].detail
    assert "surrogate" in by_line["12"].detail
    # Records that parsed carry their id; lines that never parsed do not.
    assert by_line["2"].id is None and by_line["4"].id is None
    assert by_line["6"].id == "s/mixed.jsonl:6"
    first, last = docs(recs)
    assert (first.id, first.text, first.meta) == ("s/mixed.jsonl:1", "hello", {"a": 1})
    assert (last.id, last.meta) == ("doc-13", {"id": "doc-13"})


def test_raw_is_truncated_with_marker(tmp_path: Path) -> None:
    p = tmp_path / "big.jsonl"
    p.write_bytes(b"{" + b"x" * (RAW_LIMIT * 2) + b"\n" + jl({"text": "y" * 5000}))
    recs = read_all(src(p), max_doc_bytes=1000)
    assert [r.reason for r in bads(recs)] == ["invalid_json", "too_large"]
    for r in bads(recs):
        assert len(r.raw) < RAW_LIMIT + 100
    assert bads(recs)[0].raw.endswith("bytes in all]") and "truncated" in bads(recs)[0].raw


def test_line_longer_than_any_valid_record_is_skipped_not_buffered(tmp_path: Path) -> None:
    p = tmp_path / "huge.jsonl"
    limit = jsonl.line_limit(10)
    p.write_bytes(jl({"text": "x" * (limit + 10)}) + jl({"text": "after"}))
    recs = read_all(src(p), max_doc_bytes=10)
    assert [(type(r).__name__, r.location) for r in recs] == [
        ("BadRecord", "huge.jsonl:1"),
        ("RawDoc", "huge.jsonl:2"),
    ]
    assert recs[0].reason == "too_large" and "not parsed" in recs[0].detail  # type: ignore[union-attr]
    assert len(recs[0].raw) < RAW_LIMIT + 100


def test_bad_record_size_is_the_whole_record(tmp_path: Path) -> None:
    """`raw` is cut at RAW_LIMIT for the quarantine row; `size` (what ingest counts in
    bytes_in) is the record's whole length in the input, line ending excluded."""
    parsed = json.dumps({"text": "x" * 300_000}).encode()
    unparsed = json.dumps({"text": "y" * (jsonl.line_limit(1000) + 10)}).encode()
    p = tmp_path / "sizes.jsonl"
    p.write_bytes(parsed + b"\r\n" + unparsed + b"\n" + b"{bad" + b"\n")
    recs = bads(read_all(src(p), max_doc_bytes=1000))
    assert [(r.reason, r.size) for r in recs] == [
        ("too_large", len(parsed)),
        ("too_large", len(unparsed)),
        ("invalid_json", 4),
    ]
    assert all(len(r.raw) < RAW_LIMIT + 100 for r in recs)


def test_deep_nesting_is_too_deep_not_invalid_json(tmp_path: Path) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000  # valid JSON, beyond the recursion limit
    lines = [
        deep,
        b'{"text": "t", "m": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}",
        b'{"text": "fifty levels are fine", "m": ' + b"[" * 50 + b"]" * 50 + b"}",
        b"[" * 100_000 + b"}",  # too deep to tell whether it is valid
        b"{not json",
    ]
    p = tmp_path / "deep.jsonl"
    p.write_bytes(b"\n".join(lines))
    recs = read_all(src(p))
    got = [(r.reason if isinstance(r, BadRecord) else "ok", r.location) for r in recs]
    assert got == [
        ("too_deep", "deep.jsonl:1"),
        ("too_deep", "deep.jsonl:2"),
        ("ok", "deep.jsonl:3"),
        ("too_deep", "deep.jsonl:4"),
        ("invalid_json", "deep.jsonl:5"),
    ]
    assert "nest" in recs[0].detail  # type: ignore[union-attr]
    assert recs[0].size == len(deep)  # type: ignore[union-attr]


def test_non_finite_numbers_are_quarantined(tmp_path: Path) -> None:
    """NaN and Infinity are not JSON (RFC 8259); a number too big for a float would be
    written back as Infinity. Such records are quarantined, not silently changed."""
    lines = [
        b'{"text": "a", "x": NaN}',
        b'{"text": "b", "x": Infinity}',
        b'{"text": "c", "x": {"y": [1, -Infinity]}}',
        b'{"text": "d", "x": 1e400}',
        b'{"text": "e", "x": 1e300, "y": -0.0, "z": "NaN Infinity"}',
        b'{"text": NaN}',
    ]
    p = tmp_path / "n.jsonl"
    p.write_bytes(b"\n".join(lines))
    recs = read_all(src(p))
    got = [(r.reason if isinstance(r, BadRecord) else "ok", r.location) for r in recs]
    assert got == [("non_finite_number", f"n.jsonl:{i}") for i in (1, 2, 3, 4)] + [
        ("ok", "n.jsonl:5"),
        ("non_finite_number", "n.jsonl:6"),
    ]
    assert "NaN" in recs[0].detail and "1e400" in recs[3].detail  # type: ignore[union-attr]
    assert recs[4].meta == {"x": 1e300, "y": -0.0, "z": "NaN Infinity"}  # type: ignore[union-attr]

    table = pa.table(
        {
            "text": ["p", "q", "r"],
            "f": [1.5, float("nan"), 2.0],
            "v": [[1.0], [2.0], [float("-inf")]],
        }
    )
    pq.write_table(table, tmp_path / "n.parquet")
    recs = read_all(src(tmp_path / "n.parquet"))
    got = [(r.reason if isinstance(r, BadRecord) else "ok", r.location) for r in recs]
    assert got == [
        ("ok", "n.parquet#row=1"),
        ("non_finite_number", "n.parquet#row=2"),
        ("non_finite_number", "n.parquet#row=3"),
    ]


def test_unpaired_surrogates_outside_the_text_are_invalid_utf8(tmp_path: Path) -> None:
    """A \\ud800 escape in a metadata value, a field name or the id would reach the
    (UTF-8) shards and fail the whole unit there; an escaped pair is fine."""
    lines = [
        b'{"text": "a", "k": "lone \\udfff"}',
        b'{"text": "b", "\\ud800": 1}',
        b'{"text": "c", "id": "\\ud800"}',
        b'{"text": "d", "k": "pair \\ud83d\\ude00"}',
    ]
    p = tmp_path / "s.jsonl"
    p.write_bytes(b"\n".join(lines))
    recs = read_all(src(p, id_field="id"))
    got = [r.reason if isinstance(r, BadRecord) else "ok" for r in recs]
    assert got == ["invalid_utf8", "invalid_utf8", "invalid_utf8", "ok"]
    assert "U+DFFF" in recs[0].detail  # type: ignore[union-attr]
    assert recs[3].meta == {"k": "pair \U0001f600"}  # type: ignore[union-attr]


def test_bad_id_types_and_id_field(tmp_path: Path) -> None:
    p = tmp_path / "ids.jsonl"
    p.write_bytes(
        jl(
            {"text": "a", "id": "x1"},
            {"text": "b", "id": 7},
            {"text": "c"},
            {"text": "d", "id": True},
            {"text": "e", "id": ""},
            {"text": "f", "id": None},
        )
    )
    recs = read_all(src(p, id_field="id"))
    assert [r.id for r in docs(recs)] == ["x1", "7", "s/ids.jsonl:3"]
    assert [(r.reason, r.location) for r in bads(recs)] == [
        ("bad_id", "ids.jsonl:4"),
        ("bad_id", "ids.jsonl:5"),
        ("bad_id", "ids.jsonl:6"),
    ]
    assert "boolean" in bads(recs)[0].detail and "empty string" in bads(recs)[1].detail


def test_text_field_and_bom_and_nfc(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl"
    decomposed = "Cafe\u0301 re\u0301sume\u0301"
    p.write_bytes(b"\xef\xbb\xbf" + jl({"content": decomposed, "k": [1, {"z": None}]}))
    (d,) = read_all(src(p, text_field="content"))
    assert isinstance(d, RawDoc)
    assert d.text == "Caf\u00e9 r\u00e9sum\u00e9" and "\u0301" not in d.text
    assert d.meta == {"k": [1, {"z": None}]}
    # A BOM further on is no file start: invalid_json, saying why.
    p.write_bytes(jl({"content": "a"}) + b"\xef\xbb\xbf" + jl({"content": "b"}))
    bad = bads(read_all(src(p, text_field="content")))
    assert [(r.reason, r.location) for r in bad] == [("invalid_json", "c.jsonl:2")]
    assert "BOM" in bad[0].detail


def test_ids_stable_and_unique(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.jsonl").write_bytes(jl(*({"text": f"a{i}"} for i in range(5))))
    (tmp_path / "d" / "sub" / "a.jsonl").write_bytes(jl(*({"text": f"b{i}"} for i in range(5))))
    s = src(tmp_path / "d")
    first = [(r.id, r.text) for r in docs(read_all(s))]
    assert first == [(r.id, r.text) for r in docs(read_all(s))]
    ids = [i for i, _ in first]
    assert len(ids) == len(set(ids)) == 10
    assert ids[0] == "s/d/a.jsonl:1" and ids[5] == "s/d/sub/a.jsonl:1"


# --------------------------------------------------------------------------------------
# compressed jsonl and broken streams
# --------------------------------------------------------------------------------------

ROWS = [{"text": f"document number {i}", "n": i} for i in range(3000)]


@pytest.mark.parametrize("name", ["x.jsonl.gz", "x.json.gz", "x.jsonl.zst", "x.json"])
def test_compressed_and_json_variants(tmp_path: Path, name: str) -> None:
    raw = jl(*ROWS)
    if name.endswith(".gz"):
        raw = gzip.compress(raw)
    elif name.endswith(".zst"):
        raw = zstandard.ZstdCompressor().compress(raw)
    (tmp_path / name).write_bytes(raw)
    (f,) = resolve_inputs(src(tmp_path / name), OPTS)
    assert f.format == "jsonl" and f.rel == name
    got = docs(read_all(src(tmp_path / name)))
    assert [d.text for d in got] == [r["text"] for r in ROWS]
    assert got[-1].location == f"{name}:3000" and got[-1].meta == {"n": 2999}


def test_zstd_concatenated_frames(tmp_path: Path) -> None:
    c = zstandard.ZstdCompressor()
    p = tmp_path / "multi.jsonl.zst"
    p.write_bytes(c.compress(jl(*ROWS[:10])) + c.compress(jl(*ROWS[10:20])))
    recs = read_all(src(p))
    assert len(docs(recs)) == 20 and not bads(recs)


@pytest.mark.parametrize("ext", ["gz", "zst"])
def test_truncated_stream_is_corrupt_file_not_a_crash(tmp_path: Path, ext: str) -> None:
    raw = jl(*({"text": f"line {i} " + "word " * 20} for i in range(20000)))
    comp = gzip.compress(raw) if ext == "gz" else zstandard.ZstdCompressor().compress(raw)
    p = tmp_path / f"cut.jsonl.{ext}"
    p.write_bytes(comp[: len(comp) // 2])
    recs = read_all(src(p))
    n = len(docs(recs))
    assert 0 < n < 20000
    assert recs[:-1] == docs(recs)  # everything before the break was read
    last = recs[-1]
    assert isinstance(last, BadRecord) and last.reason == "corrupt_file"
    assert last.location == f"cut.jsonl.{ext}:{n + 1}"


def test_not_gzip_at_all(tmp_path: Path) -> None:
    p = tmp_path / "fake.jsonl.gz"
    p.write_bytes(b'{"text": "plain"}\n')
    (r,) = read_all(src(p))
    assert isinstance(r, BadRecord)
    assert (r.reason, r.location) == ("corrupt_file", "fake.jsonl.gz:1")


# --------------------------------------------------------------------------------------
# parquet, txt, hf
# --------------------------------------------------------------------------------------


def test_parquet(tmp_path: Path) -> None:
    import datetime as dt

    table = pa.table(
        {
            "text": ["first doc", None, "third e\u0301", ""],
            "id": [10, 11, 12, 13],
            "ts": [dt.datetime(2024, 1, 2, 3, 4, 5)] * 4,
            "tags": [["a"], [], ["b", "c"], None],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    recs = read_all(src(tmp_path / "t.parquet", id_field="id"))
    got = [(r.reason if isinstance(r, BadRecord) else r.id, r.location) for r in recs]
    assert got == [
        ("10", "t.parquet#row=1"),
        ("wrong_type", "t.parquet#row=2"),
        ("12", "t.parquet#row=3"),
        ("empty_text", "t.parquet#row=4"),
    ]
    first, third = docs(recs)
    assert first.meta == {"id": 10, "ts": "2024-01-02T03:04:05", "tags": ["a"]}
    json.dumps(first.meta)  # JSON-serialisable
    assert third.text == "third \u00e9"
    assert "null" in recs[1].detail and '"id": 11' in recs[1].raw  # type: ignore[union-attr]
    assert '"text": ""' in recs[3].raw  # type: ignore[union-attr]


def test_parquet_unreadable_is_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet at all")
    (r,) = read_all(src(tmp_path / "bad.parquet"))
    assert isinstance(r, BadRecord)
    assert (r.reason, r.location) == ("corrupt_file", "bad.parquet#row=1")


TXT = b"First para line one.\nline two.\n\n\n  \nSecond para.\r\n\r\nThird\xc3\xa9 e\xcc\x81\n"


def test_txt_file_unit(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(TXT)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe")
    recs = read_all(src(tmp_path / "a.txt", tmp_path / "empty.txt", tmp_path / "bad.txt"))
    got = [(r.reason if isinstance(r, BadRecord) else r.id, r.location) for r in recs]
    assert got == [("s/a.txt", "a.txt"), ("invalid_utf8", "bad.txt"), ("empty_text", "empty.txt")]
    assert recs[0].text == TXT.decode().replace("e\u0301", "\u00e9")  # type: ignore[union-attr]
    assert "byte 3" in recs[1].detail  # type: ignore[union-attr]


def test_txt_paragraph_unit(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(TXT)
    recs = read_all(src(tmp_path / "a.txt", txt_unit="paragraph"))
    assert [(r.id, r.text, r.location) for r in docs(recs)] == [
        ("s/a.txt#para=1", "First para line one.\nline two.", "a.txt#para=1"),
        ("s/a.txt#para=2", "Second para.", "a.txt#para=2"),
        ("s/a.txt#para=3", "Third\u00e9 \u00e9", "a.txt#para=3"),
    ]


def test_txt_paragraph_too_large_and_gz(tmp_path: Path) -> None:
    body = b"small one\n\n" + b"long line\n" * 50 + b"\nafter\n"
    (tmp_path / "p.txt.gz").write_bytes(gzip.compress(body))
    recs = read_all(src(tmp_path / "p.txt.gz", txt_unit="paragraph"), max_doc_bytes=100)
    got = [(r.reason if isinstance(r, BadRecord) else r.text, r.location) for r in recs]
    assert got == [
        ("small one", "p.txt.gz#para=1"),
        ("too_large", "p.txt.gz#para=2"),
        ("after", "p.txt.gz#para=3"),
    ]


def test_hf_dataset_and_dataset_dict(tmp_path: Path) -> None:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": ["one", "two e\u0301"], "id": ["a", "b"]}).save_to_disk(
        str(tmp_path / "in" / "ds")
    )
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["t1", "", "t3"], "k": [1, 2, 3]}),
            "test": datasets.Dataset.from_dict({"text": ["x1"], "k": [9]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "in" / "dd"))
    (tmp_path / "in" / "plain.jsonl").write_bytes(jl({"text": "j"}))

    files = resolve_inputs(src(tmp_path / "in"), OPTS)
    assert [(f.rel, f.format) for f in files] == [
        ("in/dd", "hf"),
        ("in/ds", "hf"),
        ("in/plain.jsonl", "jsonl"),
    ]
    assert all(f.size > 0 for f in files)
    recs = read_all(src(tmp_path / "in"))
    got = [(r.reason if isinstance(r, BadRecord) else r.text, r.location) for r in recs]
    assert got == [
        ("x1", "in/dd/test#row=1"),  # splits in sorted order
        ("t1", "in/dd/train#row=1"),
        ("empty_text", "in/dd/train#row=2"),
        ("t3", "in/dd/train#row=3"),
        ("one", "in/ds#row=1"),
        ("two \u00e9", "in/ds#row=2"),
        ("j", "in/plain.jsonl:1"),
    ]
    assert docs(recs)[0].id == "s/in/dd/test#row=1" and docs(recs)[0].meta == {"k": 9}
    # The dataset directory itself, and a glob matching it, are hf inputs too.
    (f,) = resolve_inputs(src(tmp_path / "in" / "ds", id_field="id"), OPTS)
    assert (f.rel, f.format) == ("ds", "hf")
    assert [d.id for d in docs(list(read_file(src(f.uri, id_field="id"), f, OPTS, BIG)))] == [
        "a",
        "b",
    ]
    assert [f.rel for f in resolve_inputs(src(tmp_path / "in" / "**"), OPTS)] == [
        "dd",
        "ds",
        "plain.jsonl",
    ]


# --------------------------------------------------------------------------------------
# resolve_inputs
# --------------------------------------------------------------------------------------


def test_resolve_globs_dirs_dedup_and_order(tmp_path: Path) -> None:
    for rel in ["a/2.jsonl", "a/1.jsonl", "a/b/3.jsonl.gz", "a/.hidden.jsonl", "a/README.md"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    files = resolve_inputs(
        src(tmp_path / "a" / "**" / "*.jsonl*", tmp_path / "a" / "1.jsonl", tmp_path / "a"), OPTS
    )
    assert [f.rel for f in files] == ["1.jsonl", "2.jsonl", "b/3.jsonl.gz"]  # first rel wins
    assert [f.uri for f in files] == sorted(f.uri for f in files)
    assert all(isinstance(f, InputFile) and f.source == "s" for f in files)
    # A directory keeps its own name in rel; hidden files and unknown extensions are skipped.
    assert [f.rel for f in resolve_inputs(src(tmp_path / "a"), OPTS)] == [
        "a/1.jsonl",
        "a/2.jsonl",
        "a/b/3.jsonl.gz",
    ]
    # An explicit format filters a directory's files.
    (tmp_path / "a" / "notes.txt").write_bytes(b"x")
    assert [f.rel for f in resolve_inputs(src(tmp_path / "a", format="txt"), OPTS)] == [
        "a/notes.txt"
    ]


def err(source: SourceConfig) -> str:
    with pytest.raises(IngestError) as e:
        resolve_inputs(source, OPTS)
    msg = str(e.value)
    assert f"source {source.name!r}" in msg
    return msg


def test_resolve_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    assert str(missing) in err(src(missing)) and "does not exist" in err(src(missing))
    assert "glob matches no files" in err(src(tmp_path / "*.jsonl"))
    assert "does not exist" in err(src(tmp_path / "nodir" / "*.jsonl"))
    (tmp_path / "data.csv").write_bytes(b"a,b\n")
    assert "cannot tell the format" in err(src(tmp_path / "data.csv"))
    assert "cannot tell the format" in err(src(tmp_path / "*"))  # a glob names its files
    (tmp_path / "t.parquet").write_bytes(b"")
    assert "extension says parquet" in err(src(tmp_path / "t.parquet", format="jsonl"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_bytes(b"")
    assert "format is hf" in err(src(tmp_path / "d", format="hf"))
    assert "format is hf" in err(src(tmp_path / "d" / "x.jsonl", format="hf"))
    # Explicit format + unknown extension is fine: the user said what it is.
    (tmp_path / "data.ndj").write_bytes(b"")
    assert resolve_inputs(src(tmp_path / "data.ndj", format="jsonl"), OPTS)[0].format == "jsonl"


def test_resolve_directory_without_inputs(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "README.md").write_bytes(b"x")
    (tmp_path / "d" / ".cache.jsonl").write_bytes(b"x")
    assert "holds no input files" in err(src(tmp_path / "d"))
    (tmp_path / "d" / "x.jsonl").write_bytes(b"x")
    assert "holds no parquet files" in err(src(tmp_path / "d", format="parquet"))


# --------------------------------------------------------------------------------------
# The format registry
# --------------------------------------------------------------------------------------


def test_config_format_choices_are_the_registry() -> None:
    assert (
        CHOICES
        == ("auto", *FORMATS)
        == (
            "auto",
            "jsonl",
            "parquet",
            "txt",
            "hf",
            "warc",
            "wet",
            "html",
        )
    )
    with pytest.raises(ConfigError) as e:
        parse_config({"output": "o", "sources": [{"name": "s", "paths": ["p"], "format": "csv"}]})
    assert (
        "sources[0].format: Input should be 'auto', 'jsonl', 'parquet', 'txt', 'hf', 'warc', "
        "'wet' or 'html' (got 'csv')"
    ) in str(e.value)
    exts = [e for f in FORMATS.values() for e in f.extensions]
    assert len(exts) == len(set(exts)), "an extension claimed by two formats"


def test_format_from_name() -> None:
    assert [
        format_from_name(n)
        for n in (
            "a.jsonl",
            "a.JSON.GZ",
            "a.ndjson.zstd",
            "a.txt.zst",
            "a.parquet",
            "a.parquet.gz",
            "a.csv",
            "a",
        )
    ] == ["jsonl", "jsonl", "jsonl", "txt", "parquet", None, None, None]


def test_a_registered_format_is_resolved_and_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new format is one Format in the registry: detection, messages and reading follow."""

    def read_lines(recs: Records, f: InputFile, path: str) -> Iterator[RawDoc | BadRecord]:
        with open(path, "rb") as fh:
            for i, line in enumerate(fh, 1):
                loc = f"{f.rel}#line={i}"
                yield recs.text(line.decode().rstrip("\n"), {}, f"{recs.name}/{loc}", loc, line)

    monkeypatch.setitem(
        FORMATS, "lines", Format(name="lines", read=read_lines, extensions=(".lines",))
    )
    (tmp_path / "a.lines").write_bytes(b"one\n\ntwo\n")
    (tmp_path / "b.lines.gz").write_bytes(gzip.compress(b"x"))  # not compressible: no input
    recs = read_all(src(tmp_path))
    assert [(type(r).__name__, r.location) for r in recs] == [
        ("RawDoc", f"{tmp_path.name}/a.lines#line=1"),
        ("BadRecord", f"{tmp_path.name}/a.lines#line=2"),
        ("RawDoc", f"{tmp_path.name}/a.lines#line=3"),
    ]
    (tmp_path / "c.csv").write_bytes(b"")
    assert ".parquet, .lines)" in err(src(tmp_path / "c.csv"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_resolve_unreadable_file(tmp_path: Path) -> None:
    p = tmp_path / "locked.jsonl"
    p.write_bytes(b"")
    p.chmod(0)
    try:
        assert "not readable" in err(src(p))
        assert "not readable" in err(src(tmp_path))
    finally:
        p.chmod(0o644)


def test_resolve_permission_denied_even_as_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root bypasses file modes, so pretend the kernel said no for one file.
    locked = tmp_path / "d" / "locked.jsonl"
    locked.parent.mkdir()
    locked.write_bytes(b"")
    real_access = os.access
    monkeypatch.setattr(
        readers.os, "access", lambda p, mode: str(p) != str(locked) and real_access(p, mode)
    )
    assert "not readable" in err(src(locked))
    msg = err(src(tmp_path / "d"))
    assert str(locked) in msg and "permission denied" in msg


def test_resolve_rel_collision(tmp_path: Path) -> None:
    for d in ("x", "y"):
        (tmp_path / d / "data").mkdir(parents=True)
        (tmp_path / d / "data" / "part.jsonl").write_bytes(b"")
    msg = err(src(tmp_path / "x" / "data", tmp_path / "y" / "data"))
    assert "'data/part.jsonl'" in msg and "collide" in msg


# --------------------------------------------------------------------------------------
# s3 (served by a LocalStore standing in for the bucket)
# --------------------------------------------------------------------------------------


@pytest.fixture
def fake_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "buckets"

    def fake_open_store(uri: str, options: StorageOptions | None = None) -> LocalStore:
        bucket = uri.removeprefix("s3://").split("/")[0]
        if bucket == "missing":
            raise StorageError(f"bucket {bucket!r} does not exist")
        return LocalStore(root / bucket)

    monkeypatch.setattr(readers, "open_store", fake_open_store)
    (root / "b" / "web" / "2024").mkdir(parents=True)
    (root / "b" / "web" / "2024" / "p1.jsonl.gz").write_bytes(gzip.compress(jl({"text": "s3"})))
    (root / "b" / "web" / "p0.jsonl").write_bytes(jl({"text": "zero"}, {"x": 1}))
    (root / "b" / "web" / "_SUCCESS").write_bytes(b"")
    (root / "b" / "web" / ".hidden.jsonl").write_bytes(jl({"text": "hidden"}))
    (root / "b" / "webby.jsonl").write_bytes(jl({"text": "not under web/"}))
    return root


def test_s3_resolve_and_read(fake_s3: Path) -> None:
    s = src("s3://b/web")
    files = resolve_inputs(s, OPTS)
    assert [(f.uri, f.rel) for f in files] == [
        ("s3://b/web/2024/p1.jsonl.gz", "web/2024/p1.jsonl.gz"),
        ("s3://b/web/p0.jsonl", "web/p0.jsonl"),
    ]
    recs = [r for f in files for r in read_file(s, f, OPTS, BIG)]
    assert [(type(r).__name__, r.location) for r in recs] == [
        ("RawDoc", "web/2024/p1.jsonl.gz:1"),
        ("RawDoc", "web/p0.jsonl:1"),
        ("BadRecord", "web/p0.jsonl:2"),
    ]
    assert recs[0].id == "s/web/2024/p1.jsonl.gz:1"
    assert [f.rel for f in resolve_inputs(src("s3://b/web/**/*.jsonl*"), OPTS)] == [
        "2024/p1.jsonl.gz",
        "p0.jsonl",
    ]
    assert [f.rel for f in resolve_inputs(src("s3://b/web/*.jsonl"), OPTS)] == ["p0.jsonl"]
    (f,) = resolve_inputs(src("s3://b/webby.jsonl"), OPTS)
    assert (f.rel, f.format) == ("webby.jsonl", "jsonl")


def test_s3_errors(fake_s3: Path) -> None:
    assert "does not exist" in err(src("s3://missing/x"))
    assert "matches no objects" in err(src("s3://b/nothing"))
    assert "glob matches no objects" in err(src("s3://b/web/*.parquet"))
    assert "cannot tell the format" in err(src("s3://b/web/_*"))


# --------------------------------------------------------------------------------------
# real data
# --------------------------------------------------------------------------------------


def test_real_dolma_fixture_uses_id_field() -> None:
    path = SHARED / "web_dolma_cc_fixtures.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    recs = read_all(src(path, name="dolma", id_field="id"))
    assert not bads(recs)
    got = docs(recs)
    assert len(got) == 30
    with path.open("rb") as fh:
        want = [json.loads(line)["id"] for line in fh]
    assert [d.id for d in got] == want and len(set(want)) == 30
    assert got[0].meta["source"] == "common-crawl" and "text" not in got[0].meta
    assert got[0].location == "web_dolma_cc_fixtures.jsonl:1"
