"""The run config: one YAML file per run, parsed into pydantic models.

Unknown keys are errors, and every error names its key path (`sources[1].paths`) and
what was expected, so a broken config fails before any work starts.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from core.config import Strict, format_validation_error, read_yaml
from core.errors import ConfigError
from core.store import StorageOptions
from tasks.formats import CHOICES as FORMAT_CHOICES

__all__ = ["ConfigError", "PrepConfig", "load_config", "parse_config"]


# A registered input format's name, or auto. A Literal built from the registry, so that an
# unknown value is refused naming the key and every choice, as other choices are.
Format = Literal[FORMAT_CHOICES]  # type: ignore[valid-type]


class LineDedupConfig(Strict):
    # A line (stripped, whitespace collapsed) found in more than this many of the source's
    # documents is boilerplate (navigation, cookie banners) and is removed from them all.
    max_docs: int = Field(ge=1)
    # Shorter lines are never counted nor removed (blank lines, "Home", list bullets).
    min_line_chars: int = Field(default=20, ge=1)


class SourceConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    # Local globs, directories, or s3://bucket/prefix[/glob]; relative paths are taken
    # from the config file's directory.
    paths: list[str] = Field(min_length=1)
    # auto: by extension (.jsonl, .jsonl.gz, .jsonl.zst, .json[.gz], .parquet, .txt);
    # a directory written by `datasets.save_to_disk` is `hf` (see tasks.formats).
    format: Format = "auto"
    text_field: str = "text"
    id_field: str | None = None
    # txt only: a whole file is one document, or each blank-line-separated paragraph is.
    txt_unit: Literal["file", "paragraph"] = "file"
    # Target share of training tokens (used by the mixture stage).
    weight: float | None = Field(default=None, ge=0)
    # Quality rules for this source instead of the top-level list (e.g. [] for code).
    quality: list[Any] | None = None
    # Most times this source's documents may be repeated to reach its share (UniMax's
    # per-source epoch cap); unset = mixture.max_epochs.
    max_epochs: float | None = Field(default=None, gt=0)
    # auto: validation by a stable hash of the document id; train / validation put the
    # whole source in one split (e.g. a held-out file, as the classic char-level runs do).
    split: Literal["auto", "train", "validation"] = "auto"
    # Line-level dedup within this source (the `lines` stage); unset = off.
    line_dedup: LineDedupConfig | None = None
    # Mix this source per language (meta.language, written by the `language` rule): each
    # language is a mixture component of its own, "<name>/<lang>" ("<name>/und" for
    # documents without a label), with the source's epoch cap. A mapping names the
    # languages kept and their weights within the source's (a language it does not name
    # is left out, accounted as downsampled); "all" keeps every language in proportion to
    # its tokens. With mixture.alpha, every kept language is weighted n_lang ** alpha
    # (temperature sampling over languages, as mT5 and XLM-R) and a mapping's values are
    # not used. Unset: the source is one component.
    languages: dict[str, float] | Literal["all"] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leave line_dedup and languages out while unset: a config that does not use them
        dumps, and so fingerprints, exactly as before the keys existed (an existing output
        is still claimed by the same config)."""
        out = handler(self)
        for key in ("line_dedup", "languages"):
            if getattr(self, key) is None:
                out.pop(key, None)
        return out

    @field_validator("languages")
    @classmethod
    def _language_weights(cls, v: dict[str, float] | str | None
                          ) -> dict[str, float] | str | None:
        if isinstance(v, dict):
            if not v:
                raise ValueError("name at least one language, or use 'all'")
            bad = [f"{k}={w!r}" for k, w in v.items() if not (k and math.isfinite(w) and w >= 0)]
            if bad:
                raise ValueError(f"weights must be finite and >= 0: {', '.join(bad)}")
            if not any(w > 0 for w in v.values()):
                raise ValueError("the weights sum to 0: give a language a positive weight")
        return v


class NearDedupConfig(Strict):
    threshold: float = Field(default=0.8, gt=0, le=1)
    num_perm: int = Field(default=128, ge=8, le=1024)
    ngram: int = Field(default=5, ge=1, le=32)
    # Bands x rows; chosen automatically so that a pair at `threshold` becomes a
    # candidate with probability >= recall_at_threshold, unless both are given.
    bands: int | None = Field(default=None, ge=1)
    rows: int | None = Field(default=None, ge=1)
    recall_at_threshold: float = Field(default=0.999, gt=0, lt=1)
    # Candidates are confirmed with the exact Jaccard of their shingle sets.
    verify: bool = True

    @model_validator(mode="after")
    def _bands_rows(self) -> NearDedupConfig:
        if (self.bands is None) != (self.rows is None):
            raise ValueError("give both bands and rows, or neither")
        if self.bands and self.rows and self.bands * self.rows > self.num_perm:
            raise ValueError(
                f"bands*rows = {self.bands * self.rows} exceeds num_perm = {self.num_perm}"
            )
        return self


class DedupConfig(Strict):
    exact: bool = True
    near: NearDedupConfig | None = NearDedupConfig()

    @field_validator("near", mode="before")
    @classmethod
    def _near_bool(cls, v: Any) -> Any:
        if v is True:
            return {}
        if v is False:
            return None
        return v


class IngestConfig(Strict):
    # Documents above this size are quarantined at ingest (reason `too_large`) so one
    # gigantic record cannot exhaust a worker's memory.
    max_doc_bytes: int = Field(default=16 * 1024 * 1024, ge=1)
    # Documents per ingest shard; later stages keep the same shards.
    shard_docs: int = Field(default=50_000, ge=1)


def _default_rules() -> tuple[str, ...]:
    from tasks.quality import DEFAULT_RULES

    return DEFAULT_RULES


class TokenizerConfig(Strict):
    # bytes: UTF-8 bytes + special tokens (needs nothing); bpe: a byte-level BPE trained
    # with HF `tokenizers` on the kept documents; file: an existing tokenizer.json.
    kind: Literal["bytes", "bpe", "file"] = "bytes"
    vocab_size: int | None = Field(default=None, ge=260, le=1_000_000)
    path: str | None = None
    # BPE training reads at most this many documents (spread over all shards).
    train_docs: int = Field(default=200_000, ge=1)
    min_frequency: int = Field(default=2, ge=1)

    @model_validator(mode="after")
    def _kind_fields(self) -> TokenizerConfig:
        if self.kind == "bpe" and self.vocab_size is None:
            raise ValueError("kind bpe needs vocab_size")
        if self.kind == "file" and not self.path:
            raise ValueError("kind file needs path (a tokenizer.json)")
        if self.kind != "file" and self.path:
            raise ValueError(f"path is only used with kind file (kind is {self.kind})")
        return self


class MixtureConfig(Strict):
    # Shares come from sources[].weight, or, when alpha is set, from temperature
    # sampling: share_i proportional to n_i ** alpha (n_i = the source's train tokens).
    alpha: float | None = Field(default=None, gt=0, le=1)
    # Default cap on repetition per source (UniMax); sources[].max_epochs overrides it.
    max_epochs: float = Field(default=1.0, gt=0)
    # Total training tokens; unset = the largest mix the caps allow.
    total_tokens: int | None = Field(default=None, ge=1)
    # Curriculum: these sources come first in training order, in this order; the rest
    # follow, interleaved. Unset = every source interleaved across the whole run.
    order: list[str] | None = None


class PackConfig(Strict):
    seq_len: int = Field(default=1024, ge=8)
    # concat: one token stream cut into rows (every token used, documents may be split);
    # bfd: best-fit-decreasing inside a bounded window (documents up to seq_len whole).
    strategy: Literal["concat", "bfd"] = "bfd"
    # bfd: documents considered together; memory stays flat however large the corpus.
    window: int = Field(default=20_000, ge=1)


class OutputDatasetConfig(Strict):
    # Fraction of documents (by a stable hash of the id) held out for validation.
    validation_fraction: float = Field(default=0.01, ge=0, lt=1)
    # Arrow shard files per split (save_to_disk num_shards).
    train_shards: int = Field(default=4, ge=1)
    validation_shards: int = Field(default=1, ge=1)
    # Partitions of the training order packed independently (mappable work).
    pack_partitions: int = Field(default=8, ge=1)


class PrepConfig(Strict):
    output: str
    seed: int = 0
    workers: int = Field(default=2, ge=1)
    sources: list[SourceConfig] = Field(min_length=1)
    ingest: IngestConfig = IngestConfig()
    dedup: DedupConfig = DedupConfig()
    # Rule names or {name: {param: value}}; unset = tasks.quality.DEFAULT_RULES.
    quality: list[Any] = Field(default_factory=lambda: list(_default_rules()))
    storage: StorageOptions = StorageOptions()
    tokenizer: TokenizerConfig = TokenizerConfig()
    mixture: MixtureConfig = MixtureConfig()
    pack: PackConfig = PackConfig()
    dataset: OutputDatasetConfig = OutputDatasetConfig()
    # The dataset version this run builds. Set by the runner, not in a config file: 1 for
    # a fresh output, one more for each later run that takes in new data. Not part of the
    # fingerprint (every version of an output has the same config); part of every task's
    # inputs, so no cached result of one version stands in for another's.
    version: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _mixture_sources(self) -> PrepConfig:
        names = {s.name for s in self.sources}
        unknown = [n for n in self.mixture.order or [] if n not in names]
        if unknown:
            raise ValueError(f"mixture.order names unknown sources: {', '.join(unknown)} "
                             f"(sources: {', '.join(sorted(names))})")
        if self.mixture.alpha is None:
            weighted = [s.name for s in self.sources if s.weight is not None]
            if weighted and len(weighted) != len(self.sources):
                missing = [s.name for s in self.sources if s.weight is None]
                raise ValueError(f"give every source a weight, or none (then shares are "
                                 f"natural); missing: {', '.join(missing)}")
        return self

    @field_validator("quality")
    @classmethod
    def _check_quality(cls, v: list[Any]) -> list[Any]:
        from tasks.quality import parse_rules

        parse_rules(v)  # raises ValueError naming the rule and parameter
        return v

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, v: list[SourceConfig]) -> list[SourceConfig]:
        names = [s.name for s in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"source names must be unique; repeated: {', '.join(dup)}")
        for s in v:
            if s.quality is not None:
                from tasks.quality import parse_rules

                try:
                    parse_rules(s.quality)
                except ValueError as e:
                    raise ValueError(f"source {s.name!r} quality: {e}") from None
        return v

    def rules_for(self, source: str) -> list[Any]:
        for s in self.sources:
            if s.name == source and s.quality is not None:
                return s.quality
        return self.quality

    def fingerprint(self) -> str:
        """A stable hash of everything that changes the output."""
        body = self.model_dump(mode="json", exclude={"workers", "output", "version"})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def parse_config(data: Any, where: str = "", base_dir: Path | None = None) -> PrepConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {where}: expected a mapping at the top level")
    try:
        cfg = PrepConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where)) from None
    if base_dir is not None:
        cfg = _resolve_paths(cfg, base_dir)
    return cfg


def _resolve(p: str, base_dir: Path) -> str:
    if "://" in p or Path(p).is_absolute():
        return p
    return str((base_dir / p).resolve())


def _resolve_paths(cfg: PrepConfig, base_dir: Path) -> PrepConfig:
    sources = [s.model_copy(update={"paths": [_resolve(p, base_dir) for p in s.paths]})
               for s in cfg.sources]
    return cfg.model_copy(update={"sources": sources})


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PrepConfig:
    """Read a YAML config. Relative source paths are resolved against the config's
    directory; `output` is resolved against the working directory (as a CLI user expects)."""
    path = Path(path)
    data = read_yaml(path)
    if isinstance(data, dict) and overrides:
        data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    return parse_config(data, where=str(path), base_dir=path.parent.resolve())
