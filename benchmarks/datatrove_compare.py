"""Benchmark: the same prep as `benchmarks.prep scale`, done with datatrove (huggingface/datatrove)
on the same corpus, for a side-by-side comparison of wall time, throughput and memory.

Runs in its own virtual environment (never in .venv), created once with:

    python3 -m venv .venv-datatrove
    .venv-datatrove/bin/pip install datatrove==0.10.1 spacy==3.8.18 tokenizers==0.23.3 \\
        xxhash==3.8.2 orjson==3.13.0 regex==2026.11.15

(datatrove's "processing" extra is not installed whole: it pulls in trafilatura, fasttext,
nltk and more that this pipeline does not use. Nothing is downloaded at run time: English
words and sentences come from spaCy's blank "en" pipeline (rules shipped in the spacy
wheel, no model), which is datatrove 0.10's own English word tokenizer, so no nltk data is
needed; the BPE tokenizer is trained here and loaded from a local tokenizer.json, which
datatrove loads with Tokenizer.from_file; HF_HUB_OFFLINE=1 makes any hub access fail.)

The corpus is the scale benchmark's, e.g. for 100k documents (generated once, then reused):

    .venv/bin/python -c "from benchmarks.common import build_scale_corpus as b; \\
        from pathlib import Path; print(b(100000, 1, Path('runs/bench-scale/corpora'), 2))"
    .venv-datatrove/bin/python -m benchmarks.datatrove_compare \\
        --corpus runs/bench-scale/corpora/corpus-100000.jsonl [--workdir runs/bench-datatrove] \\
        [--workers 2] [--out benchmarks/results/datatrove_compare.json] [--keep]

The pipeline (each stage one LocalPipelineExecutor run, timed on its own; order as ours:
dedup before quality):

  split          the JSONL cut, on line boundaries, into `--splits` (default: --workers)
                 files: datatrove parallelises over input files, never inside one
  minhash_sigs   JsonlReader -> MinhashDedupSignature (one task per split)
  minhash_buckets MinhashDedupBuckets (one task per bucket)
  minhash_cluster MinhashDedupCluster (one task)
  minhash_filter JsonlReader -> MinhashDedupFilter -> JsonlWriter (one task per split)
  quality        JsonlReader -> GopherRepetitionFilter -> GopherQualityFilter ->
                 C4QualityFilter -> FineWebQualityFilter -> JsonlWriter (datatrove defaults,
                 no exclusion writers)
  tokenizer_train byte-level BPE, vocab 8192, on up to 50k quality-passed documents (the
                 same trainer settings as ours), saved to tokenizer.json
  tokenize       JsonlReader -> DocumentTokenizer (that tokenizer.json, EOS appended)
  merge          DocumentTokenizerMerger: one shuffled token file (ours: bfd packing)

MinHash: 5-gram word shingles, 25 buckets x 5 hashes (our 0.8 / 128-permutation choice),
64-bit xxhash. There is no exact-hash dedup stage: datatrove has none of that kind
(ExactSubstr / sentence dedup are different operations); exact copies have identical
signatures, so MinHash removes them too. Unlike ours, datatrove does not confirm LSH
candidates with their exact Jaccard: every pair sharing a bucket is a duplicate.

Reported: seconds and peak RSS (process tree, /proc VmRSS sampled every 0.1 s) per stage,
total wall, MB/s (text bytes, as ours counts them, and file bytes), docs/s, documents kept
after each stage, datatrove's own per-step counters and times, and intermediate disk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from importlib.metadata import version
from itertools import pairwise
from pathlib import Path

# Before datatrove / huggingface_hub are imported: anything that tries the hub fails at once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

# Standard library only at import: safe to import from this venv.
from benchmarks.common import RESULTS, ROOT, TreeRSS, du

VOCAB = 8192
TRAIN_DOCS = 50_000
EOS, PAD = "<|endoftext|>", "<|pad|>"


def count_corpus(path: Path) -> tuple[int, int]:
    """(documents, UTF-8 bytes of their text): not timed, for MB/s like ours."""
    import orjson

    docs = nbytes = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                docs += 1
                nbytes += len(orjson.loads(line)["text"].encode("utf-8"))
    return docs, nbytes


def split_corpus(path: Path, out: Path, n: int) -> list[Path]:
    """Cut the file into n parts of about equal size, on line boundaries (byte copy)."""
    out.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, n):
            f.seek(max(cuts[-1], size * k // n))
            f.readline()
            cuts.append(min(f.tell(), size))
    cuts.append(size)
    parts = []
    with open(path, "rb") as f:
        for k, (lo, hi) in enumerate(pairwise(cuts)):
            p = out / f"part-{k:05d}.jsonl"
            f.seek(lo)
            left = hi - lo
            with open(p, "wb") as g:
                while left > 0:
                    buf = f.read(min(left, 16 << 20))
                    g.write(buf)
                    left -= len(buf)
            parts.append(p)
    return parts


def train_tokenizer(folder: Path, out: Path) -> Path:
    """A GPT-2 style byte-level BPE exactly as ours trains it (dataprep/tokenizer.py train_bpe):
    specials <|endoftext|>, <|pad|> first, all 256 byte symbols, min_frequency 2, on up to
    50k documents spread over the quality-passed files."""
    import orjson
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(folder.glob("*.jsonl"))
    per = -(-TRAIN_DOCS // max(1, len(files)))

    def texts():
        for p in files:
            with open(p, "rb") as f:
                for i, line in enumerate(f):
                    if i >= per:
                        break
                    yield orjson.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        show_progress=False,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    tok.save(str(out))
    return out


def step_stats(stats_json: Path) -> list[dict]:
    """datatrove's merged stats of one stage (its stats.json): per step, its counters
    (totals) and the seconds summed over tasks."""
    if not stats_json.is_file():
        return []
    out = []
    for s in json.loads(stats_json.read_text()):
        name = " ".join(re.sub(r"[^\x20-\x7e]", " ", s["name"]).split())
        t = s.get("time_stats")
        counters = {
            k: v.get("total") if isinstance(v, dict) else v
            for k, v in s.get("stats", {}).items()
            if k != "XXXXX.jsonl"
        }
        secs = t.get("total", 0.0) if isinstance(t, dict) else t
        out.append({"step": name, "seconds": round(float(secs or 0.0), 2), **counters})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="a JSONL file with 'id' and 'text'")
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-datatrove"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--splits",
        type=int,
        default=None,
        help="input files (= tasks of the per-document stages); default --workers",
    )
    ap.add_argument("--out", default=str(RESULTS / "datatrove_compare.json"))
    ap.add_argument("--keep", action="store_true", help="keep the stage outputs")
    args = ap.parse_args()
    # The BPE trainer and DocumentTokenizer's encode_batch use Rust threads: no more than
    # the workers we were given.
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer, DocumentTokenizerMerger
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    corpus = Path(args.corpus).resolve()
    work = Path(args.workdir).resolve()
    splits = args.splits or args.workers
    for sub in (
        "input",
        "sigs",
        "buckets",
        "remove",
        "deduped",
        "quality",
        "tokenized",
        "merged",
        "logs",
        "tokenizer.json",
    ):
        p = work / sub
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    n_docs, text_bytes = count_corpus(corpus)
    file_bytes = corpus.stat().st_size

    cfg = MinhashConfig(
        n_grams=5,
        num_buckets=25,
        hashes_per_bucket=5,
        seed=1,
        hash_config=HashConfig(precision=64, hash_fc="xxhash"),
    )

    def reader(folder: Path) -> JsonlReader:
        return JsonlReader(str(folder), text_key="text", id_key="id", glob_pattern="*.jsonl")

    def writer(folder: Path) -> JsonlWriter:
        return JsonlWriter(str(folder), output_filename="${rank}.jsonl", compression=None)

    def executor(name: str, pipeline: list, tasks: int) -> LocalPipelineExecutor:
        return LocalPipelineExecutor(
            pipeline=pipeline,
            tasks=tasks,
            workers=min(args.workers, tasks),
            logging_dir=str(work / "logs" / name),
            skip_completed=False,
        )

    tok_path = work / "tokenizer.json"
    stages = [
        ("split", lambda: split_corpus(corpus, work / "input", splits)),
        (
            "minhash_sigs",
            lambda: executor(
                "minhash_sigs",
                [
                    reader(work / "input"),
                    MinhashDedupSignature(output_folder=str(work / "sigs"), config=cfg),
                ],
                splits,
            ).run(),
        ),
        (
            "minhash_buckets",
            lambda: executor(
                "minhash_buckets",
                [
                    MinhashDedupBuckets(
                        input_folder=str(work / "sigs"),
                        output_folder=str(work / "buckets"),
                        config=cfg,
                    ),
                ],
                cfg.num_buckets,
            ).run(),
        ),
        (
            "minhash_cluster",
            lambda: executor(
                "minhash_cluster",
                [
                    MinhashDedupCluster(
                        input_folder=str(work / "buckets"),
                        output_folder=str(work / "remove"),
                        config=cfg,
                    ),
                ],
                1,
            ).run(),
        ),
        (
            "minhash_filter",
            lambda: executor(
                "minhash_filter",
                [
                    reader(work / "input"),
                    MinhashDedupFilter(input_folder=str(work / "remove")),
                    writer(work / "deduped"),
                ],
                splits,
            ).run(),
        ),
        (
            "quality",
            lambda: executor(
                "quality",
                [
                    reader(work / "deduped"),
                    GopherRepetitionFilter(),
                    GopherQualityFilter(),
                    C4QualityFilter(),
                    FineWebQualityFilter(),
                    writer(work / "quality"),
                ],
                splits,
            ).run(),
        ),
        ("tokenizer_train", lambda: train_tokenizer(work / "quality", tok_path)),
        (
            "tokenize",
            lambda: executor(
                "tokenize",
                [
                    reader(work / "quality"),
                    DocumentTokenizer(
                        output_folder=str(work / "tokenized"),
                        tokenizer_name_or_path=str(tok_path),
                        eos_token=EOS,
                        seed=0,
                    ),
                ],
                splits,
            ).run(),
        ),
        (
            "merge",
            lambda: executor(
                "merge",
                [
                    DocumentTokenizerMerger(
                        input_folder=str(work / "tokenized"),
                        output_folder=str(work / "merged"),
                        save_filename="train",
                        seed=0,
                        progress=False,
                    ),
                ],
                1,
            ).run(),
        ),
    ]

    stage_seconds, stage_window, dt_steps = {}, {}, {}
    t_start = time.perf_counter()
    with TreeRSS(os.getpid(), 0.1) as rss:
        for name, fn in stages:
            e0, t0 = time.time(), time.perf_counter()
            fn()
            stage_seconds[name] = round(time.perf_counter() - t0, 2)
            stage_window[name] = (e0, time.time())
            if (work / "logs" / name).is_dir():
                dt_steps[name] = step_stats(work / "logs" / name / "stats.json")
            print(
                f"[datatrove_compare] {name}: {stage_seconds[name]} s", file=sys.stderr, flush=True
            )
    wall = time.perf_counter() - t_start

    def docs_in(folder: Path) -> int:
        n = 0
        for p in folder.glob("*.jsonl"):
            with open(p, "rb") as f:
                n += sum(1 for _ in f)
        return n

    tokens = None
    for s in dt_steps.get("tokenize", []):
        if "tokens" in s:
            tokens = int(s["tokens"])
    stage_rss = {}
    for name, (a, b) in stage_window.items():
        inside = [r for t, r in rss.samples if a <= t <= b]
        stage_rss[name] = round(max(inside) / 2**20) if inside else None
    mb = text_bytes / 1e6
    result = {
        "tool": "datatrove",
        "versions": {
            p: version(p) for p in ("datatrove", "spacy", "tokenizers", "xxhash", "numpy")
        },
        "machine": {"cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]},
        "corpus": str(corpus),
        "docs": n_docs,
        "workers": args.workers,
        "splits": splits,
        "mb_in": round(mb, 1),
        "file_mb": round(file_bytes / 1e6, 1),
        "wall_seconds": round(wall, 1),
        "mb_per_s": round(mb / wall, 2),
        "file_mb_per_s": round(file_bytes / 1e6 / wall, 2),
        "docs_per_s": round(n_docs / wall),
        "peak_rss_mb": round(rss.peak / 2**20),
        "stage_seconds": stage_seconds,
        "stage_peak_rss_mb": stage_rss,
        "kept_docs": {
            "input": n_docs,
            "minhash": docs_in(work / "deduped"),
            "quality": docs_in(work / "quality"),
        },
        "train_tokens": tokens,
        "minhash": {
            "n_grams": cfg.n_grams,
            "buckets": cfg.num_buckets,
            "hashes_per_bucket": cfg.hashes_per_bucket,
            "hash": str(cfg.hash_config),
            "exact_jaccard_check": False,
        },
        "quality": ["gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality"],
        "tokenizer": {"kind": "byte-level bpe", "vocab_size": VOCAB, "train_docs": TRAIN_DOCS},
        "intermediate_disk_mb": round((du(work) - du(work / "merged")) / 1e6),
        "dataset_disk_mb": round(du(work / "merged") / 1e6),
        "datatrove_steps": dt_steps,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if not args.keep:
        for sub in (
            "input",
            "sigs",
            "buckets",
            "remove",
            "deduped",
            "quality",
            "tokenized",
            "merged",
        ):
            shutil.rmtree(work / sub, ignore_errors=True)


if __name__ == "__main__":
    main()
