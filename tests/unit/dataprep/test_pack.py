"""Sequence packing: hand-checked rows, then properties on random documents.

Random documents are made of globally unique token ids (document i holds a run of
consecutive ids), so every token in a row says which document it came from and where:
that is how the tests rebuild documents from rows without trusting the packer's counters.
"""

from __future__ import annotations

import numpy as np
import pytest

from dataprep.pack import Rows, efficiency, pack_bfd, pack_concat

EOS, PAD = 99, -1


def _doc(n: int, fill: int) -> np.ndarray:
    """A document of n tokens (fill value) that ends with EOS, like tokenizer output."""
    a = np.full(n, fill, dtype=np.int32)
    a[-1] = EOS
    return a


def _docs(lengths: list[int]) -> list[np.ndarray]:
    return [_doc(n, i + 1) for i, n in enumerate(lengths)]


def _unique_docs(seed: int, n: int, seq_len: int) -> list[np.ndarray]:
    """n documents of random length 1..3*seq_len with globally unique, increasing ids."""
    lens = np.random.default_rng(seed).integers(1, 3 * seq_len + 1, size=n)
    ends = np.cumsum(lens)
    return [np.arange(e - m, e, dtype=np.int32) for e, m in zip(ends, lens, strict=True)]


def _one(batches: list[Rows]) -> Rows:
    """All batches as one Rows (counters summed)."""
    if not batches:
        raise AssertionError("no batches")
    cat = {
        f: np.concatenate([getattr(b, f) for b in batches])
        for f in ("input_ids", "position_ids", "segment_ids", "loss_mask")
    }
    sums = {
        f: sum(getattr(b, f) for b in batches)
        for f in ("n_real", "n_pad", "n_docs", "n_split_docs")
    }
    return Rows(**cat, **sums)


def _pieces(rows: Rows) -> list[np.ndarray]:
    """Each segment's tokens, rows in order, segments in row order."""
    out = []
    for ids, seg in zip(rows.input_ids, rows.segment_ids, strict=True):
        for s in range(1, int(seg.max(initial=0)) + 1):
            out.append(ids[seg == s])
    return out


def _check_layout(rows: Rows, seq_len: int) -> None:
    """Invariants of any packed batch, whatever the strategy."""
    ids, pos, seg, mask = rows.input_ids, rows.position_ids, rows.segment_ids, rows.loss_mask
    n = ids.shape[0]
    for a, dt in ((ids, np.int32), (pos, np.int32), (seg, np.int32), (mask, np.uint8)):
        assert a.shape == (n, seq_len) and a.dtype == dt
    real = seg > 0
    assert np.array_equal(mask, real.astype(np.uint8))
    assert np.all(ids[~real] == PAD) and np.all(pos[~real] == 0)
    assert rows.n_real == int(real.sum()) and rows.n_pad == int((~real).sum())
    for r in range(n):
        k = int(real[r].sum())
        assert k > 0, "empty row"
        assert real[r, :k].all() and not real[r, k:].any(), "padding only at the row end"
        s = seg[r, :k]
        assert s[0] == 1 and np.all(np.diff(s) >= 0) and np.all(np.diff(s) <= 1)
        starts = np.r_[True, np.diff(s) == 1]
        # position restarts at 0 at every segment start and grows by 1 inside a segment
        assert np.all(pos[r, :k][starts] == 0)
        assert np.all(np.diff(pos[r, :k])[~starts[1:]] == 1)


def _next_fit_rows(lengths: list[int], seq_len: int) -> int:
    """Baseline: whole documents in order, a new row whenever the next one does not fit;
    documents longer than seq_len are cut like bfd does (full pieces + remainder)."""
    rows, room = 0, 0
    for n in lengths:
        k, r = divmod(n, seq_len)
        rows += k
        if r:
            if r > room:
                rows, room = rows + 1, seq_len
            room -= r
    return rows


# ------------------------------------------------------------------ hand-checked


def test_concat_hand_example():
    rows = _one(list(pack_concat(_docs([5, 3, 6, 2]), seq_len=8, pad_id=PAD)))
    E = EOS
    assert rows.input_ids.tolist() == [[1, 1, 1, 1, E, 2, 2, E], [3, 3, 3, 3, 3, E, 4, E]]
    assert rows.segment_ids.tolist() == [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 2, 2]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]]
    assert (rows.n_real, rows.n_pad, rows.n_docs, rows.n_split_docs) == (16, 0, 4, 0)


def test_concat_hand_example_with_split_and_padding():
    rows = _one(list(pack_concat(_docs([5, 6, 2]), seq_len=8, pad_id=PAD)))
    E, P = EOS, PAD
    # doc 2 is cut at the row boundary; its second piece restarts at position 0
    assert rows.input_ids.tolist() == [[1, 1, 1, 1, E, 2, 2, 2], [2, 2, E, 3, E, P, P, P]]
    assert rows.segment_ids.tolist() == [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 2, 2, 0, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 0, 1, 0, 0, 0]]
    assert rows.loss_mask.tolist() == [[1] * 8, [1, 1, 1, 1, 1, 0, 0, 0]]
    assert (rows.n_real, rows.n_pad, rows.n_docs, rows.n_split_docs) == (13, 3, 3, 1)


@pytest.mark.parametrize("window", [1, 2, 4])
def test_bfd_hand_example(window):
    # window 4, longest first: 6 opens row A (room 2); 5 does not fit, opens B (room 3);
    # 3 fits B exactly; 2 fits A exactly. Smaller windows reach the same two full rows.
    rows = _one(list(pack_bfd(_docs([5, 3, 6, 2]), seq_len=8, pad_id=PAD, window=window)))
    E = EOS
    got = sorted(rows.input_ids.tolist())
    assert got == sorted([[3, 3, 3, 3, 3, E, 4, E], [1, 1, 1, 1, E, 2, 2, E]])
    assert (rows.n_real, rows.n_pad, rows.n_docs, rows.n_split_docs) == (16, 0, 4, 0)
    if window == 4:
        assert rows.input_ids.tolist() == [[3, 3, 3, 3, 3, E, 4, E], [1, 1, 1, 1, E, 2, 2, E]]
        assert rows.segment_ids.tolist() == [[1] * 6 + [2, 2], [1] * 5 + [2] * 3]
        assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]]


def test_bfd_hand_example_long_doc():
    # doc 1 (11 tokens) -> a full row of 8 + a remainder of 3 that is packed like a short
    # doc. Pool sorted: doc 3 (6) opens A; remainder (3, arrived first) opens B; doc 2 (3)
    # best-fits B (room 5) rather than A (room 2 is too small).
    rows = _one(list(pack_bfd(_docs([11, 3, 6]), seq_len=8, pad_id=PAD, window=3)))
    E, P = EOS, PAD
    assert rows.input_ids.tolist() == [
        [1] * 8,
        [3, 3, 3, 3, 3, E, P, P],
        [1, 1, E, 2, 2, E, P, P],
    ]
    assert rows.position_ids.tolist() == [
        list(range(8)),
        [0, 1, 2, 3, 4, 5, 0, 0],
        [0, 1, 2, 0, 1, 2, 0, 0],
    ]
    assert (rows.n_real, rows.n_pad, rows.n_docs, rows.n_split_docs) == (20, 4, 3, 1)


def test_bfd_best_fit_prefers_tightest_row():
    # Window 2 then a carried row: rows end up with room 3 (doc 5) and room 1 (doc 7);
    # a 1-token doc must go to the tighter row, not the first one.
    lens = [5, 7, 1]
    batches = list(pack_bfd(_docs(lens), seq_len=8, pad_id=PAD, window=2))
    rows = _one(batches)
    assert rows.input_ids.tolist()[0] == [2] * 6 + [EOS, EOS]  # doc 2 + the 1-token doc 3


# ------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("pack", ["concat", "bfd"])
def test_empty_input(pack):
    gen = pack_concat([], 8, PAD) if pack == "concat" else pack_bfd([], 8, PAD, window=4)
    assert list(gen) == []
    assert efficiency(0, 0) == 1.0


@pytest.mark.parametrize("pack", ["concat", "bfd"])
def test_doc_exactly_seq_len_and_length_one(pack):
    docs = _docs([8, 1])
    gen = pack_concat(docs, 8, PAD) if pack == "concat" else pack_bfd(docs, 8, PAD, window=1)
    rows = _one(list(gen))
    _check_layout(rows, 8)
    assert rows.input_ids.tolist() == [[1] * 7 + [EOS], [EOS] + [PAD] * 7]
    assert rows.segment_ids.tolist() == [[1] * 8, [1] + [0] * 7]
    assert (rows.n_real, rows.n_pad, rows.n_docs, rows.n_split_docs) == (9, 7, 2, 0)


def test_bad_arguments():
    with pytest.raises(ValueError):
        list(pack_concat(_docs([3]), 0, PAD))
    with pytest.raises(ValueError):
        list(pack_bfd(_docs([3]), 8, PAD, window=0))
    with pytest.raises(ValueError):
        list(pack_bfd(_docs([3]), 8, PAD, window=2, batch_rows=0))


def test_efficiency():
    assert efficiency(3, 1) == 0.75


# ------------------------------------------------------------------ properties

SEQ = 64
N_DOCS = 300


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch_rows", [1, 7, 1024])
def test_concat_properties(seed, batch_rows):
    docs = _unique_docs(seed, N_DOCS, SEQ)
    batches = list(pack_concat(docs, SEQ, PAD, batch_rows=batch_rows))
    assert all(1 <= len(b) <= batch_rows for b in batches)
    assert all(len(b) == batch_rows for b in batches[:-1])
    rows = _one(batches)
    _check_layout(rows, SEQ)
    stream = np.concatenate(docs)
    # the real tokens in row order are exactly the stream; only the last row is padded
    assert np.array_equal(rows.input_ids[rows.loss_mask.astype(bool)], stream)
    assert rows.n_pad == (-stream.size) % SEQ
    # a segment starts at each document start and at each row start, nowhere else
    doc_starts = np.zeros(stream.size, dtype=bool)
    doc_starts[np.cumsum([0] + [d.size for d in docs[:-1]])] = True
    seg_starts = (rows.position_ids == 0).reshape(-1)[: stream.size]
    row_starts = np.arange(stream.size) % SEQ == 0
    assert np.array_equal(seg_starts, doc_starts | row_starts)
    # counters against the same facts computed directly
    offs = np.cumsum([0] + [d.size for d in docs[:-1]])
    lens = np.array([d.size for d in docs])
    assert rows.n_docs == N_DOCS
    assert rows.n_split_docs == int(np.sum(offs // SEQ != (offs + lens - 1) // SEQ))


def _check_bfd_docs(rows: Rows, docs: list[np.ndarray], seq_len: int) -> None:
    """Every document is present exactly once: whole if it fits a row, else cut into
    seq_len pieces plus one remainder, each piece contiguous and in order."""
    first = np.array([d[0] for d in docs])
    found: dict[int, list[np.ndarray]] = {}
    for p in _pieces(rows):
        assert np.all(np.diff(p) == 1), "a piece is a contiguous run of one document"
        i = int(np.searchsorted(first, p[0], side="right")) - 1
        found.setdefault(i, []).append(p)
    assert sorted(found) == list(range(len(docs)))
    split = 0
    for i, d in enumerate(docs):
        ps = sorted(found[i], key=lambda p: int(p[0]))
        assert np.array_equal(np.concatenate(ps), d), f"doc {i} not rebuilt"
        if d.size <= seq_len:
            assert len(ps) == 1, f"doc {i} fits a row but was split"
        else:
            assert len(ps) == -(-d.size // seq_len)
            assert all(p.size == seq_len for p in ps[:-1])
            split += 1
    assert rows.n_docs == len(docs) and rows.n_split_docs == split


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("window", [1, 10, 1000])
def test_bfd_properties(seed, window):
    docs = _unique_docs(seed, N_DOCS, SEQ)
    batches = list(pack_bfd(docs, SEQ, PAD, window=window, batch_rows=50))
    assert all(1 <= len(b) <= 50 for b in batches)
    rows = _one(batches)
    _check_layout(rows, SEQ)
    _check_bfd_docs(rows, docs, SEQ)
    # deterministic: a second run gives identical rows
    again = _one(list(pack_bfd(docs, SEQ, PAD, window=window, batch_rows=50)))
    for f in ("input_ids", "position_ids", "segment_ids", "loss_mask"):
        assert np.array_equal(getattr(rows, f), getattr(again, f))
    # at least as good as whole documents in order (next fit), never below the bound
    lens = [d.size for d in docs]
    baseline = _next_fit_rows(lens, SEQ)
    n_rows = rows.input_ids.shape[0]
    assert -(-sum(lens) // SEQ) <= n_rows <= baseline


@pytest.mark.parametrize("seed", [3, 4])
def test_bfd_short_docs_stay_whole_and_pack_tightly(seed):
    # Short documents only (the BPE-like case): none is split and a big window packs
    # close to the bound.
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, SEQ // 2, size=N_DOCS)
    ends = np.cumsum(lens)
    docs = [np.arange(e - m, e, dtype=np.int32) for e, m in zip(ends, lens, strict=True)]
    rows = _one(list(pack_bfd(docs, SEQ, PAD, window=N_DOCS)))
    _check_layout(rows, SEQ)
    _check_bfd_docs(rows, docs, SEQ)
    assert rows.n_split_docs == 0
    assert rows.input_ids.shape[0] <= -(-int(lens.sum()) // SEQ) + 1
    assert efficiency(rows.n_real, rows.n_pad) > efficiency(
        int(lens.sum()), _next_fit_rows(list(lens), SEQ) * SEQ - int(lens.sum())
    )


def test_bfd_carries_open_rows_but_caps_them():
    # window=1 must still fill rows across windows (carrying), and with every doc taking
    # 5 of 8 slots no two ever share a row, so each window closes the extra open row.
    rows = _one(list(pack_bfd(_docs([5] * 6), 8, PAD, window=1)))
    assert rows.input_ids.shape[0] == 6
    rows = _one(list(pack_bfd(_docs([4] * 6), 8, PAD, window=1)))
    assert rows.input_ids.shape[0] == 3 and rows.n_pad == 0


def test_input_dtype_is_normalised():
    docs = [np.array([5, 6, EOS], dtype=np.int64), [7, EOS]]
    rows = _one(list(pack_bfd(docs, 8, PAD, window=2)))
    assert rows.input_ids.dtype == np.int32
    assert rows.input_ids.tolist() == [[5, 6, EOS, 7, EOS, PAD, PAD, PAD]]
