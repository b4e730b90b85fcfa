"""Language identification: fastText lid.176 (the `language` rule's model) against CLD2
(pycld2), accuracy per language and documents per second, on a multilingual sample built
offline.

    python -m benchmarks.langid [--per-lang 100] [--seed 0] [--out benchmarks/results/langid.json]

The sample: the system's gettext catalogs (/usr/share/locale/<lang>/LC_MESSAGES/*.mo, real
human translations of program messages) give, per language, translated messages of at
least 40 characters (not equal to their English original; format codes and menu
mnemonics removed), shuffled with the seed and joined into 300-600 character documents;
English documents are the first ~450 characters of the shared OpenWebText sample. Short
UI sentences are harder than web pages, so these accuracies are a floor. Speed is also
measured on the 1,000 whole OpenWebText documents (~4.6 KB each), next to the default
quality chain for scale.

CLD2 is an optional extra (`pip install pycld2`, not a dependency of the project); without
it the benchmark reports fastText alone. Lingua (lingua-language-detector) is not run: its
wheel is 96 MB, too much to add to every install; CLD3 (gcld3) is not run either: the
package index here has no wheel of it (it builds from source against protobuf).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks.common import ENGLISH, LOCALE, RESULTS, english, messages, write_json
from dataprep.quality import DEFAULT_RULES, filter_document, parse_rules
from dataprep.quality.language import identify

# Catalog directory -> the language's lid.176 code (CLD2 uses the same ISO 639-1 codes).
LANGS: dict[str, str] = {
    "de": "de",
    "fr": "fr",
    "es": "es",
    "it": "it",
    "pt": "pt",
    "pt_BR": "pt",
    "nl": "nl",
    "sv": "sv",
    "da": "da",
    "fi": "fi",
    "pl": "pl",
    "cs": "cs",
    "ro": "ro",
    "hu": "hu",
    "tr": "tr",
    "id": "id",
    "vi": "vi",
    "ru": "ru",
    "uk": "uk",
    "el": "el",
    "ja": "ja",
    "ko": "ko",
    "zh_CN": "zh",
    "zh_TW": "zh",
    "ar": "ar",
    "he": "he",
}
DOC_CHARS = (300, 600)
MIN_SCORE = 0.65  # the rule's default threshold


def documents(pieces: list[str], n: int, rng: random.Random) -> list[str]:
    """Up to `n` documents of DOC_CHARS characters, each piece used once."""
    pieces = sorted(set(pieces))
    rng.shuffle(pieces)
    docs: list[str] = []
    cur: list[str] = []
    size = 0
    for p in pieces:
        if size + len(p) > DOC_CHARS[1]:
            continue
        cur.append(p)
        size += len(p) + 1
        if size >= DOC_CHARS[0]:
            docs.append(" ".join(cur))
            cur, size = [], 0
            if len(docs) == n:
                break
    return docs


def build_sample(per_lang: int, seed: int) -> list[tuple[str, str]]:
    by_lang: dict[str, list[str]] = defaultdict(list)
    for d, code in LANGS.items():
        if (LOCALE / d).is_dir():
            by_lang[code] += messages(LOCALE / d)
    rng = random.Random(seed)
    sample = [("en", t) for t in english(per_lang, DOC_CHARS[0])]
    for code in sorted(by_lang):
        sample += [(code, t) for t in documents(by_lang[code], per_lang, rng)]
    return sample


def cld2_detector() -> Callable[[str], tuple[str, float]] | None:
    try:
        import pycld2
    except ImportError:
        return None
    # CLD2's old or script-specific codes for the same languages.
    alias = {"iw": "he", "zh-Hant": "zh", "un": "unknown"}

    def detect(text: str) -> tuple[str, float]:
        try:
            reliable, _, details = pycld2.detect(text)
        except pycld2.error:  # "input contains invalid UTF-8": it refuses control characters
            detect.errors += 1  # type: ignore[attr-defined]
            return "unknown", 0.0
        code = details[0][1]
        # CLD2 has no probability: its percent of the text, if it calls itself reliable.
        return alias.get(code, code), details[0][2] / 100 if reliable else 0.0

    detect.errors = 0  # type: ignore[attr-defined]
    return detect


def web_speed(detect: Callable[[str], Any], texts: list[str], repeat: int) -> dict[str, Any]:
    """Speed on whole web documents (~4.6 KB), where the text length dominates."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for t in texts:
            detect(t)
        best = min(best, time.perf_counter() - t0)
    return {
        "docs_per_s": round(len(texts) / best),
        "mb_per_s": round(sum(len(t.encode()) for t in texts) / best / 1e6, 1),
    }


def evaluate(
    detect: Callable[[str], tuple[str, float]], sample: list[tuple[str, str]], repeat: int
) -> dict[str, Any]:
    preds = [detect(t) for _, t in sample]  # warm-up (loads the model) and the predictions
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _, t in sample:
            detect(t)
        times.append(time.perf_counter() - t0)
    total: Counter[str] = Counter()
    right: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    confusions: dict[str, Counter[str]] = defaultdict(Counter)
    for (gold, _), (lang, score) in zip(sample, preds, strict=True):
        total[gold] += 1
        if lang == gold:
            right[gold] += 1
            kept[gold] += score >= MIN_SCORE
        else:
            confusions[gold][lang] += 1
    n = len(sample)
    return {
        "accuracy": round(sum(right.values()) / n, 4),
        f"correct_and_score_ge_{MIN_SCORE}": round(sum(kept.values()) / n, 4),
        "docs_per_s": round(n / min(times)),
        "per_language": {g: round(right[g] / total[g], 3) for g in sorted(total)},
        "errors": {g: dict(c.most_common(3)) for g, c in sorted(confusions.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-lang", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "langid.json")
    args = ap.parse_args()

    sample = build_sample(args.per_lang, args.seed)
    langs = Counter(g for g, _ in sample)
    print(
        f"sample: {len(sample)} documents, {len(langs)} languages "
        f"({', '.join(f'{g}={c}' for g, c in sorted(langs.items()))})"
    )
    results: dict[str, Any] = {
        "sample": {
            "documents": len(sample),
            "per_language": dict(sorted(langs.items())),
            "mean_chars": round(sum(len(t) for _, t in sample) / len(sample)),
            "seed": args.seed,
        },
        "machine": {"python": platform.python_version(), "cpu": platform.processor()},
    }
    detectors: dict[str, Callable[[str], tuple[str, float]] | None] = {
        f"fasttext_lid176 (fasttext-predict {version('fasttext-predict')})": identify,
        "cld2": cld2_detector(),
    }
    for name, detect in detectors.items():
        if detect is None:
            print(f"{name}: not installed (pip install pycld2), skipped")
            results[name] = "not installed"
            continue
        r = evaluate(detect, sample, args.repeat)
        results[name] = r
        worst = sorted(r["per_language"].items(), key=lambda kv: kv[1])[:4]
        print(
            f"{name}: accuracy {r['accuracy']:.1%}, correct with score >= {MIN_SCORE} "
            f"{r[f'correct_and_score_ge_{MIN_SCORE}']:.1%}, {r['docs_per_s']:,} docs/s "
            f"(one core); weakest: {', '.join(f'{g} {a:.0%}' for g, a in worst)}"
        )
    with open(ENGLISH, encoding="utf-8") as f:
        web = [json.loads(line)["text"] for line in f if line.strip()]
    chain = parse_rules(list(DEFAULT_RULES))
    detectors["default quality chain (for scale)"] = lambda t: filter_document(chain, t)
    results["whole_web_documents"] = {"documents": len(web)}
    for name, detect in detectors.items():
        if detect is None:
            continue
        errors = getattr(detect, "errors", 0)
        r = results["whole_web_documents"][name] = web_speed(detect, web, args.repeat)
        if name == "cld2":
            r["refused"] = (detect.errors - errors) // args.repeat  # type: ignore[attr-defined]
        print(
            f"whole OpenWebText documents, {name}: {r['docs_per_s']:,} docs/s, "
            f"{r['mb_per_s']} MB/s" + (f", refused {r['refused']}" if "refused" in r else "")
        )
    write_json(args.out, results, ensure_ascii=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
