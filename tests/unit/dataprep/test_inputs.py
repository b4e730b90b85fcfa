"""What a run read, and re-runs on an existing output (issue 12, groundwork): inputs and
output must not overlap; every run records its inputs (size, version tag, sha256 per part
read) in the ingest markers, report.json and the dataset manifest; a re-run compares the
inputs with that record: unchanged resumes (and says so), anything else is refused with a
line naming what differs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from core.store import StorageOptions
from dataprep.config import parse_config
from dataprep.inputs import (
    INVENTORY_KEY,
    CurrentBytes,
    FileRecord,
    InputsChanged,
    Part,
    compare_inputs,
)
from dataprep.pipeline import run_prep
from dataprep.readers import resolve_inputs
from dataprep.stages import ingest
from tests.support.inputs import (
    build,
    cfg_dict,
    cli,
    jsonl_rows,
    make_corpus,
    mtimes,
    one_line_error,
)

UNIT = 3000  # bytes per ingest unit in these tests: the big files are split into parts
LINE = "inputs unchanged since the last run of this output"  # the first version, unfinished
LINE_DONE = "inputs unchanged since version v0001"  # a finished version


def prep(cfg: dict[str, Any], until: str | None = None) -> dict[str, Any]:
    """run_prep with small ingest units, so that the big inputs are split into parts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ingest, "UNIT_BYTES", UNIT)
        return run_prep(parse_config(cfg), until=until, progress=False)


def file_sha(path: Path, start: int = 0, end: int | None = None) -> str:
    return hashlib.sha256(path.read_bytes()[start:end]).hexdigest()


def write_cfg(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    return build(tmp_path_factory, "inputs", prep)


@pytest.fixture
def ingested(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A corpus of this test's own (to change) and an output that ingested it."""
    data = make_corpus(tmp_path / "data")
    cfg = cfg_dict(data, tmp_path / "out")
    prep(cfg, until="ingest")
    return data, cfg


# --------------------------------------------------------------------------------------
# Overlap
# --------------------------------------------------------------------------------------


def test_output_inside_an_input_directory_is_refused_before_any_write(tmp_path: Path) -> None:
    data = make_corpus(tmp_path / "data")
    out = data / "web" / "prep-out"
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(data, out))
    line = one_line_error(
        cli("prep", str(cfg), "--no-progress"), str(out), "'web'", str(data / "web")
    )
    assert "lies inside" in line
    assert not out.exists()


def test_input_glob_under_the_output_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    make_corpus(out / "in")
    c = cfg_dict(out / "in", out)
    c["sources"][0]["paths"] = [str(out / "in" / "web" / "*.jsonl")]
    cfg = write_cfg(tmp_path / "c.yaml", c)
    one_line_error(
        cli("prep", str(cfg), "--no-progress"),
        str(out),
        "'web'",
        str(out / "in" / "web" / "*.jsonl"),
    )
    assert not (out / "_run.json").exists()


def test_sibling_paths_are_not_an_overlap(tmp_path: Path) -> None:
    """A shared name prefix is not containment: data/web vs data/web-out."""
    data = make_corpus(tmp_path / "data")
    prep(cfg_dict(data, data / "web-out"), until="ingest")


# --------------------------------------------------------------------------------------
# The inventory
# --------------------------------------------------------------------------------------


def test_inventory_in_report_markers_and_manifest(built) -> None:
    data, out, report = built
    files = {f["uri"]: f for f in report["inputs"]}
    expect = [data / "code.parquet", data / "web" / "big.jsonl", data / "web" / "small.jsonl"]
    assert sorted(files) == sorted(str(p) for p in expect)
    for p in expect:
        f = files[str(p)]
        st = p.stat()
        assert f["size"] == st.st_size and f["version"] == f"{st.st_size}-{st.st_mtime_ns}"
        assert f["rel"] == (p.name if p.suffix == ".parquet" else f"web/{p.name}")
        assert f["source"] == ("code" if p.suffix == ".parquet" else "web")
        # The parts tile the file, and each hash is that of its bytes.
        assert f["parts"][0]["start"] == 0 and f["parts"][-1]["end"] == st.st_size
        for a, b in zip(f["parts"], f["parts"][1:], strict=False):
            assert a["end"] == b["start"]
        for part in f["parts"]:
            assert part["sha256"] == file_sha(p, part["start"], part["end"])
    assert len(files[str(data / "web" / "big.jsonl")]["parts"]) > 2  # split into parts
    assert len(files[str(data / "code.parquet")]["parts"]) > 1  # by row groups
    assert files[str(data / "web" / "small.jsonl")]["parts"][0]["sha256"] == file_sha(
        data / "web" / "small.jsonl"
    )
    manifest = json.loads((out / "dataset" / "v0001" / "manifest.json").read_text())
    assert manifest["inputs"] == report["inputs"]
    # Each ingest marker records the parts its unit read.
    marked = [
        p
        for m in sorted((out / "_done" / "ingest").glob("*.json"))
        for p in json.loads(m.read_text())["inputs"]
    ]
    assert sorted((p["uri"], p["start"]) for p in marked) == sorted(
        (f["uri"], p["start"]) for f in report["inputs"] for p in f["parts"]
    )
    assert json.loads((out / INVENTORY_KEY).read_text())["files"][0]["parts"] == []


def test_s3_inputs_carry_the_etag(s3_bucket: str, s3_client: Any, moto_endpoint: str) -> None:
    s3_client.put_object(Bucket=s3_bucket, Key="in/a.jsonl", Body=b'{"text": "x"}\n')
    src = parse_config(
        {"output": "/tmp/unused", "sources": [{"name": "web", "paths": [f"s3://{s3_bucket}/in/"]}]}
    ).sources[0]
    [f] = resolve_inputs(src, StorageOptions(endpoint_url=moto_endpoint))
    etag = s3_client.head_object(Bucket=s3_bucket, Key="in/a.jsonl")["ETag"]
    assert f.version == etag and f.size == 14


# --------------------------------------------------------------------------------------
# compare_inputs
# --------------------------------------------------------------------------------------


def record(path: Path, parts: list[tuple[int, int]], source: str = "web") -> FileRecord:
    st = path.stat()
    return FileRecord(
        source,
        str(path),
        path.name,
        "jsonl",
        st.st_size,
        f"{st.st_size}-{st.st_mtime_ns}",
        tuple(Part(a, b, file_sha(path, a, b)) for a, b in parts),
    )


def now(path: Path) -> FileRecord:
    """The file as a run lists it now: no parts."""
    return record(path, [])


def split_parts(path: Path) -> list[tuple[int, int]]:
    cfg = parse_config(
        {"output": str(path.parent / "o"), "sources": [{"name": "web", "paths": [str(path)]}]}
    )
    [f] = resolve_inputs(cfg.sources[0], cfg.storage)
    parts = ingest.split_input(f, 1000)
    assert len(parts) >= 3
    return [(p.start, p.end if p.end is not None else f.size) for p in parts]


def test_compare_inputs_classifies_each_file(tmp_path: Path) -> None:
    keep, grow, edit, cut, gone, touch = (
        tmp_path / f"{n}.jsonl" for n in ("keep", "grow", "edit", "cut", "gone", "touch")
    )
    for i, p in enumerate((keep, grow, edit, cut, gone, touch)):
        jsonl_rows(p, 0, 40, seed=i)
    recorded = [record(p, split_parts(p)) for p in (keep, grow, edit, cut, gone, touch)]
    jsonl_rows(grow, 40, 5, mode="a")  # rows appended
    # One byte in the middle part changed, same size.
    edit_parts = recorded[2].parts
    middle = edit_parts[len(edit_parts) // 2]
    raw = bytearray(edit.read_bytes())
    pos = middle.start + 20
    raw[pos] = ord("z") if raw[pos] != ord("z") else ord("y")
    edit.write_bytes(bytes(raw))
    raw = cut.read_bytes()
    cut.write_bytes(raw[: len(raw) // 2])  # truncated in the middle
    gone.unlink()
    os.utime(touch, ns=(1, 1))  # only the tag changes
    (tmp_path / "new.jsonl").write_text('{"text": "n"}\n')
    current = [now(p) for p in (keep, grow, edit, cut, touch, tmp_path / "new.jsonl")]
    with CurrentBytes(StorageOptions()) as read:
        ch = compare_inputs(recorded, current, read)
    key = lambda p: ("web", str(p))  # noqa: E731
    assert ch.unchanged == (key(keep), key(touch))
    assert ch.grown == (key(grow),)
    assert ch.changed == (key(edit), key(cut))
    assert ch.removed == (key(gone),)
    assert ch.new == (key(tmp_path / "new.jsonl"),)
    assert ch.why[key(edit)] == f"bytes {middle.start}-{middle.end} differ"
    assert "truncated" in ch.why[key(cut)]
    text = ch.describe()
    for p in (grow, edit, cut, gone, tmp_path / "new.jsonl"):
        assert str(p) in text
    assert not ch.all_unchanged


def test_compare_inputs_reads_nothing_for_unchanged_files(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    jsonl_rows(p, 0, 10)
    rec = record(p, [(0, p.stat().st_size)])

    def read(*_a: object) -> str:
        raise AssertionError("an unchanged file must not be read")

    ch = compare_inputs([rec], [now(p)], read)
    assert ch.all_unchanged and ch.unchanged == (("web", str(p)),)


def test_grown_needs_every_byte_read_to_be_recorded(tmp_path: Path) -> None:
    """A file whose parts were not all read (a killed run) cannot be told grown."""
    p = tmp_path / "a.jsonl"
    jsonl_rows(p, 0, 40)
    parts = split_parts(p)
    rec = record(p, parts[:-1])
    jsonl_rows(p, 40, 2, mode="a")
    with CurrentBytes(StorageOptions()) as read:
        ch = compare_inputs([rec], [now(p)], read)
    assert ch.changed == (("web", str(p)),) and not ch.grown


# --------------------------------------------------------------------------------------
# Re-runs
# --------------------------------------------------------------------------------------


def test_rerun_with_unchanged_inputs_does_no_work_and_says_so(built, capsys) -> None:
    data, out, report = built
    before = mtimes(out)
    capsys.readouterr()
    again = prep(cfg_dict(data, out))
    err = capsys.readouterr().err
    assert f"{LINE_DONE} (3 files): nothing new to take in" in err
    assert mtimes(out) == before  # no marker, shard or dataset file written again
    assert again["inputs"] == report["inputs"]


def test_touched_inputs_still_count_as_unchanged(ingested, capsys) -> None:
    data, cfg = ingested
    os.utime(data / "web" / "big.jsonl", ns=(1, 1))
    capsys.readouterr()
    prep(cfg, until="ingest")
    assert LINE in capsys.readouterr().err


def test_rerun_after_appending_rows_and_adding_a_file_is_refused(ingested, tmp_path) -> None:
    data, cfg = ingested
    before = mtimes(Path(cfg["output"]))
    jsonl_rows(data / "web" / "small.jsonl", 10, 3, seed=1, mode="a")
    jsonl_rows(data / "web" / "added.jsonl", 0, 5, seed=9)
    line = one_line_error(
        cli("prep", str(write_cfg(tmp_path / "c.yaml", cfg)), "--no-progress"),
        "1 grown",
        str(data / "web" / "small.jsonl"),
        "1 new",
        str(data / "web" / "added.jsonl"),
        "before its first version was finished",
        "new output",
    )
    assert "changed (" not in line and "removed" not in line
    assert mtimes(Path(cfg["output"])) == before


def test_file_truncated_in_the_middle_is_named(ingested) -> None:
    data, cfg = ingested
    big = data / "web" / "big.jsonl"
    raw = big.read_bytes()
    big.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(InputsChanged, match="1 changed") as e:
        prep(cfg, until="ingest")
    assert f"{big} (truncated or edited: {len(raw)} -> {len(raw) // 2} bytes)" in str(e.value)


def test_file_edited_in_the_middle_is_named(ingested) -> None:
    """Same size, one byte of a middle part changed: named with the part that differs."""
    data, cfg = ingested
    big = data / "web" / "big.jsonl"
    raw = bytearray(big.read_bytes())
    pos = len(raw) // 2
    raw[pos] = ord("z") if raw[pos] != ord("z") else ord("y")
    big.write_bytes(bytes(raw))
    with pytest.raises(
        InputsChanged, match=f"1 changed \\({big} \\(bytes [0-9]+-[0-9]+ differ\\)\\)"
    ):
        prep(cfg, until="ingest")


def test_parquet_rewritten_is_named(ingested) -> None:
    data, cfg = ingested
    code = data / "code.parquet"
    rows = pq.read_table(code).to_pylist()
    rows[30]["text"] = "edited"
    pq.write_table(pa.Table.from_pylist(rows), code, row_group_size=20)
    with pytest.raises(InputsChanged, match=f"1 changed \\({code} "):
        prep(cfg, until="ingest")


def test_removed_file_is_named(ingested) -> None:
    data, cfg = ingested
    (data / "web" / "small.jsonl").unlink()
    with pytest.raises(InputsChanged, match=f"1 removed \\({data / 'web' / 'small.jsonl'}"):
        prep(cfg, until="ingest")


def test_output_without_an_inventory_resumes_as_before(built, tmp_path, capsys) -> None:
    """An output made before inventories were kept: no check, no inventory made up."""
    data, out, _ = built
    old = tmp_path / "old"
    shutil.copytree(out, old)
    (old / INVENTORY_KEY).unlink()
    shutil.rmtree(old / "_versions")
    capsys.readouterr()
    prep(cfg_dict(data, old), until="ingest")
    err = capsys.readouterr().err
    assert LINE not in err and LINE_DONE not in err
    assert not (old / INVENTORY_KEY).exists()
