"""The packed rows of a prepared dataset, read back as the sequences other trainers want:
a split's Arrow shards record batch by record batch (one shard on local disk at a time),
and the document pieces of those rows (core/dataset.py's `segment_ids`), joined again
into whole documents where the packing makes that exact.

Where a piece ends and whether it can be joined: every document the tokenizer wrote ends
with EOS, so a piece that does not end with EOS is a document cut by the packer. A
dataset with provenance names each piece's document and token offsets, so `documents`
joins the pieces of every document whatever the packing (bfd puts a long document's
remainder in a later row). Without provenance (a dataset prepared before it), `sequences`
joins what the rows alone tell: with `concat` packing the rest of a cut document is the
first piece of the next row (one token stream cut into rows); with `bfd` its pieces stay
separate sequences (`cut` counts them)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.store import Store


@dataclass
class Rows:
    """A record batch of packed rows as (n, seq_len) arrays."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class Sequences:
    """Whole sequences, back to back: `tokens` is their concatenation, `lengths` theirs;
    `cut` of them do not end with EOS (pieces of a document the packing cut)."""

    tokens: np.ndarray
    lengths: np.ndarray
    cut: int


def _matrix(batch: pa.RecordBatch, name: str, seq_len: int) -> np.ndarray:
    # flatten() honours a sliced batch's offset; the values are fixed-width, no nulls.
    values = batch.column(name).flatten().to_numpy(zero_copy_only=False)
    return values.reshape(-1, seq_len)


def _local(store: Store, rel: str, tmp: str) -> Path:
    """A file of the dataset on local disk: its own path, or a download into `tmp`."""
    path = store.local_path(rel)
    if path is None:
        path = Path(tmp) / Path(rel).name
        store.get_file(rel, path)
    return path


def shard_rows(store: Store, rel: str, seq_len: int) -> Iterator[Rows]:
    """The rows of one Arrow shard, a record batch at a time. A shard of a remote dataset
    is downloaded to a temporary file first and removed when it has been read."""
    with (
        tempfile.TemporaryDirectory(prefix="ballast-export-") as tmp,
        pa.memory_map(str(_local(store, rel, tmp))) as src,
    ):
        for batch in pa.ipc.open_stream(src):
            if batch.num_rows:
                yield Rows(
                    *(
                        _matrix(batch, c, seq_len)
                        for c in ("input_ids", "position_ids", "segment_ids")
                    )
                )


def split_rows(store: Store, manifest: dict[str, Any], split: str) -> Iterator[Rows]:
    """The rows of `split` in the dataset's order (its shards in the manifest's order, as
    `load_from_disk` reads them), a record batch at a time."""
    seq_len = int(manifest["seq_len"])
    for rel in manifest["splits"][split]["files"]:
        yield from shard_rows(store, rel, seq_len)


def pieces(rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The document pieces of a batch of rows, in order: their tokens back to back, their
    lengths, and for each whether it runs to the last slot of its row."""
    seq_len = rows.segment_ids.shape[1]
    seg = rows.segment_ids.reshape(-1)
    real = seg > 0
    # A piece starts where a real token's segment differs from the slot before it, or at a
    # row start (segment ids restart at 1 in every row).
    start = real.copy()
    start[1:] &= (seg[1:] != seg[:-1]) | (np.arange(1, seg.size) % seq_len == 0)
    piece = np.cumsum(start)[real] - 1
    lengths = np.bincount(piece, minlength=int(start.sum())).astype(np.int64)
    last = np.flatnonzero(real)[np.cumsum(lengths) - 1] if lengths.size else lengths
    return rows.input_ids.reshape(-1)[real], lengths, last % seq_len == seq_len - 1


def sequences(batches: Iterator[Rows], eos_id: int, join: bool) -> Iterator[Sequences]:
    """The sequences of a split's rows: one per document piece, or (`join`) with a piece
    that runs to the end of its row without EOS joined to the next row's first piece.
    A document joined across batches is held until its end: memory is a batch plus the
    longest document."""
    carry: list[np.ndarray] = []  # the tokens of a document still open at a batch end
    for rows in batches:
        tokens, lengths, at_row_end = pieces(rows)
        if not lengths.size:
            continue
        ends = np.cumsum(lengths)
        open_end = tokens[ends - 1] != eos_id  # the piece is not a document's last
        cont = open_end & at_row_end if join else np.zeros_like(open_end)
        # A sequence starts at every piece that does not continue the one before it.
        first = np.ones(lengths.size, dtype=bool)
        first[1:] = ~cont[:-1]
        if carry:
            first[0] = False
        seq = np.cumsum(first) - 1 + (1 if carry else 0)
        seq_lengths = np.bincount(seq, weights=lengths).astype(np.int64)
        if carry:
            tokens = np.concatenate([*carry, tokens])
            seq_lengths[0] += sum(c.size for c in carry)
            carry = []
        if cont[-1]:  # the last sequence goes on in the next batch
            keep = int(seq_lengths[-1])
            carry = [tokens[tokens.size - keep :].copy()]
            tokens, seq_lengths = tokens[: tokens.size - keep], seq_lengths[:-1]
        cut_ends = np.cumsum(seq_lengths) - 1
        cut = int(np.count_nonzero(tokens[cut_ends] != eos_id)) if seq_lengths.size else 0
        if seq_lengths.size:
            yield Sequences(tokens, seq_lengths, cut)
    if carry:  # a row stream that ends inside a document: what there is, as a cut piece
        tokens = np.concatenate(carry)
        yield Sequences(tokens, np.array([tokens.size], np.int64), int(tokens[-1] != eos_id))


@dataclass
class Spans:
    """The document pieces of a record batch of rows, as the dataset's provenance names
    them, flattened in row and segment order: the global document index and the piece's
    token offsets [start, end) in that document."""

    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray


def _read_spans(path: Path) -> tuple[Spans, np.ndarray]:
    """A provenance spans file whole (a few bytes per segment): flattened values and
    each row's first entry (len rows + 1)."""
    t = pq.read_table(path)
    doc = t.column("doc").combine_chunks()
    offsets = doc.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    flat = [t.column(c).combine_chunks().flatten().to_numpy() for c in ("doc", "start", "end")]
    return Spans(
        flat[0].astype(np.int64), flat[1].astype(np.int64), flat[2].astype(np.int64)
    ), offsets


def split_rows_with_spans(
    store: Store, manifest: dict[str, Any], split: str
) -> Iterator[tuple[Rows, Spans]]:
    """split_rows with each batch's provenance spans (manifest["provenance"]: one spans
    file per Arrow shard, row for row)."""
    files = manifest["provenance"]["splits"][split]
    shards = manifest["splits"][split]["files"]
    if len(files) != len(shards):
        raise ValueError(
            f"the provenance of split {split} names {len(files)} files for "
            f"{len(shards)} Arrow shards"
        )
    seq_len = int(manifest["seq_len"])
    for shard, entry in zip(shards, files, strict=True):
        with tempfile.TemporaryDirectory(prefix="ballast-export-") as tmp:
            spans, offsets = _read_spans(_local(store, entry["file"], tmp))
        row = 0
        for rows in shard_rows(store, shard, seq_len):
            lo, hi = offsets[row], offsets[row + len(rows)]
            yield rows, Spans(spans.doc[lo:hi], spans.start[lo:hi], spans.end[lo:hi])
            row += len(rows)
        if row != len(offsets) - 1:
            raise ValueError(
                f"{entry['file']}: {len(offsets) - 1} rows of spans for {row} rows of {shard}"
            )


def documents(batches: Iterator[tuple[Rows, Spans]], eos_id: int) -> Iterator[Sequences]:
    """Whole documents from rows and their provenance, whatever the packing: a piece that
    is a whole document (offset 0, ends with EOS) is one as it comes; the pieces of a
    document the packer cut (bfd puts a long document's remainder in a later row of the
    same window) are held until all of them have come and then joined in offset order, so
    a document is emitted when its last piece is read. Memory: the open documents, at most
    those of one packing window. A document still open at the end (its pieces do not add
    up) is emitted piece by piece and counted in `cut`."""
    pending: dict[int, list[tuple[int, np.ndarray]]] = {}
    need: dict[int, int] = {}  # doc -> its length, once its EOS piece has come
    have: dict[int, int] = {}
    for rows, sp in batches:
        tokens, lengths, _ = pieces(rows)
        if lengths.size != sp.doc.size or not np.array_equal(lengths, sp.end - sp.start):
            raise ValueError("the provenance spans do not match the rows' segments")
        if not lengths.size:
            continue
        ends = np.cumsum(lengths)
        whole = (sp.start == 0) & (tokens[ends - 1] == eos_id)
        if whole.all() and not pending:
            yield Sequences(tokens, lengths, 0)
            continue
        out: list[np.ndarray] = []
        for i in range(lengths.size):
            piece = tokens[ends[i] - lengths[i] : ends[i]]
            if whole[i]:
                out.append(piece)
                continue
            d = int(sp.doc[i])
            pending.setdefault(d, []).append((int(sp.start[i]), piece.copy()))
            have[d] = have.get(d, 0) + piece.size
            if piece[-1] == eos_id:
                need[d] = int(sp.end[i])
            if need.get(d) == have[d]:
                parts = sorted(pending.pop(d), key=lambda p: p[0])
                del need[d], have[d]
                out.append(np.concatenate([p for _, p in parts]))
        if out:
            yield Sequences(np.concatenate(out), np.array([o.size for o in out], np.int64), 0)
    for d in sorted(pending):
        parts = [p for _, p in sorted(pending[d], key=lambda p: p[0])]
        yield Sequences(
            np.concatenate(parts),
            np.array([p.size for p in parts], np.int64),
            sum(int(p[-1] != eos_id) for p in parts),
        )
