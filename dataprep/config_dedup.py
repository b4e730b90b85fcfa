"""The prep config's deduplication sections: line-level dedup within a source
(`sources[].line_dedup`), and the run's `dedup:` (exact, near, substring). Part of the run
config (dataprep/config.py re-exports them); split out so each file holds one concern."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from core.config import Strict

__all__ = [
    "DedupConfig",
    "LineDedupConfig",
    "NearDedupConfig",
    "SubstringDedupConfig",
    "parse_size",
]


class LineDedupConfig(Strict):
    max_docs: int = Field(
        ge=1,
        description=(
            "A line (stripped, whitespace collapsed) found in more than this many of the "
            "source's documents, over every dataset version, is boilerplate (menus, cookie "
            "banners) and is removed from them all; a document left empty is dropped as "
            "`lines:empty`."
        ),
    )
    min_line_chars: int = Field(
        default=20,
        ge=1,
        description=(
            'Shorter lines are never counted nor removed (blank lines, "Home", list bullets).'
        ),
    )


class NearDedupConfig(Strict):
    threshold: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description=(
            "Jaccard similarity of two documents' word n-gram sets at which they are near "
            "duplicates."
        ),
    )
    num_perm: int = Field(
        default=128, ge=8, le=1024, description=("MinHash permutations per signature.")
    )
    ngram: int = Field(default=5, ge=1, le=32, description="Words per shingle.")
    bands: int | None = Field(
        default=None,
        ge=1,
        description=(
            "LSH bands. Bands x rows are chosen automatically from `recall_at_threshold` "
            "unless both are given (set bands and rows together; bands * rows <= num_perm)."
        ),
    )
    rows: int | None = Field(default=None, ge=1, description="Rows per band; see `bands`.")
    recall_at_threshold: float = Field(
        default=0.999,
        gt=0,
        lt=1,
        description=(
            "The probability that a pair at `threshold` becomes a candidate, which picks "
            "bands x rows."
        ),
    )
    verify: bool = Field(
        default=True,
        description=("Confirm candidates with the exact Jaccard of their shingle sets."),
    )

    @model_validator(mode="after")
    def _bands_rows(self) -> NearDedupConfig:
        if (self.bands is None) != (self.rows is None):
            raise ValueError("give both bands and rows, or neither")
        if self.bands and self.rows and self.bands * self.rows > self.num_perm:
            raise ValueError(
                f"bands*rows = {self.bands * self.rows} exceeds num_perm = {self.num_perm}"
            )
        return self


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_size(v: Any) -> Any:
    """A size in bytes from an int or a string such as "1GiB", "512MB", "2e9" (anything
    else is left to the field's type check, which names the key)."""
    if not isinstance(v, str):
        return v
    text = v.strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num) :]
    if unit not in _SIZE_UNITS or not num:
        raise ValueError(f"expected a size such as 1GiB, 512MB or a number of bytes, got {v!r}")
    try:
        return int(float(num) * _SIZE_UNITS[unit])
    except ValueError:
        raise ValueError(
            f"expected a size such as 1GiB, 512MB or a number of bytes, got {v!r}"
        ) from None


class SubstringDedupConfig(Strict):
    min_tokens: int = Field(
        default=50,
        ge=1,
        le=1_000_000,
        description=(
            "Window length in `unit`s: every span of at least this many units that occurs "
            "more than once in the corpus (over every dataset version) is removed, as Lee et "
            "al. 2022 (50 tokens)."
        ),
    )
    unit: Literal["tokens", "bytes"] = Field(
        default="tokens",
        description=(
            "`tokens`: whitespace-separated tokens (ASCII whitespace; equal token sequences "
            "match whatever whitespace separates them); `bytes`: UTF-8 bytes (for text "
            "without spaces), removed ranges shrunk to whole characters."
        ),
    )
    keep: Literal["first", "none"] = Field(
        default="first",
        description=(
            "`first`: the first occurrence in input order stays, every later one goes; "
            "`none`: every occurrence goes (google-research/deduplicate-text-datasets)."
        ),
    )
    min_doc_chars: int = Field(
        default=1,
        ge=1,
        description=(
            "A document left with fewer characters (whitespace stripped) after its spans "
            "are removed is dropped as `substring_dup`; 1: only documents left empty."
        ),
    )
    max_memory: int = Field(
        default=1 << 30,
        ge=1 << 20,
        description=(
            "Working memory per task, e.g. `1GiB`, `512MB` (bytes as a number): the hash "
            "step goes in passes and select in more partitions to stay below it, whatever "
            "the corpus size (the shard's own text comes on top, as in every stage)."
        ),
    )

    @field_validator("max_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return parse_size(v)


class DedupConfig(Strict):
    exact: bool = Field(
        default=True,
        description=(
            "Exact dedup: a 128-bit hash of the normalised text; the first copy in input order "
            "stays."
        ),
    )
    near: NearDedupConfig | None = Field(
        default=NearDedupConfig(),
        description=(
            "Near dedup (MinHash, LSH, exact-Jaccard confirmation); `near: false` turns it "
            "off, `near: true` takes the defaults."
        ),
    )

    substring: SubstringDedupConfig | None = Field(
        default=None,
        description=(
            "Exact substring dedup (the `substring` stage, after near dedup and line dedup, "
            "before quality), e.g. `{min_tokens: 50, unit: tokens, keep: first}`: repeated "
            "spans are cut out of documents. `substring: true` takes the defaults; unset = "
            "off."
        ),
    )

    @field_validator("near", "substring", mode="before")
    @classmethod
    def _near_bool(cls, v: Any) -> Any:
        if v is True:
            return {}
        if v is False:
            return None
        return v

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leave substring out while unset: a config without it fingerprints as before the
        key existed (an existing output stays claimed)."""
        out = handler(self)
        if self.substring is None:
            out.pop("substring", None)
        return out
