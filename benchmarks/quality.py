"""Throughput of the default quality chain on the shared web and code corpora, one core,
against datatrove's Gopher + C4 + FineWeb filters when datatrove (with spaCy) is installed.

    python benchmarks/quality.py [--out benchmarks/results/quality.json] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tasks.quality import DEFAULT_RULES, filter_document, parse_rules  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
CORPORA = (
    "web_openwebtext_1k",
    "web_c4_olmo_fixtures",
    "web_dolma_cc_fixtures",
    "code_python_cosqa_dev",
    "code_java_methods_codexglue_flat",
    "code_humanevalx",
)


def load(name: str) -> list[str]:
    with open(DATA / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def rates(docs: int, nbytes: int, seconds: float) -> dict[str, float]:
    return {
        "docs": docs,
        "mb": round(nbytes / 1e6, 3),
        "seconds": round(seconds, 4),
        "docs_per_s": round(docs / seconds, 1),
        "mb_per_s": round(nbytes / 1e6 / seconds, 3),
    }


def run_ours(texts: list[str], rules: list[Any]) -> tuple[float, list[str | None]]:
    start = time.perf_counter()
    reasons = [filter_document(rules, t).reason for t in texts]
    return time.perf_counter() - start, reasons


def datatrove_chain() -> tuple[Any, list[Any]] | str:
    """datatrove's four filters, or why they cannot run here (datatrove is optional)."""
    try:
        from datatrove.data import Document
        from datatrove.pipeline.filters import (
            C4QualityFilter,
            FineWebQualityFilter,
            GopherQualityFilter,
            GopherRepetitionFilter,
        )
    except ImportError as e:
        return f"datatrove not importable ({e})"
    filters = [
        GopherQualityFilter(),
        GopherRepetitionFilter(),
        C4QualityFilter(),
        FineWebQualityFilter(),
    ]
    try:  # English word splitting needs spaCy; this also loads it outside the timing
        warm = Document(text="Warm up the tokenizer. It is loaded once.", id="warm")
        for f in filters:
            f.filter(warm)
    except ImportError as e:
        return f"datatrove cannot split words ({e})"
    return Document, filters


def run_datatrove(texts: list[str], document: Any, filters: list[Any]) -> tuple[float, list[bool]]:
    kept = []
    start = time.perf_counter()
    for i, text in enumerate(texts):
        doc = document(text=text, id=str(i))
        ok = True
        for f in filters:  # filter() is what datatrove's executor calls; True keeps
            if f.filter(doc) is not True:
                ok = False
                break
        kept.append(ok)
    return time.perf_counter() - start, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quality.json")
    ap.add_argument("--repeat", type=int, default=5, help="timed passes of our chain")
    ap.add_argument("--dt-repeat", type=int, default=1, help="timed passes of datatrove's")
    ap.add_argument("--no-datatrove", action="store_true", help="skip the datatrove baseline")
    args = ap.parse_args(argv)

    if not DATA.is_dir():
        print(f"skip: shared data not found at {DATA}")
        return 0
    corpora = {}
    for name in CORPORA:
        if (DATA / f"{name}.jsonl").is_file():
            corpora[name] = load(name)
        else:
            print(f"skip corpus {name}: {DATA / name}.jsonl not found")
    if not corpora:
        print(f"skip: none of the corpora are in {DATA}")
        return 0

    rules = parse_rules(list(DEFAULT_RULES))
    nbytes = {n: sum(len(t.encode("utf-8")) for t in ts) for n, ts in corpora.items()}
    times: dict[str, list[float]] = {n: [] for n in corpora}
    reasons: dict[str, list[str | None]] = {}
    for _ in range(max(1, args.repeat)):
        for name, texts in corpora.items():
            seconds, reasons[name] = run_ours(texts, rules)
            times[name].append(seconds)

    result: dict[str, Any] = {
        "rules": list(DEFAULT_RULES),
        "repeat": max(1, args.repeat),
        "timing": "median of the passes; one process, one core",
        "python": platform.python_version(),
        "machine": platform.platform(),
        "corpora": {},
    }
    total_docs = sum(len(t) for t in corpora.values())
    total_bytes = sum(nbytes.values())
    for name, texts in corpora.items():
        r = reasons[name]
        drops = Counter(x for x in r if x is not None)
        result["corpora"][name] = {
            **rates(len(texts), nbytes[name], statistics.median(times[name])),
            "kept_fraction": round(1 - sum(drops.values()) / len(texts), 4),
            "drop_reasons": dict(drops.most_common()),
        }
    per_pass = [sum(ts) for ts in zip(*times.values(), strict=True)]
    overall = rates(total_docs, total_bytes, statistics.median(per_pass))
    kept_all = sum(1 for r in reasons.values() for x in r if x is None)
    overall["kept_fraction"] = round(kept_all / total_docs, 4)
    result["overall"] = overall

    dt: dict[str, Any] = {"available": False}
    chain = "datatrove skipped (--no-datatrove)" if args.no_datatrove else datatrove_chain()
    if isinstance(chain, str):
        dt["note"] = chain
    else:
        document, filters = chain
        dt.update(available=True, version=version("datatrove"))
        dt_times: dict[str, list[float]] = {n: [] for n in corpora}
        dt_kept: dict[str, list[bool]] = {}
        for _ in range(max(1, args.dt_repeat)):
            for name, texts in corpora.items():
                seconds, dt_kept[name] = run_datatrove(texts, document, filters)
                dt_times[name].append(seconds)
        dt["corpora"] = {}
        for name, texts in corpora.items():
            ours_kept = [x is None for x in reasons[name]]
            agree = sum(a == b for a, b in zip(ours_kept, dt_kept[name], strict=True))
            dt["corpora"][name] = {
                **rates(len(texts), nbytes[name], statistics.median(dt_times[name])),
                "kept_fraction": round(sum(dt_kept[name]) / len(texts), 4),
                "same_decision_fraction": round(agree / len(texts), 4),
            }
        dt_pass = [sum(ts) for ts in zip(*dt_times.values(), strict=True)]
        dt["overall"] = rates(total_docs, total_bytes, statistics.median(dt_pass))
        dt["speedup"] = round(dt["overall"]["seconds"] / overall["seconds"], 1)
    result["datatrove"] = dt

    print(f"{'corpus':34} {'docs':>6} {'MB':>7} {'s':>7} {'docs/s':>9} {'MB/s':>7} {'kept':>6}")
    for name, c in [*result["corpora"].items(), ("overall", overall)]:
        print(
            f"{name:34} {c['docs']:>6} {c['mb']:>7.2f} {c['seconds']:>7.3f} "
            f"{c['docs_per_s']:>9.0f} {c['mb_per_s']:>7.2f} {c['kept_fraction']:>6.1%}"
        )
    for name, c in result["corpora"].items():
        top = ", ".join(f"{k}={v}" for k, v in list(c["drop_reasons"].items())[:5])
        print(f"  {name} drops: {top or 'none'}")
    if dt["available"]:
        o = dt["overall"]
        print(
            f"datatrove {dt['version']}: {o['docs_per_s']:.0f} docs/s, {o['mb_per_s']:.3f} MB/s "
            f"-> ours is {dt['speedup']}x faster"
        )
        for name, c in dt["corpora"].items():
            print(
                f"  {name}: datatrove kept {c['kept_fraction']:.1%}, "
                f"same decision {c['same_decision_fraction']:.1%}"
            )
    else:
        print(f"datatrove baseline skipped: {dt['note']}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
