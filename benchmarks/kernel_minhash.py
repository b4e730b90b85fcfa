"""Benchmark: the MinHash kernel, Python reference against native (native/minhash.cpp),
as the near stage runs it (dataprep/stages/near.py signature_shard): batches of 1,000
documents of an Arrow string column, each cut to MAX_CHARS characters, shingled (word
5-grams), signed (128 permutations) and banded.

    python -m benchmarks.kernel_minhash [--mb 64] [--repeats 3]
        [--out benchmarks/results/kernel_minhash.json]

One process, the same documents for both (the scale corpus's documents, benchmarks/common.py
ScaleCorpus: remixed lines of the shared web corpora with planted near copies); MB/s of
the documents' UTF-8 bytes, median of `repeats` runs. Also: the native parts' shares, the
signatures at every instruction-set level this CPU has, the share of documents that are
not ASCII and of those Python lower-cases for the kernel (a capital sigma), and a check
that both give the same bits.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import CORPORA, RESULTS, ScaleCorpus, have_shared, machine, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=64.0, help="MB of text (UTF-8) to process")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "kernel_minhash.json")
    args = ap.parse_args()
    if not have_shared(*(c for c in CORPORA if c.startswith("web_"))):
        print("kernel_minhash: skipped, the shared web corpora are not present")
        return

    import numpy as np
    import pyarrow as pa

    from dataprep import minhash, native
    from dataprep.config import NearDedupConfig
    from dataprep.stages.near import BATCH_DOCS, MAX_CHARS

    mod = native.module()
    if mod is None:
        raise SystemExit(f"kernel_minhash: no native module ({native.IMPORT_ERROR or 'off'})")
    near = NearDedupConfig()
    bands, rows = minhash.choose_bands(near.threshold, near.num_perm, near.recall_at_threshold)
    a, b = minhash.permutations(near.num_perm, args.seed)

    corpus = ScaleCorpus(args.seed)
    docs: list[str] = []
    n_bytes = 0
    while n_bytes < args.mb * 1e6:
        docs.append(corpus.text(len(docs)))
        n_bytes += len(docs[-1].encode("utf-8"))
    column = pa.array(docs, type=pa.string())
    batches = [column.slice(i, BATCH_DOCS) for i in range(0, len(column), BATCH_DOCS)]
    mb = n_bytes / 1e6
    non_ascii = sum(not d.isascii() for d in docs)
    non_ascii_bytes = sum(len(d.encode("utf-8")) for d in docs if not d.isascii())
    to_python = sum("\u03a3" in d for d in docs)
    print(
        f"{len(docs):,} documents, {mb:.1f} MB; not ASCII: {non_ascii / len(docs):.1%} of "
        f"documents ({non_ascii_bytes / n_bytes:.1%} of bytes); lowered by Python for the "
        f"kernel (capital sigma): {to_python / len(docs):.2%}"
    )

    def python_batch(batch: pa.Array) -> tuple[np.ndarray, ...]:
        texts = [t[:MAX_CHARS] for t in batch.to_pylist()]
        sh, off = minhash.shingle_hashes_python(texts, near.ngram)
        sig = minhash.signatures_python(sh, off, a, b)
        return sh, off, sig, minhash.band_keys_python(sig, bands, rows)

    parts = {"shingles": 0.0, "signatures": 0.0, "band_keys": 0.0}

    def native_batch(batch: pa.Array) -> tuple[np.ndarray, ...]:
        t0 = time.perf_counter()
        sh, off = minhash.shingle_hashes_column(batch, near.ngram, MAX_CHARS)
        t1 = time.perf_counter()
        sig = minhash.signatures(sh, off, a, b)
        t2 = time.perf_counter()
        keys = minhash.band_keys(sig, bands, rows)
        parts["shingles"] += t1 - t0
        parts["signatures"] += t2 - t1
        parts["band_keys"] += time.perf_counter() - t2
        return sh, off, sig, keys

    def timed(fn: Callable[[pa.Array], tuple[np.ndarray, ...]]) -> float:
        t0 = time.perf_counter()
        for batch in batches:
            fn(batch)
        return time.perf_counter() - t0

    # The same bits, batch by batch (this also builds the kernel's lower-case table and
    # warms both paths before anything is timed).
    all_sh, all_off = [], []
    for batch in batches:
        got, want = native_batch(batch), python_batch(batch)
        for x, y in zip(got, want, strict=True):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                raise SystemExit("kernel_minhash: native and Python results differ")
        all_sh.append(got[0])
        all_off.append(got[1])
    print("native == python: identical shingles, offsets, signatures and band keys")

    secs: dict[str, list[float]] = {"python": [], "native": []}
    native_parts = []
    for r in range(args.repeats):
        secs["python"].append(timed(python_batch))
        for k in parts:
            parts[k] = 0.0
        secs["native"].append(timed(native_batch))
        native_parts.append(dict(parts))
        print(
            f"run {r + 1}: python {mb / secs['python'][-1]:.1f} MB/s, "
            f"native {mb / secs['native'][-1]:.1f} MB/s"
        )
    med = {k: statistics.median(v) for k, v in secs.items()}
    fastest = min(range(args.repeats), key=lambda i: secs["native"][i])

    # Signatures alone at every instruction-set level (the shingles precomputed).
    levels = {}
    names = ["scalar", "avx2", "avx512"]
    for level in range(mod.minhash_simd_level() + 1):
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for sh, off in zip(all_sh, all_off, strict=True):
                mod.minhash_signatures(sh, off, a, b, level)
            runs.append(time.perf_counter() - t0)
        levels[names[level]] = round(mb / statistics.median(runs), 1)

    result = {
        "what": (
            "near-stage MinHash per batch of 1,000 documents: shingles (word 5-grams) + "
            "signatures (128 permutations) + band keys, one process"
        ),
        "docs": len(docs),
        "mb": round(mb, 2),
        "num_perm": near.num_perm,
        "ngram": near.ngram,
        "bands_rows": [bands, rows],
        "non_ascii_docs_share": round(non_ascii / len(docs), 4),
        "non_ascii_bytes_share": round(non_ascii_bytes / n_bytes, 4),
        "python_lowered_docs_share": round(to_python / len(docs), 6),
        "python_mb_s": round(mb / med["python"], 1),
        "native_mb_s": round(mb / med["native"], 1),
        "speedup": round(med["python"] / med["native"], 1),
        "native_part_secs": {k: round(v, 3) for k, v in native_parts[fastest].items()},
        "signatures_only_mb_s_by_level": levels,
        "simd_level": names[mod.minhash_simd_level()],
        "identical": True,
        "runs_secs": {k: [round(x, 3) for x in v] for k, v in secs.items()},
        "python": platform.python_version(),
        "machine": machine(),
    }
    print(
        f"median of {args.repeats}: python {result['python_mb_s']} MB/s, native "
        f"{result['native_mb_s']} MB/s ({result['speedup']}x); native parts "
        f"{result['native_part_secs']}; signatures alone by level {levels} MB/s"
    )
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
