"""Sequence packing: turn a stream of tokenised documents into fixed-length training rows.

Pure functions over numpy, no I/O. Input documents come in training order, each an int32
array of token ids that already ends with EOS. Two strategies:

* `pack_concat`: one token stream cut into rows of exactly `seq_len`. Every token is used
  and only the very last row can be padded, but documents are cut at row boundaries.
* `pack_bfd`: best-fit-decreasing over a bounded window of documents. Documents up to
  `seq_len` stay whole; longer ones are cut into `seq_len` pieces (each a row of its own)
  plus a remainder that is packed like a short document. Rows that are not full yet are
  carried into the next window, so the waste is small even with a small window.

Both are generators that yield `Rows` batches of up to `batch_rows` rows, with memory
bounded by the batch (concat) or the window (bfd), never by the corpus.

Each row also carries `segment_ids` (1, 2, 3... per document piece, 0 on padding) and
`position_ids` that restart at 0 at each piece, so a trainer can build a block-diagonal
attention mask and keep documents from attending to each other.

Each batch also says which document pieces its rows hold (`Rows.spans`: the provenance),
one entry per segment in row and segment order: the document's position in the input
stream (0-based, empty documents counted) and the piece's token offsets in it.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

import numpy as np

__all__ = ["Rows", "Spans", "efficiency", "pack_bfd", "pack_concat"]


@dataclass
class Spans:
    """The document pieces of a batch's rows, in row order, then segment order (entry k of
    a row is its segment k + 1). int64 arrays, one entry per piece."""

    row: np.ndarray  # the row in the batch
    doc: np.ndarray  # the document's position in the packer's input stream
    start: np.ndarray  # the piece's token offsets [start, end) in the document
    end: np.ndarray


@dataclass
class Rows:
    """A batch of packed rows, all arrays shaped (n, seq_len).

    The counters let a caller report on the whole stream by summing over batches: a
    document is counted (in `n_docs`, and in `n_split_docs` if it was cut into more than
    one piece) in the batch that holds its first piece.
    """

    input_ids: np.ndarray  # int32; pad_id on padding
    position_ids: np.ndarray  # int32; 0 at each segment start, +1 per token; 0 on padding
    segment_ids: np.ndarray  # int32; 1, 2, 3... per piece in the row; 0 on padding
    loss_mask: np.ndarray  # uint8; 1 on real tokens, 0 on padding
    n_real: int
    n_pad: int
    n_docs: int
    n_split_docs: int
    spans: Spans | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def efficiency(n_real: int, n_pad: int) -> float:
    """Share of row slots that hold real tokens. No rows at all wastes nothing: 1.0."""
    total = n_real + n_pad
    return n_real / total if total else 1.0


def _check(seq_len: int, batch_rows: int, window: int = 1) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def _tokens(doc: np.ndarray) -> np.ndarray:
    # asarray only copies when the caller handed us another dtype.
    a = np.asarray(doc, dtype=np.int32)
    if a.ndim != 1:
        raise ValueError(f"a document must be a 1-D token array, got shape {a.shape}")
    return a


# --------------------------------------------------------------------------- concat


def _concat_rows(
    tokens: np.ndarray, doc_starts: np.ndarray, doc_lens: np.ndarray, seq_len: int, pad_id: int
) -> Rows:
    """Rows from a slice of the stream that starts at a row boundary. `doc_starts` are
    offsets (in `tokens`) of the documents that start in it, `doc_lens` their full lengths
    (which may run past the slice)."""
    n_real = int(tokens.size)
    n = -(-n_real // seq_len)
    total = n * seq_len
    ids = np.full(total, pad_id, dtype=np.int32)
    ids[:n_real] = tokens
    # A segment starts at every document start and at every row start (the rest of a cut
    # document is a new segment: the model cannot attend to the previous row anyway).
    start = np.zeros(total, dtype=bool)
    start[doc_starts] = True
    start[::seq_len] = True
    idx = np.arange(total, dtype=np.int64)  # int64: a batch may exceed 2**31 slots
    pos = (idx - np.maximum.accumulate(np.where(start, idx, 0))).astype(np.int32)
    seg = start.reshape(n, seq_len).cumsum(axis=1, dtype=np.int32)
    pos[n_real:] = 0
    seg.reshape(-1)[n_real:] = 0
    # Slices start on a row boundary, so the offset in the row is the offset mod seq_len.
    n_split = int(np.count_nonzero(doc_starts % seq_len + doc_lens > seq_len))
    return Rows(
        input_ids=ids.reshape(n, seq_len),
        position_ids=pos.reshape(n, seq_len),
        segment_ids=seg,
        loss_mask=(seg > 0).view(np.uint8),
        n_real=n_real,
        n_pad=total - n_real,
        n_docs=int(doc_starts.size),
        n_split_docs=n_split,
    )


def _concat_spans(s: np.ndarray, ln: np.ndarray, od: np.ndarray, n_tok: int, seq_len: int) -> Spans:
    """The pieces of the rows of a slice of `n_tok` tokens: documents at offsets `s`
    (relative to the slice; negative for one begun in an earlier slice) of lengths `ln`
    and stream positions `od`. Document-major order is row-major here: a stream's
    documents follow each other."""
    hit = (s < n_tok) & (s + ln > 0)
    s, ln, od = s[hit], ln[hit], od[hit]
    a = np.maximum(s, 0)
    b = np.minimum(s + ln, n_tok)
    first = a // seq_len
    cnt = (b - 1) // seq_len - first + 1
    rep = np.repeat(np.arange(len(s), dtype=np.int64), cnt)
    within = np.arange(len(rep), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    row = first[rep] + within
    lo = np.maximum(a[rep], row * seq_len)
    hi = np.minimum(b[rep], (row + 1) * seq_len)
    return Spans(row, od[rep], lo - s[rep], hi - s[rep])


def pack_concat(
    docs: Iterable[np.ndarray], seq_len: int, pad_id: int, batch_rows: int = 1024
) -> Iterator[Rows]:
    """Concatenate all documents into one stream and cut it into rows of `seq_len`.

    Every token is used once, in order; only the last row of the last batch is padded.
    Holds at most one batch plus the document that completes it.
    """
    _check(seq_len, batch_rows)
    chunk = seq_len * batch_rows
    buf: list[np.ndarray] = []
    buf_len = 0
    # The documents with tokens in `buf`: start offsets relative to the start of `buf`
    # (negative for one begun in an earlier batch), lengths, stream positions.
    starts: list[int] = []
    lens: list[int] = []
    ords: list[int] = []

    def cut(flat: np.ndarray, upto: int) -> Iterator[Rows]:
        # Emit [0, upto) of the buffer in batches of `chunk` tokens (the last may be short).
        s = np.asarray(starts, dtype=np.int64)
        ln = np.asarray(lens, dtype=np.int64)
        od = np.asarray(ords, dtype=np.int64)
        for off in range(0, upto, chunk):
            end = min(off + chunk, upto)
            sel = (s >= off) & (s < end)
            rows = _concat_rows(flat[off:end], s[sel] - off, ln[sel], seq_len, pad_id)
            rows.spans = _concat_spans(s - off, ln, od, end - off, seq_len)
            yield rows

    for i, doc in enumerate(docs):
        a = _tokens(doc)
        if a.size == 0:
            continue
        starts.append(buf_len)
        lens.append(int(a.size))
        ords.append(i)
        buf.append(a)
        buf_len += int(a.size)
        if buf_len >= chunk:
            # One concatenation per batch (not per document) keeps the copying linear.
            flat = np.concatenate(buf)
            done = buf_len - buf_len % chunk
            yield from cut(flat, done)
            buf, buf_len = [flat[done:]], buf_len - done
            keep = [k for k, st in enumerate(starts) if st + lens[k] > done]
            starts = [starts[k] - done for k in keep]
            lens = [lens[k] for k in keep]
            ords = [ords[k] for k in keep]
    if buf_len:
        yield from cut(np.concatenate(buf), buf_len)


# --------------------------------------------------------------------------- bfd


class _Piece(NamedTuple):
    tokens: np.ndarray
    first: bool  # the document's first piece: where the document is counted
    split: bool  # the document was cut into more than one piece
    doc: int  # the document's position in the input stream
    start: int  # the piece's first token's offset in the document


def _build_rows(rows: list[list[_Piece]], seq_len: int, pad_id: int) -> Rows:
    """Scatter the pieces of each row into (n, seq_len) arrays with a few numpy passes."""
    n = len(rows)
    pieces = [p for r in rows for p in r]
    per_row = np.fromiter((len(r) for r in rows), dtype=np.int64, count=n)
    lens = np.fromiter((p.tokens.size for p in pieces), dtype=np.int64, count=len(pieces))
    tokens = np.concatenate([p.tokens for p in pieces])
    n_real = int(tokens.size)

    piece_row = np.repeat(np.arange(n, dtype=np.int64), per_row)
    row_first_piece = np.cumsum(per_row) - per_row
    piece_start = np.cumsum(lens) - lens  # piece offset in `tokens`
    # Pieces of a row are contiguous in `tokens`, so offset in row = offset in `tokens`
    # minus where the row's first piece starts.
    in_row = piece_start - piece_start[row_first_piece][piece_row]
    piece_dest = piece_row * seq_len + in_row
    piece_seg = np.arange(len(pieces), dtype=np.int64) - row_first_piece[piece_row] + 1

    tok_piece = np.repeat(np.arange(len(pieces), dtype=np.int64), lens)
    within = np.arange(n_real, dtype=np.int64) - piece_start[tok_piece]
    dest = piece_dest[tok_piece] + within

    total = n * seq_len
    ids = np.full(total, pad_id, dtype=np.int32)
    pos = np.zeros(total, dtype=np.int32)
    seg = np.zeros(total, dtype=np.int32)
    ids[dest] = tokens
    pos[dest] = within
    seg[dest] = piece_seg[tok_piece]
    shape = (n, seq_len)
    seg2 = seg.reshape(shape)
    p_start = np.fromiter((p.start for p in pieces), dtype=np.int64, count=len(pieces))
    spans = Spans(
        piece_row,
        np.fromiter((p.doc for p in pieces), dtype=np.int64, count=len(pieces)),
        p_start,
        p_start + lens,
    )
    return Rows(
        input_ids=ids.reshape(shape),
        position_ids=pos.reshape(shape),
        segment_ids=seg2,
        loss_mask=(seg2 > 0).view(np.uint8),
        n_real=n_real,
        n_pad=total - n_real,
        n_docs=sum(p.first for p in pieces),
        n_split_docs=sum(p.first and p.split for p in pieces),
        spans=spans,
    )


def _drain(
    out: list[list[_Piece]], seq_len: int, pad_id: int, batch_rows: int, final: bool = False
) -> Iterator[Rows]:
    """Yield full batches from the front of `out` (and the short tail too if `final`)."""
    while len(out) >= batch_rows or (final and out):
        batch = out[:batch_rows]
        del out[:batch_rows]
        yield _build_rows(batch, seq_len, pad_id)


def _best_fit(pool: list[_Piece], rows: list[list[_Piece]], room: list[int], seq_len: int) -> None:
    """Place `pool` (in the order given) into `rows` in place: each piece goes to the open
    row with the least room that still fits it, ties to the lowest row index (older rows
    first), else to a new row. `room[i]` is what row i has left."""
    # Open rows as sorted ints (room << shift | index): one bisect finds the best fit,
    # and ints compare much faster than tuples. pop/insort move at most ~2*window pointers
    # (a memmove), which is cheap next to the Python work per piece.
    shift = (len(rows) + len(pool)).bit_length()
    mask = (1 << shift) - 1
    keys = sorted((r << shift) | i for i, r in enumerate(room) if r > 0)
    for p in pool:
        size = int(p.tokens.size)
        j = bisect_left(keys, size << shift)
        if j < len(keys):
            i = keys.pop(j) & mask
        else:
            i = len(rows)
            rows.append([])
            room.append(seq_len)
        rows[i].append(p)
        room[i] -= size
        if room[i]:
            insort(keys, (room[i] << shift) | i)


def pack_bfd(
    docs: Iterable[np.ndarray],
    seq_len: int,
    pad_id: int,
    window: int,
    batch_rows: int = 1024,
) -> Iterator[Rows]:
    """Best-fit-decreasing packing over windows of `window` documents.

    Per window: documents longer than `seq_len` are cut into full `seq_len` pieces, each
    a row of its own, plus a remainder piece; the remainders and the whole documents are
    sorted longest first (ties in arrival order) and placed by best fit into the open rows
    carried from earlier windows or into new rows. Full rows are emitted; open rows are
    carried on, at most `window` of them (the fullest beyond that are emitted padded,
    since they are the least likely to fit anything). At the end every open row is
    emitted with padding. Deterministic: the same input gives the same rows.

    Memory: one window of documents plus at most `window` open rows and one batch.
    """
    _check(seq_len, batch_rows, window)
    it = iter(enumerate(docs))
    out: list[list[_Piece]] = []  # closed rows, in output order
    rows: list[list[_Piece]] = []  # open rows carried between windows, oldest first
    room: list[int] = []
    while block := list(islice(it, window)):
        pool: list[_Piece] = []
        for i, doc in block:
            a = _tokens(doc)
            if a.size == 0:
                continue
            if a.size <= seq_len:
                pool.append(_Piece(a, True, False, i, 0))
                continue
            k, r = divmod(int(a.size), seq_len)
            out.extend(
                [_Piece(a[j * seq_len : (j + 1) * seq_len], j == 0, True, i, j * seq_len)]
                for j in range(k)
            )
            if r:
                # Copy the tail so a carried open row does not pin the whole long document.
                pool.append(_Piece(a[k * seq_len :].copy(), False, True, i, k * seq_len))
        # Stable sort: equal lengths keep arrival order, so the result is deterministic.
        pool.sort(key=lambda p: -p.tokens.size)
        _best_fit(pool, rows, room, seq_len)

        open_ix = [i for i in range(len(rows)) if room[i] > 0]
        if len(open_ix) > window:
            # Too many open rows to carry: close the fullest ones (least room, then oldest).
            by_full = sorted(open_ix, key=lambda i: (room[i], i))
            forced = set(by_full[: len(open_ix) - window])
        else:
            forced = set()
        out.extend(rows[i] for i in range(len(rows)) if room[i] == 0 or i in forced)
        keep = [i for i in open_ix if i not in forced]
        rows = [rows[i] for i in keep]
        room = [room[i] for i in keep]
        yield from _drain(out, seq_len, pad_id, batch_rows)
    out.extend(rows)
    yield from _drain(out, seq_len, pad_id, batch_rows, final=True)
