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
from dataprep.config_dedup import (
    DedupConfig,
    LineDedupConfig,
    NearDedupConfig,
    SubstringDedupConfig,
    parse_size,
)
from dataprep.formats import CHOICES as FORMAT_CHOICES

__all__ = [
    "ConfigError",
    "DedupConfig",
    "LineDedupConfig",
    "NearDedupConfig",
    "PrepConfig",
    "SubstringDedupConfig",
    "load_config",
    "parse_config",
    "parse_size",
]


# A registered input format's name, or auto. A Literal built from the registry, so that an
# unknown value is refused naming the key and every choice, as other choices are.
Format = Literal[FORMAT_CHOICES]  # type: ignore[valid-type]


class SourceConfig(Strict):
    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$",
        description=(
            "The source's name ([A-Za-z0-9_.-]+, unique): in ids, the report and the mixture."
        ),
    )
    paths: list[str] = Field(
        min_length=1,
        description=(
            "Local globs (`**` included), directories, files, or `s3://bucket/prefix[/glob]`; "
            "relative paths are taken from the config file's directory. A path or glob that "
            "matches nothing is an error before any work starts."
        ),
    )
    format: Format = Field(
        default="auto",
        description=(
            "`auto`: by extension (.jsonl, .jsonl.gz, .jsonl.zst, .json[.gz], .parquet, "
            ".txt, .warc[.gz], .wet[.gz], .html); a directory written by "
            "`datasets.save_to_disk` is `hf` (dataprep/formats/)."
        ),
    )
    text_field: str = Field(default="text", description="The record field with the text.")
    id_field: str | None = Field(
        default=None,
        description=(
            "The record field with the document id; unset, ids are stable locations: "
            "`<source>/<file>:<line>` (`#row=n` in parquet, `#para=n` for paragraphs)."
        ),
    )
    txt_unit: Literal["file", "paragraph"] = Field(
        default="file",
        description=(
            "txt only: a whole file is one document, or each blank-line-separated paragraph is."
        ),
    )
    weight: float | None = Field(
        default=None,
        ge=0,
        description=(
            "Target share of training tokens (the mixture stage), e.g. 0.7. Give every source "
            "a weight, or none (then shares are natural, or set by `mixture.alpha`)."
        ),
    )
    quality: list[Any] | None = Field(
        default=None,
        description=(
            "This source's quality rules instead of the top-level `quality` list (`[]` = "
            "none); the same syntax, e.g. `[char_repetition, {length: {min_chars: 20}}]`."
        ),
    )
    max_epochs: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Most times this source's documents may be repeated to reach its share (UniMax's "
            "per-source epoch cap); unset = `mixture.max_epochs`."
        ),
    )
    split: Literal["auto", "train", "validation"] = Field(
        default="auto",
        description=(
            "`auto`: validation by a stable hash of the document id; `train` / `validation` "
            "put the whole source in one split (e.g. a held-out file, as the classic "
            "char-level runs do)."
        ),
    )
    line_dedup: LineDedupConfig | None = Field(
        default=None,
        description=(
            "Line-level dedup within this source (the `lines` stage), e.g. `{max_docs: 10, "
            "min_line_chars: 20}`: remove lines found in more than max_docs of this source's "
            "documents. Unset = off."
        ),
    )
    languages: dict[str, float] | Literal["all"] | None = Field(
        default=None,
        description=(
            "Mix this source per language (`meta.language`, written by the `language` rule): "
            "each language is a mixture component of its own, `<name>/<lang>` (`<name>/und` "
            "for documents without a label), with the source's epoch cap. A mapping (`{en: "
            "0.8, de: 0.2}`) names the languages kept and their weights within the source's "
            "(a language it does not name is left out, accounted as `downsampled`); `all` "
            "keeps every language in proportion to its tokens. With `mixture.alpha`, every "
            "kept language is weighted n_lang ** alpha (temperature sampling over languages, "
            "as mT5 and XLM-R) and a mapping's values are not used. Unset: the source is one "
            "component."
        ),
    )

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
    def _language_weights(cls, v: dict[str, float] | str | None) -> dict[str, float] | str | None:
        if isinstance(v, dict):
            if not v:
                raise ValueError("name at least one language, or use 'all'")
            bad = [f"{k}={w!r}" for k, w in v.items() if not (k and math.isfinite(w) and w >= 0)]
            if bad:
                raise ValueError(f"weights must be finite and >= 0: {', '.join(bad)}")
            if not any(w > 0 for w in v.values()):
                raise ValueError("the weights sum to 0: give a language a positive weight")
        return v


class ExtractConfig(Strict):
    engine: Literal["resiliparse", "trafilatura"] = Field(
        default="resiliparse",
        description=(
            "Main-content extractor for HTML (warc and html sources): `resiliparse` (DCLM's; "
            "the default, as precise as trafilatura on the reference pages and ~30x faster) "
            "or `trafilatura` (FineWeb's). docs/prep.md gives the measurements."
        ),
    )
    favor: Literal["balanced", "precision", "recall"] = Field(
        default="balanced",
        description=(
            "trafilatura's favor_precision / favor_recall; with resiliparse, `recall` also "
            "keeps comment sections."
        ),
    )
    max_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1,
        description=(
            "Bigger HTML bodies are quarantined unread (`too_large`): extraction time and "
            "memory grow with the page."
        ),
    )
    timeout_s: float | None = Field(
        default=10.0,
        gt=0,
        description=(
            "Per-page time cap: pages are extracted in a helper process that is killed past "
            "it, and the page is quarantined (`extract_timeout`). `null`: in the reading "
            "process, no cap (faster; for trusted input). A cap depends on the machine's "
            "load, so set it well above the slowest normal page."
        ),
    )


class IngestConfig(Strict):
    max_doc_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1,
        description=(
            "Larger documents are quarantined at ingest (reason `too_large`), so one gigantic "
            "record cannot exhaust a worker's memory."
        ),
    )
    shard_docs: int = Field(
        default=50_000,
        ge=1,
        description=(
            "Documents per ingest shard; later stages keep the same shards. With `workers`, "
            "it sets the memory a run needs (docs/scale.md)."
        ),
    )
    extract: ExtractConfig | None = Field(
        default=None,
        description=(
            "HTML main-content extraction for warc and html sources, e.g. `{engine: "
            "trafilatura, favor: precision}`; unset = the defaults below."
        ),
    )

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leave extract out while unset: a config without it fingerprints as before the
        key existed."""
        out = handler(self)
        if self.extract is None:
            out.pop("extract", None)
        return out


def _default_rules() -> tuple[str, ...]:
    from dataprep.quality import DEFAULT_RULES

    return DEFAULT_RULES


class TokenizerConfig(Strict):
    kind: Literal["bytes", "bpe", "file"] = Field(
        default="bytes",
        description=(
            "`bytes`: UTF-8 bytes + `<|endoftext|>` (256) and `<|pad|>` (257), needs nothing; "
            "`bpe`: a byte-level BPE trained with HF `tokenizers` on the kept documents; "
            "`file`: an existing tokenizer.json."
        ),
    )
    vocab_size: int | None = Field(
        default=None,
        ge=260,
        le=1_000_000,
        description=("bpe (required there): e.g. 32768; the special tokens get ids 0 and 1."),
    )
    path: str | None = Field(
        default=None,
        description=(
            "file (required there, refused otherwise): a tokenizer.json (EOS: "
            "`<|endoftext|>`, `</s>` or `<eos>`)."
        ),
    )
    train_docs: int = Field(
        default=200_000,
        ge=1,
        description=("bpe: training reads at most this many documents, spread over all shards."),
    )
    min_frequency: int = Field(
        default=2,
        ge=1,
        description=(
            "bpe: a pair is merged only if it occurs at least this often (the vocabulary can "
            "come out smaller than vocab_size)."
        ),
    )

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
    alpha: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=(
            "Temperature sampling instead of the sources' weights: share_i proportional to "
            "n_i ** alpha (n_i = the source's train tokens). Unset: shares come from "
            "`sources[].weight`."
        ),
    )
    max_epochs: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Default cap on repetition per source (UniMax); `sources[].max_epochs` overrides it."
        ),
    )
    total_tokens: int | None = Field(
        default=None,
        ge=1,
        description=("Total training tokens; unset = the largest mix the caps allow."),
    )
    order: list[str] | None = Field(
        default=None,
        description=(
            "Curriculum: these sources come first in training order, in this order (e.g. "
            "`[books, web]`); the rest follow, interleaved. Unset = every source interleaved "
            "across the whole run."
        ),
    )


class PackConfig(Strict):
    seq_len: int = Field(default=1024, ge=8, description="Tokens per packed row.")
    strategy: Literal["concat", "bfd"] = Field(
        default="bfd",
        description=(
            "`bfd`: best-fit-decreasing inside a bounded window (documents up to seq_len "
            "whole); `concat`: one token stream cut into rows (every token used, documents "
            "may be split)."
        ),
    )
    window: int = Field(
        default=20_000,
        ge=1,
        description=("bfd: documents packed together; memory stays flat however large the corpus."),
    )


class OutputDatasetConfig(Strict):
    validation_fraction: float = Field(
        default=0.01,
        ge=0,
        lt=1,
        description=(
            "Fraction of documents held out for validation, by a stable hash of the document "
            "id (seed-independent)."
        ),
    )
    train_shards: int = Field(
        default=4, ge=1, description=("Arrow files of the train split (`save_to_disk` num_shards).")
    )
    validation_shards: int = Field(
        default=1, ge=1, description=("Arrow files of the validation split.")
    )
    pack_partitions: int = Field(
        default=8,
        ge=1,
        description=(
            "At least this many partitions of the training order, packed in parallel (more "
            "when the plan has over ~8M tokens a partition)."
        ),
    )
    versions: Literal["whole", "append"] = Field(
        default="whole",
        description=(
            "How a later version (a run that takes in new data) builds its dataset. `whole`: "
            "the mixture and packing are planned anew over all of the version's documents, "
            "so earlier documents' rows move. `append`: only the new documents are mixed "
            "and packed, and their rows follow the previous version's, which are kept as "
            "they are (hard links, or server-side copies on S3): a nightly run's cost "
            "follows the new data, and every earlier row keeps its place (row i of the "
            "previous version is row i of this one). The mixture's weights and caps then "
            "apply to each version's new documents; `mixture.total_tokens` cannot be used "
            "with it. Not part of the fingerprint: a version is finished in the mode it began "
            "in."
        ),
    )


# The keys that say how or where a run works, not what it makes: outside the fingerprint.
UNFINGERPRINTED = ("workers", "output", "version", "max_task_memory")


class PrepConfig(Strict):
    output: str = Field(
        description=(
            "Where the run writes: a local path (resolved from the working directory) or "
            "`s3://bucket/prefix`. It may not lie inside an input path, nor an input inside "
            "it."
        )
    )
    seed: int = Field(
        default=0, description=("MinHash permutations and the mixture's sampling derive from it.")
    )
    workers: int = Field(default=2, ge=1, description="Processes for `ballast prep`.")
    max_task_memory: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Working memory per task of the steps that see the whole corpus, e.g. `256MB`, "
            "`1GiB` (bytes as a number): exact select then runs as tasks over ranges of hash "
            "values, as many as needed for no range to hold more documents than the bound "
            "allows at the step's measured bytes per document (the worker's interpreter and "
            "one shard's own data come on top), near clustering over partitions of the "
            "candidate graph's components, and the mixture plan as steps over one shard "
            "each. The output is the same bytes whatever the bound. Unset: one task each. "
            "docs/scale.md says how each is split."
        ),
    )
    sources: list[SourceConfig] = Field(
        min_length=1, description=("The inputs, one entry per source.")
    )
    ingest: IngestConfig = Field(
        default=IngestConfig(), description=("Reading the inputs into shards.")
    )
    dedup: DedupConfig = Field(
        default=DedupConfig(), description=("Exact, near and substring deduplication.")
    )
    quality: list[Any] = Field(
        default_factory=lambda: list(_default_rules()),
        description=(
            "Quality rules, applied in order; the first that drops wins. A rule name uses the "
            "published thresholds, `{name: {param: value}}` sets parameters (see Quality rule "
            "parameters below). Unset: dataprep.quality.DEFAULT_RULES, `char_repetition, "
            "gopher_quality, gopher_repetition, c4, fineweb`."
        ),
    )
    storage: StorageOptions = Field(
        default=StorageOptions(),
        description=("For `s3://` URIs; anything unset comes from the environment."),
    )
    tokenizer: TokenizerConfig = Field(
        default=TokenizerConfig(),
        description=("The tokenizer (one for every dataset version: version 1's)."),
    )
    mixture: MixtureConfig = Field(
        default=MixtureConfig(),
        description=("Per-source token shares, epoch caps and training order."),
    )
    pack: PackConfig = Field(
        default=PackConfig(), description=("Packing documents into rows of seq_len tokens.")
    )
    dataset: OutputDatasetConfig = Field(
        default=OutputDatasetConfig(), description=("The DatasetDict written at the end.")
    )
    version: int = Field(
        default=1,
        ge=1,
        description=(
            "The dataset version this run builds. Set by the runner, not in a config file: 1 "
            "for a fresh output, one more for each later run that takes in new data. Not part "
            "of the fingerprint (every version of an output has the same config); part of "
            "every task's inputs, so no cached result of one version stands in for "
            "another's."
        ),
    )

    @model_validator(mode="after")
    def _mixture_sources(self) -> PrepConfig:
        names = {s.name for s in self.sources}
        unknown = [n for n in self.mixture.order or [] if n not in names]
        if unknown:
            raise ValueError(
                f"mixture.order names unknown sources: {', '.join(unknown)} "
                f"(sources: {', '.join(sorted(names))})"
            )
        if self.mixture.alpha is None:
            weighted = [s.name for s in self.sources if s.weight is not None]
            if weighted and len(weighted) != len(self.sources):
                missing = [s.name for s in self.sources if s.weight is None]
                raise ValueError(
                    f"give every source a weight, or none (then shares are "
                    f"natural); missing: {', '.join(missing)}"
                )
        return self

    @model_validator(mode="after")
    def _append_budget(self) -> PrepConfig:
        if self.dataset.versions == "append" and self.mixture.total_tokens is not None:
            raise ValueError(
                "dataset.versions: append mixes each version's new documents alone, so "
                "mixture.total_tokens (one budget for the whole mix) cannot apply: unset "
                "it, or use dataset.versions: whole"
            )
        return self

    @field_validator("max_task_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return parse_size(v)

    @field_validator("quality")
    @classmethod
    def _check_quality(cls, v: list[Any]) -> list[Any]:
        from dataprep.quality import parse_rules

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
                from dataprep.quality import parse_rules

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
        body = self.model_dump(
            mode="json",
            exclude={**dict.fromkeys(UNFINGERPRINTED, True), "dataset": {"versions"}},
        )
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def parse_config(data: Any, where: str = "", base_dir: Path | None = None) -> PrepConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {where}: expected a mapping at the top level")
    try:
        cfg = PrepConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where, model=PrepConfig)) from None
    if base_dir is not None:
        cfg = _resolve_paths(cfg, base_dir)
    return cfg


def _resolve(p: str, base_dir: Path) -> str:
    if "://" in p or Path(p).is_absolute():
        return p
    return str((base_dir / p).resolve())


def _resolve_paths(cfg: PrepConfig, base_dir: Path) -> PrepConfig:
    sources = [
        s.model_copy(update={"paths": [_resolve(p, base_dir) for p in s.paths]})
        for s in cfg.sources
    ]
    return cfg.model_copy(update={"sources": sources})


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PrepConfig:
    """Read a YAML config. Relative source paths are resolved against the config's
    directory; `output` is resolved against the working directory (as a CLI user expects)."""
    path = Path(path)
    data = read_yaml(path)
    if isinstance(data, dict) and overrides:
        data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    return parse_config(data, where=str(path), base_dir=path.parent.resolve())
