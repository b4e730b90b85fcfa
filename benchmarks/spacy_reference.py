"""The reference side of the tokenizer comparison in benchmarks/quality.py: spaCy's English
tokenizer and sentencizer (and datatrove's filters when installed), run in a venv of their
own, never in .venv. Two commands:

    python3 -m venv .venv-spacy && .venv-spacy/bin/pip install spacy==3.8.18
    # optional, for the datatrove chain's speed and decisions:
    .venv-spacy/bin/pip install datatrove==0.10.1 regex xxhash orjson

    .venv-spacy/bin/python -m benchmarks.spacy_reference dump [--out PATH]
    .venv-spacy/bin/python -m benchmarks.spacy_reference export-rules [--out PATH]
    .venv-spacy/bin/python -m benchmarks.spacy_reference fixture [--out PATH]

(defaults: runs/spacy-reference/reference.json, dataprep/quality/spacy_en_rules.py and
tests/fixtures/spacy_en_cases.json)

`dump` writes, for the shared web corpora, every document's tokens as datatrove 0.10's
`split_into_words` gives them for English (spaCy's `blank("en")` with the sentencizer,
tokens stripped, empty ones left out) and the sentence count of each non-blank stripped
line (what datatrove's C4 filter adds up: `len(split_into_sentences(line))`), with the
time spaCy takes; with datatrove importable, also its Gopher + C4 + FineWeb chain's
decision on every document of every corpus and its time. benchmarks/quality.py reads it.
Nothing is downloaded: `blank("en")` needs no model.

`export-rules` writes spaCy's English tokenizer rules (prefix, suffix and infix patterns,
URL pattern, special cases, the sentencizer's characters) as a Python module, which
dataprep/quality/spacy_en.py runs without spaCy. spaCy is MIT-licensed (Explosion AI).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before datatrove / huggingface_hub are imported

# Standard library only at import: safe to import from this venv.
from benchmarks.common import ROOT, SHARED

DATA = SHARED
WEB = ("web_openwebtext_1k", "web_c4_olmo_fixtures", "web_dolma_cc_fixtures",
       "web_dclm_quality_labels_train")  # fmt: skip
CODE = ("code_python_cosqa_dev", "code_java_methods_codexglue_flat", "code_humanevalx")


def corpus_id(path: Path) -> dict[str, Any]:
    """What identifies a corpus file, so a stale dump is noticed."""
    data = path.read_bytes()
    return {"bytes": len(data), "md5": hashlib.md5(data).hexdigest()}


def load(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def english() -> Any:
    import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    return nlp


def words(nlp: Any, text: str) -> list[str]:
    """datatrove's SpaCyTokenizer.word_tokenize: every token's text, stripped, empty ones
    (whitespace tokens) left out."""
    nlp.max_length = len(text) + 10
    return [s for t in nlp(text) if (s := t.text.strip())]


def line_sentences(nlp: Any, text: str) -> list[int]:
    """Sentences in each non-blank stripped line, as datatrove's C4 filter counts them."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line:
            nlp.max_length = len(line) + 10
            out.append(sum(1 for _ in nlp(line).sents))
    return out


def dump(out: Path, repeat: int) -> int:
    nlp = english()
    words(nlp, "Warm up. The tokenizer is built on first use.")
    result: dict[str, Any] = {
        "spacy": version("spacy"),
        "python": sys.version.split()[0],
        "corpora": {},
        "timing": "median of the passes; one process, one core",
    }
    for name in WEB:
        path = DATA / f"{name}.jsonl"
        if not path.is_file():
            print(f"skip corpus {name}: {path} not found")
            continue
        texts = load(path)
        tokens = [words(nlp, t) for t in texts]
        sentences = [line_sentences(nlp, t) for t in texts]
        # Speed: the tokenizer alone (nlp.tokenizer: what a word count needs) and
        # datatrove's word_tokenize (the tokenizer plus the sentencizer, which its
        # SpaCyTokenizer always runs).
        tok_s, full_s = [], []
        for _ in range(max(1, repeat)):
            start = time.perf_counter()
            for t in texts:
                nlp.tokenizer(t)
            tok_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            for t in texts:
                words(nlp, t)
            full_s.append(time.perf_counter() - start)
        result["corpora"][name] = {
            **corpus_id(path),
            "tokens": tokens,
            "line_sentences": sentences,
            "tokenizer_seconds": round(statistics.median(tok_s), 4),
            "word_tokenize_seconds": round(statistics.median(full_s), 4),
        }
        n_tok = sum(map(len, tokens))
        print(
            f"{name}: {len(texts)} docs, {n_tok} tokens, spaCy tokenizer "
            f"{statistics.median(tok_s):.3f} s, word_tokenize {statistics.median(full_s):.3f} s"
        )
    result["datatrove"] = datatrove_decisions()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


def datatrove_decisions() -> dict[str, Any]:
    """datatrove's Gopher quality + repetition, C4 and FineWeb filters (defaults) on every
    corpus: each document's decision and the time taken, or why they could not run."""
    try:
        from datatrove.data import Document
        from datatrove.pipeline.filters import (
            C4QualityFilter,
            FineWebQualityFilter,
            GopherQualityFilter,
            GopherRepetitionFilter,
        )
    except ImportError as e:
        return {"available": False, "note": f"datatrove not importable ({e})"}
    filters = [GopherQualityFilter(), GopherRepetitionFilter(), C4QualityFilter(),
               FineWebQualityFilter()]  # fmt: skip
    warm = Document(text="Warm up the tokenizer. It is loaded once.", id="warm")
    for f in filters:
        f.filter(warm)
    out: dict[str, Any] = {"available": True, "version": version("datatrove"), "corpora": {}}
    for name in WEB + CODE:
        path = DATA / f"{name}.jsonl"
        if not path.is_file():
            continue
        texts = load(path)
        kept = []
        start = time.perf_counter()
        for i, text in enumerate(texts):
            doc = Document(text=text, id=str(i))
            # filter() is what datatrove's executor calls; True keeps (C4 edits doc.text)
            kept.append(all(f.filter(doc) is True for f in filters))
        out["corpora"][name] = {**corpus_id(path), "kept": kept,
                                "seconds": round(time.perf_counter() - start, 4)}  # fmt: skip
        print(f"datatrove {name}: kept {sum(kept)}/{len(kept)}")
    return out


# --- export-rules ----------------------------------------------------------------------


def _literal(s: str, indent: str, width: int = 92) -> str:
    """A long string as implicitly concatenated literals of at most `width` columns."""
    parts, piece = [], ""
    for ch in s:
        if len(ascii(piece + ch)) + len(indent) > width:
            parts.append(ascii(piece))
            piece = ""
        piece += ch
    parts.append(ascii(piece))
    return "(\n" + "".join(f"{indent}{p}\n" for p in parts) + indent[:-4] + ")"


def _lines(lines: list[str]) -> list[str]:
    return [f"{x}  # noqa: E501" if len(x) > 100 else x for x in lines]


def export_rules(out: Path) -> int:
    nlp = english()
    tok = nlp.tokenizer
    punct = nlp.get_pipe("sentencizer").punct_chars
    special = {k: [t[65] for t in v] for k, v in sorted(tok.rules.items())}  # 65: ORTH
    for k, v in special.items():
        if "".join(v) != k:
            raise SystemExit(f"special case {k!r}: tokens {v!r} do not spell it")
    try:
        dt = f", as datatrove {version('datatrove')} uses it"
    except PackageNotFoundError:
        dt = ""
    lines = [
        f'"""spaCy {version("spacy")}\'s English tokenizer rules (`spacy.blank("en")`{dt}),',
        "exported by `benchmarks/spacy_reference.py export-rules`; do not edit by hand.",
        'spaCy is MIT-licensed, (c) Explosion AI. dataprep/quality/spacy_en.py runs them."""',
        "",
        f'SPACY_VERSION = "{version("spacy")}"',
        "",
        "# Patterns as spaCy compiles them (flags: re.UNICODE).",
        f"PREFIX = {_literal(tok.prefix_search.__self__.pattern, ' ' * 4)}",
        f"SUFFIX = {_literal(tok.suffix_search.__self__.pattern, ' ' * 4)}",
        f"INFIX = {_literal(tok.infix_finditer.__self__.pattern, ' ' * 4)}",
        f"URL = {_literal(tok.url_match.__self__.pattern, ' ' * 4)}",
        "",
        "# Special cases: a chunk (or what is left of it between affixes) that is one of",
        "# these stays one token ...",
        "WHOLE = frozenset({",
        *_lines([f"    {k!a}," for k, v in special.items() if len(v) == 1]),
        "})",
        "# ... or becomes exactly these tokens.",
        "SPLIT: dict[str, tuple[str, ...]] = {",
        *_lines([f"    {k!a}: {tuple(v)!a}," for k, v in special.items() if len(v) > 1]),
        "}",
        "",
        "# The sentencizer's sentence-final characters (a token that is exactly one of",
        "# them ends a sentence).",
        f"SENTENCE_PUNCT_CHARS = {_literal(''.join(sorted(punct)), ' ' * 4)}",
        "SENTENCE_PUNCT = frozenset(SENTENCE_PUNCT_CHARS)",
        "",
    ]
    out.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {out}: {len(special)} special cases")
    return 0


# --- fixture ----------------------------------------------------------------------------

# Strings where spaCy's English rules are easy to get wrong; tests/test_spacy_en.py holds
# spacy_en to spaCy's answers on them.
CASES = (
    "The U.S. economy grew 3.5% in Q2, said Dr. Smith vs. Mr. Jones at 5 p.m. today.",
    "Meet at 10a.m. or 3p.m.; e.g. Jan. 5, Feb. 12 (approx.) and St. Louis, Mo., U.K.",
    "Send an e-mail to john.doe@example.com or visit https://www.example.com/a?b=1&c=2.",
    "See www.example.org, http://x.co/y_z and ftp://files.example.net/pub/file.tar.gz!",
    "I don't know, can't say, won't go; it's y'all's fault, isn't it? I'm sure we'd've.",
    "Rock'n'roll at 8 o'clock, 'em and 'cause -- ’twas nothin’ lovin'.",
    "A well-known, state-of-the-art, 2-3 year, self-driving car costs $30,000 (€27k/£23k).",
    "Prices: $5.99, US$10, 100USD, 50% off, 1,000,000 items, -5°C and 98.6°F. Cool.",
    "Wait... what?! Really?? Yes!!! Ok… fine. (Really.) \"Quoted.\" 'Single.'",
    "Smile :) or :-) or ;) or :D or <3 or :( or =) xD ^_^ (-_-) :P",
    "x) :) and right): (a) and 1): (b) and Int): (c)",
    # ":)" + a combining mark is cut, then merged back, unless ") :" across the space
    # (no special case, but matched first) takes the ":".
    "o'clock.) :)\u0301 and ok :)\u0301 and (x):)\u0301",
    "Author(s): me. a.m.): b. (D-Mass.), (R-Calif.) U-Va. id. id):",
    "Hello world.  Two spaces.\tA tab. \n A newline.\n\nTwo newlines.",
    "end. \t ) more. \u00a0 Non-breaking space. \u3000 Ideographic space.",
    "She said “Go.” Then left. “Why?” he asked. ‘No!’",
    "Figures 1.2.3 and 4.5; v2.0.1-beta, C++ and C#, A&B, and/or, w/o, 24/7, 3:30pm.",
    "Hashtags #AI and @handles, 9/11, 2019-08-12, 12:30:45, 1st 2nd 3rd 4th, 1980s '90s.",
    "Sentences end here.Next starts without a space!And this?Yes.",
    "Mr.Smith and Mrs.Jones met Ph.D. students (i.e. grads) in Washington, D.C. on Sept. 3.",
    "  leading spaces. trailing spaces.  ",
    "Ellipsis ... spaced . . . and unicode … mixed ….",
    "Numbers like 1.5x, 10k, 3M, 2.5bn, #1, No. 5, pp. 10-12, vol. 3, ch. 4.",
    "Emoji 😀 and symbols ©®™ and math ½ ² ≤ ≥ ± × ÷ → and — dashes – here.",
    "Über café naïve résumé, दिल्ली हिंदी, and 東京は日本の首都です。それは大きい！",
    "",
    " ",
    "\n",
    ".",
    "?!",
    "a.b.c. d.e. f.",
)


def fixture(out: Path) -> int:
    nlp = english()
    cases = []
    for text in CASES:
        doc = nlp(text)
        cases.append({
            "text": text,
            "tokens": [t.text for t in doc],
            "words": [s for t in doc if (s := t.text.strip())],
            "sentences": sum(1 for _ in doc.sents),
        })  # fmt: skip
    note = (f"spaCy {version('spacy')} blank('en') + sentencizer on each text: `tokens` all "
            "token texts (whitespace tokens too), `words` datatrove's split_into_words, "
            "`sentences` the sentencizer's count. Made by `.venv-spacy/bin/python "
            "benchmarks/spacy_reference.py fixture`; do not edit by hand.")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"note": note, "spacy": version("spacy"), "cases": cases},
                      ensure_ascii=False, indent=1)  # fmt: skip
    out.write_text(body + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(cases)} cases")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="spaCy's tokens and sentence counts for the web corpora")
    d.add_argument("--out", type=Path,
                   default=ROOT / "runs" / "spacy-reference" / "reference.json")  # fmt: skip
    d.add_argument("--repeat", type=int, default=3, help="timed passes of spaCy")
    e = sub.add_parser("export-rules", help="spaCy's English rules as a Python module")
    e.add_argument("--out", type=Path, default=ROOT / "dataprep" / "quality" / "spacy_en_rules.py")
    f = sub.add_parser("fixture", help="spaCy's answers on tricky strings, for the tests")
    f.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "spacy_en_cases.json")
    args = ap.parse_args(argv)
    if args.cmd == "export-rules":
        return export_rules(args.out)
    if args.cmd == "fixture":
        return fixture(args.out)
    if not DATA.is_dir():
        print(f"skip: shared data not found at {DATA}")
        return 0
    return dump(args.out, args.repeat)


if __name__ == "__main__":
    sys.exit(main())
