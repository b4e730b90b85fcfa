"""Byte-level BPE encoding per core: HF `tokenizers` (the tokenize stage's reference path)
against the native encoder (native/bpe.cpp), on the same documents with the same trained
vocabulary, both through `Tokenizer.encode_column` as the tokenize stage calls it (EOS
after each document, a flat int32 array out).

    python -m benchmarks.kernel_bpe [--repeat-to-mb 40] [--vocab 8192] [--runs 3]
                                    [--out benchmarks/results/kernel_bpe.json]

Documents: the shared web corpora (OpenWebText 1k, C4 and Dolma fixtures), repeated to
about --repeat-to-mb MB. The BPE is `train_bpe` on those documents at the scale
benchmark's vocabulary size (benchmarks/prep.py: 8192). One thread: RAYON_NUM_THREADS=1
and TOKENIZERS_PARALLELISM=false are set before HF is imported, and the native encoder is
single-threaded, so the figures are per core. MB/s of raw UTF-8 text, median of --runs.

"warm" runs reuse the tokenizer, so the native pre-token cache (and HF's own word cache)
is filled by the earlier runs; "cold" is one pass over the documents once (not repeated)
with a freshly loaded tokenizer, the first shard a worker encodes.
"""

from __future__ import annotations

import os

# Before anything imports `tokenizers`: its Rayon pool reads these once.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, SHARED, have_shared, machine, write_json

WEB = ["web_openwebtext_1k.jsonl", "web_c4_olmo_fixtures.jsonl", "web_dolma_cc_fixtures.jsonl"]


def load_docs() -> list[str]:
    import json

    out: list[str] = []
    for name in WEB:
        with open(SHARED / name, encoding="utf-8") as f:
            out += [json.loads(line)["text"] for line in f]
    return out


def timed(fn: Callable[[], Any], runs: int) -> tuple[list[float], Any]:
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return times, result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat-to-mb", type=float, default=40.0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "kernel_bpe.json")
    args = ap.parse_args(argv)
    if not have_shared(*WEB):
        print(f"skipped: the shared web corpora are not under {SHARED}")
        return 0
    import numpy as np
    import pyarrow as pa

    from dataprep import native
    from dataprep.tokenizer import ENCODE_BATCH, load_tokenizer, train_bpe

    if native.module() is None:
        print(f"skipped: dataprep._native is not built ({native.IMPORT_ERROR}) or switched off")
        return 0
    docs = load_docs()
    once_bytes = sum(len(d.encode()) for d in docs)
    times_over = max(1, round(args.repeat_to_mb * 1e6 / once_bytes))
    column = pa.array(docs * times_over, pa.string())
    nbytes = once_bytes * times_over
    t0 = time.perf_counter()
    tok = train_bpe(docs, args.vocab)
    train_s = time.perf_counter() - t0
    assert tok.native_status() == "native", tok.native_status()

    def encode(flag: str, t: Any = tok, col: Any = column) -> tuple[np.ndarray, np.ndarray]:
        before = os.environ.get("BALLAST_NATIVE")
        os.environ["BALLAST_NATIVE"] = flag
        try:
            return t.encode_column(col, append_id=t.eos_id)
        finally:
            if before is None:
                del os.environ["BALLAST_NATIVE"]
            else:
                os.environ["BALLAST_NATIVE"] = before

    hf_times, (hf_values, hf_offsets) = timed(lambda: encode("0"), args.runs)
    nat_times, (nat_values, nat_offsets) = timed(lambda: encode("1"), args.runs)
    strs = column.to_pylist()
    fast = getattr(tok._hf, "encode_batch_fast", tok._hf.encode_batch)

    def hf_only() -> None:
        # In slices as the HF path runs it: one call over 40 MB would hold GBs of Encodings.
        for i in range(0, len(strs), ENCODE_BATCH):
            fast(strs[i : i + ENCODE_BATCH], add_special_tokens=False)

    raw_times, _ = timed(hf_only, args.runs)
    same = bool(np.array_equal(hf_values, nat_values) and np.array_equal(hf_offsets, nat_offsets))
    once = pa.array(docs, pa.string())
    cold_times = []
    for _ in range(args.runs):
        fresh = load_tokenizer(tok.to_json())
        fresh.native_status()  # builds the encoder (and runs its canary) outside the timing
        t1 = time.perf_counter()
        encode("1", fresh, once)
        cold_times.append(time.perf_counter() - t1)

    def rate(times: list[float], size: int) -> float:
        return round(size / 1e6 / statistics.median(times), 2)

    hf_rate, nat_rate = rate(hf_times, nbytes), rate(nat_times, nbytes)
    result = {
        "what": "byte-level BPE encode of an Arrow text column, EOS appended, one thread",
        "timing": f"median of {args.runs} runs; MB/s of raw UTF-8 text",
        "corpus": {
            "files": WEB,
            "docs": len(docs) * times_over,
            "mb": round(nbytes / 1e6, 2),
            "repeated": times_over,
        },
        "vocab_size": tok.vocab_size,
        "train_seconds": round(train_s, 2),
        "tokens": len(nat_values),
        "identical_ids": same,
        "hf": {"mb_per_s": hf_rate, "seconds": [round(t, 3) for t in hf_times]},
        # HF's encode_batch_fast alone on a ready list of str: no Arrow -> str, no ids
        # -> numpy (the stage pays those on the HF path, included in "hf").
        "hf_encode_only": {
            "mb_per_s": rate(raw_times, nbytes),
            "seconds": [round(t, 3) for t in raw_times],
        },
        "native": {"mb_per_s": nat_rate, "seconds": [round(t, 3) for t in nat_times]},
        "native_cold_once": {
            "mb": round(once_bytes / 1e6, 2),
            "mb_per_s": rate(cold_times, once_bytes),
            "seconds": [round(t, 3) for t in cold_times],
        },
        "speedup": round(nat_rate / hf_rate, 2),
        "tokenizers": version("tokenizers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": machine(),
    }
    print(
        f"{nbytes / 1e6:.1f} MB, vocab {tok.vocab_size}: HF {hf_rate} MB/s, native {nat_rate}"
        f" MB/s ({result['speedup']}x), native cold {result['native_cold_once']['mb_per_s']}"
        f" MB/s; identical ids: {same}"
    )
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
