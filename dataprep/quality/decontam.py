"""`decontaminate`: drop documents that share a word n-gram (13 words by default) with an
evaluation set, the overlap test of GPT-3 (Brown et al. 2020, appendix C) as EleutherAI's
lm-evaluation-harness implements it (decontamination/janitor.py): words are lowercased,
punctuation is deleted, and the text is split on whitespace."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from pydantic import Field, field_validator, model_validator

from dataprep.quality.base import Drop, Rule, RuleParams, Verdict
from dataprep.quality.text import MARK_CLASS, Doc

# Files read as JSON lines (one example a line, its text in `field`); any other file is
# plain text, one example a line.
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")

# Deleted before splitting, as the Janitor deletes string.punctuation: here every
# character that is neither a letter, digit, combining mark nor whitespace, so "don't"
# and "dont", "U.S." and "US" are one word. Marks stay: deleting them would merge
# different Devanagari or Arabic words.
_DELETE = re.compile(rf"[^\w\s{MARK_CLASS}]|_")


def normalise(text: str) -> list[str]:
    """The words that n-grams are made of: lowercased, punctuation deleted."""
    return _DELETE.sub("", text.lower()).split()


def ngram_hashes(words: list[str], n: int) -> list[int]:
    """One 64-bit hash per n-gram position. Python's string hash differs between processes
    (PYTHONHASHSEED), so a set of them is only compared within the process that built it."""
    return list(map(hash, zip(*(words[i:] for i in range(n)), strict=False)))


@dataclass(frozen=True, slots=True)
class EvalNgrams:
    """The n-gram hashes of every example of some evaluation files: sorted unique 64-bit
    ints (8 bytes each, where a Python set of ints takes ~60), and for each, the file
    index (high 32 bits) and line number of the first example that has it."""

    files: tuple[str, ...]
    hashes: np.ndarray
    where: np.ndarray

    def first_match(self, hashes: list[int]) -> tuple[int, str, int] | None:
        """(position in `hashes`, file, line) of the first n-gram in the set, or None."""
        if not hashes:
            return None
        q = np.array(hashes, dtype=np.int64)
        idx = np.minimum(np.searchsorted(self.hashes, q), len(self.hashes) - 1)
        hit = self.hashes[idx] == q
        if not hit.any():
            return None
        pos = int(hit.argmax())
        where = int(self.where[idx[pos]])
        return pos, self.files[where >> 32], where & 0xFFFFFFFF


def load(files: tuple[str, ...], field: str, n: int) -> EvalNgrams:
    """The n-grams of `files`, built once per process while the files are unchanged (the
    quality stage builds its rules once per shard)."""
    return _load(tuple((f, *_stamp(f)) for f in files), field, n)


def _stamp(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    return st.st_mtime_ns, st.st_size


@lru_cache(maxsize=4)
def _load(keys: tuple[tuple[str, int, int], ...], field: str, n: int) -> EvalNgrams:
    # (path, mtime, size) keys: an edited file is read again.
    hashes: list[int] = []
    where: list[int] = []
    for i, (path, _mtime, _size) in enumerate(keys):
        for line, text in _examples(path, field):
            hs = ngram_hashes(normalise(text), n)
            hashes.extend(hs)
            where.extend([i << 32 | line] * len(hs))
    files = tuple(k[0] for k in keys)
    if not hashes:
        raise ValueError(f"no example in {', '.join(files)} has {n} words: nothing to match")
    unique, first = np.unique(np.array(hashes, dtype=np.int64), return_index=True)
    return EvalNgrams(files, unique, np.array(where, dtype=np.int64)[first])


def _examples(path: str, field: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each example of an evaluation file."""
    jsonl = path.lower().endswith(JSONL_SUFFIXES)
    try:
        with open(path, encoding="utf-8") as f:
            for line, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                if not jsonl:
                    yield line, raw
                    continue
                try:
                    row: Any = json.loads(raw)
                except ValueError:
                    row = None
                text = row.get(field) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    raise ValueError(
                        f"{path} line {line}: not a JSON object with a string {field!r} field"
                    )
                yield line, text
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"cannot read {path}: not UTF-8 text") from None


class DecontaminateParams(RuleParams):
    # Evaluation sets: JSON lines (.jsonl, .ndjson, .json; the text in `field`) or plain
    # text, one example a line. An example shorter than `ngram` words can never match.
    files: tuple[str, ...] = Field(
        min_length=1,
        description=(
            "Evaluation sets: JSON lines (.jsonl, .ndjson, .json; the text in `field`) or "
            "plain text, one example a line. A missing file is a config error."
        ),
    )
    field: str = Field(
        default="text",
        min_length=1,
        description=("The JSON field with the text; a JSON line without it is a config error."),
    )
    ngram: int = Field(
        default=13,
        ge=1,
        description=(
            "Words per n-gram (lowercased, punctuation deleted, as GPT-3's decontamination)."
        ),
    )

    @field_validator("files")
    @classmethod
    def _readable(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for path in v:
            _stamp(path)  # raises ValueError naming the path
        return v

    @model_validator(mode="after")
    def _loadable(self) -> DecontaminateParams:
        load(self.files, self.field, self.ngram)  # bad lines are config errors
        return self


class Decontaminate(Rule[DecontaminateParams]):
    """Drops a document sharing any n-gram with the evaluation files, naming the n-gram
    and the first file and line that has it. Documents can only be dropped, not marked:
    a rule sees the record's metadata but cannot change what the stage writes."""

    name = "decontaminate"
    Params = DecontaminateParams

    def setup(self) -> None:
        p = self.params
        self._ngrams = load(p.files, p.field, p.ngram)

    def __reduce__(self) -> tuple[Any, ...]:
        # The hashes are only valid in the process that built them: a copy sent to
        # another process builds its own.
        return (type(self), (self.params,))

    def apply(self, doc: Doc) -> Verdict:
        n = self.params.ngram
        words = normalise(doc.text)
        found = self._ngrams.first_match(ngram_hashes(words, n))
        if found is None:
            return None
        pos, path, line = found
        ngram = " ".join(words[pos : pos + n])
        return Drop("ngram_overlap", f"{n}-gram {ngram[:80]!r} of {path} line {line}")
