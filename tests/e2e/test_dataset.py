"""Prep all the way to the dataset contract: DatasetDict + manifest, verify, mixture
shares, curriculum order, determinism."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.dataset import verify
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.helpers import read_jsonl, shared_file, write_jsonl


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ds-data")
    web = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 200)
    code = read_jsonl(shared_file("code_python_cosqa_dev.jsonl"))
    write_jsonl(root / "web.jsonl", [{"id": r["id"], "text": r["text"]} for r in web])
    write_jsonl(root / "code.jsonl", [{"id": r["id"], "text": r["text"]} for r in code])
    return root


def cfg_dict(data: Path, out: Path, **over) -> dict:
    d = {
        "output": str(out),
        "workers": 1,
        "seed": 3,
        "sources": [
            {"name": "web", "paths": [str(data / "web.jsonl")], "id_field": "id", "weight": 0.7},
            {
                "name": "code",
                "paths": [str(data / "code.jsonl")],
                "id_field": "id",
                "weight": 0.3,
                "quality": [],
            },
        ],
        "ingest": {"shard_docs": 100},
        "quality": ["char_repetition", "gopher_repetition"],
        "pack": {"seq_len": 256, "strategy": "bfd", "window": 500},
        "dataset": {"validation_fraction": 0.05, "train_shards": 3, "pack_partitions": 4},
    }
    for k, v in over.items():
        d[k] = {**d[k], **v} if isinstance(d.get(k), dict) else v
    return d


@pytest.fixture(scope="module")
def built(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ds-out") / "run"
    report = run_prep(parse_config(cfg_dict(data, out)), progress=False)
    return out, report


def test_dataset_loads_with_the_contract(built):
    from datasets import load_from_disk

    out, report = built
    dd = load_from_disk(str(out / "dataset" / "v0001"))
    assert set(dd) == {"train", "validation"}
    manifest = json.loads((out / "dataset" / "v0001" / "manifest.json").read_text())
    row = dd["train"][0]
    assert len(row["input_ids"]) == manifest["seq_len"] == 256
    assert dd["train"].features["input_ids"].feature.dtype == "int32"
    ids = np.array(dd["train"]["input_ids"][:50])
    seg = np.array(dd["train"]["segment_ids"][:50])
    pos = np.array(dd["train"]["position_ids"][:50])
    mask = np.array(dd["train"]["loss_mask"][:50])
    tok = manifest["tokenizer"]
    assert (ids[mask == 0] == tok["pad_id"]).all()
    assert ((seg > 0) == (mask == 1)).all()
    # positions restart at 0 where a new segment starts
    starts = np.zeros_like(seg, dtype=bool)
    starts[:, 0] = seg[:, 0] > 0
    starts[:, 1:] = (seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] > 0)
    assert (pos[starts] == 0).all()
    assert manifest["splits"]["train"]["rows"] == dd["train"].num_rows
    assert len(manifest["splits"]["train"]["files"]) == 3
    assert report["dataset"]["uri"].endswith("/dataset/v0001")


def test_eos_ends_every_document(built):
    out, _ = built
    tok = json.loads((out / "dataset" / "v0001" / "manifest.json").read_text())["tokenizer"]
    t = pa.ipc.open_stream((out / "v0001" / "packed" / "validation.arrows").read_bytes()).read_all()
    ids = np.array(t["input_ids"].to_pylist())
    seg = np.array(t["segment_ids"].to_pylist())
    for r in range(len(ids)):
        for s in set(seg[r][seg[r] > 0]):
            piece = ids[r][seg[r] == s]
            # bfd keeps documents up to seq_len whole: a piece ends in EOS unless it is
            # a seq_len-sized chunk of a longer document.
            assert piece[-1] == tok["eos_id"] or len(piece) == 256


def test_verify_passes_then_names_what_differs(built, tmp_path):
    out, _ = built
    assert verify(str(out / "dataset" / "v0001")) == []
    copy = tmp_path / "copy"
    shutil.copytree(out / "dataset" / "v0001", copy)
    arrow = sorted((copy / "train").glob("*.arrow"))[1]
    data = bytearray(arrow.read_bytes())
    data[-100] ^= 0xFF
    arrow.write_bytes(bytes(data))
    (copy / "validation" / "extra.arrow").write_bytes(b"x")
    (copy / "tokenizer.json").unlink()
    problems = verify(str(copy))
    text = "\n".join(problems)
    assert f"train/{arrow.name}: sha256" in text
    assert "unexpected file validation/extra.arrow" in text
    assert "missing file tokenizer.json" in text
    # A directory that is not there is named as such, by its absolute path.
    assert verify(str(tmp_path / "nothing")) == [f"{tmp_path / 'nothing'}: no such directory"]
    (tmp_path / "empty").mkdir()
    assert verify(str(tmp_path / "empty"))[0].endswith("incomplete one)")


def test_mixture_realises_the_planned_shares(built):
    _, report = built
    mix = report["mixture"]
    for src, m in mix["sources"].items():
        assert m["planned_tokens"] > 0, src
        assert abs(m["realised_tokens"] - m["planned_tokens"]) <= 0.01 * m["planned_tokens"], src
    shares = {s: m["realised_share"] for s, m in mix["sources"].items()}
    assert shares["web"] == pytest.approx(0.7, abs=0.01)
    assert shares["code"] == pytest.approx(0.3, abs=0.01)
    # Every document is accounted for, including the ones the mixture left out.
    st = report["stages"]["mixture"]["total"]
    assert st["docs_in"] == st["kept"] + sum(st["dropped"].values())
    assert st["dropped"].get("downsampled", 0) > 0


def test_too_small_source_warns_and_budget_is_redistributed(data, tmp_path):
    out = tmp_path / "small"
    over = cfg_dict(data, out)
    over["mixture"] = {"total_tokens": 1_500_000, "max_epochs": 1.0}
    over["sources"][1]["weight"] = 0.6
    over["sources"][0]["weight"] = 0.4
    report = run_prep(parse_config(over), until="mixture", progress=False)
    code = report["mixture"]["sources"]["code"]
    assert code["capped"] and code["warning"] and "code" in code["warning"]
    assert code["planned_tokens"] <= code["available_tokens"]


def test_curriculum_puts_chosen_sources_first(data, tmp_path):
    out = tmp_path / "cur"
    c = cfg_dict(data, out)
    c["mixture"] = {"order": ["code"]}
    run_prep(parse_config(c), until="mixture", progress=False)
    g0 = {
        s
        for f in (out / "v0001" / "mix" / "train").glob("g00-*/*.arrows")
        for s in pa.ipc.open_stream(f.read_bytes()).read_all()["source"].to_pylist()
    }
    g1 = {
        s
        for f in (out / "v0001" / "mix" / "train").glob("g01-*/*.arrows")
        for s in pa.ipc.open_stream(f.read_bytes()).read_all()["source"].to_pylist()
    }
    assert g0 == {"code"} and g1 == {"web"}


def test_same_config_and_seed_give_identical_bytes(data, built, tmp_path):
    out1, _ = built
    out2 = tmp_path / "again"
    run_prep(parse_config({**cfg_dict(data, out2), "workers": 2}), progress=False)
    files = sorted(
        p.relative_to(out1 / "dataset") for p in (out1 / "dataset").rglob("*") if p.is_file()
    )
    assert files == sorted(
        p.relative_to(out2 / "dataset") for p in (out2 / "dataset").rglob("*") if p.is_file()
    )
    for f in files:
        assert (out1 / "dataset" / f).read_bytes() == (out2 / "dataset" / f).read_bytes(), f


def as_parquet(files: list[Path]) -> None:
    """Rewrite Arrow IPC stream files as the Parquet files an older ballast wrote."""
    for f in files:
        pq.write_table(pa.ipc.open_stream(f.read_bytes()).read_all(), f.with_suffix(".parquet"))
        f.unlink()


def assert_same_dataset(out1: Path, out2: Path) -> None:
    for f in sorted(p for p in (out1 / "dataset").rglob("*") if p.is_file()):
        rel = f.relative_to(out1)
        assert (out2 / rel).read_bytes() == f.read_bytes(), rel


def test_resume_packs_pieces_scattered_as_parquet(data, built, tmp_path):
    # A run scattered by a ballast that wrote the mixture's partition pieces as Parquet,
    # then resumed by this one, packs from those pieces to the same dataset.
    out1, _ = built
    out2 = tmp_path / "older"
    cfg = parse_config(cfg_dict(data, out2))
    run_prep(cfg, until="mixture", progress=False)
    pieces = sorted((out2 / "v0001" / "mix").rglob("*.arrows"))
    assert pieces
    as_parquet(pieces)
    run_prep(cfg, progress=False)
    assert_same_dataset(out1, out2)


def test_dataset_from_partitions_packed_as_parquet(data, built, tmp_path):
    # A run packed by a ballast that wrote the packed partitions as Parquet, its dataset
    # then written by this one: the same dataset.
    out1, _ = built
    out2 = tmp_path / "older-pack"
    cfg = parse_config(cfg_dict(data, out2))
    run_prep(cfg, progress=False)
    shutil.rmtree(out2 / "dataset" / "v0001")
    packed = sorted((out2 / "v0001").glob("packed*/**/*.arrows"))
    assert len(packed) >= 4  # rows and spans of the train and validation partitions
    as_parquet(packed)
    run_prep(cfg, progress=False)
    assert_same_dataset(out1, out2)


def test_other_seed_changes_the_order(data, built, tmp_path):
    out1, _ = built
    out2 = tmp_path / "seed"
    run_prep(parse_config({**cfg_dict(data, out2), "seed": 4}), progress=False)
    part = Path("v0001") / "packed" / "train" / "g00-p0000.arrows"
    a = pa.ipc.open_stream((out1 / part).read_bytes()).read_all()["input_ids"]
    b = pa.ipc.open_stream((out2 / part).read_bytes()).read_all()["input_ids"]
    assert a.to_pylist()[:5] != b.to_pylist()[:5]


def test_concat_and_bpe(data, tmp_path):
    from datasets import load_from_disk

    out = tmp_path / "bpe"
    c = cfg_dict(data, out)
    c["tokenizer"] = {"kind": "bpe", "vocab_size": 600, "train_docs": 200}
    c["pack"] = {"strategy": "concat", "seq_len": 128}
    report = run_prep(parse_config(c), progress=False)
    manifest = json.loads((out / "dataset" / "v0001" / "manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "bpe" and manifest["tokenizer"]["vocab_size"] == 600
    train = load_from_disk(str(out / "dataset" / "v0001"))["train"]
    assert np.array(train["input_ids"]).max() < 600
    # concat wastes nothing but the last row's tail
    assert report["packing"]["train"]["pad_tokens"] < 128 * c["dataset"]["pack_partitions"]
    assert verify(str(out / "dataset" / "v0001")) == []


def test_partitions_follow_the_token_count(data, tmp_path, monkeypatch):
    """A corpus with more tokens than `pack_partitions` partitions should hold gets more
    partitions (train and validation), so packing's memory is bounded by
    PARTITION_TOKENS; every planned token still reaches the dataset exactly once."""
    from datasets import load_from_disk

    from dataprep.stages import mixture

    monkeypatch.setattr(mixture, "PARTITION_TOKENS", 20_000)
    out = tmp_path / "run"
    report = run_prep(
        parse_config(cfg_dict(data, out, dataset={"validation_fraction": 0.2})), progress=False
    )
    plan = json.loads((out / "v0001" / mixture.PLAN_KEY).read_text())
    assert plan["train_partitions"] > 4
    assert plan["train_partitions"] * 20_000 >= plan["total_realised_tokens"]
    assert plan["validation_partitions"] > 1
    root = out / "v0001" / "packed"
    packed = {p.relative_to(root).as_posix() for p in root.rglob("*.arrows")}
    assert len([p for p in packed if p.startswith("train/")]) == plan["train_partitions"]
    assert len([p for p in packed if p.startswith("validation/")]) == plan["validation_partitions"]
    assert report["packing"]["train"]["real_tokens"] == plan["total_realised_tokens"]
    assert verify(str(out / "dataset" / "v0001")) == []
    dd = load_from_disk(str(out / "dataset" / "v0001"))
    real = sum(int(np.asarray(r).sum()) for r in dd["validation"]["loss_mask"])
    assert real == report["packing"]["validation"]["real_tokens"] > 0
