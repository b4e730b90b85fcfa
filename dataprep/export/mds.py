"""MosaicML streaming's MDS shards, written by mosaicml-streaming's own `MDSWriter`: one
sample per packed row, so a row is what LLM Foundry's `StreamingTextDataset` trains on
(`tokens`, an int32 array; its `ndarray` column type, as llm-foundry's
`convert_dataset_hf --concat_tokens` writes them since 0.8), with the row's position ids,
segment ids and loss mask beside it for a trainer that masks attention per document or
ignores padding. Each split is a directory with `index.json` (StreamingDataset(local=OUT,
split=...) reads it)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dataprep.export.rows import Rows

COLUMNS = {
    "tokens": "ndarray:int32",
    "position_ids": "ndarray:int32",
    "segment_ids": "ndarray:int32",
    "loss_mask": "ndarray:uint8",
}
SIZE_LIMIT = 1 << 26  # bytes per shard, MDSWriter's default


def import_streaming() -> types.ModuleType:
    """`streaming`, importable without torchvision: the package's __init__ imports its image
    datasets (streaming.vision -> torchvision), whose wheels would replace this torch with a
    CUDA build, so the Makefile installs mosaicml-streaming without its dependencies. MDS
    code does not use streaming.vision; an empty module stands in for it unless the real
    one imports."""
    try:
        import streaming
    except ModuleNotFoundError as e:
        if e.name != "torchvision":
            raise
        for name in [m for m in sys.modules if m == "streaming" or m.startswith("streaming.")]:
            del sys.modules[name]  # the half-imported package
        sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")
        import streaming
    return streaming


def write_split(out: Path, split: str, rows: Iterator[Rows]) -> dict[str, Any]:
    """OUT/<split>/index.json and shard.NNNNN.mds, a sample per row."""
    writer_cls = import_streaming().MDSWriter
    n = tokens = 0
    with writer_cls(
        out=str(out / split),
        columns=COLUMNS,
        compression=None,
        size_limit=SIZE_LIMIT,
        progress_bar=False,
    ) as w:
        for r in rows:
            mask = r.segment_ids > 0
            loss = mask.astype(np.uint8)
            for i in range(len(r)):
                w.write(
                    {
                        "tokens": r.input_ids[i].astype(np.int32, copy=False),
                        "position_ids": r.position_ids[i].astype(np.int32, copy=False),
                        "segment_ids": r.segment_ids[i].astype(np.int32, copy=False),
                        "loss_mask": loss[i],
                    }
                )
            n += len(r)
            tokens += int(mask.sum())
    files = sorted(p.relative_to(out).as_posix() for p in (out / split).iterdir())
    return {"files": files, "samples": n, "real_tokens": tokens, "columns": COLUMNS}
