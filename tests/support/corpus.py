"""The mixed corpus of real web and code documents with planted copies and junk that the
prep tests check document by document (`make_corpus`; its config is
`factories.prep_config`), and the word 5-gram Jaccard they judge near copies by."""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.support.helpers import edit_words, read_jsonl, shared_file

WORD = re.compile(r"[A-Za-z0-9_\x80-\U0010ffff]+")


def string_jaccard(a: str, b: str, n: int = 5) -> float:
    def sh(t: str) -> set[tuple[str, ...]]:
        w = WORD.findall(t.lower())
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    x, y = sh(a), sh(b)
    return len(x & y) / len(x | y)


def make_corpus(root: Path) -> dict:
    """web.jsonl.gz: 150 real web docs + planted copies + junk lines; code.parquet: 80
    real Python functions. Returns what was planted."""
    rng = random.Random(3)
    web = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 150)
    code = read_jsonl(shared_file("code_python_cosqa_dev.jsonl"), 80)
    rows = [{"id": r["id"], "text": r["text"]} for r in web]
    planted: dict = {"exact": {}, "near": {}, "distinct": [], "junk": {}}
    for k, r in enumerate(web[:6]):
        rows.append({"id": f"exact-{k}", "text": r["text"]})
        planted["exact"][f"exact-{k}"] = r["id"]
    for k, r in enumerate(web[10:16]):
        text = edit_words(r["text"], 0.01, rng)
        rows.append({"id": f"near-{k}", "text": text})
        planted["near"][f"near-{k}"] = (r["id"], string_jaccard(r["text"], text))
    for k, r in enumerate(web[20:25]):
        # Similar but distinct: a third of the words changed (J far below 0.8).
        rows.append({"id": f"distinct-{k}", "text": edit_words(r["text"], 0.33, rng)})
        planted["distinct"].append(f"distinct-{k}")
    rows.append({"id": "slashes", "text": "/" * 200_000})
    lines = [json.dumps(r).encode() for r in rows]
    junk = [
        (b'{"id": "broken", "text": "no closing brace"', "invalid_json"),
        (b'["a", "list"]', "not_an_object"),
        (b'{"id": "notext", "body": "x"}', "missing_text"),
        (b'{"id": "num", "text": 42}', "wrong_type"),
        (b'{"id": "blank", "text": "   "}', "empty_text"),
        (b'{"id": "nul", "text": "a\\u0000b"}', "nul_bytes"),
        (b'{"id": "latin1", "text": "caf\xe9"}', "invalid_utf8"),
    ]
    for k, (line, _) in enumerate(junk):
        lines.insert(40 + 10 * k, line)
    for line, reason in junk:
        lineno = next(i for i, ln in enumerate(lines, 1) if ln == line)
        planted["junk"][lineno] = reason
    (root / "web").mkdir(parents=True)
    with gzip.open(root / "web" / "web.jsonl.gz", "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    (root / "code").mkdir()
    pq.write_table(
        pa.table(
            {
                "id": [r["id"] for r in code],
                "text": [r["text"] for r in code],
                "language": [r.get("language", "python") for r in code],
            }
        ),
        root / "code" / "code.parquet",
    )
    planted["n_web_lines"] = len(lines)
    planted["n_code"] = len(code)
    return planted
