"""The streaming dataset writer against the library's own: `write_dataset` must produce
byte for byte the files `DatasetDict.save_to_disk(num_shards=...)` writes from the same
packed rows (the reference below is the previous implementation, kept small), and must
not hold a whole split in memory while doing it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from core.dataset import MANIFEST, arrow_stats, row_schema, verify
from core.files import sha256_file
from core.store import LocalStore, Store
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from dataprep.stages import dataset
from dataprep.stages.mixture import read_plan, train_partitions, validation_partitions
from dataprep.stages.pack import packed_done_key, packed_key, table_bytes
from dataprep.stages.tokenize import TOKENIZER_KEY
from tests.support.helpers import ROOT, read_jsonl, shared_file, write_jsonl


class RemoteLikeStore(LocalStore):
    """A LocalStore that offers no local paths, so the writer takes the download /
    upload path it takes for S3."""

    def local_path(self, key: str) -> Path | None:
        return None


def reference_save(
    store: Store,
    parts: dict[str, list[str]],
    seq_len: int,
    shards: dict[str, int],
    fingerprint: str,
    out: Path,
) -> None:
    """What write_dataset did before it streamed: every split staged as one Arrow file,
    memory-mapped and saved with `DatasetDict.save_to_disk`."""
    from datasets import Dataset, DatasetDict
    from datasets.table import MemoryMappedTable

    schema = row_schema(seq_len)
    staged = out.parent / f"{out.name}-staged"
    staged.mkdir()
    for name, ps in parts.items():
        with (
            pa.OSFile(str(staged / f"{name}.arrow"), "wb") as sink,
            pa.ipc.new_stream(sink, schema) as writer,
        ):
            for p in ps:
                table = pa.ipc.open_stream(store.get(packed_key(p))).read_all()
                for batch in table.cast(schema).to_batches(max_chunksize=1000):
                    writer.write_batch(batch)
    dd = DatasetDict(
        {
            name: Dataset(
                MemoryMappedTable.from_file(str(staged / f"{name}.arrow")),
                fingerprint=f"{fingerprint}-{name}",
            )
            for name in parts
        }
    )
    dd.save_to_disk(str(out), num_shards=shards)


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def put_packed(store: Store, part: str, rows: int, seq_len: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cols = {}
    for field in row_schema(seq_len):
        dtype = np.int8 if field.name == "loss_mask" else np.int32
        values = rng.integers(0, 100, size=rows * seq_len).astype(dtype)
        cols[field.name] = pa.FixedSizeListArray.from_arrays(pa.array(values), seq_len)
    store.put(packed_key(part), table_bytes(pa.table(cols, schema=row_schema(seq_len))))
    store.put(packed_done_key(part), json.dumps({"rows": rows}).encode())


def write_streaming(
    store: Store,
    target: Store,
    parts: list[str],
    name: str,
    seq_len: int,
    shards: int,
    fingerprint: str,
    scratch: Path,
) -> dict[str, dict[str, Any]]:
    schema = row_schema(seq_len)
    rows = dataset.packed_rows(store, parts)
    per_part = [dataset.packed_rows(store, [p]) for p in parts]

    def batches_from(start: int):
        return dataset.packed_batches(
            store, parts, dataset.read_batch_rows(schema), scratch, skip=start, part_rows=per_part
        )

    return dataset.write_split(
        target, name, batches_from, rows, shards, fingerprint, schema, scratch
    )


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
@pytest.mark.parametrize(
    ("sizes", "shards", "row_group"),
    [
        ([1396, 0, 1763, 5], 3, None),  # shards and 1000-row batches cross partitions
        ([100, 250, 7], 4, "5KB"),  # save_to_disk's own batch size drops below 1000 rows
        ([1, 1], 2, None),  # a row per shard
        ([0], 1, None),  # an empty split is one schema-only shard
    ],
)
def test_split_matches_save_to_disk_byte_for_byte(
    tmp_path, monkeypatch, remote, sizes, shards, row_group
):
    import datasets
    from datasets import load_from_disk

    if row_group:
        monkeypatch.setattr(datasets.config, "MAX_ROW_GROUP_SIZE", row_group)
    seq_len = 16
    cls = RemoteLikeStore if remote else LocalStore
    store, target = cls(tmp_path / "store"), cls(tmp_path / "new")
    parts = [f"train/g00-p{i:04d}" for i in range(len(sizes))]
    for i, (part, n) in enumerate(zip(parts, sizes, strict=True)):
        put_packed(store, part, n, seq_len, seed=i)
    (tmp_path / "scratch").mkdir()
    entries = write_streaming(
        store, target, parts, "train", seq_len, shards, "fp-train", tmp_path / "scratch"
    )
    target.put("dataset_dict.json", b'{"splits": ["train"]}')
    reference_save(store, {"train": parts}, seq_len, {"train": shards}, "fp", tmp_path / "ref")

    new, ref = tree(tmp_path / "new"), tree(tmp_path / "ref")
    assert sorted(new) == sorted(ref)
    for rel in ref:
        assert new[rel] == ref[rel], rel
    if row_group:
        batches = [b.num_rows for b in pa.ipc.open_stream(ref["train/data-00000-of-00004.arrow"])]
        assert max(batches) == 24 and len(batches) > 1
    assert not list((tmp_path / "scratch").iterdir())  # nothing left behind
    for rel, entry in entries.items():
        path = tmp_path / "ref" / rel
        assert entry["sha256"] == sha256_file(path) and entry["bytes"] == path.stat().st_size
        if rel.endswith(".arrow"):
            assert (entry["rows"], entry["real_tokens"]) == arrow_stats(path)
    got = load_from_disk(str(tmp_path / "new"))["train"].with_format("arrow")[:]
    packed = [pa.ipc.open_stream(store.get(packed_key(p))).read_all() for p in parts]
    assert got.equals(pa.concat_tables(packed).cast(got.schema))


def test_wrong_done_marker_is_an_error(tmp_path):
    store, target = LocalStore(tmp_path / "store"), LocalStore(tmp_path / "new")
    put_packed(store, "train/g00-p0000", 10, 8, seed=0)
    (tmp_path / "scratch").mkdir()
    for rows in (9, 11):
        store.put(packed_done_key("train/g00-p0000"), json.dumps({"rows": rows}).encode())
        with pytest.raises(RuntimeError, match="rows than their done markers say"):
            write_streaming(
                store, target, ["train/g00-p0000"], "train", 8, 2, "fp", tmp_path / "scratch"
            )


def prep_cfg(root: Path) -> dict[str, Any]:
    web = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 500)
    code = read_jsonl(shared_file("code_python_cosqa_dev.jsonl"))
    write_jsonl(root / "web.jsonl", [{"id": r["id"], "text": r["text"]} for r in web])
    write_jsonl(root / "code.jsonl", [{"id": r["id"], "text": r["text"]} for r in code])
    return {
        "output": str(root / "run"),
        "workers": 1,
        "seed": 3,
        "sources": [
            {"name": "web", "paths": [str(root / "web.jsonl")], "id_field": "id", "weight": 0.7},
            {
                "name": "code",
                "paths": [str(root / "code.jsonl")],
                "id_field": "id",
                "weight": 0.3,
                "quality": [],
            },
        ],
        "ingest": {"shard_docs": 200},
        "quality": ["char_repetition"],
        "pack": {"seq_len": 64, "strategy": "bfd", "window": 500},
        "dataset": {
            "validation_fraction": 0.05,
            "train_shards": 3,
            "validation_shards": 2,
            "pack_partitions": 5,
        },
    }


def test_prep_dataset_matches_save_to_disk_byte_for_byte(tmp_path):
    from datasets import load_from_disk

    cfg = parse_config(prep_cfg(tmp_path))
    run_prep(cfg, progress=False)
    out = Path(cfg.output) / "dataset" / "v0001"
    store, vstore = LocalStore(cfg.output), LocalStore(Path(cfg.output) / "v0001")
    plan = read_plan(cfg)
    parts = {"train": train_partitions(cfg, plan), "validation": validation_partitions(plan)}
    rows = {name: dataset.packed_rows(vstore, ps) for name, ps in parts.items()}
    shards = {"train": min(3, rows["train"]), "validation": min(2, rows["validation"])}
    assert shards == {"train": 3, "validation": 2}
    ref = tmp_path / "ref"
    reference_save(vstore, parts, cfg.pack.seq_len, shards, cfg.fingerprint(), ref)
    (ref / "tokenizer.json").write_bytes(store.get(TOKENIZER_KEY))

    new, old = tree(out), tree(ref)
    # Beside save_to_disk's files: the manifest and the provenance (core/provenance.py).
    prov = {rel for rel in new if rel.startswith("provenance/")}
    assert prov and sorted(set(new) - prov) == sorted([*old, MANIFEST])
    for rel in old:
        assert new[rel] == old[rel], rel
    manifest = json.loads(new[MANIFEST])
    for rel in old:
        entry: dict[str, Any] = {
            "sha256": sha256_file(ref / rel),
            "bytes": (ref / rel).stat().st_size,
        }
        if rel.endswith(".arrow"):
            entry["rows"], entry["real_tokens"] = arrow_stats(ref / rel)
            entry["tokens"] = entry["rows"] * cfg.pack.seq_len
        assert manifest["files"][rel] == entry, rel
    assert set(manifest["files"]) == set(old) | prov
    for name, n in rows.items():
        assert manifest["splits"][name]["rows"] == n
    assert verify(str(out)) == []

    got, want = load_from_disk(str(out)), load_from_disk(str(ref))
    for name in parts:
        assert got[name].with_format("arrow")[:].equals(want[name].with_format("arrow")[:])

    # A second run of the same config finds the manifest and writes nothing.
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert dataset.write_dataset(cfg, parts["train"], {}) == manifest
    assert mtimes == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


MEASURE = f"""
import json, sys
from pathlib import Path
import pyarrow as pa
from core.store import LocalStore
from dataprep.stages import dataset
from {__name__} import write_streaming
root = Path(sys.argv[1])
dataset.SHARD_THREADS = int(sys.argv[3])
before = pa.default_memory_pool().max_memory()
entries = write_streaming(LocalStore(root / "store"), LocalStore(root / "new"),
                          ["train/g00-p0000"], "train", int(sys.argv[2]), 3, "fp", root / "scratch")
print(json.dumps({{"before": before, "peak": pa.default_memory_pool().max_memory(),
                  "rows": sum(e.get("rows", 0) for e in entries.values())}}))
"""


def test_memory_stays_at_a_few_batches_not_the_split(tmp_path):
    """~210 MB of rows in one packed partition: Arrow's peak allocation while writing
    them (measured in a fresh process, whose pool peak is this write's alone) is a few
    record batches, not the split (the old writer read a whole partition into memory
    and memory-mapped the whole split)."""
    seq_len, rows = 2048, 8000
    schema = row_schema(seq_len)
    store = LocalStore(tmp_path / "store")
    # Compressible values keep the parquet file (and the time to make it) small.
    ids = pa.array(np.arange(rows * seq_len, dtype=np.int32) % 1000)
    mask = pa.array(np.ones(rows * seq_len, dtype=np.int8))
    table = pa.table(
        [pa.FixedSizeListArray.from_arrays(a, seq_len) for a in (ids, ids, ids, mask)],
        schema=schema,
    )
    split_bytes = table.nbytes
    store.put(packed_key("train/g00-p0000"), table_bytes(table))
    store.put(packed_done_key("train/g00-p0000"), json.dumps({"rows": rows}).encode())
    del table, ids, mask
    (tmp_path / "scratch").mkdir()

    def peak(threads: int) -> int:
        shutil.rmtree(tmp_path / "new", ignore_errors=True)
        proc = subprocess.run(
            [sys.executable, "-c", MEASURE, str(tmp_path), str(seq_len), str(threads)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["rows"] == rows
        return got["peak"] - got["before"]

    batch_bytes = dataset.save_batch_size(rows, split_bytes) * dataset.row_nbytes(schema)
    # One shard writer streams: a few batches, not the split.
    one = peak(1)
    assert one < 4 * batch_bytes, (one, batch_bytes)
    assert one < split_bytes / 2, (one, split_bytes)
    # The step writes SHARD_THREADS shards at once: each streams the same way.
    both = peak(dataset.SHARD_THREADS)
    assert both < dataset.SHARD_THREADS * 4 * batch_bytes, (both, batch_bytes)
