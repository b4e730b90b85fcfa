"""MinHash near-duplicate detection, vectorised with numpy over batches of documents.

Pure functions, no I/O: word-n-gram shingling, signatures, LSH band keys, the choice of
bands x rows and the exact-Jaccard confirmation of candidates.

Why not datasketch's MinHash per document: it hashes every shingle with SHA-1 in a
Python loop (~60 us for a 1 KB document); here one batch of documents is one byte array
and every step is a numpy operation over it (benchmarks/dedup.py measures both).

The shingles, signatures and band keys also have a compiled kernel (native/minhash.cpp)
that reads the Arrow text column in place and gives the same bits; `shingle_hashes`,
`signatures` and `band_keys` use it when dataprep.native has it, and the *_python
functions, the reference, otherwise (tests/e2e/test_minhash_native.py compares
them; benchmarks/kernel_minhash.py times them).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dataprep import native

U64 = np.uint64
_MASK32 = U64(0xFFFFFFFF)

# A "word" is a maximal run of ASCII letters, digits, '_' or any non-ASCII byte, taken
# from the lower-cased UTF-8 text. Counting every non-ASCII byte as a word byte keeps
# non-Latin scripts tokenisable without a Unicode-aware tokenizer in the hot loop.
_WORD_BYTE = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_":
    _WORD_BYTE[_c] = True
_WORD_BYTE[128:] = True

_P = 0x100000001B3  # odd multiplier of the polynomial word hash (FNV prime)
_P_INV = pow(_P, -1, 2**64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Finaliser of splitmix64: spreads every input bit over the whole word."""
    x = x ^ (x >> U64(30))
    x = x * U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> U64(27))
    x = x * U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


_pow_cache: dict[str, np.ndarray] = {}


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """P**i and P**-i mod 2**64 for i < n, grown on demand."""
    have = _pow_cache.get("p")
    if have is None or len(have) < n:
        m = max(n, 1 << 20, 0 if have is None else 2 * len(have))
        with np.errstate(over="ignore"):
            p = np.full(m, _P, dtype=U64)
            p[0] = 1
            _pow_cache["p"] = np.cumprod(p, dtype=U64)
            q = np.full(m, _P_INV, dtype=U64)
            q[0] = 1
            _pow_cache["q"] = np.cumprod(q, dtype=U64)
    return _pow_cache["p"][:n], _pow_cache["q"][:n]


def word_hashes_python(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every word of every text, and word offsets per text
    (words of text i are hashes[offsets[i]:offsets[i+1]]). The reference for the native
    kernel (native/minhash.cpp)."""
    encoded = [t.lower().encode("utf-8") for t in texts]
    # A space after each text: no word runs across two texts.
    buf = np.frombuffer(b" ".join(encoded) + b" ", dtype=np.uint8)
    doc_end = np.cumsum(
        np.fromiter((len(e) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    )
    is_word = _WORD_BYTE[buf]
    edges = np.diff(is_word.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    pw, pw_inv = _powers(len(buf) + 1)
    with np.errstate(over="ignore"):
        # prefix[i] = sum_{j<i} (byte_j + 1) * P**j, so a run's hash is position-free
        # after multiplying by P**-start.
        prefix = np.zeros(len(buf) + 1, dtype=U64)
        np.cumsum((buf.astype(U64) + U64(1)) * pw[: len(buf)], out=prefix[1:])
        h = (prefix[ends] - prefix[starts]) * pw_inv[starts]
        h = _splitmix64(h ^ (ends - starts).astype(U64))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    offsets[1:] = np.searchsorted(starts, doc_end, side="left")
    return h, offsets


_NGRAM_MULT = _splitmix64(np.arange(1, 33, dtype=U64)) | U64(1)


def shingle_hashes_python(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, unique 32-bit hashes of the word n-grams of each text, and offsets.

    A text shorter than `ngram` words is one shingle of all its words (otherwise every
    short text would have an empty set and they would all look identical); a text with
    no words at all has an empty set and never becomes a near-duplicate.
    """
    wh, woff = word_hashes_python(texts)
    n_words = np.diff(woff)
    n_sh = np.where(n_words >= ngram, n_words - ngram + 1, np.minimum(n_words, 1))
    with np.errstate(over="ignore"):
        # g[i] = mix(sum_k wh[i+k] * C_k): an order-sensitive hash of the n-gram at i.
        total = len(wh)
        m = max(total - ngram + 1, 0)
        acc = np.zeros(m, dtype=U64)
        for k in range(ngram):
            acc += wh[k : k + m] * _NGRAM_MULT[k]
        starts = woff[:-1]
        # Positions of each doc's n-grams: starts[d] .. starts[d] + n_sh[d].
        sh_off = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(n_sh, out=sh_off[1:])
        pos = np.repeat(starts - sh_off[:-1], n_sh) + np.arange(sh_off[-1], dtype=np.int64)
        full = n_words >= ngram
        out = np.empty(sh_off[-1], dtype=U64)
        mask_full = np.repeat(full, n_sh)
        out[mask_full] = acc[pos[mask_full]] if m else np.zeros(0, dtype=U64)
        for d in np.flatnonzero(~full & (n_words > 0)):
            w = wh[woff[d] : woff[d + 1]]
            out[sh_off[d]] = (w * _NGRAM_MULT[: len(w)]).sum(dtype=U64)
        out = (_splitmix64(out) >> U64(32)).astype(np.uint32)
    # Sort within each doc and drop repeats: sort by (doc, hash) in one pass.
    doc_of = np.repeat(np.arange(len(texts), dtype=np.int64), n_sh)
    order = np.lexsort((out, doc_of))
    out, doc_of = out[order], doc_of[order]
    keep = np.ones(len(out), dtype=bool)
    keep[1:] = (out[1:] != out[:-1]) | (doc_of[1:] != doc_of[:-1])
    out, doc_of = out[keep], doc_of[keep]
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.bincount(doc_of, minlength=len(texts)), out=offsets[1:])
    return out, offsets


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients of `num_perm` multiply-add-shift hash functions of 32-bit keys."""
    rng = np.random.Generator(np.random.PCG64(seed))
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) | U64(1)
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


def signatures_python(
    shingles: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray, chunk: int = 4096
) -> np.ndarray:
    """MinHash signatures (n_docs, num_perm) uint32. h_p(x) = ((a_p*x + b_p) mod 2**64) >> 32
    is the multiply-add-shift family; the min commutes with the shift, so the shift is
    applied once to the minima. Docs with no shingles get the all-ones signature."""
    n = len(offsets) - 1
    sig = np.full((n, len(a)), np.iinfo(np.uint32).max, dtype=np.uint32)
    x = shingles.astype(U64)
    counts = np.diff(offsets)
    nonempty = np.flatnonzero(counts > 0)
    if len(nonempty) == 0:
        return sig
    # Process whole documents per chunk of shingles so reduceat never straddles chunks.
    i = 0
    while i < len(nonempty):
        j = i
        total = 0
        while j < len(nonempty) and (total == 0 or total + counts[nonempty[j]] <= chunk):
            total += counts[nonempty[j]]
            j += 1
        docs = nonempty[i:j]
        lo, hi = offsets[docs[0]], offsets[docs[-1] + 1]
        # Permutations along rows, shingles along columns: reduceat then takes the min
        # over contiguous memory (8x faster than reducing down the columns).
        with np.errstate(over="ignore"):
            v = a[:, None] * x[None, lo:hi]
            v += b[:, None]
        mins = np.minimum.reduceat(v, offsets[docs] - lo, axis=1)
        sig[docs] = (mins.T >> U64(32)).astype(np.uint32)
        i = j
    return sig


def band_keys_python(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n_docs, bands) uint64: one hash per band of `rows` signature values."""
    n = sig.shape[0]
    out = np.empty((n, bands), dtype=U64)
    with np.errstate(over="ignore"):
        for j in range(bands):
            acc = np.zeros(n, dtype=U64)
            for k in range(rows):
                acc = _splitmix64(acc ^ sig[:, j * rows + k].astype(U64))
            out[:, j] = acc
    return out


# ---- the native kernels: the same results as the *_python functions above -------------
#
# str.lower() is the full Unicode case mapping (KELVIN SIGN -> 'k', 'İ' -> 'i' + COMBINING
# DOT ABOVE), applied one code point at a time except for GREEK CAPITAL LETTER SIGMA,
# whose lower case depends on its neighbours. So the kernel gets the mapping of every code
# point lower() changes, from this interpreter (_lower_table), and Python lower-cases the
# documents holding a capital sigma itself and hands their bytes over as replacements.

_SIGMA = 0x3A3
_lower_cache: dict[int, object] = {}  # id(module) -> its MinhashLowerTable


def _lower_changes() -> tuple[np.ndarray, list[str]]:
    """The non-ASCII code points (but capital sigma) whose str.lower() differs, and their
    lower case. Whole blocks are lowered at once and compared as UTF-32 (one code point
    per element when the lengths match; a block where lower() lengthens one is checked
    code point by code point): milliseconds instead of a Python loop over 1.1M."""
    cps: list[np.ndarray] = []
    low: list[str] = []
    block = 4096
    for lo in range(0x80, 0x110000, block):
        c = np.arange(lo, min(lo + block, 0x110000), dtype=np.uint32)
        c = c[((c < 0xD800) | (c >= 0xE000)) & (c != _SIGMA)]  # no surrogates: not str-able
        text = c.tobytes().decode("utf-32-le")
        lowered = text.lower()
        if len(lowered) == len(text):
            mapped = np.frombuffer(lowered.encode("utf-32-le"), dtype=np.uint32)
            diff = np.flatnonzero(mapped != c)
            cps.append(c[diff])
            low += [lowered[i] for i in diff.tolist()]
        else:
            one = [(int(cp), chr(cp).lower()) for cp in c.tolist() if chr(cp).lower() != chr(cp)]
            cps.append(np.array([cp for cp, _ in one], dtype=np.uint32))
            low += [m for _, m in one]
    return np.concatenate(cps), low


def _lower_table() -> object:
    """The kernel's MinhashLowerTable, made once per process."""
    mod = native.module()
    assert mod is not None
    table = _lower_cache.get(id(mod))
    if table is None:
        cps, low = _lower_changes()
        table = _lower_cache[id(mod)] = mod.MinhashLowerTable(cps, [m.encode() for m in low])
    return table


def _lowered(texts: list[str], max_chars: int | None) -> list[bytes]:
    return [(t if max_chars is None else t[:max_chars]).lower().encode("utf-8") for t in texts]


def _native_texts(texts: list[str]) -> tuple[tuple, np.ndarray, list[bytes]]:
    """`texts` as the kernel reads them: an Arrow column, and the indices and lower-cased
    UTF-8 of those Python lower-cases (a capital sigma)."""
    idx = [i for i, t in enumerate(texts) if "\u03a3" in t]
    col = native.text_column(pa.array(texts, type=pa.large_string()))
    return col, np.array(idx, dtype=np.int64), _lowered([texts[i] for i in idx], None)


def word_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """word_hashes_python's result, from the native kernel when there is one."""
    mod = native.module()
    if mod is None:
        return word_hashes_python(texts)
    col, idx, repl = _native_texts(texts)
    return mod.minhash_word_hashes(col, -1, _lower_table(), idx, repl)


def shingle_hashes(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """shingle_hashes_python's result, from the native kernel when there is one."""
    mod = native.module()
    if mod is None:
        return shingle_hashes_python(texts, ngram)
    col, idx, repl = _native_texts(texts)
    return mod.minhash_shingle_hashes(col, ngram, -1, _lower_table(), idx, repl)


def shingle_hashes_column(
    column: pa.Array | pa.ChunkedArray, ngram: int, max_chars: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """shingle_hashes of an Arrow string column's texts, each cut to its first `max_chars`
    characters. The native kernel reads the column's buffers in place: only the documents
    holding a capital sigma become Python strings (to be lower-cased by str.lower())."""
    mod = native.module()
    text_type = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
    if mod is None or not text_type or column.null_count:  # nulls: Python fails, as before
        texts = column.to_pylist()
        return shingle_hashes_python(
            texts if max_chars is None else [t[:max_chars] for t in texts], ngram
        )
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    col = native.text_column(column)
    limit = -1 if max_chars is None else max_chars
    idx = mod.minhash_needs_python(col)
    repl = _lowered(column.take(pa.array(idx)).to_pylist(), max_chars) if len(idx) else []
    return mod.minhash_shingle_hashes(col, ngram, limit, _lower_table(), idx, repl)


def signatures(
    shingles: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray, chunk: int = 4096
) -> np.ndarray:
    """signatures_python's result (`chunk` is its memory bound), from the native kernel when
    there is one and the shingles are 32-bit as shingle_hashes makes them."""
    mod = native.module()
    if mod is None or shingles.dtype != np.uint32 or a.dtype != U64 or b.dtype != U64:
        return signatures_python(shingles, offsets, a, b, chunk)
    return mod.minhash_signatures(shingles, offsets.astype(np.int64, copy=False), a, b)


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """band_keys_python's result, from the native kernel when there is one."""
    mod = native.module()
    if mod is None or sig.dtype != np.uint32:
        return band_keys_python(sig, bands, rows)
    return mod.minhash_band_keys(sig, bands, rows)


def candidate_probability(j: float, bands: int, rows: int) -> float:
    """Probability that a pair with Jaccard j shares at least one band."""
    return 1.0 - (1.0 - j**rows) ** bands


def choose_bands(threshold: float, num_perm: int, recall_at_threshold: float) -> tuple[int, int]:
    """The (bands, rows) with the most rows (fewest false candidates) that still makes a
    pair at exactly `threshold` a candidate with probability >= recall_at_threshold.

    datasketch's MinHashLSH instead minimises the sum of false-positive and
    false-negative areas; for threshold 0.8 and 128 permutations that gives 9 bands x 13
    rows, which catches a pair at J=0.8 only ~40% of the time. Here 0.8/128/0.999 gives
    25 x 5: a pair at 0.8 is caught with p=0.99995; candidates below the threshold are
    removed afterwards by the exact Jaccard check.
    """
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if candidate_probability(threshold, bands, rows) >= recall_at_threshold:
            best = (bands, rows)
    return best


def jaccard(x: np.ndarray, y: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique arrays."""
    if len(x) == 0 and len(y) == 0:
        return 1.0
    inter = len(np.intersect1d(x, y, assume_unique=True))
    return inter / (len(x) + len(y) - inter)
