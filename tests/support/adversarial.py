"""A shared adversarial-input generator for ingest.

`write_corpus(root)` writes, into `root`, inputs of every format the readers take (jsonl,
gzip and zstd jsonl, parquet, txt) holding records that produce every quarantine reason
the readers have, next to good records that must come through, and returns what to
expect: the number of records quarantined per reason and the number of good records.

Read it as one source (`source(root)`, with `ingest.max_doc_bytes = MAX_DOC_BYTES`). The
cases are listed below, one per line, so a new reason is one more line and the expected
counts follow by themselves.
"""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

SOURCE = "adv"
MAX_DOC_BYTES = 4096
# dataprep.formats.jsonl.line_limit(MAX_DOC_BYTES): a longer jsonl line is quarantined unparsed.
LINE_LIMIT = 6 * MAX_DOC_BYTES + (1 << 20)
DEEP = 100_000  # far beyond Python's recursion limit (1000 by default)
# Where ingest keeps a document's location in its meta (dataprep.records.LOCATION_KEY); a
# record of its own with that field is refused.
LOCATION_KEY = "_ballast_location"

# Every reason the readers quarantine a record for (tests check it against the code).
REASONS = (
    "bad_id",
    "corrupt_file",
    "empty_line",
    "empty_text",
    "invalid_json",
    "invalid_utf8",
    "missing_text",
    "non_finite_number",
    "not_an_object",
    "nul_bytes",
    "reserved_field",
    "too_deep",
    "too_large",
    "wrong_type",
)


@dataclass(frozen=True)
class Expected:
    root: Path
    reasons: dict[str, int]  # records quarantined, per reason
    good: int  # records that become documents

    @property
    def records(self) -> int:
        """Every record ingest counts in: good + quarantined (a broken stream counts as
        one record, `corrupt_file`)."""
        return self.good + sum(self.reasons.values())


def source(root: Path) -> dict[str, Any]:
    """The source config that reads the corpus (a directory: every file in it)."""
    return {"name": SOURCE, "paths": [str(root)], "id_field": "id"}


class _Texts:
    """Distinct, plausible document texts (no two share a 5-word run)."""

    def __init__(self, seed: int = 11):
        self.rng = random.Random(seed)
        self.n = 0

    def __call__(self, extra: str = "") -> str:
        self.n += 1
        words = [
            "".join(self.rng.choice("aeioubcdfglmnprstv") for _ in range(self.rng.randint(3, 9)))
            for _ in range(30)
        ]
        return f"Document {self.n}: " + " ".join(words) + f". {extra}".rstrip() + "\n"


def _j(obj: Any, ascii_only: bool = False) -> bytes:
    return json.dumps(obj, ensure_ascii=ascii_only).encode()


def _jsonl_cases(t: _Texts) -> list[tuple[bytes, str | None]]:
    """(line with its ending, reason or None for a good record), in file order."""
    deep_ok = "[" * 50 + "]" * 50
    deep = "[" * DEEP + "]" * DEEP
    cases: list[tuple[bytes, str | None]] = [
        # -- good records --
        (b"\xef\xbb\xbf" + _j({"id": "bom", "text": t()}), None),  # a BOM on line 1 is fine
        (_j({"text": t(), "n": 1, "tags": ["a"], "nested": {"x": [1, 2, {"y": None}]}}), None),
        (_j({"id": 7, "text": t()}), None),  # integer id
        (_j({"text": t("café naïve 日本語 😀")}), None),
        (_j({"text": t("escaped pair 😀 é")}, ascii_only=True), None),  # \ud83d\ude00
        (_j({"id": "user-location", "text": t(), "location": "Paris, France"}), None),
        (_j({"text": t(), "score": 1e300, "neg": -0.0, "big": 10**30}), None),
        (b'{"text": ' + _j(t()) + b', "m": ' + deep_ok.encode() + b"}", None),
        (_j({"text": t("[[[ {{{ NaN Infinity -Infinity 1e400")}), None),  # only words
        (_j({"id": "crlf", "text": t()}) + b"\r", None),  # a CRLF line ending
        # -- invalid_json --
        (b"{not json", "invalid_json"),
        (b'{"text": "unterminated', "invalid_json"),
        (b'{"text": "a"} trailing', "invalid_json"),
        (b"{'text': 'single quotes'}", "invalid_json"),
        (b"\xef\xbb\xbf" + _j({"text": t()}), "invalid_json"),  # a BOM not on line 1
        # -- empty_line --
        (b"", "empty_line"),
        (b"   \t ", "empty_line"),
        (b"\r", "empty_line"),  # a blank CRLF line
        # -- not_an_object --
        (b"[1, 2]", "not_an_object"),
        (b'"just a string"', "not_an_object"),
        (b"null", "not_an_object"),
        (b"42", "not_an_object"),
        # -- bad_id --
        (_j({"id": 1.5, "text": t()}), "bad_id"),
        (_j({"id": "", "text": t()}), "bad_id"),
        (_j({"id": True, "text": t()}), "bad_id"),
        (_j({"id": None, "text": t()}), "bad_id"),
        (_j({"id": ["a"], "text": t()}), "bad_id"),
        # -- missing_text --
        (_j({"body": "x"}), "missing_text"),
        (b"{}", "missing_text"),
        (b'{"id": "\\ud800 lone", "body": "x"}', "missing_text"),  # the id is no UTF-8
        (b'{"\\udc00": 1}', "missing_text"),  # a field name that is no UTF-8
        # -- wrong_type --
        (_j({"text": 5}), "wrong_type"),
        (_j({"text": None}), "wrong_type"),
        (_j({"text": ["a"]}), "wrong_type"),
        (_j({"text": {"a": 1}}), "wrong_type"),
        (_j({"text": True}), "wrong_type"),
        # -- invalid_utf8 --
        (b'{"text": "caf\xff au lait"}', "invalid_utf8"),
        (b'{"text": "cut \xc3"}', "invalid_utf8"),
        (b'{"text": "lone \\ud800 surrogate"}', "invalid_utf8"),
        (b'{"text": ' + _j(t()) + b', "k": "lone \\udfff in meta"}', "invalid_utf8"),
        (b'{"id": "\\ud800", "text": ' + _j(t()) + b"}", "invalid_utf8"),
        (b'{"text": ' + _j(t()) + b', "\\ud800key": 1}', "invalid_utf8"),
        # -- too_large --
        (_j({"text": "x" * (MAX_DOC_BYTES + 1)}), "too_large"),
        (_j({"text": "é" * (MAX_DOC_BYTES // 2 + 1)}), "too_large"),  # bytes, not chars
        (_j({"text": "y" * (LINE_LIMIT + 1000)}), "too_large"),  # not even parsed
        # -- nul_bytes --
        (_j({"text": "a\u0000b"}), "nul_bytes"),
        # -- empty_text --
        (_j({"text": ""}), "empty_text"),
        (_j({"text": "  \n\t "}), "empty_text"),
        (_j({"text": "\u3000"}), "empty_text"),
        # -- too_deep: valid JSON (or not: the parser cannot tell) nested too deep --
        (deep.encode(), "too_deep"),
        (b'{"text": ' + _j(t()) + b', "m": ' + deep.encode() + b"}", "too_deep"),
        (
            b'{"text": ' + _j(t()) + b', "m": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}",
            "too_deep",
        ),
        (b"[" * DEEP, "too_deep"),
        # -- non_finite_number: not JSON (RFC 8259), and would be written back as such --
        (b'{"text": ' + _j(t()) + b', "x": NaN}', "non_finite_number"),
        (b'{"text": ' + _j(t()) + b', "x": Infinity}', "non_finite_number"),
        (b'{"text": ' + _j(t()) + b', "x": [1, -Infinity]}', "non_finite_number"),
        (b'{"text": ' + _j(t()) + b', "x": {"y": 1e400}}', "non_finite_number"),  # overflow
        (b'{"text": ' + _j(t()) + b', "x": -1E999}', "non_finite_number"),
        (b'{"text": NaN}', "non_finite_number"),
        (b'{"id": NaN, "text": ' + _j(t()) + b"}", "non_finite_number"),
        # -- reserved_field --
        (_j({"text": t(), LOCATION_KEY: "elsewhere"}), "reserved_field"),
        # -- good again, the last line without a newline --
        (_j({"id": "last", "text": t()}), None),
    ]
    return cases


def _good_lines(t: _Texts, n: int) -> bytes:
    return b"".join(_j({"text": t()}) + b"\n" for _ in range(n))


def write_corpus(root: Path) -> Expected:
    """Write the adversarial corpus into `root` (created) and return what to expect."""
    root.mkdir(parents=True, exist_ok=True)
    t = _Texts()
    reasons: Counter[str] = Counter()
    good = 0

    # jsonl: one line per case.
    cases = _jsonl_cases(t)
    body = b"\n".join(line for line, _ in cases)  # the last line has no newline
    (root / "adv.jsonl").write_bytes(body)
    for _, reason in cases:
        if reason is None:
            good += 1
        else:
            reasons[reason] += 1

    # Broken streams: whole members/frames come through, then the file is corrupt_file.
    # A first member/frame that is complete, then a second cut off right after its header
    # (so it yields nothing): what a writer killed mid-append leaves.
    (root / "trunc.jsonl.gz").write_bytes(
        gzip.compress(_good_lines(t, 3)) + gzip.compress(_good_lines(t, 2))[:10]
    )
    zc = zstandard.ZstdCompressor()
    (root / "trunc.jsonl.zst").write_bytes(
        zc.compress(_good_lines(t, 3)) + zc.compress(_good_lines(t, 2))[:6]
    )
    good += 6
    reasons["corrupt_file"] += 2
    (root / "not-gzip.jsonl.gz").write_bytes(_good_lines(t, 2))  # plain text, named .gz
    reasons["corrupt_file"] += 1
    (root / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file")
    reasons["corrupt_file"] += 1

    # parquet: the arrow path (hf datasets share it).
    rows: list[tuple[dict[str, Any], str | None]] = [
        ({"id": "pq-1", "text": t(), "score": 0.5, "vec": [1.0]}, None),
        ({"id": "pq-2", "text": None, "score": 0.5, "vec": []}, "wrong_type"),
        ({"id": "pq-3", "text": t(), "score": float("nan"), "vec": []}, "non_finite_number"),
        (
            {"id": "pq-4", "text": t(), "score": 1.0, "vec": [2.0, float("inf")]},
            "non_finite_number",
        ),
        ({"id": "pq-5", "text": "", "score": 1.0, "vec": []}, "empty_text"),
        ({"id": "pq-6", "text": "z" * (MAX_DOC_BYTES + 1), "score": 1.0, "vec": []}, "too_large"),
        ({"id": None, "text": t(), "score": 1.0, "vec": []}, "bad_id"),
        ({"id": "pq-8", "text": t(), "score": -0.0, "vec": [1e308]}, None),
    ]
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("text", pa.string()),
            ("score", pa.float64()),
            ("vec", pa.list_(pa.float64())),
        ]
    )
    pq.write_table(
        pa.Table.from_pylist([r for r, _ in rows], schema=schema), root / "table.parquet"
    )
    for _, reason in rows:
        if reason is None:
            good += 1
        else:
            reasons[reason] += 1

    # txt, one document per file.
    txt: list[tuple[str, bytes, str | None]] = [
        ("good.txt", t().encode(), None),
        ("latin1.txt", "café au lait\n".encode("latin-1"), "invalid_utf8"),
        ("blank.txt", b"  \n\n \t\n", "empty_text"),
        ("nul.txt", b"a\x00b\n", "nul_bytes"),
        ("big.txt", b"w" * (3 * MAX_DOC_BYTES), "too_large"),
    ]
    (root / "notes").mkdir(exist_ok=True)
    for name, data, reason in txt:
        (root / "notes" / name).write_bytes(data)
        if reason is None:
            good += 1
        else:
            reasons[reason] += 1

    missing = set(REASONS) - set(reasons)
    assert not missing, f"the corpus produces no {sorted(missing)}"
    return Expected(root, dict(sorted(reasons.items())), good)
