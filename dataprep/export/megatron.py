"""Megatron's indexed dataset (megatron/core/datasets/indexed_dataset.py): `PREFIX.bin`
holds the tokens of every sequence back to back, `PREFIX.idx` the index that
`IndexedDatasetBuilder.finalize` writes:

    b"MMIDIDX\\x00\\x00"  <Q version 1  <B dtype code
    <Q sequence count  <Q document count
    int32 sequence lengths, int64 sequence byte offsets, int64 document indices

One sequence per document and the document indices 0, 1, ..., n, as `preprocess_data.py`
writes a corpus without --split-sentences; the dtype is the one it picks for the
vocabulary (`DType.optimal_dtype`). The lengths go to a temporary file while the tokens
are written, so memory never holds an index of the whole split."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dataprep.export.rows import Sequences

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# DType's codes in indexed_dataset.py.
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
_CHUNK = 1 << 20  # index entries per write when the index is assembled


def token_dtype(vocab_size: int) -> np.dtype:
    """`DType.optimal_dtype(vocab_size)`: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def document_prefix(split: str) -> str:
    """`preprocess_data.py`'s output name for the json key `text` at document level."""
    return f"{split}_text_document"


def write_index(idx: Path, lengths_file: Path, count: int, dtype: np.dtype) -> None:
    """PREFIX.idx for `count` sequences whose int32 lengths are in `lengths_file`."""
    with open(idx, "wb") as f, open(lengths_file, "rb") as lf:
        f.write(HEADER)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", count))
        f.write(struct.pack("<Q", count + 1))  # document indices: 0 and one per document
        while chunk := lf.read(_CHUNK * 4):
            f.write(chunk)
        lf.seek(0)
        offset = 0
        while chunk := lf.read(_CHUNK * 4):
            ends = np.cumsum(np.frombuffer(chunk, np.int32), dtype=np.int64) * dtype.itemsize
            f.write((offset + np.concatenate([[0], ends[:-1]])).astype(np.int64).tobytes())
            offset += int(ends[-1])
        for lo in range(0, count + 1, _CHUNK):
            f.write(np.arange(lo, min(lo + _CHUNK, count + 1), dtype=np.int64).tobytes())


def write_split(
    out: Path, split: str, seqs: Iterator[Sequences], vocab_size: int
) -> dict[str, Any]:
    """OUT/<split>_text_document.bin/.idx from the split's sequences."""
    dtype = token_dtype(vocab_size)
    prefix = document_prefix(split)
    bin_path, idx_path = out / f"{prefix}.bin", out / f"{prefix}.idx"
    lengths_file = out / f".{prefix}.lengths.tmp"
    count = tokens = cut = 0
    try:
        with open(bin_path, "wb") as bf, open(lengths_file, "wb") as lf:
            for s in seqs:
                bf.write(s.tokens.astype(dtype).tobytes())
                lf.write(s.lengths.astype(np.int32).tobytes())
                count += s.lengths.size
                tokens += s.tokens.size
                cut += s.cut
        write_index(idx_path, lengths_file, count, dtype)
    finally:
        lengths_file.unlink(missing_ok=True)
    return {
        "prefix": prefix,
        "files": [bin_path.name, idx_path.name],
        "dtype": dtype.name,
        "sequences": count,
        "documents": count,
        "cut_pieces": cut,
        "tokens": tokens,
    }
