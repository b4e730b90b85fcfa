"""Benchmark: sequence packing (concat vs best-fit-decreasing) on a real web corpus.

    python -m benchmarks.packing [--seq-len 1024] [--repeat 3] [--bpe-ratio 4]
                                 [--out benchmarks/results/packing.json]

Tokenises ../shared/data/web_openwebtext_1k.jsonl with a byte tokenizer (UTF-8 bytes are
ids 0..255, EOS = 256, pad = 257; inline, so this needs no tokenizer module) and packs it
into rows of --seq-len with `pack_concat` and with `pack_bfd` at several window sizes.
Reports per strategy: efficiency (real tokens / all row slots), the fraction of documents
split, rows and tokens/s (median of --repeat runs, one core).

The target is bfd >= 99% efficiency with whole documents. With bytes as tokens most
documents of this corpus are longer than 1024 tokens and cannot stay whole in any
packing, so the report also gives the best possible: the fraction of documents that must
be split and the efficiency upper bound from a lower bound on the number of rows (see
`bounds`). Byte lengths are ~4x a BPE tokenizer's, so the same is also run on "BPE-like"
documents (every --bpe-ratio-th byte: realistic lengths, meaningless ids).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, SHARED, write_json
from dataprep.pack import Rows, efficiency, pack_bfd, pack_concat

CORPUS = "web_openwebtext_1k.jsonl"
EOS, PAD = 256, 257


def byte_tokens(path: Path) -> list[np.ndarray]:
    """Each document's UTF-8 bytes as int32 ids plus EOS, as views into one array."""
    texts = [
        json.loads(line)["text"]
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    raw = [t.encode("utf-8") + b"\x00" for t in texts]  # placeholder byte where EOS goes
    flat = np.frombuffer(b"".join(raw), dtype=np.uint8).astype(np.int32)
    ends = np.cumsum([len(r) for r in raw])
    flat[ends - 1] = EOS
    return np.split(flat, ends[:-1])


def bpe_like(docs: list[np.ndarray], ratio: int) -> list[np.ndarray]:
    """Shorter documents with roughly BPE lengths: keep every ratio-th byte, then EOS."""
    return [np.append(d[:-1][::ratio], np.int32(EOS)) for d in docs]


def bounds(lengths: np.ndarray, seq_len: int) -> dict:
    """Upper bounds on efficiency from lower bounds on the number of rows.

    `any_packing`: rows >= ceil(tokens / seq_len), whatever is split.
    `whole_docs`: documents that fit stay whole and longer ones are cut into seq_len pieces
    plus a remainder (what bfd does): the full pieces fill rows exactly, and among the
    rest (whole docs and remainders) no two items longer than seq_len / 2 can share a row,
    so rows >= full pieces + max(ceil(rest / seq_len), items > seq_len / 2).
    """
    total = int(lengths.sum())
    full = lengths // seq_len
    rest = lengths % seq_len  # docs <= seq_len: the doc itself (or 0 if exactly seq_len)
    rest = np.where(lengths <= seq_len, np.where(lengths == seq_len, 0, lengths), rest)
    items = rest[rest > 0]
    any_rows = -(-total // seq_len)
    whole_rows = int(full.sum()) + max(
        -(-int(items.sum()) // seq_len), int(np.sum(items > seq_len / 2))
    )
    return {
        "any_packing": {"min_rows": any_rows, "max_efficiency": total / (any_rows * seq_len)},
        "whole_docs": {
            "min_rows": whole_rows,
            "max_efficiency": total / (whole_rows * seq_len),
            "min_split_fraction": float(np.mean(lengths > seq_len)),
        },
    }


def next_fit_rows(lengths: np.ndarray, seq_len: int) -> int:
    """Baseline: whole documents in order, a new row whenever the next one does not fit
    (long documents cut like bfd does); this is what naive whole-document packing gets."""
    rows, room = 0, 0
    for n in lengths.tolist():
        k, r = divmod(n, seq_len)
        rows += k
        if r:
            if r > room:
                rows, room = rows + 1, seq_len
            room -= r
    return rows


def run(name: str, make, repeat: int) -> dict:
    """Pack `repeat` times (consuming every batch); counters from the last run."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        batches: list[Rows] = list(make())
        times.append(time.perf_counter() - t0)
    n_real = sum(b.n_real for b in batches)
    n_pad = sum(b.n_pad for b in batches)
    n_docs = sum(b.n_docs for b in batches)
    n_split = sum(b.n_split_docs for b in batches)
    sec = statistics.median(times)
    return {
        "strategy": name,
        "rows": sum(len(b) for b in batches),
        "efficiency": efficiency(n_real, n_pad),
        "split_fraction": n_split / n_docs if n_docs else 0.0,
        "seconds": sec,
        "tokens_per_s": n_real / sec if sec else float("inf"),
    }


def bench(docs: list[np.ndarray], seq_len: int, repeat: int) -> dict:
    lengths = np.array([d.size for d in docs], dtype=np.int64)
    total = int(lengths.sum())
    windows = [10, 100, 1000, len(docs)]
    results = [run("concat", lambda: pack_concat(docs, seq_len, PAD), repeat)]
    for w in dict.fromkeys(windows):  # de-duplicated, in order
        label = f"bfd(window={w})" + (" [all docs]" if w == len(docs) else "")
        results.append(run(label, lambda w=w: pack_bfd(docs, seq_len, PAD, window=w), repeat))
    nf = next_fit_rows(lengths, seq_len)
    return {
        "docs": len(docs),
        "tokens": total,
        "doc_len": {
            "mean": float(lengths.mean()),
            "median": float(np.median(lengths)),
            "p90": float(np.percentile(lengths, 90)),
            "max": int(lengths.max()),
        },
        "bounds": bounds(lengths, seq_len),
        "baseline_next_fit_whole_docs": {"rows": nf, "efficiency": total / (nf * seq_len)},
        "results": results,
    }


def print_table(title: str, rep: dict) -> None:
    b = rep["bounds"]
    print(
        f"\n{title}: {rep['docs']} docs, {rep['tokens']:,} tokens, "
        f"median doc {rep['doc_len']['median']:.0f}"
    )
    print(f"  bound (any packing):   efficiency <= {b['any_packing']['max_efficiency']:.4f}")
    print(
        f"  bound (whole docs):    efficiency <= {b['whole_docs']['max_efficiency']:.4f}, "
        f"split >= {b['whole_docs']['min_split_fraction']:.3f}"
    )
    nf = rep["baseline_next_fit_whole_docs"]
    print(f"  next-fit whole docs:   efficiency  = {nf['efficiency']:.4f}")
    print(f"  {'strategy':<28}{'rows':>8}{'efficiency':>12}{'split':>8}{'Mtok/s':>9}")
    for r in rep["results"]:
        print(
            f"  {r['strategy']:<28}{r['rows']:>8}{r['efficiency']:>12.4f}"
            f"{r['split_fraction']:>8.3f}{r['tokens_per_s'] / 1e6:>9.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bpe-ratio", type=int, default=4, help="0 to skip the BPE-like run")
    ap.add_argument("--out", default=str(RESULTS / "packing.json"))
    args = ap.parse_args()

    path = SHARED / CORPUS
    if not path.exists():
        print(f"skip: {CORPUS} not found under {SHARED}")
        return
    docs = byte_tokens(path)
    report = {
        "corpus": CORPUS,
        "seq_len": args.seq_len,
        "tokenizer": "bytes (ids 0..255), EOS=256, pad=257",
        "timing": f"median of {args.repeat} runs; one process, one core",
        "python": platform.python_version(),
        "machine": platform.platform(),
        "bytes": bench(docs, args.seq_len, args.repeat),
    }
    print_table("byte tokens", report["bytes"])
    if args.bpe_ratio > 0:
        key = f"bpe_like_bytes_div_{args.bpe_ratio}"
        report[key] = bench(bpe_like(docs, args.bpe_ratio), args.seq_len, args.repeat)
        print_table(f"BPE-like lengths (every {args.bpe_ratio}th byte)", report[key])
    out = write_json(args.out, report)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
