"""Config factories: `train_config` for the trainer and `prep_config` for a prep run over
`corpus.make_corpus`'s corpus. Each returns a plain dict (parse it, or write it as YAML);
a test states only what it changes. `merge` is train_config's rule for changes, for a test's
own defaults on top of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The tiny GPT every training test uses.
TINY = {"d_model": 32, "n_layer": 2, "n_head": 2}


def train_config(dataset: str, run_dir: Path | str, **over: Any) -> dict[str, Any]:
    """Six steps of the tiny model on `dataset`, 4 rows a micro-batch, an eval and a
    checkpoint every 3 steps (the last 2 kept), 2 warmup steps. Each keyword replaces its key;
    a dict given for a key that holds a dict updates that dict instead
    (`checkpoint={"every": 5}` keeps keep_last 2)."""
    return merge(
        {
            "dataset": dataset,
            "run_dir": str(run_dir),
            "steps": 6,
            "micro_batch": 4,
            "eval_every": 3,
            "model": dict(TINY),
            "checkpoint": {"every": 3, "keep_last": 2},
            "schedule": {"warmup_steps": 2},
        },
        **over,
    )


def merge(config: dict[str, Any], **over: Any) -> dict[str, Any]:
    """A copy of `config` with each keyword's key replaced, or updated where both the old and
    the new value are dicts (one level deep: train_config's rule)."""
    c = dict(config)
    for k, v in over.items():
        c[k] = {**c[k], **v} if isinstance(c.get(k), dict) and isinstance(v, dict) else v
    return c


def prep_config(data: Path, out: Path, workers: int = 1, shard_docs: int = 40) -> dict[str, Any]:
    """A prep run over `corpus.make_corpus(data)`: the web documents (gzipped jsonl) and the
    code (parquet, its own quality chain) into `out`, the default dedup, three quality
    rules."""
    return {
        "output": str(out),
        "workers": workers,
        "sources": [
            {"name": "web", "paths": [str(data / "web" / "*.jsonl.gz")], "id_field": "id"},
            {
                "name": "code",
                "paths": [str(data / "code")],
                "format": "parquet",
                "id_field": "id",
                "quality": ["char_repetition"],
            },
        ],
        "ingest": {"shard_docs": shard_docs},
        "quality": ["char_repetition", "gopher_quality", "gopher_repetition"],
    }
