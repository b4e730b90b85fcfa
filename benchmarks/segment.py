"""Words in Chinese, Japanese and Thai: what the Gopher quality rule sees with the English
tokenizer (whitespace-separated chunks) and with ICU word segmentation
(dataprep/quality/segment.py), and how fast ICU segments.

    python -m benchmarks.segment [--per-lang 60] [--seed 0] [--out benchmarks/results/segment.json]

The sample, built offline as benchmarks/langid.py builds it: the system's gettext catalogs
(real human translations of program messages), per language, joined into documents of
1,500-3,000 characters; English documents from the shared OpenWebText sample as the
control. Per language: words per document and mean word length under both tokenizers,
and the share of documents `gopher_quality` keeps, (a) as before: English tokens and the
English thresholds and stop words, (b) segmented with FineWeb-2's per-language thresholds
and stop words (the defaults the rule now applies to these languages). Program messages
are not web prose (lists of short phrases, few stop words), so the keep rates say that the
checks work, not what share of real pages they keep.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from importlib.metadata import version
from typing import Any

from benchmarks.common import LOCALE, RESULTS, english, messages, write_json
from dataprep.quality import Doc, parse_rules, segment
from dataprep.quality.base import Drop
from dataprep.quality.text import SYMBOLS, split_words_regex

CATALOGS = {"zh": ["zh_CN", "zh_TW"], "ja": ["ja"], "th": ["th"], "ko": ["ko"]}
DOC_CHARS = (1500, 3000)


def docs_of(pieces: list[str], n: int, rng: random.Random) -> list[str]:
    pieces = sorted(set(pieces))
    rng.shuffle(pieces)
    out: list[str] = []
    cur: list[str] = []
    size = 0
    for p in pieces:
        cur.append(p)
        size += len(p) + 1
        if size >= DOC_CHARS[0]:
            out.append("\n".join(cur)[: DOC_CHARS[1]])
            cur, size = [], 0
            if len(out) == n:
                break
    return out


def content(words: list[str]) -> list[str]:
    return [w for w in words if w.strip(SYMBOLS)]


def stats(docs: list[str], split: Any) -> dict[str, float]:
    n_words = [len(content(split(d))) for d in docs]
    lengths = [sum(map(len, c)) / len(c) for d in docs if (c := content(split(d)))]
    return {
        "words_per_doc": round(sum(n_words) / len(docs), 1),
        "mean_word_length": round(sum(lengths) / max(len(lengths), 1), 2),
    }


def keep_rate(docs: list[str], english_only: bool) -> dict[str, Any]:
    """The share of `docs` gopher_quality keeps: (a) `english_only`, as the language rule
    labelling them English makes the chain treat them (the English tokenizer, thresholds
    and stop words: what every document got before segmentation); (b) with no label, as
    a chain without the language rule sees them (the script decides)."""
    (rule,) = parse_rules(["gopher_quality"])
    reasons: dict[str, int] = {}
    kept = 0
    for d in docs:
        doc = Doc(d, None, annotations={"language": "en"} if english_only else None)
        verdict = rule.apply(doc)
        if isinstance(verdict, Drop):
            reasons[verdict.check] = reasons.get(verdict.check, 0) + 1
        else:
            kept += 1
    return {"kept": round(kept / len(docs), 3), "dropped_by": reasons}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-lang", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "segment.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    result: dict[str, Any] = {
        "python": platform.python_version(),
        "pyicu": version("pyicu-wheels"),
        "languages": {},
    }
    samples = {"en": [" ".join(t.split()) for t in english(args.per_lang)]}
    for lang, dirs in CATALOGS.items():
        pieces = [m for d in dirs if (LOCALE / d).is_dir() for m in messages(LOCALE / d)]
        samples[lang] = docs_of(pieces, args.per_lang, rng)
    for lang, docs in samples.items():
        if not docs:
            print(f"{lang}: no catalogs on this system, skipped")
            continue
        seg_lang = lang if lang in segment.NO_SPACE_LANGUAGES else None
        row: dict[str, Any] = {
            "docs": len(docs),
            "chars": sum(map(len, docs)),
            "detected": sum(segment.script_language(d) == seg_lang for d in docs) / len(docs),
            "english_tokens": stats(docs, split_words_regex),
        }
        if seg_lang:
            row["icu_words"] = stats(docs, lambda d, lang=seg_lang: segment.words(d, lang))
            t = time.perf_counter()
            for d in docs:
                segment.words(d, seg_lang)
            dt = time.perf_counter() - t
            row["icu_chars_per_s"] = round(row["chars"] / dt)
        row["gopher_before"] = keep_rate(docs, english_only=True)
        row["gopher_after"] = keep_rate(docs, english_only=False)
        result["languages"][lang] = row
        print(
            f"{lang}: {len(docs)} docs; words/doc {row['english_tokens']['words_per_doc']} "
            f"-> {row.get('icu_words', row['english_tokens'])['words_per_doc']}, mean word "
            f"length {row['english_tokens']['mean_word_length']} -> "
            f"{row.get('icu_words', row['english_tokens'])['mean_word_length']}; gopher "
            f"keeps {row['gopher_before']['kept']:.0%} -> {row['gopher_after']['kept']:.0%}"
            f"; script detected {row['detected']:.0%}"
            + (
                f"; ICU {row['icu_chars_per_s'] / 1e6:.2f} M chars/s"
                if "icu_chars_per_s" in row
                else ""
            )
        )
    write_json(args.out, result, indent=1, end="")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
