"""Throughput of the default quality chain on the shared web and code corpora, one core,
against datatrove's Gopher + C4 + FineWeb filters when datatrove (with spaCy) is installed.

    python -m benchmarks.quality [--out benchmarks/results/quality.json] [--repeat 5]

The chain is timed with both splitters for English words and sentences (text.py): "regex"
(the older approximation) and "spacy" (spacy_en, the default), passes interleaved. With
runs/spacy-reference/reference.json (`python -m benchmarks.spacy_reference dump`, in .venv-spacy)
it also reports how often each splitter gives spaCy's tokens (per document and per token)
and sentence counts (per line) on the web corpora, and, where the dump holds datatrove's
decisions, how often the chain decides as datatrove did and datatrove's time.

Also each rule alone (on the web corpora; `code` on the code corpora) and the default
chains: web, web with language ID, web with language ID and the classifier (a model
`ballast quality train` makes from the labelled pages unless --classifier names one),
and the code chain; median of --rule-repeat passes, docs/s and MB/s.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, SHARED, write_json
from dataprep.quality import DEFAULT_RULES, filter_document, parse_rules
from dataprep.quality.text import (
    count_sentences,
    split_words,
    use_english_splitter,
)

DATA = SHARED
REFERENCE = ROOT / "runs" / "spacy-reference" / "reference.json"
SPLITTERS = ("regex", "spacy")  # before / after; the last is the default
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


WEB = ("web_openwebtext_1k", "web_c4_olmo_fixtures", "web_dolma_cc_fixtures")
CODE = ("code_python_cosqa_dev", "code_java_methods_codexglue_flat", "code_humanevalx")
LABELLED = DATA / "web_dclm_quality_labels_train.jsonl"


def classifier_model(path: Path | None, tmp: Path) -> Path | None:
    """The model for the classifier rule and chain: `path`, else one `ballast quality
    train` makes from the labelled pages (the mechanism's demo model, ~10 s), else None."""
    if path is not None:
        return path
    if not LABELLED.is_file():
        return None
    from dataprep.quality.train_classifier import ClassifierTrainConfig, load_examples, train

    texts, labels = load_examples(labelled=[str(LABELLED)])
    out = tmp / "quality.bin"
    train(texts, labels, out, ClassifierTrainConfig())
    return out


def rule_configs(model: Path | None, tmp: Path) -> dict[str, Any]:
    """Each rule as the benchmark runs it alone: its defaults, plus what it cannot run
    without (decontaminate: an evaluation set, here 200 C4 fixture documents;
    classifier: a model; char_ratios: a threshold, all five at 0.5). perplexity is left
    out: it needs a trained LM directory (`benchmarks.classifier perplexity` times it)."""
    from dataprep.quality import RULES

    evalset = tmp / "eval.jsonl"
    if (DATA / "web_c4_olmo_fixtures.jsonl").is_file():
        evalset.write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in load("web_c4_olmo_fixtures")[:200])
        )
    out: dict[str, Any] = {}
    for name in RULES:
        if name == "perplexity":
            continue
        if name == "decontaminate":
            if evalset.is_file():
                out[name] = {name: {"files": [str(evalset)]}}
        elif name == "classifier":
            if model is not None:
                out[name] = {name: {"model": str(model)}}
        elif name == "char_ratios":  # every check on (it has no defaults), for the timing
            out[name] = {
                name: {
                    k: 0.5
                    for k in (
                        "max_digit_frac",
                        "max_punct_frac",
                        "max_whitespace_frac",
                        "max_bracket_frac",
                        "max_non_alnum_frac",
                    )
                }
            }
        else:
            out[name] = name
    return out


def timed(texts: list[str], rules: list[Any], repeat: int) -> tuple[float, list[str | None]]:
    times = []
    for _ in range(repeat):
        seconds, reasons = run_ours(texts, rules)
        times.append(seconds)
    return statistics.median(times), reasons


def rules_and_chains(
    corpora: dict[str, list[str]], model: Path | None, tmp: Path, repeat: int
) -> dict[str, Any]:
    """docs/s and MB/s of every rule alone (on the web corpora; `code` on the code
    corpora) and of the default chains: web, web with language ID, web with language ID
    and the classifier, code."""
    from dataprep.quality import CODE_DEFAULT_RULES

    web = [t for n in WEB if n in corpora for t in corpora[n]]
    code = [t for n in CODE if n in corpora for t in corpora[n]]
    sizes = {"web": sum(len(t.encode()) for t in web), "code": sum(len(t.encode()) for t in code)}
    texts = {"web": web, "code": code}

    def row(kind: str, spec: list[Any]) -> dict[str, Any]:
        seconds, reasons = timed(texts[kind], parse_rules(spec), repeat)
        kept = sum(r is None for r in reasons) / max(len(reasons), 1)
        return {
            "on": kind,
            **rates(len(texts[kind]), sizes[kind], seconds),
            "kept_fraction": round(kept, 4),
        }

    out: dict[str, Any] = {"per_rule": {}, "chains": {}}
    for name, spec in rule_configs(model, tmp).items():
        out["per_rule"][name] = row("code" if name == "code" else "web", [spec])
    chains: dict[str, tuple[str, list[Any]]] = {
        "web": ("web", list(DEFAULT_RULES)),
        "web + language": ("web", ["language", *DEFAULT_RULES]),
    }
    if model is not None:
        chains["web + language + classifier"] = (
            "web",
            ["language", *DEFAULT_RULES, {"classifier": {"model": str(model)}}],
        )
    chains["code"] = ("code", list(CODE_DEFAULT_RULES))
    for name, (kind, spec) in chains.items():
        out["chains"][name] = {"rules": spec, **row(kind, spec)}
    return out


def file_id(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"bytes": len(data), "md5": hashlib.md5(data).hexdigest()}


def load_reference(path: Path) -> dict[str, Any] | str:
    """spacy_reference.py's dump, or why there is none."""
    if not path.is_file():
        return (
            f"no spaCy reference at {path}; make it with: python3 -m venv .venv-spacy && "
            ".venv-spacy/bin/pip install spacy==3.8.18 && "
            ".venv-spacy/bin/python -m benchmarks.spacy_reference dump"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def fresh(name: str, entry: dict[str, Any]) -> bool:
    """Whether a dump's entry was made from the corpus file as it is now."""
    path = DATA / f"{name}.jsonl"
    if not path.is_file():
        return False
    now = file_id(path)
    if now != {"bytes": entry.get("bytes"), "md5": entry.get("md5")}:
        print(f"skip {name} in the reference: the corpus changed since the dump (rerun it)")
        return False
    return True


def agreement(ref: dict[str, Any]) -> dict[str, Any]:
    """Each splitter against spaCy's tokens and sentence counts: documents whose token
    list is exactly spaCy's; tokens in the longest common runs of both lists (difflib)
    over the longer list's length; lines (non-blank, stripped) with spaCy's sentence
    count."""
    out: dict[str, Any] = {"spacy": ref.get("spacy"), "corpora": {}, "overall": {}}
    totals = {s: [0, 0, 0, 0, 0, 0] for s in SPLITTERS}  # docs ok/all, tokens, lines
    for name, entry in ref["corpora"].items():
        if not fresh(name, entry):
            continue
        texts = load(name)
        row: dict[str, Any] = {}
        for splitter in SPLITTERS:
            use_english_splitter(splitter)
            t = totals[splitter]
            d_ok = tok_ok = tok_n = l_ok = l_n = 0
            for text, want, want_sents in zip(
                texts, entry["tokens"], entry["line_sentences"], strict=True
            ):
                got = split_words(text)
                if got == want:
                    d_ok += 1
                    tok_ok += len(want)
                    tok_n += len(want)
                else:
                    m = difflib.SequenceMatcher(None, got, want, autojunk=False)
                    tok_ok += sum(b.size for b in m.get_matching_blocks())
                    tok_n += max(len(got), len(want))
                lines = [s for line in text.splitlines() if (s := line.strip())]
                l_n += len(lines)
                l_ok += sum(count_sentences(s) == n for s, n in zip(lines, want_sents, strict=True))
            row[splitter] = {
                "docs_exact": round(d_ok / len(texts), 5),
                "tokens": round(tok_ok / max(tok_n, 1), 5),
                "sentence_lines": round(l_ok / max(l_n, 1), 5),
            }
            for i, v in enumerate((d_ok, len(texts), tok_ok, tok_n, l_ok, l_n)):
                t[i] += v
        out["corpora"][name] = row
    use_english_splitter(SPLITTERS[-1])
    for s, (d_ok, d_n, tok_ok, tok_n, l_ok, l_n) in totals.items():
        out["overall"][s] = {
            "docs": d_n,
            "docs_exact": round(d_ok / max(d_n, 1), 5),
            "tokens_n": tok_n,
            "tokens": round(tok_ok / max(tok_n, 1), 5),
            "lines": l_n,
            "sentence_lines": round(l_ok / max(l_n, 1), 5),
        }
    return out


def reference_decisions(
    dref: dict[str, Any],
    corpora: dict[str, list[str]],
    nbytes: dict[str, int],
    summaries: dict[str, dict[str, Any]],
    by_splitter: dict[str, dict[str, list[str | None]]],
) -> dict[str, Any]:
    """The chain's decisions against datatrove's in the dump (same documents, same order),
    and datatrove's time there (another process on this machine, maybe under another
    load: compare with care)."""
    names = [n for n in corpora if n in dref["corpora"] and fresh(n, dref["corpora"][n])]
    out: dict[str, Any] = {"version": dref.get("version"), "corpora": {}}
    same = {s: 0 for s in SPLITTERS}
    for name in names:
        kept = dref["corpora"][name]["kept"]
        row: dict[str, Any] = {"kept_fraction": round(sum(kept) / len(kept), 4)}
        for s in SPLITTERS:
            ours = [x is None for x in by_splitter[s][name]]
            n = sum(a == b for a, b in zip(ours, kept, strict=True))
            row[f"same_decision_{s}"] = round(n / len(kept), 4)
            same[s] += n
        out["corpora"][name] = row
    docs = sum(len(corpora[n]) for n in names)
    dt_s = sum(dref["corpora"][n]["seconds"] for n in names)
    out["overall"] = rates(docs, sum(nbytes[n] for n in names), dt_s)
    out["same_decision"] = {s: round(same[s] / max(docs, 1), 4) for s in SPLITTERS}
    out["speedup"] = {
        s: round(dt_s / sum(summaries[s]["corpora"][n]["seconds"] for n in names), 1)
        for s in SPLITTERS
    }
    return out


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
    ap.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    ap.add_argument("--repeat", type=int, default=5, help="timed passes of our chain")
    ap.add_argument("--dt-repeat", type=int, default=1, help="timed passes of datatrove's")
    ap.add_argument("--no-datatrove", action="store_true", help="skip the datatrove baseline")
    ap.add_argument(
        "--classifier",
        type=Path,
        help="a fastText model for the classifier rule "
        "and chain (default: one trained on the labelled pages)",
    )
    ap.add_argument("--rule-repeat", type=int, default=3, help="timed passes per rule / chain")
    ap.add_argument(
        "--reference",
        type=Path,
        default=REFERENCE,
        help="spacy_reference.py's dump (spaCy tokens, datatrove decisions)",
    )
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
    times: dict[str, dict[str, list[float]]] = {s: {n: [] for n in corpora} for s in SPLITTERS}
    by_splitter: dict[str, dict[str, list[str | None]]] = {s: {} for s in SPLITTERS}
    for _ in range(max(1, args.repeat)):
        for splitter in SPLITTERS:  # interleaved: both meet the same machine load
            use_english_splitter(splitter)
            for name, texts in corpora.items():
                seconds, by_splitter[splitter][name] = run_ours(texts, rules)
                times[splitter][name].append(seconds)
    use_english_splitter(SPLITTERS[-1])

    result: dict[str, Any] = {
        "rules": list(DEFAULT_RULES),
        "repeat": max(1, args.repeat),
        "timing": "median of the passes; one process, one core",
        "python": platform.python_version(),
        "machine": platform.platform(),
    }
    total_docs = sum(len(t) for t in corpora.values())
    total_bytes = sum(nbytes.values())
    summaries: dict[str, dict[str, Any]] = {}
    for splitter in SPLITTERS:
        summary: dict[str, Any] = {"corpora": {}}
        for name, texts in corpora.items():
            drops = Counter(x for x in by_splitter[splitter][name] if x is not None)
            summary["corpora"][name] = {
                **rates(len(texts), nbytes[name], statistics.median(times[splitter][name])),
                "kept_fraction": round(1 - sum(drops.values()) / len(texts), 4),
                "drop_reasons": dict(drops.most_common()),
            }
        per_pass = [sum(ts) for ts in zip(*times[splitter].values(), strict=True)]
        summary["overall"] = rates(total_docs, total_bytes, statistics.median(per_pass))
        kept_all = sum(1 for r in by_splitter[splitter].values() for x in r if x is None)
        summary["overall"]["kept_fraction"] = round(kept_all / total_docs, 4)
        summaries[splitter] = summary
    reasons = by_splitter[SPLITTERS[-1]]
    result["corpora"] = summaries[SPLITTERS[-1]]["corpora"]
    overall = summaries[SPLITTERS[-1]]["overall"]
    result["english_splitters"] = {
        s: {
            "overall": v["overall"],
            "corpora": {
                n: {k: c[k] for k in ("docs_per_s", "mb_per_s", "kept_fraction")}
                for n, c in v["corpora"].items()
            },
        }
        for s, v in summaries.items()
    }
    slow = overall["seconds"] / summaries["regex"]["overall"]["seconds"]
    result["english_splitters"]["spacy_time_over_regex"] = round(slow, 3)
    result["overall"] = overall

    with tempfile.TemporaryDirectory(prefix="ballast-quality-bench-") as tmp:
        model = classifier_model(args.classifier, Path(tmp))
        result.update(rules_and_chains(corpora, model, Path(tmp), max(1, args.rule_repeat)))

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

    ref = load_reference(args.reference)
    if isinstance(ref, str):
        result["spacy_reference"] = {"available": False, "note": ref}
    else:
        result["spacy_reference"] = {"available": True, **agreement(ref)}
        if ref.get("datatrove", {}).get("available"):
            result["datatrove_reference"] = reference_decisions(
                ref["datatrove"], corpora, nbytes, summaries, by_splitter
            )

    print(f"{'rule / chain':34} {'on':>5} {'docs/s':>9} {'MB/s':>7} {'kept':>6}")
    for label, rows in (("", result["per_rule"]), ("chain: ", result["chains"])):
        for name, c in rows.items():
            print(
                f"{label + name:34} {c['on']:>5} {c['docs_per_s']:>9.0f} {c['mb_per_s']:>7.2f} "
                f"{c['kept_fraction']:>6.1%}"
            )
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
    for s, v in result["english_splitters"].items():
        if isinstance(v, dict):
            o = v["overall"]
            print(
                f"english splitter {s:6}: {o['docs_per_s']:.0f} docs/s, "
                f"{o['mb_per_s']:.3f} MB/s, kept {o['kept_fraction']:.1%}"
            )
    print(f"  spacy / regex time: {result['english_splitters']['spacy_time_over_regex']}")
    sr = result["spacy_reference"]
    if sr["available"]:
        for s, o in sr["overall"].items():
            print(
                f"agreement with spaCy {sr['spacy']} ({s}): documents {o['docs_exact']:.3%} of "
                f"{o['docs']}, tokens {o['tokens']:.4%} of {o['tokens_n']}, sentence "
                f"counts {o['sentence_lines']:.4%} of {o['lines']} lines"
            )
    else:
        print(f"spaCy agreement skipped: {sr['note']}")
    if "datatrove_reference" in result:
        d = result["datatrove_reference"]
        print(
            f"datatrove {d['version']} (from the reference dump): {d['overall']['docs_per_s']:.0f} "
            f"docs/s, {d['overall']['mb_per_s']:.3f} MB/s"
        )
        for s in SPLITTERS:
            print(
                f"  {s}: ours {d['speedup'][s]}x faster, same decision "
                f"{d['same_decision'][s]:.2%} of {d['overall']['docs']} documents"
            )

    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
