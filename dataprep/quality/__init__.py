"""Heuristic quality filters for pre-training text: Gopher, C4, FineWeb, code (The Stack /
StarCoder), URL, character-ratio and boilerplate rules, two rules of our own, PII
redaction, eval-set decontamination and language identification, built from the run
config's `quality:` list and applied to one document at a time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from core.config import did_you_mean, key_path, known_keys
from dataprep.quality.base import Drop, Rule, RuleParams
from dataprep.quality.boilerplate import Boilerplate
from dataprep.quality.c4 import C4
from dataprep.quality.classifier import Classifier
from dataprep.quality.code import Code
from dataprep.quality.decontam import Decontaminate
from dataprep.quality.fineweb import FineWeb
from dataprep.quality.gopher import GopherQuality, GopherRepetition
from dataprep.quality.language import Language
from dataprep.quality.perplexity import Perplexity
from dataprep.quality.pii import Pii
from dataprep.quality.ratios import CharRatios
from dataprep.quality.simple import CharRepetition, Length
from dataprep.quality.text import Doc
from dataprep.quality.url import Url

__all__ = [
    "CODE_DEFAULT_RULES",
    "DEFAULT_RULES",
    "RULES",
    "Doc",
    "FilterResult",
    "Rule",
    "RuleParams",
    "batched",
    "filter_document",
    "filter_documents",
    "parse_rules",
]

RULES: dict[str, type[Rule[Any]]] = {
    cls.name: cls
    for cls in (
        GopherQuality,
        GopherRepetition,
        C4,
        FineWeb,
        CharRepetition,
        Length,
        Code,
        Url,
        CharRatios,
        Boilerplate,
        Pii,
        Decontaminate,
        Language,
        Perplexity,
        Classifier,
    )
}

# The default chain (config `quality:` when unset, and the benchmark's). The character
# check runs first: it is the cheapest, and a document of one repeated symbol should be
# dropped for that reason rather than for having no words. C4's line cleaning runs before
# FineWeb's line statistics, as FineWeb ordered them.
DEFAULT_RULES: tuple[str, ...] = (
    "char_repetition",
    "gopher_quality",
    "gopher_repetition",
    "c4",
    "fineweb",
)

# A chain for source code (a source's `quality:`): the prose chain above keeps none of
# the shared code corpora. `length` drops empty files, `char_repetition` a file of one repeated
# character, and `code` applies The Stack / StarCoder thresholds, except that a one-line
# document is not held to the mean line length (a flattened function, as in CodeXGLUE:
# the published test would drop 70% of the shared Java methods; the 1000-character
# longest-line bound still applies to it).
CODE_DEFAULT_RULES: tuple[str | dict[str, Any], ...] = (
    "length",
    "char_repetition",
    {"code": {"min_lines_for_mean": 2}},
)


@dataclass(frozen=True, slots=True)
class FilterResult:
    text: str | None  # the text to keep (C4 may have edited it); None when dropped
    reason: str | None  # "<rule>:<check>", e.g. "gopher_quality:min_doc_words"; None if kept
    detail: str  # the measured value against the threshold; "" when kept
    # Replacements made in the kept text, by kind ({"email": 2, "ip": 1}; `pii`); empty
    # when nothing was replaced or the document was dropped.
    redacted: Mapping[str, int] = field(default_factory=dict)
    # Fields for the kept document's metadata ({"language": "en", ...}; `language`); empty
    # when no rule added any or the document was dropped.
    annotations: Mapping[str, Any] = field(default_factory=dict)
    # What the rules measured on a kept document ({"<rule>.<value>": number}; Doc.stats);
    # empty when dropped (the drop's detail holds the failing value). Not part of an
    # outcome's equality: two outcomes are the same verdict whatever was measured.
    stats: Mapping[str, float] = field(default_factory=dict, compare=False)


def filter_document(
    rules: list[Rule[Any]], text: str, meta: str | Mapping[str, Any] | None = None
) -> FilterResult:
    """Run `rules` in order: the first drop wins, and an edit feeds the next rule.
    `meta` is the record's metadata (a JSON object string or a mapping) for rules that
    read more than the text, such as `url`."""
    doc = Doc(text, meta)
    for rule in rules:
        verdict = rule.apply(doc)
        if verdict is None:
            continue
        if isinstance(verdict, Drop):
            return FilterResult(None, f"{rule.name}:{verdict.check}", verdict.detail)
        # Edited text: views of the old text no longer apply; replacement counts and
        # annotations carry on.
        doc = Doc(verdict, meta, doc.redacted, doc.annotations, doc.stats)
    return FilterResult(doc.text, None, "", doc.redacted, doc.annotations, doc.stats)


def filter_documents(
    rules: list[Rule[Any]], texts: list[str], metas: list[str | None]
) -> list[FilterResult]:
    """filter_document over many documents, rule by rule, so that a rule with
    `apply_batch` (a model that scores a batch at once: `perplexity`) sees every document
    still kept at that point in one call. Each document meets the rules in the same order
    as in filter_document, so the outcomes are the same."""
    docs = [Doc(t, m) for t, m in zip(texts, metas, strict=True)]
    outcomes: list[FilterResult | None] = [None] * len(docs)
    alive = list(range(len(docs)))
    for rule in rules:
        if not alive:
            break
        batch = getattr(rule, "apply_batch", None)
        verdicts = (
            batch([docs[i] for i in alive])
            if batch is not None
            else [rule.apply(docs[i]) for i in alive]
        )
        still = []
        for i, verdict in zip(alive, verdicts, strict=True):
            if isinstance(verdict, Drop):
                outcomes[i] = FilterResult(None, f"{rule.name}:{verdict.check}", verdict.detail)
                continue
            if verdict is not None:
                d = docs[i]
                docs[i] = Doc(verdict, metas[i], d.redacted, d.annotations, d.stats)
            still.append(i)
        alive = still
    for i in alive:
        d = docs[i]
        outcomes[i] = FilterResult(d.text, None, "", d.redacted, d.annotations, d.stats)
    return [o for o in outcomes if o is not None]


def batched(rules: list[Rule[Any]]) -> bool:
    """Whether a chain holds a rule that scores documents in batches."""
    return any(hasattr(r, "apply_batch") for r in rules)


def parse_rules(spec: list[str | dict[str, Any]]) -> list[Rule[Any]]:
    """Build rules from a config list of names or single-key {name: {param: value}} maps.

    Raises ValueError naming the item index, rule, parameter and what was expected."""
    if not isinstance(spec, list | tuple):
        raise ValueError(f"quality: expected a list of rules (got {spec!r:.80})")
    rules: list[Rule[Any]] = []
    for i, item in enumerate(spec):
        where = f"quality[{i}]"
        if isinstance(item, str):
            name, params = item, None
        elif isinstance(item, dict) and len(item) == 1:
            ((name, params),) = item.items()
            if not isinstance(name, str):
                raise ValueError(f"{where}: rule name must be a string (got {name!r:.80})")
        else:
            raise ValueError(
                f"{where}: expected a rule name or a single-key mapping "
                f"{{rule: {{param: value}}}} (got {item!r:.80})"
            )
        cls = RULES.get(name)
        if cls is None:
            raise ValueError(
                f"{where}: unknown rule {name!r} (known: {', '.join(sorted(RULES))})"
                + did_you_mean(name, RULES)
            )
        if params is None:  # `- c4:` in YAML
            params = {}
        if not isinstance(params, dict):
            raise ValueError(
                f"{where} {name}: parameters must be a mapping of name: value (got {params!r:.80})"
            )
        try:
            rules.append(cls(cls.Params.model_validate(params)))
        except ValidationError as e:
            raise ValueError(_explain(e, f"{where} {name}", cls.Params)) from None
    return rules


def _explain(err: ValidationError, where: str, model: type[RuleParams]) -> str:
    problems = []
    for e in err.errors():
        path = key_path(e["loc"])
        if e["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields)
            hint = did_you_mean(e["loc"][-1], known_keys(model, e["loc"][:-1]))
            problems.append(f"{where}.{path}: unknown parameter (known: {known}){hint}")
        elif path and e["type"] == "value_error":  # our validators name the value
            problems.append(f"{where}.{path}: {e['msg'].removeprefix('Value error, ')}")
        elif path:
            problems.append(f"{where}.{path}: {e['msg']} (got {e.get('input')!r:.80})")
        else:  # a check across parameters (model validator)
            problems.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(problems)
