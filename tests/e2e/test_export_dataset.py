"""`ballast export dataset`: each format read back by its own ecosystem's reader
(megatron-core's IndexedDataset, mosaicml-streaming's StreamingDataset; llm.c has no
Python reader, so modded-nanogpt's `_load_data_shard` logic) and compared token for token
with the Arrow dataset as `datasets.load_from_disk` reads it."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.store import StorageOptions
from dataprep.export import DatasetExportError, export_dataset, llmc, megatron
from dataprep.export.mds import import_streaming
from dataprep.export.rows import Rows, sequences
from tests.support.helpers import assert_one_line_error, run_cli, shared_file

SEQ_LEN = 64


def _prep(root: Path, strategy: str) -> str:
    from dataprep.config import parse_config
    from dataprep.pipeline import run_prep

    text = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:60_000]
    (root / "s.txt").write_text(text, encoding="utf-8")
    run_prep(
        parse_config(
            {
                "output": str(root / "prep"),
                "workers": 1,
                "sources": [
                    {"name": "tiny", "paths": [str(root / "s.txt")], "txt_unit": "paragraph"}
                ],
                "dedup": {"exact": False, "near": False},
                "quality": [],
                "pack": {"seq_len": SEQ_LEN, "strategy": strategy},
                "dataset": {"validation_fraction": 0.1, "pack_partitions": 2, "train_shards": 3},
            }
        ),
        progress=False,
    )
    return str(root / "prep" / "dataset" / "v0001")


@pytest.fixture(scope="module", params=["concat", "bfd"])
def dataset(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str]:
    return request.param, _prep(tmp_path_factory.mktemp(request.param), request.param)


def arrow(ds: str, split: str) -> dict[str, np.ndarray]:
    from datasets import load_from_disk

    d = load_from_disk(ds)[split]
    return {c: np.array(d[c]) for c in ("input_ids", "position_ids", "segment_ids", "loss_mask")}


def manifest(ds: str) -> dict[str, Any]:
    return json.loads((Path(ds) / "manifest.json").read_text())


def row_pieces(cols: dict[str, np.ndarray], eos: int, join: bool) -> list[np.ndarray]:
    """The sequences the rows alone give, computed row by row in plain Python (the
    reference for rows.py's `sequences`, used without provenance): each segment of each
    row, a segment that runs to its row's end without EOS joined to the next row's first
    segment when `join`."""
    out: list[list[int]] = []
    open_doc = False
    for ids, seg in zip(cols["input_ids"].tolist(), cols["segment_ids"].tolist(), strict=True):
        prev = 0
        for j, (t, s) in enumerate(zip(ids, seg, strict=True)):
            if s == 0:
                prev = 0
                continue
            if s != prev and not (j == 0 and open_doc):
                out.append([])
            out[-1].append(t)
            prev = s
        open_doc = join and seg[-1] != 0 and ids[-1] != eos
    return [np.array(d) for d in out]


def whole_documents(ds: str, split: str) -> list[np.ndarray]:
    """Every document of the split from its rows and the provenance reader
    (core/provenance.py), one row at a time: its pieces joined in offset order, in the
    order in which each document's last piece comes."""
    from core.provenance import Provenance

    prov = Provenance(ds)
    cols = arrow(ds, split)
    pieces: dict[int, list[tuple[int, list[int]]]] = {}
    last: dict[int, int] = {}
    n = 0
    for r, (ids, seg) in enumerate(
        zip(cols["input_ids"].tolist(), cols["segment_ids"].tolist(), strict=True)
    ):
        for k, sp in enumerate(prov.spans(split, r), start=1):
            toks = [t for t, s in zip(ids, seg, strict=True) if s == k]
            assert len(toks) == sp.end - sp.start
            pieces.setdefault(sp.doc, []).append((sp.start, toks))
            last[sp.doc] = n
            n += 1
    order = sorted(last, key=last.__getitem__)
    return [np.array([t for _, p in sorted(pieces[d]) for t in p]) for d in order]


def check_record(out: Path, ds: str) -> dict[str, Any]:
    rec = json.loads((out / "ballast_export.json").read_text())
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert set(rec["files"]) == on_disk - {"ballast_export.json"}
    for rel, f in rec["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == f["sha256"], rel
    src = manifest(ds)
    assert rec["source_manifest"]["accounting"] == src["accounting"]
    assert rec["source_manifest"]["files"] == src["files"]  # the dataset's checksums
    raw = (Path(ds) / "manifest.json").read_bytes()
    assert rec["dataset_manifest_sha256"] == hashlib.sha256(raw).hexdigest()
    return rec


def test_megatron_reads_the_documents(dataset: tuple[str, str], tmp_path: Path) -> None:
    with warnings.catch_warnings():  # megatron-core warns that Apex is absent
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    strategy, ds = dataset
    out = tmp_path / "meg"
    r = run_cli("export", "dataset", ds, str(out), "--format", "megatron", "--no-progress")
    assert r.returncode == 0, r.stderr
    rec = check_record(out, ds)
    eos = manifest(ds)["tokenizer"]["eos_id"]
    assert rec["documents_from"] == "provenance"
    for split in ("train", "validation"):
        want = whole_documents(ds, split)
        ix = IndexedDataset(str(out / f"{split}_text_document"))
        assert len(ix) == len(want) == rec["splits"][split]["documents"]
        assert ix.index.dtype == np.uint16  # byte vocabulary: DType.optimal_dtype
        assert np.array_equal(ix.document_indices, np.arange(len(want) + 1))
        for i in range(len(ix)):
            assert np.array_equal(ix[i].astype(np.int64), want[i]), (split, i)
        # Every sequence a whole document, with either packing: bfd's cut documents too.
        assert all(d[-1] == eos for d in want)
        assert len(want) == manifest(ds)["packing"][split]["docs"]
        assert rec["splits"][split]["cut_pieces"] == 0
    if strategy == "bfd":  # the packer did cut documents, which the export joined
        assert manifest(ds)["packing"]["train"]["split_docs"] > 0


def nanogpt_shard(path: Path) -> tuple[int, np.ndarray]:
    """modded-nanogpt's `_load_data_shard` (train_gpt.py), with numpy for torch: a 256-int32
    header (magic 20240520, version 1, token count), then exactly that many uint16."""
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    ntok = int(header[2])
    tokens = np.fromfile(path, dtype=np.uint16, offset=256 * 4)
    assert tokens.size == ntok, "number of tokens read does not match header"
    return ntok, tokens


def test_llmc_shards_hold_the_eos_first_stream(dataset: tuple[str, str], tmp_path: Path) -> None:
    _, ds = dataset
    out = tmp_path / "llmc"
    rec = export_dataset(ds, "llmc", str(out), shard_tokens=20_000)
    check_record(out, ds)
    eos = manifest(ds)["tokenizer"]["eos_id"]
    for split, name in (("train", "train"), ("validation", "val")):
        want = whole_documents(ds, split)
        # llm.c's fineweb.py: [eot] + the document's tokens; ours end with EOS, so it moves.
        stream = np.concatenate(
            [np.concatenate([[eos], d[:-1] if d[-1] == eos else d]) for d in want]
        )
        files = rec["splits"][split]["files"]
        assert files == sorted(files) and all(f.startswith(f"{name}_") for f in files)
        got = []
        for i, f in enumerate(files):
            ntok, tokens = nanogpt_shard(out / f)
            assert ntok == 20_000 or i == len(files) - 1  # cut at shard_tokens
            got.append(tokens)
        assert np.array_equal(np.concatenate(got).astype(np.int64), stream)


def test_mds_rows_through_streaming_dataset(dataset: tuple[str, str], tmp_path: Path) -> None:
    _, ds = dataset
    out = tmp_path / "mds"
    rec = export_dataset(ds, "mds", str(out))
    check_record(out, ds)
    streaming = import_streaming()
    for split in ("train", "validation"):
        cols = arrow(ds, split)
        sd = streaming.StreamingDataset(local=str(out), split=split, shuffle=False, batch_size=1)
        assert len(sd) == len(cols["input_ids"]) == rec["splits"][split]["samples"]
        got = {
            k: np.stack([sd[i][k] for i in range(len(sd))])
            for k in ("tokens", "position_ids", "segment_ids", "loss_mask")
        }
        assert np.array_equal(got["tokens"], cols["input_ids"])
        for k in ("position_ids", "segment_ids", "loss_mask"):
            assert np.array_equal(got[k], cols[k]), k


def test_without_provenance_rows_alone(dataset: tuple[str, str], tmp_path: Path) -> None:
    """A dataset prepared before provenance: concat's documents are still joined from the
    rows; bfd's cut documents stay pieces, counted."""
    import shutil

    strategy, ds = dataset
    old = tmp_path / "old"
    shutil.copytree(ds, old)
    m = manifest(ds)
    del m["provenance"]
    (old / "manifest.json").write_text(json.dumps(m))
    out = tmp_path / "meg"
    rec = export_dataset(str(old), "megatron", str(out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    eos = m["tokenizer"]["eos_id"]
    want = row_pieces(arrow(ds, "train"), eos, join=strategy == "concat")
    ix = IndexedDataset(str(out / "train_text_document"))
    assert len(ix) == len(want)
    assert all(np.array_equal(ix[i].astype(np.int64), want[i]) for i in range(len(ix)))
    cut = rec["splits"]["train"]["cut_pieces"]
    assert cut == sum(int(d[-1] != eos) for d in want)
    assert (cut == 0) == (strategy == "concat")


def test_sequences_join_across_batches() -> None:
    eos = 9
    # Row 0: doc A (3 tokens, ends with EOS), then doc B's start; rows 1 and 2 continue B;
    # B ends in row 2, then doc C, then padding. Batches of one row each.
    ids = np.array([[1, 2, eos, 4], [5, 6, 7, 8], [3, eos, 1, eos]])
    seg = np.array([[1, 1, 1, 2], [1, 1, 1, 1], [1, 1, 2, 2]])
    batches = [
        Rows(ids[i : i + 1], np.zeros_like(ids[i : i + 1]), seg[i : i + 1]) for i in range(3)
    ]
    joined = list(sequences(iter(batches), eos, join=True))
    tokens = np.concatenate([s.tokens for s in joined])
    lengths = np.concatenate([s.lengths for s in joined])
    assert lengths.tolist() == [3, 7, 2]
    assert tokens.tolist() == [1, 2, eos, 4, 5, 6, 7, 8, 3, eos, 1, eos]
    assert sum(s.cut for s in joined) == 0
    apart = list(sequences(iter(batches), eos, join=False))
    assert np.concatenate([s.lengths for s in apart]).tolist() == [3, 1, 4, 2, 2]
    assert sum(s.cut for s in apart) == 2


def test_wide_vocabularies(tmp_path: Path) -> None:
    """Above 65,500 ids Megatron stores int32 and llm.c switches to its llama-3 header."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    from dataprep.export.rows import Sequences

    toks = np.array([70_000, 5, 1, 100_000, 2, 1])
    seqs = [Sequences(toks, np.array([3, 3]), 0)]
    megatron.write_split(tmp_path, "train", iter(seqs), vocab_size=128_000)
    ix = IndexedDataset(str(tmp_path / "train_text_document"))
    assert ix.index.dtype == np.int32
    assert [ix[i].tolist() for i in range(len(ix))] == [[70_000, 5, 1], [100_000, 2, 1]]
    rec = llmc.write_split(tmp_path, "train", iter(seqs), 128_000, eos_id=1)
    header = np.fromfile(tmp_path / rec["files"][0], dtype=np.int32, count=256)
    assert header[:3].tolist() == [20240801, 7, 6]
    body = np.fromfile(tmp_path / rec["files"][0], dtype=np.uint32, offset=1024)
    assert body.tolist() == [1, 70_000, 5, 1, 100_000, 2]


def test_bad_requests_are_one_line(train_dataset: str, tmp_path: Path) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = run_cli("export", "dataset", train_dataset, str(out), "--format", "llmc")
    assert r.returncode == 1
    assert_one_line_error(r, str(out), "not empty")
    assert (out / "keep.txt").read_text() == "mine"
    r = run_cli(
        "export", "dataset", str(tmp_path / "nothing"), str(tmp_path / "o"), "--format", "mds"
    )
    assert r.returncode == 1
    assert_one_line_error(r, "manifest.json")
    r = run_cli(
        "export",
        "dataset",
        train_dataset,
        str(tmp_path / "o"),
        "--format",
        "mds",
        "--splits",
        "train,test",
    )
    assert r.returncode == 1
    assert_one_line_error(r, "'test'")
    assert not (tmp_path / "o").exists()
    with pytest.raises(DatasetExportError, match="--format"):
        export_dataset(train_dataset, "parquet", str(tmp_path / "o"))


def test_s3_output(train_dataset: str, s3_bucket: str, moto_endpoint: str, tmp_path: Path) -> None:
    import boto3

    opts = StorageOptions(endpoint_url=moto_endpoint)
    rec = export_dataset(train_dataset, "megatron", f"s3://{s3_bucket}/exp", options=opts)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert keys == {f"exp/{k}" for k in [*rec["files"], "ballast_export.json"]}
    for rel, f in rec["files"].items():
        body = s3.get_object(Bucket=s3_bucket, Key=f"exp/{rel}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == f["sha256"]
    with pytest.raises(DatasetExportError, match="not empty"):
        export_dataset(train_dataset, "megatron", f"s3://{s3_bucket}/exp", options=opts)


def test_documents_join_pieces_in_offset_order() -> None:
    """A document whose remainder comes before its first chunk (bfd can place it so) is
    joined in offset order once all of it has come; a document whose pieces never add up
    comes out at the end as pieces, counted as cut."""
    from dataprep.export.rows import Spans, documents

    eos = 9
    # Row 0: doc 7's remainder (offsets 4..6, ends with EOS), doc 1 whole. Row 1: doc 7's
    # first chunk (0..4). Row 2: doc 3's first chunk (0..4), never finished.
    ids = np.array([[5, eos, 2, eos], [1, 2, 3, 4], [6, 6, 6, 6]])
    seg = np.array([[1, 1, 2, 2], [1, 1, 1, 1], [1, 1, 1, 1]])
    spans = [
        Spans(np.array([7, 1]), np.array([4, 0]), np.array([6, 2])),
        Spans(np.array([7]), np.array([0]), np.array([4])),
        Spans(np.array([3]), np.array([0]), np.array([4])),
    ]
    batches = [
        (Rows(ids[i : i + 1], np.zeros_like(ids[i : i + 1]), seg[i : i + 1]), spans[i])
        for i in range(3)
    ]
    out = list(documents(iter(batches), eos))
    seqs = [
        s.tokens[a - n : a].tolist()
        for s in out
        for a, n in zip(np.cumsum(s.lengths), s.lengths, strict=True)
    ]
    assert seqs == [[2, eos], [1, 2, 3, 4, 5, eos], [6, 6, 6, 6]]
    assert sum(s.cut for s in out) == 1
    bad = [(batches[0][0], Spans(np.array([7]), np.array([0]), np.array([2])))]
    with pytest.raises(ValueError, match="do not match"):
        list(documents(iter(bad), eos))
